"""Pure rules of issues 24 and 28: co-factors, capacity, the residual, power behind a negative
verdict, Holm, absent suspects, c > b, the SMALL_EFFECT boundary, two root causes (a collapse before capacity: tests/test_signature.py)."""

from __future__ import annotations

import copy

import pytest

from needlescope.investigate.decide.verdicts import (
    SMALL_EFFECT,
    cases_needed,
    classify_fix,
    detectable_cost,
    holm_adjust,
    paired,
    power_check,
    residual_verdict,
    resolve_root_cause,
    root_causes,
    suspect_verdict,
)


def _pair(b: int, c: int, n: int = 20) -> dict:
    with_s = {f"c{i}": i >= b for i in range(n)}  # cases 0..b-1 wrong with the suspect
    without = {f"c{i}": not (b <= i < b + c) for i in range(n)}  # cases b..b+c-1 wrong without
    return paired(with_s, without)


def resolve(suspects: list[dict], signature_fires: bool) -> str | None:
    """``resolve_root_cause``, which returns the roles as a new value and changes nothing it was
    given (checked), with each role joined into its suspect record as ``decide_suspects`` does."""
    before = copy.deepcopy(suspects)
    root, roles = resolve_root_cause(suspects, signature_fires=signature_fires)
    assert suspects == before  # never overwritten in place
    for s in suspects:
        if s["id"] in roles:
            r = roles[s["id"]]
            s.update(verdict=r.verdict, reason=r.reason, role=r.role)
    return root


def _s(sid, b, c=0, *, topk=False, sufficient=None, present=True):
    return {
        "id": sid,
        "verdict": "implicated",
        "present": present,
        "changes_topk": topk,
        "pair": _pair(b, c),
        "sufficient": sufficient,
        "sufficiency": None if sufficient is None else _pair(8 if sufficient else 0, 0),
        "reason": "r",
    }


def test_a_necessary_but_not_sufficient_suspect_is_a_co_factor_naming_its_partner():
    bug, keys = _s("graded_bug", 12, sufficient=False), _s("fp8_keys", 10, sufficient=False)
    root = resolve([bug, keys], signature_fires=False)
    assert root is None and bug["role"] == keys["role"] == "co-factor"
    assert bug["verdict"] == "implicated" and "interacts with fp8_keys" in bug["reason"]
    assert "interacts with graded_bug" in keys["reason"]


def test_capacity_is_a_root_cause_only_when_sufficient_on_its_own():
    # the case: top-k necessary only together with an unnamed bug -> the bug is the root
    topk, bug = _s("index_topk", 19, topk=True, sufficient=False), _s("auto:extra.py", 19, sufficient=True)
    assert resolve([topk, bug], signature_fires=False) == "auto:extra.py"
    assert topk["verdict"] == "exonerated" and topk["role"] == "workaround"
    # top-k alone necessary and not sufficient, nothing else implicated: a co-factor, no root cause
    alone = _s("index_topk", 19, topk=True, sufficient=False)
    assert resolve([alone], signature_fires=False) is None
    assert (
        alone["role"] == "co-factor" and alone["verdict"] == "implicated" and "workaround" in alone["reason"]
    )
    # top-k that costs recall on its own is a root cause
    real = _s("index_topk", 7, topk=True, sufficient=True)
    assert resolve([real], signature_fires=False) == "index_topk"


def test_two_implicated_root_causes_are_both_named_largest_effect_first():
    a, b = _s("a", 8, sufficient=True), _s("b", 12, sufficient=True)
    assert resolve([a, b], signature_fires=False) == "b"
    assert root_causes([a, b]) == ["a", "b"] and a["role"] == b["role"] == "root cause"
    fix = _pair(10, 0)
    assert classify_fix(fix, removes="a", root_cause=root_causes([a, b]), keeps_topk=True) == "root-cause fix"


def test_c_greater_than_b_is_never_implicated_and_a_harmful_fix_is_no_root_cause_fix():
    hurts = _pair(0, 10)  # removing the suspect loses 10 cases: it helps
    verdict, reason = suspect_verdict(
        present=True, pair=hurts, divergence=None, absent_by_question=None, blocked=[], ran_checks=1
    )
    assert verdict == "exonerated" and "c > b" in reason
    assert classify_fix(hurts, removes="x", root_cause="x", keeps_topk=True) == "no effect"


