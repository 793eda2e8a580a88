"""The benchmark's goal lines (bench/indexer_bench.py, ``_goal_lines``): each goal's verdict comes
from the run's own numbers, on both sides of each threshold (CPU; no kernel runs)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import indexer_bench as B  # noqa: E402


def _decode(clean_pct: float, fused_us: float, unfused_us: float, fused: str = "fused_filter") -> list[dict]:
    cell = {
        "persistent_clean_pct_copy": clean_pct,
        "persistent_clean_us": 50.0,
        "persistent_graph_pct_copy": 92.0,
        f"{fused}_us": fused_us,
        f"{fused}_same_set": True,
        "unfused_persistent_us": unfused_us,
    }
    return [{"batch": b, "context": c, "fp8_e4m3": dict(cell)} for b, c in B.GOAL_CELLS]


def _topk(default_us: float, same: bool = True) -> list[dict]:
    one = {"rows": 1, "length": 32768, "k": 512, "method": "radix"}
    one["default"] = {"us": default_us, "same_set": same}
    return [one]


def _verdicts(out: dict) -> list[str]:
    return [ln.rsplit("|", 2)[1].strip() for ln in B._goal_lines(out)[2:] if ln]


def test_each_goal_is_met_or_not_by_its_own_number() -> None:
    good = {"topk": _topk(7.9), "decode": _decode(85.0, 90.0, 100.0)}
    assert _verdicts(good) == ["met", "met", "met"]
    bad = {"topk": _topk(8.1), "decode": _decode(84.9, 90.1, 100.0)}
    assert _verdicts(bad) == ["not met", "not met", "not met"]
    lines = "\n".join(B._goal_lines(bad))
    assert "| default 8.1 us (radix) | not met |" in lines
    assert "9.9% / 9.9% / 9.9% / 9.9% ahead" in lines and "clean 84.9% / 84.9%" in lines


def test_the_fused_goal_is_the_cuda_group_path_where_timed_and_needs_its_sets_exact() -> None:
    cells = _decode(85.0, 80.0, 100.0, fused="fused_cuda")
    for c in cells:
        c["fp8_e4m3"]["fused_filter_us"] = 99.0  # the fused filter, timed beside it, is not the one of record
    assert _verdicts({"decode": cells}) == ["met", "met"]
    assert "fused cuda 20.0% / 20.0% / 20.0% / 20.0% ahead" in "\n".join(B._goal_lines({"decode": cells}))
    cells[2]["fp8_e4m3"]["fused_cuda_same_set"] = False
    assert _verdicts({"decode": cells}) == ["not met", "met"]


def test_a_wrong_set_is_never_met_and_missing_sections_give_no_line() -> None:
    assert _verdicts({"topk": _topk(5.0, same=False)}) == ["not met"]
    assert B._goal_lines({}) == ["| goal | this run | met? |", "|---|---|---|", ""]
    partial = {"decode": _decode(90.0, 80.0, 100.0)[:3]}  # a cell short: no decode verdicts
    assert _verdicts(partial) == []


RUNS = Path(__file__).resolve().parents[1] / "docs" / "perf"
DOC = RUNS / "indexer.md"


@pytest.mark.parametrize(
    ("run", "verdicts"),
    [
        ("run-issue40-h100-cuda/indexer_bench.json", ["not met", "not met", "met"]),
        ("run-issue40-h100-groups/run36/indexer_bench.json", ["met", "not met", "met"]),
        ("run-issue40-h100-race/run42/bench/indexer_bench.json", ["met", "not met", "met"]),
    ],
)
def test_the_documented_tables_are_what_the_committed_run_renders(run: str, verdicts: list[str]) -> None:
    """docs/perf/indexer.md's issue 40 tables are the benchmark's rendering of the raw runs they
    cite, so an edit of either side, or of the rendering, shows here."""
    out = json.loads((RUNS / run).read_text())
    doc = DOC.read_text()
    for line in [*B._goal_lines(out), *B._decode_lines(out)[2:], *B._topk_lines(out)]:
        assert line in doc, line
    assert _verdicts(out) == verdicts


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="graph timing needs a GPU")
def test_graph_timing_waits_for_work_the_caller_queued() -> None:
    """``med(graph=True)``: Triton's ``do_bench_cudagraph`` calls fn() first on a side stream that
    does not wait for the caller's stream; the timed fn must not see the caller's inputs before
    the caller's queued kernels wrote them (twelfth session: that race corrupted a lab's inputs).
    A warm-up timing comes first: the first of a process did not race (run 41's probe; its setup
    waits for the device), every later one did, with fn allocating or not (run 42)."""
    import torch

    x = torch.zeros(1, device="cuda")
    low = torch.ones(1, device="cuda")
    B.med(lambda: torch.minimum(low, low, out=low), graph=True)  # the stream pool and graphs up first
    torch.cuda._sleep(50_000_000)  # tens of milliseconds of GPU time queued before x is written
    x.fill_(1.0)
    B.med(lambda: torch.minimum(low, x, out=low), graph=True)  # low 0 once fn ran before the fill
    assert low.item() == 1.0
