"""Issue 38, item 8: Ctrl-C tells what was saved and how to resume, and exits 130."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

CLI = [sys.executable, "-m", "needlescope.cli.main"]


def _as_if_typed_at_a_terminal() -> None:
    # A test run started in the background ignores SIGINT; a terminal's Ctrl-C is what we imitate.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# Each answer of a slow server takes this long: long enough that the run is still going when the
# test's SIGINT (sent within 0.05 s of the rows it waits for) arrives, with seconds of requests left.
SLOW_S = 0.15


def _both(*cmds: list[str]) -> list[subprocess.CompletedProcess]:
    """Run the commands at once (each mostly waits on the slow server) and return what each did."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in cmds]
    done = []
    for cmd, proc in zip(cmds, procs):
        stdout, stderr = proc.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr))
    return done


def _answered(store, table: str = "results") -> int:
    """Answered rows in ``table`` of a results store (``sends``: an engine-state run's)."""
    try:
        with sqlite3.connect(f"file:{store}?mode=ro", uri=True) as db:
            return db.execute(f"SELECT COUNT(*) FROM {table} WHERE status = 'ok'").fetchone()[0]
    except sqlite3.Error:
        return 0


def test_ctrl_c_in_a_probe_says_what_was_saved_and_exits_130(scripted_server, tmp_path):
    url = scripted_server(window=100_000, slow_every=1, slow_s=SLOW_S)
    out = tmp_path / "run"
    cmd = [*CLI, "probe", "--base-url", url, "--model", "scripted", "--kind", "single"]
    cmd += ["--lengths", "100,200,300", "--depths", "0,50,100", "--trials", "2", "--concurrency", "1"]
    proc = subprocess.Popen(
        [*cmd, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_as_if_typed_at_a_terminal,
        env={**os.environ, "COLUMNS": "200"},
    )
    deadline = time.time() + 120
    while time.time() < deadline and _answered(out / "results.sqlite") < 3 and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    saved = _answered(out / "results.sqlite")
    assert 3 <= saved < 18
    assert f"interrupted: {saved} of 18 cases saved; rerun the same command with --resume" in stderr
    assert "Traceback" not in stderr
    again = subprocess.run([*cmd, "--out", str(out), "--resume"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert _answered(out / "results.sqlite") == 18


def _interrupt_when(
    cmd: list[str], store, answered: int, table: str = "results"
) -> subprocess.CompletedProcess:
    """Run ``cmd`` as a terminal would, send it SIGINT once ``store`` holds ``answered`` answered
    rows (``_answered``), and return what it did."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_as_if_typed_at_a_terminal,
        env={**os.environ, "COLUMNS": "200"},
    )
    deadline = time.time() + 120
    while time.time() < deadline and _answered(store, table) < answered and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _pairs(out) -> list[tuple]:
    rows = [json.loads(line) for line in (out / "pairs.jsonl").read_text().splitlines()]
    return sorted((r["case_id"], r["length"], r["depth"], r["a_correct"], r["b_correct"]) for r in rows)


def test_ctrl_c_in_a_compare_then_resume_matches_an_uninterrupted_one(scripted_server, tmp_path):
    """Interrupted while B is being sent A's prompts: the count covers both sides, and the resumed
    comparison pairs every case once, to the same verdict as a comparison never interrupted."""
    a = scripted_server(window=100_000)
    b = scripted_server(window=100_000, fault="near_miss", fault_from=250, slow_every=1, slow_s=SLOW_S)
    cmd = [*CLI, "compare", "--a", a, "--b", b, "--model", "scripted", "--kind", "single"]
    cmd += ["--lengths", "100,200,300", "--depths", "0,50,100", "--trials", "1", "--concurrency", "1"]
    out = tmp_path / "ab"
    stopped = _interrupt_when([*cmd, "--out", str(out)], out / "b" / "results.sqlite", 2)
    assert stopped.returncode == 130, stopped.stderr
    saved = _answered(out / "a" / "results.sqlite") + _answered(out / "b" / "results.sqlite")
    assert _answered(out / "a" / "results.sqlite") == 9 and 11 <= saved < 18, saved
    assert f"interrupted: {saved} of 18 cases saved; rerun the same command with --resume" in stopped.stderr
    assert "Traceback" not in stopped.stderr and not (out / "compare.json").exists()
    resumed, whole = _both([*cmd, "--out", str(out), "--resume"], [*cmd, "--out", str(tmp_path / "whole")])
    assert resumed.returncode == whole.returncode == 0, resumed.stderr + whole.stderr
    assert len(_pairs(out)) == len({p[0] for p in _pairs(out)}) == 9
    assert _pairs(out) == _pairs(tmp_path / "whole")
    got, want = (json.loads((d / "compare.json").read_text()) for d in (out, tmp_path / "whole"))
    assert got["headline"] == want["headline"] and "0.67 vs A 1.00" in got["headline"], got["headline"]
    assert (got["recall_a"], got["recall_b"], got["cases_matched"]) == (want["recall_a"], want["recall_b"], 9)


def _effects(out) -> dict:
    """Each factor's paired result and its rows' (case, answer tokens, correct), without timings."""
    body = json.loads((out / "engine_state.json").read_text())
    keep = ("pairs", "errors", "recall_a", "recall_b", "answers_differ")
    return {
        name: (
            {k: f["effect"].get(k) for k in keep},
            [sorted((r["case_id"], r["tokens"], r["correct"]) for r in rows) for rows in f["rows"]],
        )
        for name, f in body["factors"].items()
    }


def test_ctrl_c_in_engine_state_then_resume_matches_an_uninterrupted_run(tmp_path):
    from needlescope.testing.servers import scripted

    cmd = [*CLI, "engine-state", "--model", "organism", "--factors", "concurrency,repeat"]
    cmd += [
        "--lengths",
        "100,300",
        "--depths",
        "0,100",
        "--trials",
        "1",
        "--repeats",
        "2",
        "--concurrency",
        "2",
    ]
    out, whole = tmp_path / "es", tmp_path / "whole"
    with scripted(model="organism", fault="near_miss", fault_from=200, slow_every=1, slow_s=SLOW_S) as srv:
        cmd += ["--base-url", srv.url]
        stopped = _interrupt_when([*cmd, "--out", str(out)], out / "results.sqlite", 3, "sends")
        assert stopped.returncode == 130, stopped.stderr
        saved = _answered(out / "results.sqlite", "sends")
        assert 3 <= saved < 16  # 4 cases, each sent in 2 + 2 arms
        assert (
            f"interrupted: {saved} of 16 sends saved; rerun the same command with --resume" in stopped.stderr
        )
        assert "Traceback" not in stopped.stderr and not (out / "engine_state.json").exists()
        resumed, uninterrupted = _both([*cmd, "--out", str(out), "--resume"], [*cmd, "--out", str(whole)])
    assert resumed.returncode == uninterrupted.returncode == 0, resumed.stderr + uninterrupted.stderr
    assert _answered(out / "results.sqlite", "sends") == 16
    got = _effects(out)
    assert got == _effects(whole)
    assert all(len(rows) == len({r[0] for r in rows}) == 4 for _, arms in got.values() for rows in arms)
    assert got["repeat"][0]["recall_a"] == 0.5  # the fault from 200 tokens: a result, not all-or-nothing
