"""The depth profile (analysis.depth) on hand-built cells: every field of the report.

Fisher p-values come from scipy (the two-sided minimum-likelihood test the module implements in
stdlib); Holm corrections are worked by hand in the comments; Wilson intervals from
``analysis.stats`` (tested on its own in ``test_analysis.py`` and ``test_stats_exact.py``).
"""

from __future__ import annotations

import pytest
from scipy.stats import fisher_exact

from needlescope.analysis.curve import Cell
from needlescope.analysis.depth import DEPTH_ALPHA, depth_profile
from needlescope.analysis.stats import wilson_interval


def _cell(length: int, depth: float, n: int, k: int) -> Cell:
    return Cell(length, depth, n, k, 0, k / n if n else None, 0.0, 1.0)


def _fisher(a: int, b: int, c: int, d: int) -> float:
    return fisher_exact([[a, b], [c, d]]).pvalue


def test_a_middle_hole_at_the_long_length_is_lost_in_the_middle():
    # 1000 tokens: 10/10 at each depth; 4000 tokens: the middle depth 0.5 drops to 0/10.
    cells = [_cell(1000, d, 10, 10) for d in (0.0, 0.5, 1.0)] + [
        _cell(4000, 0.0, 10, 10),
        _cell(4000, 0.5, 10, 0),
        _cell(4000, 1.0, 10, 10),
    ]
    prof = depth_profile(cells)
    assert prof["alpha"] == DEPTH_ALPHA == 0.01
    assert prof["depths"] == [
        {"depth": 0.0, "n": 20, "correct": 20, "recall": 1.0, **_ci(20, 20)},
        {"depth": 0.5, "n": 20, "correct": 10, "recall": 0.5, **_ci(10, 20)},
        {"depth": 1.0, "n": 20, "correct": 20, "recall": 1.0, **_ci(20, 20)},
    ]
    hole = prof["middle_hole"]
    p_hole = _fisher(10, 10, 40, 0)
    assert hole == {
        "middle_depths": [0.5],
        "end_depths": [0.0, 1.0],
        "middle_n": 20,
        "middle_correct": 10,
        "middle_recall": 0.5,
        "end_n": 40,
        "end_correct": 40,
        "end_recall": 1.0,
        "p_value": pytest.approx(p_hole, rel=1e-9),
        "found": True,
    }
    # Depths: 0.5 (10/20 vs 40/40) has the smallest p -> x3; 0 and 1 (20/20 vs 30/40) tie -> x2,
    # and the last is the running maximum, the same value.
    p_mid, p_end = _fisher(10, 10, 40, 0), _fisher(20, 0, 30, 10)
    assert p_end > 0.01  # so the ends' Holm value is 2 * p_end, not capped
    assert prof["depth_tests"] == [
        _test(0.0, 20, 20, 1.0, 30 / 40, p_end, 2 * p_end, False),
        _test(0.5, 20, 10, 0.5, 1.0, p_mid, 3 * p_mid, True),
        _test(1.0, 20, 20, 1.0, 30 / 40, p_end, 2 * p_end, False),
    ]
    # Lengths: 1000 (30/30 vs 20/30) and 4000 (20/30 vs 30/30) have one p, both x2.
    p_len = _fisher(30, 0, 20, 10)
    assert 2 * p_len < 0.01
    assert prof["length_tests"] == [
        _test(1000, 30, 30, 1.0, 20 / 30, p_len, 2 * p_len, False),
        _test(4000, 30, 20, 20 / 30, 1.0, p_len, 2 * p_len, True),
    ]
    # A length is worse too, so this is not "depth, not length".
    assert prof["pattern"] == "lost_in_the_middle"


def _ci(k: int, n: int) -> dict:
    lo, hi = wilson_interval(k, n)
    return {"ci_low": lo, "ci_high": hi}


def _test(group, n, k, recall, rest, p, p_holm, worse) -> dict:
    return {
        "group": group,
        "n": n,
        "correct": k,
        "recall": pytest.approx(recall),
        "rest_recall": pytest.approx(rest),
        "p_value": pytest.approx(p, rel=1e-9),
        "p_holm": pytest.approx(p_holm, rel=1e-9),
        "worse": worse,
    }


def test_one_bad_depth_at_every_length_is_depth_not_length_with_lengths_in_numeric_order():
    # Every length 12/20 (no length differs); depth 1.0 is 2/10 at each. Cells without a scored
    # case (depth 0.5 here) are no data: no depth row, no test, and only two depths remain, so
    # there is no middle to test.
    cells = []
    for length in (2000, 500, 1000):
        cells += [_cell(length, 0.0, 10, 10), _cell(length, 1.0, 10, 2), _cell(length, 0.5, 0, 0)]
    prof = depth_profile(cells)
    assert [d["depth"] for d in prof["depths"]] == [0.0, 1.0]
    assert prof["middle_hole"] is None
    assert [t["group"] for t in prof["length_tests"]] == [500, 1000, 2000]
    assert [t["group"] for t in prof["depth_tests"]] == [0.0, 1.0]
    assert all(t["p_value"] == pytest.approx(1.0) and not t["worse"] for t in prof["length_tests"])
    bad = prof["depth_tests"][1]
    assert (bad["n"], bad["correct"], bad["worse"]) == (30, 6, True)
    assert bad["p_value"] == pytest.approx(_fisher(6, 24, 30, 0), rel=1e-9)
    assert prof["pattern"] == "depth_not_length"


