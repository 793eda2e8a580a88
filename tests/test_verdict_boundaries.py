"""The verdict rules at their edges (pure): evidence records, the cases a cost needs (against a
brute-force scan of the power), and the live verdict's thresholds. Expectations are worked out
by hand from the rules in ``investigate.decide.verdicts``' docstring."""

from __future__ import annotations

import math

import pytest

from needlescope.analysis.significance import mcnemar_power
from needlescope.investigate.decide.verdicts import (
    POWER,
    cases_needed,
    detectable_cost,
    evidence,
    live_verdict,
    validate_verdicts,
)


def test_evidence_keeps_numbers_and_writes_the_rest_as_text():
    assert evidence("ablation", "p", 0.25, 0.05) == {
        "check": "ablation",
        "metric": "p",
        "value": 0.25,
        "threshold": 0.05,
    }
    assert evidence("c", "m", 3) == {"check": "c", "metric": "m", "value": 3, "threshold": None}
    assert evidence("c", "m", True)["value"] == "True"  # a bool is no number here
    assert evidence("c", "m", "fp8")["value"] == "fp8" and evidence("c", "m", None)["value"] == "None"
    assert [evidence("c", "m", x)["value"] for x in (math.nan, math.inf, -math.inf)] == ["nan", "inf", "-inf"]


def _scan(cost: float, alpha: float) -> int:
    n = 1
    while mcnemar_power(n, cost, alpha) < POWER:
        n += 1
    return n


@pytest.mark.parametrize(
    ("cost", "alpha"), [(0.5, 0.05), (0.5, 0.05 / 3), (0.3, 0.05), (0.3, 0.01), (0.2, 0.05), (1.0, 0.05)]
)
def test_cases_needed_is_the_first_n_with_enough_power(cost, alpha):
    assert cases_needed(cost, alpha) == _scan(cost, alpha)


def test_cases_needed_small_ends_and_the_limit():
    # a cost of every case: the test rejects once 2 * 0.5**k < 0.05, i.e. at k = 6 discordant pairs
    assert cases_needed(1.0, 0.05) == 6
    # alpha 0.5: one lost pair gives p = 1 > 0.5, two give 0.5 (not below): three pairs, certain at cost 1
    assert cases_needed(1.0, 0.5) == 3
    assert cases_needed(0.5, 0.05) == 15 == _scan(0.5, 0.05)
    assert cases_needed(0.5, 0.05, limit=16) == 15 and cases_needed(0.5, 0.05, limit=8) is None
    assert cases_needed(0.0, 0.05, limit=64) is None  # no cost is ever detected


def test_detectable_cost_is_the_first_percent_with_enough_power():
    for n in (6, 10, 20, 40, 1000):  # 1000 pairs detect a one-point cost
        want = next(pct / 100 for pct in range(1, 101) if mcnemar_power(n, pct / 100, 0.05) >= POWER)
        assert detectable_cost(n, 0.05) == want
    assert detectable_cost(6, 0.05) > detectable_cost(10, 0.05) > detectable_cost(40, 0.05)


def _cmp(failures, reproduced, je, jb):
    return {"cases": 4, "failures": failures, "reproduced": reproduced, "jaccard_emulation": je,
            "jaccard_baseline": jb, "needle_visible": 40, "needle_live": 3, "needle_emulation": 5,
            "needle_baseline": 30}  # fmt: skip


def test_a_live_endpoint_with_no_failing_case_is_said_so_without_nan():
    """Before: 'the failure is not (mainly) in the indexer's selection ... mean Jaccard emulation
    nan' for a healthy endpoint, which has no failure at all."""
    verdict, reason = live_verdict({**_cmp(0, 0, float("nan"), float("nan")), "cases": 0})
    assert verdict == "inconclusive" and "no case failed on the live endpoint" in reason
    assert "nan" not in reason and "not (mainly)" not in reason


def test_live_verdict_thresholds():
    # 3 failures are enough to decide; 2 are not
    assert live_verdict(_cmp(2, 2, 1.0, 0.0))[0] == "inconclusive"
    assert live_verdict(_cmp(3, 3, 1.0, 0.0))[0] == "implicated"
    # reproduced in exactly 80% of the failures, gap closed exactly half: implicated
    v, reason = live_verdict(_cmp(5, 4, 0.75, 0.5))
    assert v == "implicated" and reason.startswith("its emulation reproduces the live selection failure")
    assert (
        "(gap closed 0.50)" in reason
        and "drops needle entries the baseline selects in 5 (case, layer)" in reason
    )
    assert "the emulation reproduces 4;" in reason and "live 3, emulation 5, baseline 30 of 40" in reason
    assert "emulation 0.750, baseline 0.500" in reason and "over 4 failing case(s)" in reason
    # just under either threshold: a partial reproduction
    assert live_verdict(_cmp(10, 7, 0.9, 0.0))[0] == "inconclusive"
    v, reason = live_verdict(_cmp(5, 4, 0.74, 0.5))
    assert v == "inconclusive" and reason.startswith(
        "a partial reproduction (needs >= 80% and gap closed >= 0.5)"
    )
    # reproduced in at most 20%: the emulation keeps the needle
    assert live_verdict(_cmp(5, 1, 0.2, 0.1))[0] == "exonerated"
    assert live_verdict(_cmp(5, 2, 0.2, 0.1))[0] == "inconclusive"
    # the baseline already equals the live selection: no gap to close, never implicated
    v, reason = live_verdict(_cmp(5, 5, 1.0, 1.0))
    assert v == "inconclusive" and "(gap closed nan)" in reason
    few = live_verdict(_cmp(0, 0, 1.0, 0.5))[1]
    assert few.startswith("fewer than 3 selection failures in the live capture")


def test_schema_errors_name_the_verdicts_record():
    with pytest.raises(ValueError, match=r"^verdicts: missing key 'symptom'"):
        validate_verdicts({})


def test_both_paths_the_teacher_forced_verdict_stands_unless_only_decode_reproduces():
    from needlescope.investigate.decide.verdicts import live_verdict_paths

    hit, miss = _cmp(5, 5, 1.0, 0.0), _cmp(5, 0, 0.0, 0.0)
    v, reason, path = live_verdict_paths({"prefill": miss, "decode": hit})
    assert (v, path) == ("implicated", "decode")
    assert reason == (
        "decode-path only: its teacher-forced emulation is exonerated; on the decode path "
        + live_verdict(hit)[1]
    )
    v, reason, path = live_verdict_paths({"prefill": hit, "decode": hit})
    assert (v, path) == ("implicated", "prefill")
    assert reason == (
        live_verdict(hit)[1] + "; on the decode path: implicated (5 of 5 reproduced, mean Jaccard emulation "
        "1.000 vs baseline 0.000)"
    )
    v, reason, path = live_verdict_paths({"prefill": hit, "decode": miss})
    assert (v, path) == ("implicated", "prefill") and "on the decode path: exonerated (0 of 5" in reason
    assert live_verdict_paths({"prefill": miss, "decode": miss})[0] == "exonerated"
