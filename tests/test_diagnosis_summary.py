"""DIAGNOSIS's summary box, read from the verdict data, and the block renderer's box and fold.

The organism investigation (tests/test_investigate_organism.py) renders a real run in Chromium;
these cover the verdict shapes one run cannot: no root cause, an unexplained residual,
differences no suspect covers, the roles a verdict may carry.
"""

from __future__ import annotations

from needlescope.investigate.decide.findings import Findings, Suspect
from needlescope.investigate.decide.signature import NO_SIGNATURE
from needlescope.investigate.report.summary import shown_verdict, summary_box
from needlescope.report.blocks import render_html, render_md


def _pair(with_, without, b, c, p, n=18):
    return {"n": n, "b": b, "c": c, "p": p, "recall_with": with_, "recall_without": without}


_IDENT = {
    "paged": ("fault:indexer_page_table", "the paged kernel"),
    "index_topk": ("topk=64", "top-k too small"),
}


def _suspect(sid, verdict, reason, **kw) -> Suspect:
    maps_to, hypothesis = _IDENT.get(sid, ("", ""))
    pair = _pair(0.44, 1.0, 10, 0, 0.001953125) if sid in _IDENT else None
    return Suspect(sid, 2, hypothesis, maps_to, False, False, verdict, reason, pair=pair, **kw)


def _inv(root="paged", fixes=None, suspects=None, **verdicts) -> Findings:
    default = [
        _suspect("paged", "implicated", "removing it ..."),
        _suspect("index_topk", "exonerated", "workaround, not the cause: removing it ...", role="workaround"),
        _suspect("hc_mix", "diverges_no_effect", "moves the logits ..."),
    ]
    return Findings(
        route="in-process",
        ledger="investigation.toml",
        target={"model": "organism", "device": "cpu"},
        symptom={
            "kind": "multiturn",
            "cases": 18,
            "recall_reference": {"256": 1.0, "512": 1.0, "1024": 1.0},
            "recall_candidate": {"256": 1.0, "512": 0.33, "1024": 0.0},
        },
        configs={},
        candidate_topk=64,
        suspects=tuple(suspects or default),
        fixes=tuple(fixes or []),
        explained=None,
        root_cause=root,
        root_causes=tuple(verdicts.pop("root_causes", [root] if root else [])),
        signature=NO_SIGNATURE,
        differences=(),
        unaccounted_differences=tuple(verdicts.pop("unaccounted_differences", ())),
        multiplicity={"method": "holm", "tests": 2, "alpha": 0.05},
        **verdicts,
    )


FIXES = [
    {"name": "remove-index_topk", "label": "k=fp8 topk=cfg", "removes": "index_topk", "index_topk": 2048,
     "keeps_topk": False, "changes": "config", "pair": _pair(0.44, 1.0, 10, 0, 0.001953125), "label_kind": "workaround"},
    {"name": "topk-128", "label": "k=fp8 topk=128", "removes": None, "index_topk": 128, "keeps_topk": False,
     "changes": "config", "pair": _pair(0.44, 0.72, 5, 0, 0.0625), "label_kind": "no effect"},
    {"name": "remove-paged", "label": "k=fp8 topk=64", "removes": "paged", "index_topk": 64, "keeps_topk": True,
     "changes": "kernel", "pair": _pair(0.44, 1.0, 10, 0, 0.001953125), "label_kind": "root-cause fix"},
]  # fmt: skip


def rows(inv) -> dict[str, str]:
    kind, title, items = summary_box(inv)
    assert (kind, title) == ("box", "Summary")
    return dict(items)


