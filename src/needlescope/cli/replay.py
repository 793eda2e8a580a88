"""``needlescope replay``: re-send a reproducer bundle and say whether its failure reproduces."""

from __future__ import annotations

from pathlib import Path

import typer

from needlescope.cli.output import console, err_console
from needlescope.cli.probe_options import API_KEY_ENV
from needlescope.errors import BadInput
from needlescope.run.bundles import replay_bundle


def replay_command(
    bundle: Path = typer.Argument(..., help="A bundle directory (a probe's bundles/CASE_ID)."),
    base_url: str = typer.Option(..., "--base-url", help="Server to re-send the request to."),
    times: int = typer.Option(1, "--times", help="How many times to send it."),
    api_key: str = typer.Option(
        None,
        "--api-key",
        envvar=API_KEY_ENV,
        show_default=False,
        help="Bearer key for the server (else NEEDLESCOPE_API_KEY or OPENAI_API_KEY); never written anywhere.",
    ),
) -> None:
    """Re-send a failing case exactly as it was sent and report how often the miss comes back.

    Exit 0 with a verdict; 1 when no request was answered (nothing was measured); 2 bad input."""
    if times < 1:
        raise BadInput(f"--times must be at least 1; got {times}")
    res = replay_bundle(
        bundle,
        base_url,
        times=times,
        api_key=api_key or None,
    )
    for i, a in enumerate(res["answers"], 1):
        if a["status"] != "ok":
            console.print(f"{i}: error: {a['error']}", highlight=False)
        else:
            mark = "right" if a["correct"] else a["failure"]["category"]
            console.print(f"{i}: {a['answer']!r} ({mark})", highlight=False)
    console.print(f"{res['case_id']}: {res['verdict']}", style="bold")
    if not res["scored"]:
        # Blocked is never healthy: an answer of no request says nothing about the failure.
        err_console.print(
            f"target failed: none of {res['times']} request(s) to {base_url} was answered; check --base-url",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(1)
