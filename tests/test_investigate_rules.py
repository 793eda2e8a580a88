"""Pure rules: verdicts, fix labels (the signature's rules: tests/test_signature.py)."""

from __future__ import annotations

import pytest

from needlescope.investigate.decide.verdicts import (
    classify_fix,
    paired,
    resolve_root_cause,
    suspect_verdict,
    validate_verdicts,
)


def test_paired_and_verdict_rules():
    with_s = {f"c{i}": i % 2 == 0 for i in range(20)}  # 10 right
    without = {f"c{i}": True for i in range(20)}
    pair = paired(with_s, without)
    assert (pair["b"], pair["c"], pair["n"]) == (10, 0, 20) and pair["p"] < 0.01
    kw = dict(absent_by_question=None, blocked=[], ran_checks=1)
    assert suspect_verdict(present=True, pair=pair, divergence=0.0, **kw)[0] == "implicated"
    same = paired(without, without)
    assert suspect_verdict(present=True, pair=same, divergence=0.2, **kw)[0] == "diverges_no_effect"
    two_of_ten = paired({f"c{i}": i >= 2 for i in range(10)}, {f"c{i}": True for i in range(10)})
    assert suspect_verdict(present=True, pair=two_of_ten, divergence=0.2, **kw)[0] == "inconclusive"
    assert suspect_verdict(present=True, pair=same, divergence=0.0, **kw)[0] == "exonerated"
    weak = paired({"a": False, "b": False, "c": True}, {"a": True, "b": True, "c": True})
    assert suspect_verdict(present=True, pair=weak, divergence=0.0, **kw)[0] == "inconclusive"
    assert (
        suspect_verdict(
            present=True, pair=None, divergence=None, absent_by_question=None, blocked=["x: no"], ran_checks=0
        )[0]
        == "blocked"
    )
    assert (
        suspect_verdict(
            present=True,
            pair=pair,
            divergence=None,
            absent_by_question="env X answered '1'",
            blocked=[],
            ran_checks=0,
        )[0]
        == "exonerated"
    )


def test_root_cause_and_workaround():
    strong = {"b": 10, "c": 0, "p": 0.002, "n": 20, "recall_with": 0.5, "recall_without": 1.0}
    sus = [
        {
            "id": "page_table",
            "verdict": "implicated",
            "present": True,
            "changes_topk": False,
            "pair": strong,
            "reason": "r",
        },
        {
            "id": "index_topk",
            "verdict": "implicated",
            "present": True,
            "changes_topk": True,
            "pair": strong,
            "reason": "r",
        },
        {
            "id": "fp8",
            "verdict": "exonerated",
            "present": True,
            "changes_topk": False,
            "pair": strong,
            "reason": "r",
        },
    ]
    root, roles = resolve_root_cause(sus, signature_fires=True)
    assert root == "page_table" and sus[1]["verdict"] == "implicated"  # the role is a new value
    assert roles["index_topk"].verdict == "exonerated" and roles["index_topk"].role == "workaround"
    assert "workaround" in roles["index_topk"].reason
    alone = [dict(sus[1], verdict="implicated", reason="r")]
    assert resolve_root_cause(alone, signature_fires=False)[0] == "index_topk"
    root, roles = resolve_root_cause(alone, signature_fires=True)
    assert root is None and roles["index_topk"].verdict == "inconclusive"
    assert (
        classify_fix(strong, removes="page_table", root_cause="page_table", keeps_topk=True)
        == "root-cause fix"
    )
    assert classify_fix(strong, removes=None, root_cause="page_table", keeps_topk=False) == "workaround"
    assert (
        classify_fix(
            {**strong, "b": 1, "p": 1.0}, removes="page_table", root_cause="page_table", keeps_topk=True
        )
        == "no effect"
    )