def test_a_suspect_absent_from_the_deployment_is_never_implicated():
    costs = _pair(10, 0)  # added alone to the reference it costs 10 cases
    verdict, reason = suspect_verdict(
        present=False, pair=costs, divergence=None, absent_by_question=None, blocked=[], ran_checks=1
    )
    assert verdict == "exonerated" and "cannot cause" in reason and "would cost recall if deployed" in reason
    s = {**_s("absent", 10), "present": False}
    assert resolve([s], signature_fires=False) is None


def test_small_effect_boundary():
    kw = dict(present=True, divergence=None, absent_by_question=None, blocked=[], ran_checks=1)
    at = _pair(2, 0, n=20)  # |b - c| / n == SMALL_EFFECT exactly: no effect
    assert abs((at["b"] - at["c"]) / at["n"] - SMALL_EFFECT) < 1e-12
    assert suspect_verdict(pair=at, **kw)[0] == "exonerated"
    above = _pair(3, 0, n=20)
    assert suspect_verdict(pair=above, **kw)[0] == "inconclusive"


def test_power_behind_a_negative_verdict():
    kw = dict(present=True, divergence=None, absent_by_question=None, blocked=[], ran_checks=1)
    # n = 1: nothing can be excluded
    one = _pair(0, 0, n=1)
    v, reason = suspect_verdict(pair=one, power=power_check(1, 1, 0.0), **kw)
    assert v == "inconclusive" and "too few cases to exclude a cost of 50 points" in reason
    need = power_check(1, 1, 0.0)["cases_needed"]
    assert f"{need} cases would" in reason and need == cases_needed(0.5, 0.05)
    # 40 pairs detect a 30-point cost: exonerated, and the reason states it
    ok = _pair(0, 0, n=40)
    pw = power_check(40, 1, 0.0)
    v, reason = suspect_verdict(pair=ok, power=pw, **kw)
    assert v == "exonerated" and f"detects a cost of {pw['detectable_cost'] * 100:.0f} points" in reason
    # a symptom larger than the floor raises the bar
    assert not power_check(20, 3, 0.0)["enough"] or power_check(20, 3, 0.0)["detectable_cost"] <= 0.5
    big = power_check(18, 3, 0.9)
    assert big["bound"] == 0.9 and big["enough"]
    assert detectable_cost(5, 0.05) is None  # 2 * 0.5**5 > 0.05: 5 pairs can never reject
    assert cases_needed(0.1, 0.05) > cases_needed(0.5, 0.05)


def test_holm_adjusts_across_the_runs_ablations():
    weak, strong, none = _pair(6, 0), _pair(10, 0), _pair(0, 0)
    adj = holm_adjust([weak, None, strong, none])
    assert adj[1] is None and adj[2] == pytest.approx(3 * strong["p"])
    assert weak["p"] < 0.05 <= adj[0]  # significant alone, not after the correction
    kw = dict(present=True, divergence=None, absent_by_question=None, blocked=[], ran_checks=1)
    assert suspect_verdict(pair=weak, **kw)[0] == "implicated"
    v, reason = suspect_verdict(pair=weak, p_adjusted=adj[0], **kw)
    assert v == "inconclusive" and "Holm-adjusted p" in reason


def test_residual():
    loses = residual_verdict(_pair(9, 0), ["page_table"])
    assert loses["loses"] and loses["text"].startswith("unexplained residual: recall 0.55 vs 1.00")
    fine = residual_verdict(_pair(0, 0), [])
    assert not fine["loses"] and "whole candidate" in fine["text"]


KW = dict(divergence=None, absent_by_question=None, blocked=[], ran_checks=1)


