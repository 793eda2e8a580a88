"""``needlescope investigate init|run``: the investigation ledger and its run.

``init [DIR]`` writes the commented example ledger (the original DeepSeek-V4-Flash
investigation replayed on the organism) with its env file and patch files. ``run LEDGER --out
DIR`` runs it (resumable: run it again after Ctrl-C or a crash), with a progress bar per
phase, and writes ``verdicts.json``, ``DIAGNOSIS.md`` and ``DIAGNOSIS.html`` into DIR.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import typer

from needlescope.cli.output import console, typer_app

investigate_app = typer_app(no_args_is_help=True, help="From measurements to a causal verdict.")


@investigate_app.command("init")
def init_command(
    directory: Path = typer.Argument(Path("."), help="Where to write investigation.toml and its files."),
    force: bool = typer.Option(False, "--force", help="Overwrite existing files."),
    live: str = typer.Option(
        None,
        "--live",
        help="Write a live ledger for this endpoint (a server answering /generate with captures).",
    ),
    from_probe: Path = typer.Option(
        None, "--from-probe", help="Write a live ledger whose symptom is this probe run's failing cells."
    ),
) -> None:
    """Write a ledger: the example (the original investigation, on the organism), a live one."""
    from needlescope.errors import BadInput
    from needlescope.investigate.ledger.example import EXAMPLE_FILES, write_example
    from needlescope.investigate.ledger.init import from_probe_ledger, live_ledger, write_ledger
    from needlescope.investigate.ledger.ledger import parse_ledger

    if live is not None and from_probe is not None:
        raise BadInput("give --live URL or --from-probe RUN_DIR, not both")
    if live is None and from_probe is None:
        path = write_example(directory, force=force)
        for name in EXAMPLE_FILES:
            console.print(f"wrote {Path(directory) / name}")
    else:
        text = live_ledger(live) if live is not None else from_probe_ledger(from_probe)
        parse_ledger(text, Path(directory) / "investigation.toml")  # a ledger that would not run is a bug
        path = write_ledger(directory, text, force=force)
        console.print(f"wrote {path}")
    console.print(f"next: needlescope investigate run {path} --out investigation-out")


def run_investigation_cli(
    ledger: Path, out: Path, allow_outside: bool = False, prefill_chunk: int | None = None
) -> Path:
    """Run with progress per phase (``cli.progress``); returns DIAGNOSIS.md's path."""
    from needlescope.cli.progress import ProgressView
    from needlescope.investigate.report.diagnosis import write_reports
    from needlescope.investigate.run import run_investigation

    with ProgressView(console) as view:
        run_investigation(
            ledger,
            out,
            lambda phase, done, total, what: view(phase, done, total, what[:60]),
            allow_outside=allow_outside,
            prefill_chunk=prefill_chunk,
        )
    md, _ = write_reports(out, command=shlex.join(["needlescope", *sys.argv[1:]]))
    return md


@investigate_app.command("run")
def run_command(
    ledger: Path = typer.Argument(..., help="The ledger (investigation.toml)."),
    out: Path = typer.Option(..., "--out", help="Run directory (kept; a second run resumes it)."),
    allow_outside: bool = typer.Option(
        False, "--allow-outside", help="Accept ledger paths (patches, env file, sources) outside its folder."
    ),
    prefill_chunk: int = typer.Option(
        None,
        "--prefill-chunk",
        help="Run prompts through the KV cache in chunks of this many tokens (overrides [target] prefill_chunk; docs/scale.md).",
    ),
) -> None:
    """Run the ledger: cheap questions, symptom, checks in tier order, fixes, verdicts, DIAGNOSIS."""
    import json

    md = run_investigation_cli(ledger, out, allow_outside, prefill_chunk)
    verdicts = json.loads((out / "verdicts.json").read_text(encoding="utf-8"))
    for s in verdicts["suspects"]:
        console.say("  tier {} {}: [bold]{}[/] - {}", s["tier"], s["id"], s["verdict"], s["reason"])
    console.say("root cause: [bold]{}[/]", verdicts["root_cause"])
    console.print(f"wrote {out / 'verdicts.json'}, {md} and DIAGNOSIS.html")