def test_depths_sort_numerically_and_the_middle_is_every_depth_strictly_inside():
    # Depths 0.05, 0.5, 0.25, 1.0 as text would sort "0.05" < "0.25" < "0.5" < "1" anyway; 10 and
    # 2 would not ("10" < "2"). The middle is 2 and 5; the ends 0.5 and 10.
    cells = [_cell(100, d, 10, 10) for d in (10.0, 2.0, 0.5)] + [_cell(100, 5.0, 10, 3)]
    prof = depth_profile(cells)
    assert [t["group"] for t in prof["depth_tests"]] == [0.5, 2.0, 5.0, 10.0]
    hole = prof["middle_hole"]
    assert (hole["middle_depths"], hole["end_depths"]) == ([2.0, 5.0], [0.5, 10.0])
    assert (hole["middle_correct"], hole["middle_n"], hole["end_correct"], hole["end_n"]) == (13, 20, 20, 20)
    assert hole["p_value"] == pytest.approx(_fisher(13, 7, 20, 0), rel=1e-9)


def test_a_middle_better_than_the_ends_is_no_hole_however_small_p():
    cells = [_cell(100, 0.0, 10, 2), _cell(100, 0.5, 20, 20), _cell(100, 1.0, 10, 3)]
    hole = depth_profile(cells)["middle_hole"]
    assert hole["p_value"] < 1e-5 and hole["middle_recall"] == 1.0 and hole["end_recall"] == 0.25
    assert hole["found"] is False


def test_a_p_value_equal_to_alpha_is_no_hole():
    cells = [_cell(100, 0.0, 10, 10), _cell(100, 0.5, 10, 7), _cell(100, 1.0, 10, 10)]
    p = depth_profile(cells)["middle_hole"]["p_value"]
    assert p == pytest.approx(_fisher(7, 3, 20, 0), rel=1e-9)
    assert depth_profile(cells, alpha=p)["middle_hole"]["found"] is False
    assert depth_profile(cells, alpha=p * (1 + 1e-9))["middle_hole"]["found"] is True


def test_alpha_sets_the_level_of_every_depth_test():
    # Middle 7/10 against ends 20/20: p = 0.030, a hole at alpha 0.05 but not at the default 0.01.
    cells = [_cell(100, 0.0, 10, 10), _cell(100, 0.5, 10, 7), _cell(100, 1.0, 10, 10)]
    p = _fisher(7, 3, 20, 0)
    assert 0.01 < p < 0.05
    strict, loose = depth_profile(cells), depth_profile(cells, alpha=0.05)
    assert strict["middle_hole"]["found"] is False and strict["pattern"] is None
    assert loose["alpha"] == 0.05 and loose["middle_hole"]["found"] is True
    # The one length is its own whole: nothing to compare it with, never worse.
    assert loose["length_tests"][0]["rest_recall"] is None
    # The middle depth's own test (7/10 vs 20/20, x3 by Holm) does not reach 0.05, so no depth
    # is worse and the hole alone names the pattern.
    assert 3 * p > 0.05 and loose["pattern"] == "lost_in_the_middle"


def test_no_cells_give_an_empty_profile():
    prof = depth_profile([_cell(100, 0.0, 0, 0)])
    assert prof == {
        "alpha": DEPTH_ALPHA,
        "depths": [],
        "middle_hole": None,
        "depth_tests": [],
        "length_tests": [],
        "pattern": None,
    }


def test_a_middle_hole_with_no_length_worse_is_depth_not_length_and_still_a_hole():
    # Depth 50% wrong at every length (the scripted "band" fault): the middle depths are worse than
    # the ends, and depth 50% is worse than the rest while no length is. Both hold; the pattern is
    # depth_not_length, the one that decides the headline (no effective length is stated), and the
    # hole stays in middle_hole (its own headline line).
    cells = []
    for length in (300, 600, 1200):
        cells += [_cell(length, d, 3, 0 if d == 50.0 else 3) for d in (0.0, 25.0, 50.0, 75.0, 100.0)]
    prof = depth_profile(cells)
    hole = prof["middle_hole"]
    assert (hole["middle_correct"], hole["middle_n"], hole["end_correct"], hole["end_n"]) == (18, 27, 18, 18)
    assert hole["p_value"] == pytest.approx(_fisher(18, 9, 18, 0), rel=1e-9) and hole["p_value"] < DEPTH_ALPHA
    assert hole["found"] is True
    assert [t["group"] for t in prof["depth_tests"] if t["worse"]] == [50.0]
    assert not any(t["worse"] for t in prof["length_tests"])
    assert prof["pattern"] == "depth_not_length"
