"""End-to-end probe runs through the real CLI against the scripted loopback server."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from needlescope.report.probe import validate_summary

CLI = [sys.executable, "-m", "needlescope.cli.main"]
GRID = ["--lengths", "200,400,800,1600", "--depths", "0,25,50,75,100", "--trials", "2"]


def probe(url: str, out: Path, *extra: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, "probe", "--base-url", url, "--model", "scripted", "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


def test_probe_finds_the_scripted_cliff(scripted_server, tmp_path):
    url = scripted_server(window=500)
    res = probe(url + "/v1", tmp_path, *GRID)
    assert res.returncode == 0, res.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    validate_summary(summary)
    # Needles within the last 500 tokens are answered: every depth at 200 and 400, not all at 800.
    assert summary["effective_length"] == 400
    assert summary["cliff"]["to"] in (800, 1600)
    for name in ("report.md", "heatmap.png", "results.jsonl"):
        assert (tmp_path / name).stat().st_size > 0
    by_len = {}
    for cell in summary["cells"]:
        by_len.setdefault(cell["length"], []).append(cell["recall"])
    assert min(by_len[200]) == 1.0 and min(by_len[1600]) < 1.0


@pytest.mark.parametrize("kind", ["single", "multikey", "multivalue", "multiturn"])
def test_exact_lengths_for_each_kind(scripted_server, tmp_path, kind):
    url = scripted_server(window=10_000)
    res = probe(
        url, tmp_path, "--kind", kind, "--lengths", "300,700", "--depths", "0,50,100", "--trials", "1"
    )
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    for row in rows:
        assert row["counted_length"] == row["length"]
        assert row["prompt_tokens"] == row["length"]
        assert row["correct"] is True or row["correct"] == 1


def test_faults_are_errors_not_misses(scripted_server, tmp_path):
    url = scripted_server(window=10_000, fail_every=3, fail_status=500, garbage_every=7)
    res = probe(url, tmp_path, *GRID, "--kind", "single")
    assert res.returncode == 0, res.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    cells = summary["cells"]
    # A window covering everything means every scored case is correct; failures must be errors.
    assert all(c["correct"] == c["n"] for c in cells)
    assert sum(c["n"] + c["errors"] for c in cells) == 40


def test_sigkill_then_resume_loses_and_duplicates_nothing(scripted_server, tmp_path):
    url = scripted_server(window=500, slow_every=1, slow_s=0.15)
    cmd = [
        *CLI,
        "probe",
        "--base-url",
        url,
        "--model",
        "scripted",
        "--out",
        str(tmp_path),
        *GRID,
        "--concurrency",
        "2",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    db = tmp_path / "results.sqlite"
    deadline = time.time() + 60
    done = 0
    while time.time() < deadline:
        if db.exists():
            try:
                done = sqlite3.connect(db).execute("select count(*) from results").fetchone()[0]
            except sqlite3.Error:
                done = 0
            if done >= 5:
                break
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert 5 <= done < 40
    res = probe(url, tmp_path, *GRID, "--resume")
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    ids = [r["case_id"] for r in rows]
    assert len(ids) == 40 and len(set(ids)) == 40


def test_bad_inputs_exit_2_with_one_clear_line(scripted_server, tmp_path):
    url = scripted_server(window=500)
    cases = [
        (["--base-url", "http://127.0.0.1:9", "--model", "scripted"], "cannot reach"),
        (["--base-url", url, "--model", "nope"], "not served"),
        (["--base-url", url, "--model", "scripted", "--extra-body", "{bad"], "--extra-body"),
        (["--base-url", url, "--model", "scripted", "--lengths", "5"], "shorter than the needle"),
        (["--base-url", url, "--model", "scripted", "--kind", "weird"], "--kind"),
        (["--base-url", url, "--model", "scripted", "--no-such-flag"], "No such option"),
    ]
    for i, (args, needle) in enumerate(cases):
        res = subprocess.run(
            [*CLI, "probe", *args, "--out", str(tmp_path / str(i))],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 2, (args, res.stdout, res.stderr)
        assert needle in res.stderr, (args, res.stderr)
        assert "Traceback" not in res.stderr
