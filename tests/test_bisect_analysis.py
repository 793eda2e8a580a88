"""analysis.bisect's pure pieces at their edges (mutation-tested: docs/mutation.md)."""

from __future__ import annotations

import math

import pytest

from needlescope.analysis.bisect import (
    boundaries_from_server_info,
    bracket,
    cases_for_ci_width,
    coarse_grid,
    correct_residues,
    end_evidence,
    ends_differ,
    fine_lengths,
    full_grid_points,
    midpoint,
    pooled,
    residue_runs,
    residue_test,
    stratified_class_test,
    tally_slice,
)
from needlescope.analysis.significance import fisher_exact


def test_cases_for_ci_width():
    z = 1.959964
    assert cases_for_ci_width(0.3, 0.85) == math.ceil((2 * z) ** 2 * 0.85 * 0.15 / 0.09) == 22
    assert cases_for_ci_width(0.2, 0.99) == math.ceil((2 * z) ** 2 * 0.95 * 0.05 / 0.04)  # clamped to 0.95
    assert cases_for_ci_width(0.2, 0.0) == cases_for_ci_width(0.2, 0.05)  # clamped to 0.05
    assert cases_for_ci_width(0.99, 0.05) == 1  # at least one case
    assert cases_for_ci_width(0.1, 0.5, z=1.0) == 100
    for bad in (0.0, 1.0, 1.5, -0.1):
        with pytest.raises(ValueError, match=r"width must lie in \(0, 1\); got"):
            cases_for_ci_width(bad, 0.85)


def test_grid_pieces():
    assert coarse_grid(200, 1000, 1) == [200, 1000] and coarse_grid(200, 1000, 2) == [200, 1000]
    assert coarse_grid(200, 200, 5) == [200] and coarse_grid(300, 200, 5) == [200, 300]
    assert coarse_grid(0, 10, 3) == [0, 5, 10]
    assert midpoint(400, 601, 8) == 500 and isinstance(midpoint(400, 601, 8), int)
    assert midpoint(400, 408, 8) is None and midpoint(400, 409, 8) == 404
    assert (
        full_grid_points(200, 1000, 8) == 101
        and full_grid_points(0, 7, 8) == 1
        and full_grid_points(0, 16, 8) == 3
    )
    assert fine_lengths(501, [2], 0, 1000) == [499, 500, 501, 502]  # m = 2 counts; 501 / 2 rounds to 250
    assert fine_lengths(501, [1, 128], 0, 1000) == [500, 502, 511, 512, 513]
    assert fine_lengths(501, [], 500, 502) == [500, 502]  # both ends of the range kept
    assert fine_lengths(10, [64], 0, 1000) == [9, 11, 63, 64, 65]  # at least one multiple


def test_residue_runs_edges():
    assert residue_runs(4, 200, 400, 1) == [[200, 201, 202, 203]]
    assert residue_runs(4, 200, 202, 1) == [[200, 201, 202]]
    assert residue_runs(4, 200, 400, 2) == [[200, 201, 202, 203], [397, 398, 399, 400]]


def test_bracket_and_tally_helpers():
    assert bracket({200: (2, 2), 300: (0, 0), 400: (0, 2)}, 0.85) == (200, 400)  # an empty length is skipped
    assert bracket({200: (1, 1), 400: (0, 1)}, 0.85) == (200, 400)  # one case is a sample
    assert bracket({200: (17, 20), 400: (10, 20)}, 0.85) == (200, 400)  # exactly the threshold passes
    assert pooled([(100, True), (100, False), (200, True), (100, True)]) == {100: (2, 3), 200: (1, 1)}
    assert pooled([]) == {} and list(pooled([(300, 1), (100, 0)])) == [100, 300]
    assert tally_slice({1: (1, 1), 2: (0, 1)}, [2, 3]) == {2: (0, 1)}
    e = end_evidence({500: (0, 0)}, 500)
    assert e == {"length": 500, "correct": 0, "n": 0, "recall": None, "ci_low": 0.0, "ci_high": 1.0}
    assert end_evidence({500: (3, 4)}, 500)["recall"] == 0.75