def test_verdicts_schema():
    ok = {
        "symptom": {},
        "root_cause": None,
        "signature": {"uninformative_ranking": False, "layers": [], "collapse_vs_topk": []},
        "suspects": [
            {
                "id": "a",
                "tier": 1,
                "verdict": "exonerated",
                "reason": "",
                "evidence": [{"check": "x", "metric": "m", "value": 1.0, "threshold": None}],
            }
        ],
        "root_causes": [],
        "differences": [],
        "unaccounted_differences": [],
        "residual": None,
        "localization": None,
        "rank_paths": None,
        "nonfinite_scores": {"counts": {}, "findings": []},
        "multiplicity": {"method": "holm", "tests": 0, "alpha": 0.05},
    }
    validate_verdicts(ok)
    with pytest.raises(ValueError, match="unaccounted_differences"):
        validate_verdicts({k: v for k, v in ok.items() if k != "unaccounted_differences"})
    with pytest.raises(ValueError, match="root_cause"):
        validate_verdicts({**ok, "root_causes": ["b"]})
    with pytest.raises(ValueError, match="verdict"):
        validate_verdicts({**ok, "suspects": [{**ok["suspects"][0], "verdict": "guilty"}]})
    with pytest.raises(ValueError, match="root_cause"):
        validate_verdicts({**ok, "root_cause": "b"})


def test_first_wrong_token():
    from needlescope.investigate.measure.records import first_wrong_token

    assert first_wrong_token(["4", "3", "7"], "439") == 2  # the demo's 437 for 439: the third digit
    assert first_wrong_token(["4", "3", "9"], "439") is None
    assert first_wrong_token(["5"], "439") == 0
    assert first_wrong_token(["4", "3", "9", "1"], "439") == 3


def test_absent_suspect_exoneration_says_what_it_rests_on():
    verdict, reason = suspect_verdict(
        present=False,
        pair=None,
        divergence=None,
        absent_by_question=None,
        blocked=[],
        ran_checks=0,
        presence="config check: candidate index_k=fp32, the suspect is index_k=fp8_e4m3",
        questions="config key=index_head_dim -> 64",
    )
    assert verdict == "exonerated"
    assert reason.startswith("not present in the candidate (config check: candidate index_k=fp32")
    assert "cheap questions: config key=index_head_dim -> 64" in reason and "none ran" in reason


def test_live_comparison_and_verdict():
    from needlescope.analysis.stats import jaccard
    from needlescope.investigate.decide.live import compare_rows, summarise
    from needlescope.investigate.decide.verdicts import live_verdict

    assert jaccard(set(), set()) == 1.0 and jaccard({1, 2}, {2, 3}) == 1 / 3
    live = {"1": [[0, 1], [0, 9]]}  # needle entries 5, 6: the live drops them at the analysed row
    base = {"1": [[0, 5], [5, 6]]}
    same = compare_rows(live, live, base, {"1": [5, 6]})
    other = compare_rows(live, {"1": [[7, 8], [7, 8]]}, base, {"1": [5, 6]})
    keeps = compare_rows(live, base, base, {"1": [5, 6]})
    assert same["points"] == [{"layer": 1, "needle_visible": 2, "live": 0, "emulation": 0, "baseline": 2}]
    s_same, s_other, s_keeps = (summarise([c] * 3) for c in (same, other, keeps))
    assert (s_same["failures"], s_same["reproduced"], s_same["jaccard_emulation"]) == (3, 3, 1.0)
    assert live_verdict(s_same)[0] == "implicated"
    # drops the needle too, but selects nothing like the live: the Jaccard gap stays open
    assert s_other["reproduced"] == 3 and live_verdict(s_other)[0] == "inconclusive"
    assert live_verdict(s_keeps)[0] == "exonerated" and "keeps the needle" in live_verdict(s_keeps)[1]
    few = summarise([same])  # one selection failure only
    assert (
        live_verdict(few)[0] == "inconclusive"
        and "not (mainly) in the indexer's selection" in live_verdict(few)[1]
    )
