"""``needlescope oracle export`` and ``needlescope oracle compare``: the logprob oracle (docs/oracle.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from needlescope.analysis.oracle import ATOL, FLIP_MARGIN
from needlescope.cli.output import console, err_console, typer_app
from needlescope.cli.outputs import FORCE, guard
from needlescope.cli.probe_options import API_KEY_ENV
from needlescope.cli.progress import ProgressView
from needlescope.errors import ProbeError
from needlescope.paths import check_out_dir

oracle_app = typer_app(
    no_args_is_help=True,
    help="Logprob oracle: export a server's greedy top-k logprobs over a fixed prompt set, compare another to it.",
)

_BASE_URL = typer.Option(..., "--base-url", help="Server URL (root or ending in /v1).")
_MODEL = typer.Option(None, "--model", help="Model name; default: the first in /v1/models.")
_PROMPTS = typer.Option(None, "--prompts", help="Prompt-set JSON; default: the shipped set.")
_TOP = typer.Option(20, "--top-logprobs", help="Alternatives per token (1..20).")
_TIMEOUT = typer.Option(300.0, "--timeout", help="Per request, seconds.")
_KEY = typer.Option(None, "--api-key", envvar=API_KEY_ENV, show_default=False)
_SKIP = typer.Option(
    False,
    "--skip-long-prompts/--refuse-long-prompts",
    help="Leave out, with a warning, prompts beyond the target's advertised context (default: refuse).",
)


def _config(base_url, model, api_key, top, timeout, skip, prompts=None, flip_margin=FLIP_MARGIN, atol=ATOL):
    from needlescope.run.oracle import OracleConfig

    return OracleConfig(
        skip_long_prompts=skip,
        base_url=base_url,
        model=model,
        api_key=api_key,
        top_logprobs=top,
        timeout_s=timeout,
        prompts=prompts,
        flip_margin=flip_margin,
        atol=atol,
    )


def _target_failed(exc: ProbeError) -> None:
    err_console.say("[bold red]target failed:[/] {}", exc, soft_wrap=True)
    sys.exit(1)


@oracle_app.command("export")
def export_command(
    base_url: str = _BASE_URL,
    out: Path = typer.Option(..., "--out", help="Directory for export.json."),
    model: str = _MODEL,
    prompts: str = _PROMPTS,
    top: int = _TOP,
    timeout: float = _TIMEOUT,
    api_key: str = _KEY,
    skip: bool = _SKIP,
    force: bool = FORCE,
) -> None:
    """Send the prompt set greedily with top-k logprobs and write DIR/export.json."""
    from needlescope.report.oracle import write_export
    from needlescope.run.oracle import export

    out = check_out_dir(out)
    cfg = _config(base_url, model, api_key, top, timeout, skip, prompts)
    with guard(out, "oracle export", force):
        try:
            with ProgressView(console) as view:
                body = export(cfg, view, view.note)
        except ProbeError as exc:
            _target_failed(exc)
        path = write_export(body, out)
    n_steps = sum(len(p["steps"]) for p in body["prompts"])
    asked = body["top_logprobs"]
    # What came back, not what was asked: a server may send fewer alternatives, or none.
    most = max((len(s["top"]) for p in body["prompts"] for s in p["steps"]), default=0)
    tops = (
        f"top-{asked} logprobs"
        if most >= asked
        else f"logprobs (top-{asked} asked; the server returned at most {most} alternatives a token)"
    )
    console.print(
        f"exported {len(body['prompts'])} prompts, {n_steps} generated tokens with {tops} "
        f"(prompt ids from {body['prompt_ids_source']}) to {path}",
        highlight=False,
    )


@oracle_app.command("compare")
def compare_command(
    ref: Path = typer.Argument(..., help="Directory of the reference's export.json."),
    base_url: str = _BASE_URL,
    out: Path = typer.Option(
        None, "--out", help="Directory for oracle.json, oracle.md; default REF/compare."
    ),
    model: str = _MODEL,
    top: int = _TOP,
    flip_margin: float = typer.Option(
        FLIP_MARGIN, "--flip-margin", help="Nats; a flip below it is expected."
    ),
    atol: float = typer.Option(ATOL, "--atol", help="Nats; |Δ logprob| at most this is 'identical'."),
    timeout: float = _TIMEOUT,
    api_key: str = _KEY,
    skip: bool = _SKIP,
    force: bool = FORCE,
) -> None:
    """Compare a server against a reference export. Exit 0 unless divergent (1); 2 bad input."""
    from needlescope.report.oracle import oracle_lines, write_export, write_oracle
    from needlescope.run.oracle import compare

    out = check_out_dir(out if out is not None else ref / "compare")
    cfg = _config(base_url, model, api_key, top, timeout, skip, None, flip_margin, atol)
    with guard(out, "oracle compare", force):
        try:
            with ProgressView(console) as view:
                result, cand = compare(ref, cfg, view, view.note)
        except ProbeError as exc:
            _target_failed(exc)
        write_export(cand, out, "candidate_export.json")
        js, md = write_oracle(result, out)
    console.print("\n".join(oracle_lines(result)[2:]).rstrip(), highlight=False, soft_wrap=True)
    console.print(f"wrote {js} and {md}", highlight=False)
    if result["summary"]["verdict"] == "divergent":
        sys.exit(1)
