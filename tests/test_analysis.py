"""Tests for needlescope.analysis."""

import pytest

from needlescope.analysis import (
    Cell,
    cells_from_results,
    cliff,
    effective_length,
    mcnemar_exact,
    wilson_interval,
)


def test_wilson_known_values():
    lo, hi = wilson_interval(8, 10)
    assert lo == pytest.approx(0.490, abs=1e-3) and hi == pytest.approx(0.943, abs=1e-3)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and 0.0 < hi < 0.35
    lo, hi = wilson_interval(10, 10)
    assert hi == 1.0 and lo > 0.65


def test_mcnemar():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(5, 5) == 1.0
    assert mcnemar_exact(0, 10) == pytest.approx(2 / 1024)
    assert mcnemar_exact(10, 0) == mcnemar_exact(0, 10)


def test_cells_from_results_counts_errors_apart():
    rows = [
        {"length": 100, "depth": 0, "status": "ok", "correct": True},
        {"length": 100, "depth": 0, "status": "ok", "correct": False},
        {"length": 100, "depth": 0, "status": "error", "correct": None},
        {"length": 200, "depth": 50, "status": "error", "correct": None},
    ]
    a, b = cells_from_results(rows)
    assert (a.length, a.n, a.correct, a.errors, a.recall) == (100, 2, 1, 1, 0.5)
    assert (b.length, b.n, b.errors, b.recall, b.ci_low, b.ci_high) == (200, 0, 1, None, 0.0, 1.0)


def cell(length, depth, n, k):
    lo, hi = wilson_interval(k, n)
    return Cell(length, depth, n, k, 0, k / n if n else None, lo, hi)


def test_effective_length_and_cliff():
    cells = [
        cell(1000, 0, 10, 10), cell(1000, 100, 10, 10),
        cell(2000, 0, 10, 9), cell(2000, 100, 10, 9),
        cell(4000, 0, 10, 4), cell(4000, 100, 10, 6),
        cell(8000, 0, 10, 10), cell(8000, 100, 10, 10),
    ]  # fmt: skip
    assert effective_length(cells, 0.85) == 2000  # 8000 recovers but 4000 failed: RULER stops
    assert effective_length(cells, 0.95) == 1000
    assert effective_length(cells, 1.01) is None
    assert cliff(cells) == {"from": 2000, "to": 4000, "drop": pytest.approx(0.4)}
    assert cliff(cells[:2]) is None
    assert cliff([cell(1, 0, 10, 5), cell(2, 0, 10, 5)]) is None


def test_lengths_with_no_scored_case_make_no_false_cliff_or_effective_length():
    # Seen: a server killed mid-run gave "effective length 256, cliff 256 -> 512, drops 1.00".
    cells = [cell(256, 0, 4, 4), cell(512, 0, 0, 0), cell(1024, 0, 4, 4), cell(2048, 0, 0, 0)]
    assert [c.recall for c in cells] == [1.0, None, 1.0, None]
    assert cliff(cells) is None
    assert effective_length(cells, 0.85) == 1024  # 512 is no evidence either way
    assert effective_length([cell(256, 0, 0, 0)], 0.85) is None


def test_every_grid_cell_is_reported_even_without_rows():
    (a, b) = cells_from_results([{"length": 1, "depth": 0, "status": "ok", "correct": 1}], [(1, 0), (2, 0)])
    assert (a.recall, b.n, b.recall) == (1.0, 0, None)
