"""``needlescope engine-state``: engine state as a factor (docs/engine_state.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from needlescope.cli.interrupts import on_interrupt, store_saved
from needlescope.cli.output import console, err_console
from needlescope.cli.outputs import FORCE, guard
from needlescope.cli.probe_options import API_KEY_ENV
from needlescope.cli.progress import ProgressView
from needlescope.errors import ProbeError
from needlescope.run.config import parse_float_list, parse_int_list

VALUE_DIGITS = typer.Option(
    None,
    "--value-digits",
    help="Digits per needle value; default: the target's advertised trained_value_digits, else 7.",
)
SKIP_LONG_LENGTHS = typer.Option(
    False,
    "--skip-long-lengths/--refuse-long-lengths",
    help="Drop, with a warning, lengths beyond the target's advertised context (default: refuse the run).",
)


def engine_state_command(
    base_url: str = typer.Option(..., "--base-url", help="Server URL (root or ending in /v1)."),
    model: str = typer.Option(..., "--model", help="Model name the server serves."),
    out: Path = typer.Option(
        ..., "--out", help="Directory for results.sqlite, engine_state.json and engine_state.md."
    ),
    resume: bool = typer.Option(
        False, "--resume", help="Continue the killed run in --out (same flags); finished sends are kept."
    ),
    factors: str = typer.Option(
        "cache,concurrency,repeat", "--factors", help="Any of cache,concurrency,repeat."
    ),
    kind: str = typer.Option("single", "--kind"),
    lengths: str = typer.Option("512", "--lengths", help="Comma-separated prompt lengths in tokens."),
    depths: str = typer.Option("0,50,100", "--depths", help="Comma-separated needle depths in percent."),
    trials: int = typer.Option(2, "--trials"),
    seed: int = typer.Option(0, "--seed"),
    value_digits: int = VALUE_DIGITS,
    skip_long_lengths: bool = SKIP_LONG_LENGTHS,
    concurrency: int = typer.Option(4, "--concurrency", help="Requests in flight in the concurrent arm."),
    repeats: int = typer.Option(3, "--repeats", help="Identical sends a case in the repeat factor."),
    top_logprobs: int = typer.Option(5, "--top-logprobs", help="Alternatives per token, for the margin."),
    timeout: float = typer.Option(300.0, "--timeout", help="Per request, seconds."),
    api_key: str = typer.Option(None, "--api-key", envvar=API_KEY_ENV, show_default=False),
    force: bool = FORCE,
) -> None:
    """Vary one engine condition at a time (prefix cache, concurrency, repetition); paired recall and margin."""
    from needlescope.report.engine_state import write_engine_state
    from needlescope.run.engine_state import EngineStateConfig, run_engine_state

    cfg = EngineStateConfig(
        base_url=base_url,
        model=model,
        factors=tuple(f.strip() for f in factors.split(",") if f.strip()),
        kind=kind,
        lengths=parse_int_list(lengths, "--lengths"),
        depths=parse_float_list(depths, "--depths"),
        trials=trials,
        seed=seed,
        value_digits=value_digits,
        concurrency=concurrency,
        repeats=repeats,
        top_logprobs=top_logprobs,
        timeout_s=timeout,
        skip_long_lengths=skip_long_lengths,
        api_key=api_key,
    )
    again = "rerun the same command with --resume to continue"
    with (
        on_interrupt(store_saved(out / "results.sqlite", sends=True), again),
        guard(out, "engine-state", force),
    ):
        try:
            with ProgressView(console) as view:
                body = run_engine_state(cfg, out, resume=resume, progress=view, note=view.note)
        except ProbeError as exc:  # only before any send (sizing the cases); a failed send is a row
            err_console.say("[bold red]target failed:[/] {}", exc, soft_wrap=True)
            sys.exit(1)
        js, md = write_engine_state(body, out)
    _render(body, js, md)


def _render(body: dict, js: Path, md: Path) -> None:
    """The report, the files, what failed; exit 1 when a factor has no scored pair."""
    from needlescope.report.engine_state import engine_state_markdown

    console.print(engine_state_markdown(body), highlight=False, soft_wrap=True)
    console.print(f"wrote {js} and {md}", highlight=False)
    errors = sum(f["effect"]["errors"] for f in body["factors"].values())
    if errors:
        err_console.print(
            f"{errors} pair(s) failed on the target (errors, not misses); `--resume` sends them again",
            highlight=False,
        )
    empty = [name for name, f in body["factors"].items() if f["effect"]["pairs"] == 0]
    if empty:
        err_console.print(f"no scored pair in: {', '.join(empty)}", highlight=False)
        sys.exit(1)
