"""End-to-end probe runs through the real CLI against the scripted loopback server."""

from __future__ import annotations

import functools
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


def run_probe(cli, url: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """``needlescope probe`` of the scripted model through ``cli`` (``run_cli_completed``)."""
    return cli("probe", "--base-url", url, "--model", "scripted", "--out", str(out), *extra)


@pytest.fixture
def probe(run_cli_completed):
    """``run_probe`` in this process (the SIGKILL and file-size tests below start their own child)."""
    return functools.partial(run_probe, run_cli_completed)


def test_probe_finds_the_scripted_cliff(scripted_server, tmp_path, probe):
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
def test_exact_lengths_for_each_kind(scripted_server, tmp_path, kind, probe):
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


def test_faults_are_errors_not_misses(scripted_server, tmp_path, probe):
    url = scripted_server(window=10_000, fail_every=3, fail_status=500, garbage_every=7)
    res = probe(url, tmp_path, *GRID, "--kind", "single")
    # Garbage is not retried, so both cases of one cell may draw it (which ones depends on how
    # requests interleave): that cell has no data and the run exits 1 by design, still writing
    # its outputs.
    assert res.returncode == 0 or "have no scored case" in res.stderr, res.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    cells = summary["cells"]
    # A window covering everything means every scored case is correct; failures must be errors.
    assert all(c["correct"] == c["n"] for c in cells)
    assert sum(c["n"] + c["errors"] for c in cells) == 40
    # Why they failed, not only how many (the console says "see report.md"): by kind, with an example.
    reasons = summary["error_reasons"]
    assert sum(e["count"] for e in reasons) == summary["errors_total"] > 0
    assert any("not valid JSON" in e["example"] or "JSON" in e["example"] for e in reasons), reasons
    report = (tmp_path / "report.md").read_text()
    for e in reasons:
        assert f"- {e['count']} {e['kind']}: {e['example']}" in report


def test_sigkill_then_resume_loses_and_duplicates_nothing(scripted_server, tmp_path, probe):
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


def test_bad_inputs_exit_2_with_one_clear_line(scripted_server, tmp_path, run_cli_completed):
    url = scripted_server(window=500)
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("Caf\u00e9 au lait. ".encode("latin-1") * 50)
    ok = ["--base-url", url, "--model", "scripted"]
    cases = [
        (["--base-url", "http://127.0.0.1:9", "--model", "scripted"], "cannot reach"),
        (["--base-url", url, "--model", "nope"], "not served"),
        ([*ok, "--extra-body", "{bad"], "--extra-body"),
        ([*ok, "--lengths", "5"], "shorter than the needle"),
        ([*ok, "--kind", "weird"], "--kind"),
        ([*ok, "--no-such-flag"], "No such option"),
        ([*ok, "--timeout", "0"], "--timeout must be a positive"),
        ([*ok, "--timeout", "-1"], "--timeout must be a positive"),
        ([*ok, "--max-tokens", "0"], "--max-tokens must be at least 1"),
        ([*ok, "--resume"], "holds no run to continue"),
        ([*ok, "--tokenizer", str(tmp_path / "none")], "no tokenizer.json"),
        ([*ok, "--haystack-file", str(latin1)], "is not UTF-8 text"),
    ]
    for i, (args, needle) in enumerate(cases):
        out = tmp_path / str(i)
        res = run_cli_completed("probe", *args, "--out", str(out))
        assert res.returncode == 2, (args, res.stdout, res.stderr)
        assert needle in res.stderr, (args, res.stderr)
        assert "Traceback" not in res.stderr
        assert res.stdout == "", (args, res.stdout)  # no progress bar before the error
        if needle != "No such option":  # Click's own usage box aside, the error is one line
            assert len(res.stderr.strip().splitlines()) == 1, (args, res.stderr)
        assert not out.exists(), args  # nothing created: no empty results.sqlite to trip a rerun


@pytest.mark.parametrize(
    ("out", "needle"),
    [("a_file", "is a file, not a folder"), ("a_file/sub", "is a file, so the folder"),
     ("/proc/needlescope-probe-out", "is not writable")],
)  # fmt: skip
def test_unwritable_or_clashing_out_exits_2_before_any_request(tmp_path, out, needle, run_cli_completed):
    (tmp_path / "a_file").write_text("x")
    # The base URL is unreachable: the --out check must come first to be seen at all.
    res = run_cli_completed(
        "probe", "--base-url", "http://127.0.0.1:9", "--model", "m", "--out", str(tmp_path / out)
    )
    assert res.returncode == 2 and needle in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and res.stdout == ""


def test_a_rejected_input_leaves_no_store_so_the_corrected_rerun_runs(scripted_server, tmp_path, probe):
    url = scripted_server(window=10_000)
    bad = probe(url, tmp_path, "--lengths", "5", "--depths", "50", "--trials", "1")
    assert bad.returncode == 2 and "shorter than the needle" in bad.stderr
    assert not (tmp_path / "results.sqlite").exists()
    good = probe(url, tmp_path, "--lengths", "200", "--depths", "50", "--trials", "1")
    assert good.returncode == 0, good.stderr


def test_a_server_that_dies_mid_run_gives_no_data_cells_and_exit_1(scripted_server, tmp_path, probe):
    # Preflight's one-token chat is chat 1; six probe chats succeed, then the process exits.
    url = scripted_server(window=10_000, die_after=7)
    grid = ["--lengths", "200,400,800", "--depths", "0,50", "--trials", "2", "--concurrency", "4"]
    res = probe(url, tmp_path, *grid)
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert "have no scored case" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    validate_summary(summary)
    by_len = {}
    for cell in summary["cells"]:
        by_len.setdefault(cell["length"], []).append(cell["recall"])
    assert by_len[200] == [1.0, 1.0] and by_len[800] == [None, None]
    assert summary["cells_without_data"] >= 2
    assert summary["effective_length"] in (200, 400)  # never a false cliff to 800
    assert summary["cliff"] is None
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    errors = [r for r in rows if r["status"] == "error"]
    assert errors and all(r["attempts"] == 5 for r in errors)  # first try + 4 retries, recorded


def _file_size_limit(limit: int):
    """A child's writes past ``limit`` bytes fail with EFBIG, as a full disk fails with ENOSPC."""

    def apply() -> None:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.parametrize("command", ["probe", "investigate-init"])
def test_no_room_to_write_is_one_line_and_exit_2(scripted_server, tmp_path, command):
    """Issue 38 R14: a disk that fills mid-run ended in a traceback. Now one line names the file,
    says what was kept and how to go on, and the exit code is 2."""
    out = tmp_path / "out"
    if command == "probe":
        args = [*CLI, "probe", "--base-url", scripted_server(window=10_000), "--model", "scripted"]
        args += ["--out", str(out), *GRID]
    else:
        args = [*CLI, "investigate", "init", str(out)]
    proc = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        preexec_fn=_file_size_limit(64 * 1024 if command == "probe" else 2048),
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "cannot write" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
