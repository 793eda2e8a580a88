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
    assert res["requests_used"] == 2 * len(res["points"])
    assert res["full_grid_requests"] == 2 * (1000 // 8 + 1)
    assert res["request_ratio"] < 0.3


def test_residue_class_failure_is_detected(scripted_server, tmp_path):
    # Wrong only when the prompt length is 3 mod 4; the server reports page_size 4.
    url = scripted_server(fault="near_miss", fault_residue="4:3", page_size=4)
    res = run_bisect(_cfg(url, tmp_path, (200, 400)), BisectConfig(resolution=8))
    # The window (10000) is reported too; only 4 is small enough for a residue sweep.
    assert res["boundaries"] == [4, 10000] and res["boundaries_source"] == "/get_server_info"
    assert not res["bracketed"] and "cannot bracket" in res["message"]
    (mod4,) = res["residue"]
    assert mod4["flagged"] == [3] and mod4["p_value"] < 0.01
    by_class = {c["residue"]: c["recall"] for c in mod4["classes"]}
    assert by_class[3] == 0.0 and by_class[0] == by_class[1] == by_class[2] == 1.0
    assert "residue-class failure: length = 3 (mod 4)" in (tmp_path / "bisect.md").read_text()


def test_no_boundary_in_range_says_so(scripted_server, tmp_path):
    url = scripted_server()
    res = run_bisect(_cfg(url, tmp_path, (200, 600)), BisectConfig(resolution=16, boundaries=(4,)))
    assert not res["bracketed"] and res["collapse_length"] is None
    assert res["message"].startswith("cannot bracket a boundary in [200, 600]: recall stays at or above")
    assert res["residue"][0]["flagged"] == []