def test_the_box_names_the_cause_its_fix_with_its_effect_and_the_workaround():
    r = rows(_inv(fixes=FIXES))
    assert r["Symptom"].startswith("recall falls from 512 tokens on: candidate 1.00, 0.33, 0.00 vs reference")
    assert r["Root cause"].startswith(
        "**paged** (`fault:indexer_page_table`; the paged kernel): removing it, recall"
    )
    assert r["Recommended fix"] == (
        "remove paged (setting `k=fp8 topk=64`): recall 0.44 -> 1.00 on 18 paired cases (b=10, c=0, "
        "exact McNemar p=0.002), at the deployment's index_topk"
    )
    assert r["Not a fix"].startswith("raising index_topk (64 -> 2048) is a workaround: recall 0.44 -> 1.00")
    assert "while paged stays, at 32x the entries each query reads" in r["Not a fix"]
    assert "do not chase hc_mix" in r["Not a fix"] and "topk-128" not in r["Not a fix"]


def test_no_implicated_suspect_reads_unexplained():
    r = rows(_inv(root=None, suspects=[_suspect("paged", "exonerated", "no effect")]))
    assert r["Root cause"] == "**unexplained**: no suspect in the ledger is implicated"
    assert r["Recommended fix"] == "none found: no replayed fix removes a cause" and r["Not a fix"] == "-"
    open_ = [
        _suspect("paged", "inconclusive", "too few cases"),
        _suspect("k", "inconclusive", "w", role="workaround"),
    ]
    assert rows(_inv(root=None, suspects=open_))["Root cause"] == "**unexplained**: inconclusive: paged"
    # Without a loss there is nothing to explain.
    healthy = _inv(root=None, suspects=[_suspect("paged", "exonerated", "no effect")])
    healthy.symptom["recall_candidate"] = dict(healthy.symptom["recall_reference"])
    assert rows(healthy)["Root cause"].startswith("nothing to explain: the candidate loses no recall")
    # ... also with suspects left inconclusive (a benign bug: 1.00 vs 1.00)
    benign = _inv(root=None, suspects=open_)
    benign.symptom["recall_candidate"] = dict(benign.symptom["recall_reference"])
    assert (
        rows(benign)["Root cause"].startswith("nothing to explain")
        and "unexplained" not in rows(benign)["Root cause"]
    )


def test_a_residual_loss_and_uncovered_differences_say_unexplained():
    residual = {"loses": True, "text": "unexplained residual: recall 0.50 vs 1.00 (reference)"}
    diffs = [{"kind": "env", "name": "SGLANG_X", "covered_by": [], "verdict": None}]
    r = rows(_inv(root_causes=["paged"], residual=residual, unaccounted_differences=diffs))
    assert (
        "**paged**" in r["Root cause"]
        and "**partly unexplained**: unexplained residual: recall 0.50" in r["Root cause"]
    )
    assert (
        "1 difference(s) from the reference that no ledger suspect names: `SGLANG_X` (not tested)"
        in r["Root cause"]
    )
    # A difference whose automatic suspect was exonerated is accounted for.
    settled = [{**diffs[0], "verdict": "exonerated"}]
    assert "partly" not in rows(_inv(root_causes=["paged"], unaccounted_differences=settled))["Root cause"]
    r = rows(_inv(root=None, root_causes=[], residual=residual))
    assert r["Root cause"] == "**unexplained**: unexplained residual: recall 0.50 vs 1.00 (reference)"
    # A residual that does not lose leaves the cause explained.
    assert "unexplained" not in rows(_inv(residual={"loses": False, "text": "no residual"}))["Root cause"]


def test_roles_are_shown_and_a_workaround_is_never_shown_as_exonerated():
    assert shown_verdict(_suspect("k", "exonerated", "x", role="workaround")) == "workaround"
    # the role says it, never the reason's words
    assert shown_verdict(_suspect("k", "exonerated", "workaround, not the cause: ...")) == "exonerated"
    assert shown_verdict(_suspect("k", "inconclusive", "x", role="workaround")) == "workaround"
    assert shown_verdict(_suspect("a", "implicated", "x", role="co-factor")) == "implicated (co-factor)"
    assert shown_verdict(_suspect("a", "implicated", "x")) == "implicated"
    assert shown_verdict(_suspect("a", "exonerated", "not present")) == "exonerated"
    r = rows(
        _inv(
            suspects=[
                _suspect("paged", "implicated", "x"),
                _suspect("big", "exonerated", "y", role="workaround"),
            ]
        )
    )
    assert r["Not a fix"] == "big is a workaround, not the cause"
    co = [
        _suspect("paged", "implicated", "x", role="root cause"),
        _suspect("hc", "implicated", "y", role="co-factor"),
    ]
    assert rows(_inv(suspects=co))["Root cause"].endswith(
        "; co-factor(s) hc: necessary, not sufficient on their own"
    )


