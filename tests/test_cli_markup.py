"""Strings that did not come from our own templates print as written (issue 25 item 2, issue 29
item 6): no rich markup is read from paths, server messages, model answers or help text."""

from __future__ import annotations

import io
import subprocess
import sys

from needlescope.cli.output import SafeConsole

CLI = [sys.executable, "-m", "needlescope.cli.main"]


def _run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env_extra = {"NO_COLOR": "1", "COLUMNS": "200", "HF_HUB_OFFLINE": "1"}
    import os

    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=120, cwd=cwd, env={**os.environ, **env_extra}
    )


def test_console_prints_markup_like_text_as_written():
    buf = io.StringIO()
    console = SafeConsole(file=buf, width=200)
    console.print("answer: [/x] [bold]not bold[/bold] pip install 'needlescope[watch]'")
    console.say("root cause: [bold]{}[/] in {}", "[red]x[/red]", "/tmp/a[/b]")
    console.say("--impl {}: unknown", "ours:zzz:fast")  # an emoji code (:zzz:) is text here
    assert buf.getvalue().splitlines() == [
        "answer: [/x] [bold]not bold[/bold] pip install 'needlescope[watch]'",
        "root cause: [red]x[/red] in /tmp/a[/b]",
        "--impl ours:zzz:fast: unknown",
    ]


def test_a_ledger_error_keeps_its_brackets(tmp_path):
    ledger = tmp_path / "investigation.toml"
    ledger.write_text('[target]\nmodel = "organism"\ncandidate = "k=fp8_e4m3"\n')
    res = _run("investigate", "run", str(ledger), "--out", str(tmp_path / "out"))
    assert res.returncode == 2, res.stderr
    assert "missing [symptom] table" in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_a_path_with_a_closing_tag_is_an_error_line_not_a_traceback(tmp_path):
    odd = tmp_path / "run[/x]"
    res = _run("replay", str(odd / "bundle"), "--base-url", "http://127.0.0.1:9")
    assert res.returncode == 2, res.stderr
    assert "[/x]" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_help_text_keeps_brackets():
    res = _run("probe", "--help")
    assert res.returncode == 0
    assert "Search [min, max] of --lengths" in " ".join(res.stdout.split()), res.stdout


def test_bad_values_are_one_line_not_a_traceback():
    """Issue 29 item 8: inputs that raised a TypeError or ValueError traceback."""
    for args, words in (
        (["serve", "--config-json", '{"max_connections": "x"}'], "expected int"),
        (["serve", "--config-json", '{"port": true}'], "expected int"),
        (["health", "--base-url", "http://[::1", "--model", "m"], "is not a valid URL"),
        (["health", "--base-url", "http://127.0.0.1:99999", "--model", "m"], "is not a valid URL"),
    ):
        res = _run(*args)
        assert res.returncode == 2 and words in res.stderr, (args, res.stderr[-800:])
        assert len(res.stderr.strip().splitlines()) == 1, (args, res.stderr[-800:])