def test_verdict_reasons_state_the_measurement_word_for_word():
    # b = 10, c = 0: the exact two-sided p is 2 * 0.5**10 = 0.001953125
    v, reason = suspect_verdict(present=True, pair=_pair(10, 0), **KW)
    assert v == "implicated" and reason == (
        "removing it from the candidate: recall 0.50 with it vs 1.00 without, paired n=20, b=10 c=0, "
        "exact McNemar p=0.00195"
    )
    v, reason = suspect_verdict(present=False, pair=_pair(10, 0), presence="absent", **KW)
    assert v == "exonerated" and reason == (
        "not in the deployment (absent), so it cannot cause the candidate's loss; adding it alone to the "
        "reference: recall 0.50 with it vs 1.00 without, paired n=20, b=10 c=0, exact McNemar p=0.00195: "
        "it would cost recall if deployed"
    )
    # no effect and no power statement: the counts alone (b = c = 0: p = 1)
    assert suspect_verdict(present=True, pair=_pair(0, 0), **KW) == (
        "exonerated",
        "removing it from the candidate: recall 1.00 with it vs 1.00 without, paired n=20, b=0 c=0, "
        "exact McNemar p=1",
    )


def test_verdicts_without_a_measurement():
    assert suspect_verdict(present=True, pair=None, **KW) == (
        "inconclusive",
        "present in the candidate, but no causal check ran",
    )
    blocked = dict(KW, blocked=["ablate: no weights", "replay: no server"])
    assert suspect_verdict(present=True, pair=None, **blocked)[1] == (
        "present in the candidate, but no causal check ran (ablate: no weights; replay: no server)"
    )
    assert suspect_verdict(present=True, pair=None, **dict(blocked, ran_checks=0)) == (
        "blocked",
        "ablate: no weights; replay: no server",
    )
    assert suspect_verdict(present=False, pair=None, **KW) == (
        "exonerated",
        "not present in the candidate (); no cheap question asked; no causal check asked for, so none ran",
    )


def test_equal_losses_and_gains_are_no_effect_and_an_unconfirmed_gain_is_not_exoneration():
    # 3 lost, 3 gained: no net change, however many discordant cases
    assert suspect_verdict(present=True, pair=_pair(3, 3), **KW)[0] == "exonerated"
    # 3 gained, none lost (p = 0.25): larger than SMALL_EFFECT and not significant either way
    v, reason = suspect_verdict(present=True, pair=_pair(0, 3), **KW)
    assert v == "inconclusive" and reason.endswith(
        "the change exceeds 0.10 but is not significant: run more cases"
    )


def test_divergence_counts_only_above_its_threshold():
    from needlescope.investigate.decide.verdicts import DIVERGE_REL

    kw = dict(KW, present=True, pair=_pair(0, 0))
    assert suspect_verdict(**dict(kw, divergence=DIVERGE_REL))[0] == "exonerated"
    v, reason = suspect_verdict(**dict(kw, divergence=2e-5))
    assert v == "diverges_no_effect" and "final-logit relative error 2e-05 (> 1e-05)" in reason


def test_power_statements_in_the_reason():
    kw = dict(KW, present=True)
    # 10 pairs detect 68 points at 0.05 (the first percent with 80% power), not the 50-point floor
    v, reason = suspect_verdict(pair=_pair(0, 0, n=10), power=power_check(10, 1, 0.0), **kw)
    assert (
        v == "inconclusive" and "this run detects a cost of 68 points with 80% power (level 0.05)" in reason
    )
    # a 90-point symptom is the bound, and 5 pairs can detect nothing
    v, reason = suspect_verdict(pair=_pair(0, 0, n=5), power=power_check(5, 1, 0.9), **kw)
    assert "exclude a cost of 90 points (this run cannot detect any cost with 80% power" in reason
    hopeless = {"alpha": 0.05, "power": 0.8, "detectable_cost": None, "bound": 0.5, "enough": False,
                "cases_needed": None}  # fmt: skip
    assert (
        "; more than 100000 cases would); " in suspect_verdict(pair=_pair(0, 0, n=5), power=hopeless, **kw)[1]
    )


def test_power_check_level_bound_and_the_inclusive_edge():
    assert power_check(20, 3, 0.0)["alpha"] == pytest.approx(0.05 / 3)
    assert power_check(20, 1, 0.912345)["bound"] == 0.9123
    # 10 pairs detect exactly 68 points: a 68-point bound is enough, a 67-point one is not
    assert power_check(10, 1, 0.68)["enough"] and not power_check(10, 1, 0.67)["enough"]


