"""Test helper: a characterization's ``next`` command is one the user can run as printed.

``check_next(command, cwd)`` parses the command with needlescope's own CLI (every option known,
required ones given, values of the right type) without running it, and checks every file it
names exists and parses as that option reads it, a relative path read from ``cwd`` (the ledger's
directory: a run's artifacts name paths relative to it). Returns the parsed parameters.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

FILE_OPTIONS = ("input_ids", "prompt", "patch", "extra_patch")


def check_next(command: str, cwd: Path | None = None) -> dict:
    import typer

    from needlescope.cli.main import app

    argv = shlex.split(command)
    assert argv[0] == "needlescope", command
    group = typer.main.get_command(app)
    cmd, args = group, argv[1:]
    while hasattr(cmd, "commands") and args and args[0] in cmd.commands:
        cmd, args = cmd.commands[args[0]], args[1:]
    assert not hasattr(cmd, "commands"), f"{command!r} names no command"
    params = cmd.make_context(argv[0], list(args)).params  # raises on an unknown or missing option
    for name in FILE_OPTIONS:
        values = params.get(name)
        for value in values if isinstance(values, (list, tuple)) else [values]:
            if value is None or str(value).startswith("fault:"):
                continue
            path = Path(value) if Path(value).is_absolute() or cwd is None else Path(cwd) / value
            assert path.is_file(), f"{command!r}: {name} {value} is not a file"
            if name == "input_ids":
                data = json.loads(path.read_text())
                assert data["input_ids"] and all(isinstance(i, int) for i in data["input_ids"])
                assert len(data["needle_token_span"]) == 2
            if name == "prompt":
                messages = json.loads(path.read_text())
                assert messages and all({"role", "content"} <= set(m) for m in messages)
    return params
