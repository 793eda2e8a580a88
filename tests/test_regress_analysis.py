"""Pure statistics of regression science: Holm, Fisher, paired A/B, taxonomy, bisection."""

from __future__ import annotations

import math
import random

import pytest

from needlescope.analysis.bisect import (
    boundaries_from_server_info,
    bracket,
    coarse_grid,
    correct_residues,
    crossing_confidence,
    end_evidence,
    ends_differ,
    fine_lengths,
    midpoint,
    residue_runs,
    residue_test,
    stratified_class_test,
)
from needlescope.analysis.paired import Pair, bootstrap_delta_ci, compare_pairs
from needlescope.analysis.significance import (
    fisher_exact,
    groups_vs_rest,
    holm,
    mcnemar_power,
)
from needlescope.analysis.taxonomy import classify, edit_distance, summarize_failures


def test_holm_matches_hand_computation():
    # Sorted p: 0.01*3=0.03, 0.02*2=0.04, 0.04*1=0.04 (monotone); back in input order.
    assert holm([0.04, 0.01, 0.02]) == pytest.approx([0.04, 0.03, 0.04])
    assert holm([0.5, 0.9]) == [1.0, 1.0]


def test_fisher_exact_known_values():
    # Fisher's tea-tasting table [[3, 1], [1, 3]]: two-sided p = 34/70.
    assert fisher_exact(3, 1, 1, 3) == pytest.approx(34 / 70)
    # Perfect separation of 5 vs 5: 2 / C(10, 5).
    assert fisher_exact(5, 0, 0, 5) == pytest.approx(2 / math.comb(10, 5))
    assert fisher_exact(0, 0, 0, 0) == 1.0


def test_mcnemar_power_grows_with_pairs():
    small, big = mcnemar_power(10, 0.1, 0.05), mcnemar_power(200, 0.1, 0.05)
    assert 0 <= small < 0.5 < big <= 1
    # k_min = 6 at alpha 0.05: with drop 1 every pair is discordant.
    assert mcnemar_power(6, 1.0, 0.05) == pytest.approx(1.0)
    assert mcnemar_power(5, 1.0, 0.05) == 0.0
    # One alpha convention: p = 2 / 2^5 = 0.0625 does not reject at alpha 0.0625 (p < alpha).
    assert mcnemar_power(5, 1.0, 0.0625) == 0.0 and mcnemar_power(6, 1.0, 0.0625) == pytest.approx(1.0)


def test_groups_vs_rest_names_the_bad_group():
    outcomes = [("a", True)] * 30 + [("b", True)] * 30 + [("c", True)] * 10 + [("c", False)] * 20
    res = {g.group: g for g in groups_vs_rest(outcomes)}
    assert res["c"].p_holm < 0.001 and res["c"].recall == pytest.approx(1 / 3)
    assert res["a"].p_holm >= res["c"].p_holm


def _pairs(length: int, a: list[bool], b: list[bool]) -> list[Pair]:
    return [Pair(f"L{length}-{i}", length, 50.0, x, y) for i, (x, y) in enumerate(zip(a, b))]


def test_compare_pairs_finds_the_regression_bucket():
    pairs = _pairs(100, [True] * 20, [True] * 20) + _pairs(200, [True] * 20, [False] * 15 + [True] * 5)
    res = compare_pairs(pairs)
    assert res["regresses_from"] == 200
    b200 = res["buckets"][1]
    assert b200["delta"] == pytest.approx(-0.75)
    # 15 discordant, all against B: p = 2 * 0.5**15, Holm x2.
    assert b200["p_value"] == pytest.approx(2 * 0.5**15)
    assert b200["p_holm"] == pytest.approx(4 * 0.5**15)
    assert b200["ci_low"] <= -0.75 <= b200["ci_high"] < 0
    assert res["verdict"].startswith("B regresses from 200 tokens (p=")


def test_compare_pairs_no_difference_states_power():
    pairs = _pairs(100, [True, False] * 10, [True, False] * 10)
    res = compare_pairs(pairs)
    assert res["regresses_from"] is None
    assert "no detectable difference (power to detect a 10-point drop" in res["verdict"]


def test_bootstrap_interval_covers_the_mean():
    rng = random.Random(1)
    pairs = [Pair(str(i), 1, 0.0, rng.random() < 0.8, rng.random() < 0.6) for i in range(200)]
    lo, hi = bootstrap_delta_ci(pairs)
    mean = sum(int(p.b) - int(p.a) for p in pairs) / len(pairs)
    assert lo < mean < hi and hi - lo < 0.3


@pytest.mark.parametrize(
    ("answer", "finish", "reasoning", "category"),
    [
        ("4173558", "stop", None, "near_miss"),
        ("4178881", "stop", None, "partial"),
        ("5550001", "stop", None, "distractor"),
        ("I could not find that information.", "stop", None, "refusal"),
        ("", "stop", None, "empty_or_length"),
        ("41", "length", None, "empty_or_length"),
        ("", "length", "Let me think", "reasoning_exhausted"),
        ("The weather was pleasant.", "stop", None, "unrelated"),
    ],
)
def test_classify_each_kind(answer, finish, reasoning, category):
    messages = [
        {
            "role": "user",
            "content": "The code of the red fox is 5550001. The code of the blue fox is 4173559.",
        }
    ]
    fail = classify(
        answer=answer, expected=["4173559"], finish_reason=finish, reasoning=reasoning, messages=messages
    )
    assert fail.category == category


def test_classify_evidence():
    messages = [{"role": "user", "content": "x" * 50 + " 5550001 " + "y" * 50}]
    d = classify(answer="5550001", expected=["4173559"], messages=messages)
    assert d.value == "5550001" and 40 < d.distractor_depth < 60
    p = classify(answer="4178881", expected=["4173559"])
    assert p.first_wrong == 3
    assert edit_distance("4173559", "4173558") == 1