def test_the_box_and_a_fold_render_in_markdown_and_html():
    blocks = [("h", 1, "DIAGNOSIS"), summary_box(_inv(fixes=FIXES)),
              ("details", "Evidence: 2 rows", [("table", ["a", "b"], [["<x>", "`y`"]])]), ("footer", "by **me**")]  # fmt: skip
    md = render_md(blocks)
    assert md.startswith("# DIAGNOSIS\n\n> **Summary**\n>\n> - **Symptom:** recall falls")
    assert "<details>\n<summary>Evidence: 2 rows</summary>\n\n| a | b |" in md
    page = render_html(blocks, {})
    assert '<section class="summary"><h2>Summary</h2><dl><dt>Symptom</dt>' in page
    assert "<details><summary>Evidence: 2 rows</summary><table>" in page and "<td>&lt;x&gt;</td>" in page
    assert '<footer class="footer">by <strong>me</strong></footer>' in page


def _probe_summary(recalls: dict[int, float]) -> dict:
    cells = [{"length": n, "depth": 0.0, "correct": round(4 * r), "n": 4} for n, r in recalls.items()]
    return {"cells": cells, "threshold": 0.85, "effective_length": None, "cliff": None}


def test_the_serve_probe_explain_diagnosis_md_opens_with_the_same_summary_box():
    from needlescope.report.diagnosis import render_diagnosis

    pos = {"needle_entries": [3], "visible_entries": 64, "best_rank": 40, "margin": -0.5, "selected": False}
    dump = {"index_topk": 8, "generated_text": "12", "layers": [{"layer": 1, "positions": [pos]}]}
    fixes = [
        {
            "label": "topk=16 patch=fault:x",
            "patch": "fault:x",
            "selected_all_layers": True,
            "answer_correct": True,
        },
        {"label": "topk=8", "patch": None, "selected_all_layers": True, "answer_correct": True},
    ]
    kw = dict(model="m", reference=_probe_summary({256: 1.0, 512: 1.0}), deployment_label="dep",
              case={"case_id": "c", "length": 512, "depth": 0.0, "expected": ["13"]}, why="w", rankdump=dump)  # fmt: skip
    text = render_diagnosis(
        deployment=_probe_summary({256: 1.0, 512: 0.25}), fixes=fixes, deployment_patch="fault:x", **kw
    )
    assert text.startswith(
        "# DIAGNOSIS\n\n> **Summary**\n>\n> - **Symptom:** recall falls from 512 tokens on: "
    )
    assert "deployment 1.00, 0.25 vs reference 1.00, 1.00 at 256, 512 tokens" in text
    assert (
        "> - **Root cause:** likely the patch `fault:x`: removing it restores selection and the answer"
        in text
    )
    assert "> - **Recommended fix:** `topk=8` (removes the patch)" in text
    assert "> - **Not a fix:** `topk=16 patch=fault:x` is a workaround" in text
    # Nothing restores the case: the cutoff is named, the rest is unexplained, no fix is invented.
    text = render_diagnosis(deployment=_probe_summary({256: 1.0, 512: 0.25}), fixes=[], **kw)
    assert "top-k drops the needle in CSA layer 1 (best entry rank 40 of 64, k = 8)" in text
    assert "**unexplained** beyond that" in text and "> - **Recommended fix:** none found" in text
