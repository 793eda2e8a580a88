"""Collapse bisection against real scripted loopback servers: boundary, residue class, no bracket."""

from __future__ import annotations

import json

from needlescope.report.bisect import validate_bisect
from needlescope.run.bisect import BisectConfig, run_bisect
from needlescope.run.config import ProbeConfig


def _cfg(url: str, out, lengths: tuple[int, int]) -> ProbeConfig:
    return ProbeConfig(
        base_urls=(url,), model="scripted", lengths=lengths, depths=(0, 100), trials=1, out=out
    )


def test_bisection_finds_a_planted_boundary_to_the_resolution(scripted_server, tmp_path):
    url = scripted_server(fault="near_miss", fault_from=733)
    res = run_bisect(_cfg(url, tmp_path, (200, 1200)), BisectConfig(resolution=8, boundaries=()))
    validate_bisect(json.loads((tmp_path / "bisect.json").read_text()))
    assert res["bracketed"]
    assert res["last_pass"] < 733 <= res["collapse_length"]
    assert res["collapse_length"] - res["last_pass"] <= 8
    # Fine offsets around the boundary agree with it.
    recall = {p["length"]: p["recall"] for p in res["points"]}
    assert recall[res["collapse_length"] + 1] == 0.0 and recall[res["collapse_length"] - 1] in (0.0, 1.0)
    assert res["requests_used"] == sum(p["n"] for p in res["points"])
    assert res["full_grid_requests"] == 2 * (1000 // 8 + 1)
    assert res["request_ratio"] < 0.3
    # Each narrowing rests on ends that differ significantly; with 2 cases a length (2/2 against
    # 0/2: Fisher p = 0.33) the coarse ends first got twice the trials (4/4 against 0/4: p = 0.029).
    first = res["steps"][0]
    assert first["phase"] == "coarse" and first["narrowed"] and first["p_value"] < 0.05
    assert first["last_pass"]["n"] == first["first_fail"]["n"] == 4
    assert all(s["p_value"] < 0.05 for s in res["steps"] if s["narrowed"])
    assert res["confirmed"] and res["crossing"]["last_pass"]["length"] == res["last_pass"]
    assert 0 < res["crossing"]["confidence"] < 1 and "where this sample crossed 0.85" in res["message"]
    md = (tmp_path / "bisect.md").read_text()
    assert "## Steps (evidence behind each)" in md and "Fisher p=" in md


def test_residue_class_failure_is_detected(scripted_server, tmp_path):
    # Wrong only when the prompt length is 3 mod 4; the server reports page_size 4.
    url = scripted_server(fault="near_miss", fault_residue="4:3", page_size=4)
    res = run_bisect(_cfg(url, tmp_path, (200, 400)), BisectConfig(resolution=8))
    # The window (10000) is reported too; only 4 is small enough for a residue sweep.
    assert res["boundaries"] == [4, 10000] and res["boundaries_source"] == "/get_server_info"
    assert not res["bracketed"] and "cannot bracket" in res["message"]
    (mod4,) = res["residue"]
    assert mod4["flagged"] == [3] and mod4["p_value"] < 0.01 and mod4["strata"] == 3
    by_class = {c["residue"]: c["recall"] for c in mod4["classes"]}
    assert by_class[3] == 0.0 and by_class[0] == by_class[1] == by_class[2] == 1.0
    assert "residue-class failure: length = 3 (mod 4)" in (tmp_path / "bisect.md").read_text()


def test_no_boundary_in_range_says_so(scripted_server, tmp_path):
    url = scripted_server()
    res = run_bisect(_cfg(url, tmp_path, (200, 600)), BisectConfig(resolution=16, boundaries=(4,)))
    assert not res["bracketed"] and res["collapse_length"] is None
    assert res["message"].startswith("cannot bracket a boundary in [200, 600]: recall stays at or above")
    assert res["residue"][0]["flagged"] == []


def test_one_miss_never_narrows(scripted_server, tmp_path):
    # Recall 0.85-ish at every length (15% of answers wrong at random from 200 tokens): the
    # first coarse length with a miss is below the threshold in the sample, but its recall does
    # not differ significantly from the passing one even with 4x the trials: no bisection.
    url = scripted_server(fault="near_miss", fault_from=200, fault_rate=0.15, fault_seed=3)
    cfg = ProbeConfig(
        base_urls=(url,),
        model="scripted",
        lengths=(200, 1200),
        depths=(0, 100),
        trials=2,
        out=tmp_path,
        concurrency=1,
    )
    res = run_bisect(cfg, BisectConfig(resolution=8, boundaries=()))
    # One request at a time, so the server's seeded draws are the same every run: 200 tokens
    # pass and 450 fail in this sample (15/16 against 11/16), Fisher p = 0.17.
    assert res["bracketed"] and not res["confirmed"]
    assert "do not differ significantly" in res["message"] and "raise --trials" in res["message"]
    (step,) = res["steps"]
    assert not step["narrowed"] and step["p_value"] > 0.05
    assert step["last_pass"]["n"] == step["first_fail"]["n"] == 16  # escalated to the cap first
    assert not [p for p in res["points"] if p["phase"] == "bisect"]
