"""The organism demo end to end on a tiny random DeepSeek-V4 (real servers, real probe)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from needlescope.dsa.rankdump import validate_rankdump  # noqa: E402
from needlescope.organism.bundle import save_random  # noqa: E402
from needlescope.organism.demo import pick_case_to_explain, pick_failing_case  # noqa: E402
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
    fixes = json.loads((out / "fixes.json").read_text())
    assert [f["numerics"]["index_topk"] for f in fixes["fixes"]] == [8, 16, 16]
    text = (out / "DIAGNOSIS.md").read_text()
    for heading in (
        "## Where recall collapses",
        "## Which layer's indexer drops the needle",
        "## Which fix restores it",
    ):
        assert heading in text
    assert "reference/heatmap.png" in text and fixes["case_id"] in text
