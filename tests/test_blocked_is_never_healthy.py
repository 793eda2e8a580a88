"""Issue 38's principle "blocked is never healthy", checked beyond the listed cases: a command
that measured nothing never exits 0."""

from __future__ import annotations

import json
import subprocess
import sys

CLI = [sys.executable, "-m", "needlescope.cli.main"]


def test_oracle_with_every_prompt_left_out_measures_nothing_and_says_so(
    scripted_server, tmp_path, run_cli_completed
):
    """``--skip-long-prompts`` against a target whose context holds none of the prompts used to
    write an export of no prompt and exit 0, and ``oracle compare`` (the same ``run.oracle.fit_prompts``)
    called no prompt compared "identical"."""
    url = scripted_server(window=1000, max_len=16)  # advertises a 16-token context
    words = " ".join(f"word{i}" for i in range(40))
    prompts = [{"id": i, "category": "c", "prompt": words, "max_tokens": 2} for i in ("a", "b")]
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps({"name": "long", "prompts": prompts}))
    out = tmp_path / "export"
    res = run_cli_completed("oracle", "export", "--base-url", url, "--model", "scripted", "--prompts", str(path),
                            "--skip-long-prompts", "--out", str(out))  # fmt: skip
    assert res.returncode == 2, res.stdout + res.stderr
    line = res.stderr.strip()
    assert line.startswith("error: every prompt (a, b) is beyond the target's context of 16 tokens"), line
    assert "no prompt is left to send" in line and "Traceback" not in res.stderr
    assert not (out / "export.json").exists()


def test_a_bounded_canary_that_scored_no_probe_exits_1(tmp_path):
    """``canary --rounds 1`` against a target that is down logged "target ... is down" and "canary
    stopped", then exited 0: a script reading the exit code saw a healthy deployment."""
    res = subprocess.run(
        [*CLI, "canary", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--rounds", "1",
         "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 1, res.stdout + res.stderr
    assert "is down" in res.stderr and "no probe was scored in 1 round(s): nothing was measured" in res.stderr
    assert "Traceback" not in res.stderr
