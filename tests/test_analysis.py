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
    assert lo == pytest.approx(0.4902, abs=1e-3) and hi == pytest.approx(0.9433, abs=1e-3)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    lo, hi = wilson_interval(10, 10)
    assert hi == pytest.approx(1.0) and lo == pytest.approx(0.7225, abs=1e-3)


def test_mcnemar_exact():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(0, 10) == pytest.approx(2 / 1024)
    assert mcnemar_exact(5, 5) == 1.0


def _cells(recalls: dict[int, float], n: int = 10) -> list[Cell]:
    return [Cell(L, 50.0, n, round(r * n), 0, r, 0, 1) for L, r in recalls.items()]


def test_effective_length_requires_every_shorter_length():
    assert effective_length(_cells({1000: 1.0, 2000: 0.9, 4000: 0.5, 8000: 0.9}), 0.85) == 2000
    assert effective_length(_cells({1000: 0.5, 2000: 1.0}), 0.85) is None
    assert effective_length(_cells({1000: 1.0, 2000: 1.0}), 0.85) == 2000


def test_cliff_is_largest_adjacent_drop():
    assert cliff(_cells({1000: 1.0, 2000: 0.9, 4000: 0.3, 8000: 0.1})) == {
        "from": 2000,
        "to": 4000,
        "drop": 0.6,
    }
    assert cliff(_cells({1000: 1.0, 2000: 1.0})) is None
    assert cliff(_cells({1000: 1.0})) is None


def test_errors_are_counted_apart_from_misses():
    rows = [
        {"length": 100, "depth": 0, "status": "ok", "correct": True},
        {"length": 100, "depth": 0, "status": "ok", "correct": False},
        {"length": 100, "depth": 0, "status": "error", "correct": None},
    ]
    (cell,) = cells_from_results(rows)
    assert (cell.n, cell.correct, cell.errors, cell.recall) == (2, 1, 1, 0.5)
