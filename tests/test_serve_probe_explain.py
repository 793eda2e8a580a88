"""``needlescope serve-probe-explain`` end to end on a tiny random DeepSeek-V4 (real servers, real
probe), and its input checks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from needlescope.dsa.rankdump import validate_rankdump  # noqa: E402
from needlescope.outdir import MANIFEST_NAME, record_outputs  # noqa: E402
from needlescope.report.diagnosis import render_diagnosis  # noqa: E402
from needlescope.report.probe import validate_summary  # noqa: E402
from needlescope.setting import Setting  # noqa: E402
from needlescope.testing.checkpoints import save_random  # noqa: E402
from needlescope.workflows.explain import (  # noqa: E402
    default_fixes,
    pick_case_to_explain,
    pick_failing_case,
    validate_fixes,
)
from needlescope.workflows.serve_probe_explain import OUTPUTS  # noqa: E402


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


# The page-table fault, from a user file that records each execution of its body (one line per process).
COUNTING_PATCH = """
import os
from pathlib import Path

with open(Path(__file__).with_suffix(".runs"), "a") as f:
    f.write(f"{os.getpid()}\\n")

from needlescope.dsa.faults.indexer_page_table import apply  # noqa: E402,F401
"""


def _serve_probe_explain(model, out, *extra: str) -> subprocess.CompletedProcess:
    argv = [
        sys.executable,
        "-m",
        "needlescope.cli.main",
        "serve-probe-explain",
        "--model",
        str(model),
        "--out",
        str(out),
    ]
    return subprocess.run([*argv, *extra], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_random(tmp_path_factory.mktemp("spe_model"), seed=0, hidden_size=64, moe_intermediate_size=64)


def test_serve_probe_explain_on_a_random_checkpoint_writes_a_diagnosis_and_runs_its_patch_once_per_process(
    tmp_path, tiny_model
):
    model = tiny_model
    out = tmp_path / "spe"
    patch = tmp_path / "counting_patch.py"
    patch.write_text(COUNTING_PATCH)
    res = _serve_probe_explain(
        model,
        out,
        "--lengths",
        "200,400",
        "--trials",
        "1",
        "--deploy-index-topk",
        "8",
        "--deploy-patch",
        str(patch),
    )
    assert res.returncode == 0, res.stderr[-2000:]
    # The pipeline's process (fail-fast check, rank dump, 4 fixes) and the deployment server each ran it once.
    runs = patch.with_suffix(".runs").read_text().split()
    assert len(runs) == len(set(runs)) == 2
    recorded = json.loads((out / MANIFEST_NAME).read_text())["files"]
    assert recorded["DIAGNOSIS.md"]["command"] == "serve-probe-explain"
    for name in ("reference", "deployment"):
        summary = json.loads((out / name / "summary.json").read_text())
        validate_summary(summary)
        assert summary["errors_total"] == 0
        assert (out / name / "heatmap.png").stat().st_size > 0
    dump = json.loads((out / "rankdump.json").read_text())
    validate_rankdump(dump)
    assert dump["index_topk"] == 8 and dump["numerics"]["index_k"] == "fp8_e4m3"
    assert dump["patch"] == str(patch)
    fixes = json.loads((out / "fixes.json").read_text())
    validate_fixes(fixes)
    assert [f["numerics"]["index_topk"] for f in fixes["fixes"]] == [8, 16, 32, 16, 8]
    assert [f["patch"] for f in fixes["fixes"]] == [str(patch)] * 4 + [None]
    text = (out / "DIAGNOSIS.md").read_text()
    for heading in (
        "## Where recall collapses",
        "## Which layer's indexer drops the needle",
        "## Which fix restores it",
    ):
        assert heading in text
    assert "reference/heatmap.png" in text and fixes["case_id"] in text


def test_default_fixes_try_the_deployment_without_its_patch_last():
    plain = default_fixes(Setting(index_k="fp8_e4m3", index_topk=64))
    assert [(f.index_k, f.index_topk, f.patch) for f in plain] == [
        ("bf16", 64, None),
        ("fp8_e4m3", 128, None),
        ("fp8_e4m3", 256, None),
        ("bf16", 128, None),
    ]
    patched = default_fixes(Setting(index_k="fp8_e4m3", index_topk=64, patch="fault:indexer_key_slot"))
    assert patched[-1] == Setting(index_k="fp8_e4m3", index_topk=64)
    assert {f.patch.spec for f in patched[:-1]} == {"fault:indexer_key_slot"}


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
        and "restores both selection and the answer on this case: `no patch`" in text
    )
    # With the deployment's patch known, a fix that keeps it is a workaround, never the root cause.
    patched = [
        {
            "label": "topk=16 patch=fault:x",
            "patch": "fault:x",
            "selected_all_layers": True,
            "answer_correct": True,
        },
        {"label": "topk=8", "patch": None, "selected_all_layers": True, "answer_correct": True},
    ]
    text = render_diagnosis(rankdump=_dump(False), fixes=patched, deployment_patch="fault:x", **kw)
    assert "Removing the patch (`topk=8`) restores both selection and the answer" in text
    assert "`topk=16 patch=fault:x` also restores this case while the patch stays in: a workaround" in text
    assert "| `topk=16 patch=fault:x` | patch stays in |" in text
    text = render_diagnosis(rankdump=_dump(True), fixes=fixes[:1], **kw)
    assert "the cause is outside the indexer's top-k" in text


@pytest.fixture
def refusal(run_cli_completed):
    """``needlescope serve-probe-explain --model MODEL --out OUT ...`` through its real entry point in this process:
    its input checks refuse before anything is served, and a child spent seconds on imports."""

    def run(model, out, *extra: str) -> subprocess.CompletedProcess:
        return run_cli_completed("serve-probe-explain", "--model", str(model), "--out", str(out), *extra)

    return run


def test_an_unknown_fault_exits_2_before_serving(tmp_path, run_cli_completed):
    res = run_cli_completed(
        "serve-probe-explain", "--out", str(tmp_path / "o"), "--deploy-patch", "fault:nope"
    )
    assert res.returncode == 2
    assert "unknown fault 'nope'" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_refuses_to_replace_a_file_it_did_not_write(tmp_path, tiny_model, refusal):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "DIAGNOSIS.md").write_text("years of work")
    res = refusal(tiny_model, out, "--lengths", "200")
    assert res.returncode == 2 and "DIAGNOSIS.md was not written by needlescope" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert (out / "DIAGNOSIS.md").read_text() == "years of work"


def test_checks_the_model_before_touching_out(tmp_path, refusal):
    out = tmp_path / "earlier"
    out.mkdir()
    (out / "DIAGNOSIS.md").write_text("earlier run")
    record_outputs(out, OUTPUTS)
    res = refusal(tmp_path / "typo", out)
    assert res.returncode == 2 and "does not exist" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert (out / "DIAGNOSIS.md").read_text() == "earlier run"


def test_refuses_an_out_that_is_a_file_or_inside_the_checkpoint(tmp_path, tiny_model, refusal):
    clash = tmp_path / "file"
    clash.write_text("x")
    for out, words in ((clash, "is not a directory"), (tiny_model / "sub", "overlaps the checkpoint")):
        res = refusal(tiny_model, out)
        assert res.returncode == 2 and words in res.stderr, res.stderr
    assert clash.read_text() == "x"


def test_runs_no_patch_when_another_input_is_bad(tmp_path, refusal):
    patch = tmp_path / "counting_patch.py"
    patch.write_text(COUNTING_PATCH)
    res = refusal(tmp_path / "typo", tmp_path / "out", "--deploy-patch", str(patch))
    assert res.returncode == 2 and "does not exist" in res.stderr
    assert not patch.with_suffix(".runs").exists() and not (tmp_path / "out").exists()
