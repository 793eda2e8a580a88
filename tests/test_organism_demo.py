"""The organism demo end to end on a tiny random DeepSeek-V4 (real servers, real probe)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from needlescope.dsa.emulate import Numerics  # noqa: E402
from needlescope.dsa.rankdump import validate_rankdump  # noqa: E402
from needlescope.organism.bundle import save_random  # noqa: E402
from needlescope.organism.demo import (  # noqa: E402
    Setting,
    default_fixes,
    pick_case_to_explain,
    pick_failing_case,
)
from needlescope.report.diagnosis import render_diagnosis  # noqa: E402
from needlescope.report.probe import validate_summary  # noqa: E402


def _row(case_id, length, depth, correct, status="ok"):
    return {
        "case_id": case_id,
        "length": length,
        "depth": depth,
        "trial": 0,
        "status": status,
        "correct": correct,
    }


def test_failing_case_prefers_deployment_only_failures_at_the_longest_length():
    ref = [_row("a", 512, 0, True), _row("b", 1024, 0, False), _row("c", 1024, 50, True)]
    dep = [_row("a", 512, 0, False), _row("b", 1024, 0, False), _row("c", 1024, 50, False)]
    assert pick_failing_case(ref, dep)[0] == "c"
    assert pick_failing_case([_row("b", 1024, 0, False)], [_row("b", 1024, 0, False)])[1].startswith(
        "wrong under both"
    )
    with pytest.raises(ValueError):
        pick_failing_case(ref, [_row("a", 512, 0, True), _row("e", 512, 0, None, status="error")])


def test_without_a_deployment_miss_the_longest_case_is_explained():
    rows = [_row("a", 512, 50, True), _row("b", 1024, 50, True), _row("c", 1024, 0, True)]
    case_id, why = pick_case_to_explain(rows, rows)
    assert case_id == "c" and why.startswith("no probed case failed")
    assert pick_case_to_explain(rows, [*rows[:1], _row("d", 512, 0, False)])[0] == "d"
    with pytest.raises(ValueError):
        pick_case_to_explain(rows, [_row("e", 512, 0, None, status="error")])


def test_demo_on_a_random_checkpoint_writes_a_diagnosis(tmp_path):
    model = save_random(tmp_path / "model", seed=0, hidden_size=64, moe_intermediate_size=64)
    out = tmp_path / "demo"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "needlescope.cli.main",
            "demo",
            "--model",
            str(model),
            "--out",
            str(out),
            "--lengths",
            "200,400",
            "--trials",
            "1",
            "--deploy-index-topk",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    for name in ("reference", "deployment"):
        summary = json.loads((out / name / "summary.json").read_text())
        validate_summary(summary)
        assert summary["errors_total"] == 0
        assert (out / name / "heatmap.png").stat().st_size > 0
    dump = json.loads((out / "rankdump.json").read_text())
    validate_rankdump(dump)
    assert dump["index_topk"] == 8 and dump["numerics"]["index_k"] == "fp8_e4m3"
    assert dump["patch"] == "fault:indexer_page_table"
    fixes = json.loads((out / "fixes.json").read_text())
    assert [f["numerics"]["index_topk"] for f in fixes["fixes"]] == [8, 16, 32, 16, 8]
    assert [f["patch"] for f in fixes["fixes"]] == ["fault:indexer_page_table"] * 4 + [None]
    text = (out / "DIAGNOSIS.md").read_text()
    for heading in (
        "## Where recall collapses",
        "## Which layer's indexer drops the needle",
        "## Which fix restores it",
    ):
        assert heading in text
    assert "reference/heatmap.png" in text and fixes["case_id"] in text


def test_default_fixes_try_the_deployment_without_its_patch_last():
    plain = default_fixes(Setting(Numerics(index_k="fp8_e4m3", index_topk=64)))
    assert [(f.numerics.index_k, f.numerics.index_topk, f.patch) for f in plain] == [
        ("bf16", 64, None),
        ("fp8_e4m3", 128, None),
        ("fp8_e4m3", 256, None),
        ("bf16", 128, None),
    ]
    patched = default_fixes(Setting(Numerics(index_k="fp8_e4m3", index_topk=64), "fault:indexer_key_slot"))
    assert patched[-1] == Setting(Numerics(index_k="fp8_e4m3", index_topk=64))
    assert {f.patch for f in patched[:-1]} == {"fault:indexer_key_slot"}


def _summary(recall: float) -> dict:
    return {
        "cells": [{"length": 256, "depth": 0.0, "correct": round(4 * recall), "n": 4}],
        "threshold": 0.85,
        "effective_length": 256 if recall >= 0.85 else None,
        "cliff": None,
    }


def _dump(selected: bool) -> dict:
    pos = {
        "needle_entries": [3],
        "visible_entries": 64,
        "best_rank": 1 if selected else 40,
        "margin": 0.5 if selected else -0.5,
        "margin_frac": 0.1,
        "selected": selected,
    }
    return {"index_topk": 8, "generated_text": "12", "layers": [{"layer": 1, "positions": [pos]}]}


def test_diagnosis_blames_no_cutoff_when_the_needle_was_selected_but_a_fix_restores_the_answer():
    case = {"case_id": "c", "length": 256, "depth": 0.0, "expected": ["13"]}
    fixes = [
        {"label": "k=bf16", "selected_all_layers": True, "answer_correct": False},
        {"label": "no patch", "selected_all_layers": True, "answer_correct": True},
    ]
    kw = dict(
        model="m",
        reference=_summary(1.0),
        deployment=_summary(0.5),
        deployment_label="dep",
        case=case,
        why="w",
    )
    text = render_diagnosis(rankdump=_dump(True), fixes=fixes, **kw)
    assert "the top-k cutoff is not what failed; `no patch` restores the answer" in text
    text = render_diagnosis(rankdump=_dump(False), fixes=fixes, **kw)
    assert (
        "ranks the needle's best entry 40 of 64" in text
        and "restores both selection and the answer: `no patch`" in text
    )
    text = render_diagnosis(rankdump=_dump(True), fixes=fixes[:1], **kw)
    assert "the cause is outside the indexer's top-k" in text


def test_demo_with_an_unknown_fault_exits_2_before_serving(tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "needlescope.cli.main",
            "demo",
            "--out",
            str(tmp_path / "o"),
            "--deploy-patch",
            "fault:nope",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2
    assert "unknown fault 'nope'" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()