def test_stratified_test_values():
    # One stratum, 7 cases, 6 right; the class holds 3 of them with 2 right: its support is
    # {2, 3} (at most one wrong case), P(T <= 2) = C(6, 2) C(1, 1) / C(7, 3) = 15 / 35.
    assert stratified_class_test([(2, 3, 4, 4)]) == pytest.approx(15 / 35)
    assert stratified_class_test([(3, 3, 3, 4)]) == 1.0
    # Two strata: the class's correct answers sum, each hypergeometric.
    one = [math.comb(4, k) * math.comb(4, 2 - k) / math.comb(8, 2) for k in range(3)]
    assert stratified_class_test([(0, 2, 4, 6), (0, 2, 4, 6)]) == pytest.approx(one[0] ** 2)
    assert stratified_class_test([(1, 2, 3, 6), (0, 2, 4, 6)]) == pytest.approx(
        one[0] ** 2 + 2 * one[0] * one[1]
    )


def test_residue_test_fields_and_empty_classes():
    res = residue_test([{200: (1, 2), 201: (2, 2), 202: (2, 2), 203: (2, 2)}, {300: (2, 2), 301: (1, 2)}], 4)
    c0, c1, c2, c3 = res["classes"]
    assert res["modulus"] == 4 and res["strata"] == 2
    assert (c0["n"], c0["correct"], c0["recall"]) == (4, 3, 0.75)
    assert c0["rest_recall"] == pytest.approx(7 / 8)  # run 1: 6 of 6, run 2: 1 of 2
    assert (c1["n"], c1["correct"], c1["recall"], c1["rest_recall"]) == (4, 3, 0.75, pytest.approx(7 / 8))
    assert (c2["n"], c2["correct"], c2["recall"], c2["rest_recall"]) == (2, 2, 1.0, 5 / 6)
    assert (c3["n"], c3["correct"]) == (2, 2) and 0 < c0["p"] <= 1
    # A run holding one class only compares it with nothing: left out.
    lone = residue_test([{203: (0, 2)}], 4)["classes"]
    assert all(
        c["n"] == 0 and c["recall"] is None and c["rest_recall"] is None and c["p"] == 1.0 for c in lone
    )
    # Holm: p = 0.025 twice is 0.05 after correction, not below alpha.
    tests = [{"modulus": 2, "strata": 1, "classes": [{"residue": 0, "p": 0.025}, {"residue": 1, "p": 0.025}]}]
    (out,) = correct_residues(tests)
    assert out["flagged"] == [] and out["p_value"] == pytest.approx(0.05)
    (empty,) = correct_residues([{"modulus": 3, "strata": 0, "classes": []}])
    assert empty["p_value"] == 1.0 and empty["flagged"] == []


def test_boundaries_from_server_info_scopes_and_lists():
    assert boundaries_from_server_info({"config": {"page_size": 16}}) == [16]
    assert boundaries_from_server_info({"server_args": {"window_size": 300}}) == [300]
    assert boundaries_from_server_info({"compress_ratios": [4, 128], "index_topk": 64}) == [4, 128, 256, 8192]
    assert boundaries_from_server_info({"page_size": 2, "sliding_window": 1}) == [2]
    assert boundaries_from_server_info({"page_size": True, "window": "x"}) == []


def test_ends_differ_rejects_only_below_alpha():
    # p < alpha narrows; a p equal to alpha does not (the project's one convention).
    tally = {400: (3, 3), 600: (0, 3)}
    p = fisher_exact(3, 0, 0, 3)
    assert ends_differ(tally, 400, 600, p) == (False, p)
    assert ends_differ(tally, 400, 600, math.nextafter(p, 1.0)) == (True, p)
