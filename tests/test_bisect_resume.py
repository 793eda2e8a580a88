"""Issue 38, R7: ``probe --bisect --resume`` keeps its whole step history (phases, the coarse
bracket, every step), exactly as the uninterrupted run recorded it."""

from __future__ import annotations

import json
import shutil

from needlescope.run.bisect import BisectConfig, run_bisect
from needlescope.run.config import ProbeConfig


def _cfg(url: str, out, resume: bool = False) -> ProbeConfig:
    return ProbeConfig(
        base_urls=(url,),
        model="scripted",
        lengths=(200, 1200),
        depths=(0, 100),
        trials=1,
        out=out,
        resume=resume,
    )


def test_a_resumed_bisection_decides_from_what_it_had_asked_for(scripted_server, tmp_path):
    url = scripted_server(window=100_000, fault="near_miss", fault_from=733)
    bis = BisectConfig(resolution=8, boundaries=())
    whole = run_bisect(_cfg(url, tmp_path / "whole"), bis)
    assert len(whole["steps"]) >= 4 and all(p["phase"] != "?" for p in whole["points"])
    # A run killed at its very end holds every case; resumed, it must replay the same search.
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    for name in ("bisect.json", "bisect.md", "results.jsonl"):
        (tmp_path / "resumed" / name).unlink()
    resumed = run_bisect(_cfg(url, tmp_path / "resumed", resume=True), bis)
    assert resumed["steps"] == whole["steps"]
    assert resumed["points"] == whole["points"] and resumed["message"] == whole["message"]
    assert json.loads((tmp_path / "resumed" / "bisect.json").read_text())["steps"] == whole["steps"]
