"""Issue 38, item 8: Ctrl-C tells what was saved and how to resume, and exits 130."""

from __future__ import annotations

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


def _answered(store) -> int:
    try:
        with sqlite3.connect(f"file:{store}?mode=ro", uri=True) as db:
            return db.execute("SELECT COUNT(*) FROM results WHERE status = 'ok'").fetchone()[0]
    except sqlite3.Error:
        return 0


def test_ctrl_c_in_a_probe_says_what_was_saved_and_exits_130(scripted_server, tmp_path):
    url = scripted_server(window=100_000, slow_every=1, slow_s=0.3)
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