def test_co_factor_reasons_name_every_partner_or_the_residual():
    a, b, c = (_s(x, 10, sufficient=False) for x in "abc")
    resolve([a, b, c], signature_fires=False)
    assert a["reason"].endswith("so it interacts with b, c")
    lone = _s("a", 10, sufficient=False)
    resolve([lone], signature_fires=False)
    assert lone["reason"].endswith(
        "so it interacts with a difference no suspect reproduces on its own (see the residual)"
    )


def test_a_root_cause_keeps_its_reason_and_a_co_factor_beside_it_stays_implicated():
    root, co = _s("root", 12, sufficient=True), _s("co", 10, sufficient=False)
    assert resolve([root, co], signature_fires=False) == "root"
    assert root["reason"] == "r" and (co["verdict"], co["role"]) == ("implicated", "co-factor")
    assert root_causes([root, co]) == ["root"]


def test_the_largest_net_effect_comes_first():
    # 12 lost and 4 gained (net 8) against 10 lost (net 10)
    a, b = _s("a", 12, 4, sufficient=True), _s("b", 10, sufficient=True)
    assert resolve([a, b], signature_fires=False) == "b"


def test_a_sufficient_capacity_change_beside_a_functional_root_stays_a_root_cause():
    bug = _s("bug", 12, sufficient=True)
    real, helper = _s("topk_a", 10, topk=True, sufficient=True), _s("topk_b", 10, topk=True, sufficient=False)
    assert resolve([bug, real, helper], signature_fires=False) == "bug"
    assert (real["verdict"], real["role"]) == ("implicated", "root cause")
    assert (helper["verdict"], helper["role"]) == ("exonerated", "workaround")
    assert root_causes([bug, real, helper]) == ["bug", "topk_a"]


def test_capacity_measured_without_a_sufficiency_verdict_is_a_co_factor():
    s = {**_s("index_topk", 10, topk=True), "sufficiency": _pair(1, 0)}  # measured, sufficient unset
    assert resolve([s], signature_fires=False) is None and s["role"] == "co-factor"


def test_with_the_signature_an_insufficient_capacity_change_is_a_workaround_and_a_sufficient_one_a_root():
    s = _s("index_topk", 10, topk=True, sufficient=False)
    assert resolve([s], signature_fires=True) is None
    assert (s["verdict"], s["role"]) == ("inconclusive", "workaround")
    assert s["reason"] == (
        "r; but the needle's ranking is uninformative and the collapse tracks compress_ratio x index_topk: a "
        "larger index_topk is a workaround for a functional indexer bug that no suspect in the ledger reproduces"
    )
    real = _s("index_topk", 10, topk=True, sufficient=True)
    assert resolve([real], signature_fires=True) == "index_topk" and real["verdict"] == "implicated"


def test_fix_labels_need_both_the_root_cause_and_the_deployment_topk():
    fix = _pair(10, 0)
    assert classify_fix(fix, removes=None, root_cause="a", keeps_topk=True) == "workaround"
    assert classify_fix(fix, removes="b", root_cause="a", keeps_topk=True) == "workaround"
    assert classify_fix(fix, removes="a", root_cause="a", keeps_topk=False) == "workaround"
    assert classify_fix(fix, removes="a", root_cause=None, keeps_topk=True) == "workaround"


def test_paired_counts_only_cases_both_runs_scored():
    p = paired({"a": True, "b": False, "c": True, "x": False}, {"a": False, "b": True, "c": False, "y": True})
    assert (p["n"], p["b"], p["c"]) == (3, 1, 2) and p["recall_with"] == pytest.approx(2 / 3)
    none = paired({"a": True}, {"b": True})
    assert (
        none["n"] == 0
        and none["recall_with"] != none["recall_with"]
        and none["recall_without"] != none["recall_without"]
    )


def test_residual_record_and_texts():
    r = residual_verdict(_pair(9, 0), ["a", "b"])
    assert r["removed"] == ["a", "b"] and r["pair"]["b"] == 9
    assert "the candidate without a, b; paired n=20, b=9 c=0" in r["text"]
    fine = residual_verdict(_pair(0, 0), [])
    assert fine["text"] == (
        "no residual: the whole candidate (no suspect implicated) recalls 1.00 vs the reference's 1.00 (b=0 c=0, p=1)"
    )
