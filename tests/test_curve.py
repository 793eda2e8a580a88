"""The recall curve's edges (analysis.curve): cell counting, pooling, the passing run, the cliff.

Each expectation is counted by hand from the rows in the test; ``test_analysis.py`` holds the
typical curves.
"""

from __future__ import annotations

from needlescope.analysis.curve import (
    Cell,
    cells_from_results,
    cliff,
    effective_length,
    longest_passing,
    pool_by_length,
    pooled_recall,
)
from needlescope.analysis.stats import wilson_interval


def _row(length, depth, status="ok", correct=True) -> dict:
    return {"length": length, "depth": depth, "status": status, "correct": correct}


def test_cells_count_every_row_of_a_cell_and_errors_never_stop_the_count():
    rows = [
        _row(200, 50, "error", None),  # an error first: the ok rows after it still count
        _row(100, 0, correct=True),
        _row(100, 0, correct=False),
        _row(100, 0, correct=True),
        _row(100, 0, "timeout", None),
        _row(100, 0, "error", None),
        _row(200, 50, correct=False),
        _row(200, 50, correct=0),
        _row(200, 50),
        {"length": 200, "depth": 50, "status": "ok"},  # no "correct": not right
    ]
    a, b = cells_from_results(rows)
    # (100, 0): 3 ok rows, 2 right, 2 non-ok rows.
    assert a == Cell(100, 0.0, 3, 2, 2, 2 / 3, *wilson_interval(2, 3))
    # (200, 50): 4 ok rows, 1 right, 1 error.
    assert b == Cell(200, 50.0, 4, 1, 1, 1 / 4, *wilson_interval(1, 4))
    assert isinstance(a.length, int) and isinstance(a.depth, float)


def test_a_grid_cell_without_rows_is_all_zero_and_cells_sort_by_length_then_depth():
    rows = [_row("300", "10"), _row(100, 90), _row(100, 10, correct=False)]
    cells = cells_from_results(rows, grid=[(200, 0), (100, 10)])
    assert [(c.length, c.depth) for c in cells] == [(100, 10.0), (100, 90.0), (200, 0.0), (300, 10.0)]
    assert cells[2] == Cell(200, 0.0, 0, 0, 0, None, 0.0, 1.0)
    # The grid cell that also has a row counts it once.
    assert (cells[0].n, cells[0].correct, cells[0].recall) == (1, 0, 0.0)


def test_pool_by_length_sums_every_depth_in_length_order():
    pooled = pool_by_length([(200, 3, 4), (100, 1, 2), (200, 5, 6), (100, 0, 0), (200, 0, 1)])
    assert pooled == {100: (1, 2), 200: (8, 11)}
    assert list(pooled) == [100, 200]
    cells = [Cell(50, 0.0, 4, 3, 0, 0.75, 0, 1), Cell(50, 1.0, 2, 0, 1, 0.0, 0, 1)]
    assert pooled_recall(cells) == {50: (3, 6)}


def test_longest_passing_counts_a_rate_equal_to_the_threshold_as_passing():
    assert longest_passing([(300, 0.5), (100, 1.0), (200, 0.5)], 0.5) == 300
    assert longest_passing([(100, 1.0), (200, 0.25), (300, 1.0)], 0.5) == 100
    assert longest_passing([(100, 0.25), (200, 1.0)], 0.5) is None
    assert longest_passing([(100, None), (200, 1.0), (300, None), (400, 0.0)], 0.5) == 200
    assert longest_passing([], 0.5) is None


def test_effective_length_pools_depths_before_the_threshold():
    # 1000: 5/10 at one depth and 10/10 at the other pool to 0.75, which passes 0.75 exactly.
    cells = [
        Cell(1000, 0.0, 10, 5, 0, 0.5, 0, 1),
        Cell(1000, 1.0, 10, 10, 0, 1.0, 0, 1),
        Cell(2000, 0.0, 4, 2, 0, 0.5, 0, 1),
    ]
    assert effective_length(cells, 0.75) == 1000
    assert effective_length(cells, 0.5) == 2000


def test_cliff_keeps_the_first_of_equal_drops_and_reports_the_drop():
    def c(length, k, n=4):
        return Cell(length, 0.0, n, k, 0, k / n, 0, 1)

    assert cliff([c(1, 4), c(2, 2), c(3, 4), c(4, 2)]) == {"from": 1, "to": 2, "drop": 0.5}
    # The larger later drop wins over an earlier smaller one; rises are not cliffs.
    assert cliff([c(1, 3), c(2, 2), c(3, 4), c(4, 1)]) == {"from": 3, "to": 4, "drop": 0.75}
    assert cliff([c(1, 1), c(2, 4)]) is None
    assert cliff([]) is None