def test_summarize_failures_counts_and_keeps_errors_apart():
    rows = [
        {"status": "error", "case_id": "e"},
        {"status": "ok", "correct": True, "case_id": "c"},
        {
            "status": "ok",
            "correct": False,
            "case_id": "m",
            "failure": {"category": "near_miss", "value": "1"},
        },
    ]
    s = summarize_failures(rows)
    assert s["errors"] == 1 and s["misses"] == 1 and s["counts"]["near_miss"] == 1
    assert s["examples"]["near_miss"][0]["case_id"] == "m"


def test_bisection_planning_pieces():
    assert coarse_grid(200, 1000, 5) == [200, 400, 600, 800, 1000]
    tally = {200: (10, 10), 400: (10, 10), 600: (2, 10), 800: (0, 10)}
    assert bracket(tally, 0.85) == (400, 600)
    assert bracket({200: (0, 10), 400: (0, 10)}, 0.85) is None
    assert bracket({200: (10, 10), 400: (10, 10)}, 0.85) is None
    assert midpoint(400, 600, 8) == 500 and midpoint(400, 408, 8) is None
    assert fine_lengths(501, [128], 200, 1000) == [500, 502, 511, 512, 513]
    assert residue_runs(4, 200, 1000, 2) == [[200, 201, 202, 203], [997, 998, 999, 1000]]


def test_residue_test_flags_the_failing_class():
    runs = [{n: ((0, 6) if n % 4 == 3 else (6, 6)) for n in range(s, s + 4)} for s in (200, 220, 236)]
    (res,) = correct_residues([residue_test(runs, 4)])
    assert res["flagged"] == [3] and res["strata"] == 3
    by = {c["residue"]: c for c in res["classes"]}
    # Per run: 0 of the class's 6 right while the other 18 are: hypergeometric 1 / C(24, 6).
    assert by[3]["p"] == pytest.approx((1 / math.comb(24, 6)) ** 3)
    assert by[3]["p_holm"] == pytest.approx(4 * by[3]["p"]) and res["p_value"] == by[3]["p_holm"]
    assert by[0]["p"] == 1.0 and by[3]["recall"] == 0.0 and by[3]["rest_recall"] == 1.0


def test_residue_test_is_stratified_by_run_and_corrected_across_moduli():
    # Recall falls with length (1.0 in the first run, 0.5 in the second, 0 in the third) and not
    # with the residue; the second run misses its half on classes 0 and 1 only by chance of
    # placement. Pooling would compare classes across unequal lengths; within runs, each class
    # is compared with its neighbours only.
    runs = [
        {n: (4, 4) for n in range(200, 204)},
        {300: (1, 4), 301: (1, 4), 302: (3, 4), 303: (3, 4)},
        {n: (0, 4) for n in range(400, 404)},
    ]
    unbalanced = {**runs[0], **runs[1], 400: (0, 4)}  # the old pooling: one length of the last run
    res = residue_test(runs, 4)
    assert all(c["p"] > 0.05 for c in res["classes"])
    assert residue_test([unbalanced], 4)["classes"][0]["p"] < res["classes"][0]["p"]
    # Holm across moduli: a class at p = 0.02 in one of two moduli is not flagged.
    fake = [
        {"modulus": 2, "strata": 1, "classes": [{"residue": 0, "p": 0.02}, {"residue": 1, "p": 0.9}]},
        {"modulus": 4, "strata": 1, "classes": [{"residue": r, "p": 0.5} for r in range(4)]},
    ]
    out = correct_residues(fake)
    assert out[0]["flagged"] == [] and out[0]["classes"][0]["p_holm"] == pytest.approx(0.12)
    assert stratified_class_test([]) == 1.0


def test_bracket_evidence_and_confidence():
    tally = {400: (6, 6), 500: (5, 6), 600: (1, 6), 700: (24, 24), 800: (6, 24)}
    assert ends_differ(tally, 400, 600, 0.05) == (True, pytest.approx(fisher_exact(6, 0, 1, 5)))
    assert ends_differ(tally, 400, 500, 0.05)[0] is False  # one miss never narrows
    assert ends_differ(tally, 600, 400, 0.05)[0] is False  # direction matters
    e = end_evidence(tally, 500)
    assert (e["correct"], e["n"], e["recall"]) == (5, 6, 5 / 6) and e["ci_low"] < 0.85 < e["ci_high"]
    weak = crossing_confidence(tally, 400, 600, 0.85)
    assert weak == pytest.approx(1 - 0.85**6 - 0.15**6 - 6 * 0.85 * 0.15**5)
    strong = crossing_confidence(tally, 700, 800, 0.85)
    assert strong > 0.97 > weak
    assert crossing_confidence({1: (3, 6), 2: (5, 6)}, 1, 2, 0.85) == 0.0


def test_boundaries_from_server_info():
    info = {"index_topk": 64, "args": {"compress_rates": {"csa": 4, "hca": 128}}, "page_size": 64}
    assert boundaries_from_server_info(info) == [4, 64, 128, 256, 8192]
    assert boundaries_from_server_info({"window": 500}) == [500]


def test_check_same_models_names_the_odd_endpoint():
    from needlescope.analysis.endpoints import check_same_models
    from needlescope.errors import BadInput

    check_same_models({"http://a": ["m"], "http://b": ["m"]})
    with pytest.raises(BadInput, match="http://b serves m, x but http://a serves m"):
        check_same_models({"http://a": ["m"], "http://b": ["x", "m"]})
