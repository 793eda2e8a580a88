"""Pure rules of issues 24 and 28: co-factors, capacity, the residual, power behind a negative
verdict, Holm, absent suspects, c > b, the SMALL_EFFECT boundary, two root causes (a collapse before capacity: tests/test_signature.py)."""

from __future__ import annotations

import pytest

from needlescope.investigate.verdicts import (
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
    root = resolve_root_cause([bug, keys], signature_fires=False)
    assert root is None and bug["role"] == keys["role"] == "co-factor"
    assert bug["verdict"] == "implicated" and "interacts with fp8_keys" in bug["reason"]
    assert "interacts with graded_bug" in keys["reason"]


def test_capacity_is_a_root_cause_only_when_sufficient_on_its_own():
    # the case: top-k necessary only together with an unnamed bug -> the bug is the root
    topk, bug = _s("index_topk", 19, topk=True, sufficient=False), _s("auto:extra.py", 19, sufficient=True)
    assert resolve_root_cause([topk, bug], signature_fires=False) == "auto:extra.py"
    assert topk["verdict"] == "exonerated" and topk["role"] == "workaround"
    # top-k alone necessary and not sufficient, nothing else implicated: a co-factor, no root cause
    alone = _s("index_topk", 19, topk=True, sufficient=False)
    assert resolve_root_cause([alone], signature_fires=False) is None
    assert (
        alone["role"] == "co-factor" and alone["verdict"] == "implicated" and "workaround" in alone["reason"]
    )
    # top-k that costs recall on its own is a root cause
    real = _s("index_topk", 7, topk=True, sufficient=True)
    assert resolve_root_cause([real], signature_fires=False) == "index_topk"


def test_two_implicated_root_causes_are_both_named_largest_effect_first():
    a, b = _s("a", 8, sufficient=True), _s("b", 12, sufficient=True)
    assert resolve_root_cause([a, b], signature_fires=False) == "b"
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
    assert resolve_root_cause([s], signature_fires=False) is None


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
