"""Issue 38, items 18 and R19: a probe says each thing once (the needle values on the console, the
effective length in report.md), leaves no lock file behind, and a run that scored no case says so
instead of "the shortest tested length already fails"."""

from __future__ import annotations

import json
import subprocess

import pytest

GRID = ["--kind", "single", "--lengths", "200,400", "--depths", "0,100", "--trials", "1"]


@pytest.fixture
def probe(run_cli_completed, monkeypatch):
    """``needlescope probe`` through the real entry point, in this process, on a 200-column terminal."""
    monkeypatch.setenv("COLUMNS", "200")

    def run(url: str, out, *extra: str) -> subprocess.CompletedProcess:
        return run_cli_completed(
            "probe", "--base-url", url, "--model", "scripted", *GRID, "--out", str(out), *extra
        )

    return run


def test_each_thing_is_said_once_and_no_lock_is_left(scripted_server, tmp_path, probe):
    res = probe(scripted_server(window=300), tmp_path / "run")
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("needle values:") == 1
    report = (tmp_path / "run" / "report.md").read_text()
    assert report.lower().count("effective length") == 1, report
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if "sqlite" in p.name) == ["results.sqlite"]


def test_no_scored_case_is_said_as_such(scripted_server, tmp_path, probe):
    res = probe(scripted_server(window=100_000, fail_every=1), tmp_path / "run", "--retry-budget", "1")
    assert res.returncode == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["headline"] == [
        "no case was scored: every request failed or missed its length (4 failed); recall, the effective "
        "length and the cliff are unknown"
    ]
    assert "shortest tested length" not in res.stdout + (tmp_path / "run" / "report.md").read_text()
