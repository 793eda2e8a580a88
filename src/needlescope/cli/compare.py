"""``needlescope compare``: paired A/B on byte-identical prompts, live or from two finished runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import typer

from needlescope.cli.interrupts import on_interrupt, store_saved
from needlescope.cli.output import console, err_console
from needlescope.cli.outputs import FORCE, OUTPUT_SPECS, guard, recording_runs
from needlescope.cli.probe import probe_events
from needlescope.cli.probe_options import PROBE_FLAGS, build, option_group
from needlescope.cli.progress import ProgressView
from needlescope.errors import BadInput, ProbeError
from needlescope.outdir import record_outputs
from needlescope.report.compare import errors_line
from needlescope.report.oracle import append_oracle_section, read_oracle
from needlescope.run.compare import compare_runs
from needlescope.run.compare_live import compare_live
from needlescope.run.config import ProbeConfig, parse_int_list
from needlescope.run.probe import STORE_NAME


@option_group(ProbeConfig, PROBE_FLAGS)
def compare_command(
    flags: dict,
    a: str = typer.Option(None, "--a", help="Base URL of side A (the reference)."),
    b: str = typer.Option(None, "--b", help="Base URL of side B (the candidate)."),
    a_run: Path = typer.Option(None, "--a-run", help="A finished probe --out directory for side A."),
    b_run: Path = typer.Option(None, "--b-run", help="A finished probe --out directory for side B."),
    out: Path = typer.Option(..., "--out", help="Output directory."),
    model: str = typer.Option(None, "--model", help="Model name on A (and on B unless --model-b)."),
    model_b: str = typer.Option(None, "--model-b", help="Model name on B when it differs from A's."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted live comparison in --out."),
    alpha: float = typer.Option(0.05, "--alpha", help="Significance level after Holm correction."),
    power_drop: float = typer.Option(0.10, "--power-drop", help="Drop whose power a null verdict states."),
    buckets: str = typer.Option(
        None, "--buckets", help="Bucket lower bounds in tokens (default: one per length)."
    ),
    oracle: Path = typer.Option(
        None,
        "--oracle",
        help="An oracle.json (needlescope oracle compare) to report beside the recall verdicts.",
    ),
    force: bool = FORCE,
) -> None:
    """Compare recall of B against A on identical prompts: per cell and per length, exact tests."""
    if not 0 < alpha < 1:
        raise BadInput(f"--alpha must lie in (0, 1); got {alpha}")
    if not 0 < power_drop <= 1:
        raise BadInput(f"--power-drop must lie in (0, 1]; got {power_drop}")
    edges = parse_int_list(buckets, "--buckets") if buckets else None
    oracle_result = read_oracle(oracle) if oracle is not None else None
    live = a is not None or b is not None
    runs = a_run is not None or b_run is not None
    if live == runs:
        raise BadInput("give either --a URL --b URL (live) or --a-run DIR --b-run DIR (finished runs)")
    if runs:
        if a_run is None or b_run is None:
            raise BadInput("--a-run and --b-run go together; give both probe directories")
        with guard(out, "compare", force):
            result = _target_failures(
                lambda: compare_runs(
                    a_run, b_run, out, alpha=alpha, power_drop=power_drop, bucket_edges=edges
                )
            )
    else:
        if a is None or b is None:
            raise BadInput("--a and --b go together; give both base URLs")
        if not model:
            raise BadInput("--model is required with --a/--b; pass the model name as served in /v1/models")
        cfg_a = build(ProbeConfig, flags, base_urls=(a,), model=model, out=out / "a", resume=resume)
        cfg_b = replace(cfg_a, base_urls=(b,), model=model_b or model, out=out / "b")

        stores = (out / "a" / STORE_NAME, out / "b" / STORE_NAME)
        again = "rerun the same command with --resume to continue"
        with (
            on_interrupt(store_saved(*stores), again),
            guard(out, "compare", force),
            ProgressView(console) as view,
        ):
            result = _target_failures(
                lambda: compare_live(
                    cfg_a,
                    cfg_b,
                    out,
                    alpha=alpha,
                    power_drop=power_drop,
                    bucket_edges=edges,
                    on_event=recording_runs(probe_events(view), out, "compare"),
                )
            )
    _render(result, out, oracle_result, resume_hint=not runs)


def _target_failures(compare: Callable[[], dict]) -> dict:
    """``compare()``; a comparison the targets left without a single pair exits 1 (target failed)."""
    try:
        return compare()
    except ProbeError as exc:
        err_console.say("[bold red]target failed:[/] {}", exc, soft_wrap=True)
        raise typer.Exit(1) from None


def _render(result: dict, out: Path, oracle_result: dict | None, *, resume_hint: bool) -> None:
    """The headline (both recalls), what failed, and the files; exit 1 when a request failed or B
    regresses (a finding, docs/exit_codes.md)."""
    console.print(result["headline"], style="bold", soft_wrap=True)
    if result["graded"] is not None:
        console.say("[bold]margins:[/] {}", result["graded"]["verdict"], soft_wrap=True)
    if oracle_result is not None:
        append_oracle_section(out / "report.md", oracle_result)
        record_outputs(out, OUTPUT_SPECS["compare"])  # report.md is still compare's own
        console.print(f"logprob oracle: {oracle_result['summary']['verdict']} (section added to report.md)")
    console.print(f"wrote {out}/compare.json, report.md, delta_heatmap.png, pairs.jsonl", soft_wrap=True)
    failed = errors_line(result["errors"])
    if failed:
        # Errors are never misses: the verdict covers only the pairs both sides answered.
        again = "rerun with --resume to send them again" if resume_hint else "rerun the probes with --resume"
        err_console.say(
            "[bold red]error:[/] {}; the verdict covers only the {} pairs both sides answered; {}",
            failed,
            result["cases_matched"],
            again,
            soft_wrap=True,
        )
        raise typer.Exit(1)
    if result["regresses_from"] is not None:
        raise typer.Exit(1)  # B regresses significantly: the finding a compare is run for
