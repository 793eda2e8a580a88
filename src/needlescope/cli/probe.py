"""``needlescope probe``: token-exact recall sweep against OpenAI-compatible servers."""

from __future__ import annotations

import contextlib
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from needlescope.cli.probe_options import PROBE_FLAGS, build, config_default, option_group
from needlescope.report.bisect import residue_lines
from needlescope.run.bisect import BisectConfig, run_bisect
from needlescope.run.config import ProbeConfig, parse_int_list
from needlescope.run.difficulty import probe_with_difficulty

console = Console()
err_console = Console(stderr=True)


@option_group(ProbeConfig, PROBE_FLAGS)
def probe_command(
    flags: dict,
    base_url: list[str] = typer.Option(
        ..., "--base-url", help="Server URL (root or ending in /v1); repeat to spread load."
    ),
    model: str = typer.Option(..., "--model", help="Model name as served in /v1/models."),
    out: Path = typer.Option(config_default(ProbeConfig, "out"), "--out", help="Output directory."),
    resume: bool = typer.Option(
        config_default(ProbeConfig, "resume"),
        "--resume",
        help="Continue the run in --out, re-running unfinished cases only.",
    ),
    bundles: int = typer.Option(
        config_default(ProbeConfig, "bundles"),
        "--bundles",
        help="Reproducer bundles to write for failing cases.",
    ),
    bisect: bool = typer.Option(
        False, "--bisect", help="Search [min, max] of --lengths for the collapse length instead of a grid."
    ),
    resolution: int = typer.Option(
        config_default(BisectConfig, "resolution"),
        "--resolution",
        help="--bisect: bracket width to stop at, in tokens.",
    ),
    ci_width: float = typer.Option(
        config_default(BisectConfig, "ci_width"),
        "--ci-width",
        help="--bisect: raise trials until a 95% CI near the threshold is this wide.",
    ),
    boundaries: str = typer.Option(
        config_default(BisectConfig, "boundaries"),
        "--boundaries",
        help="--bisect: kernel lengths (e.g. 4,64,128,256); default from /get_server_info.",
    ),
) -> None:
    """Measure needle recall across lengths and depths and find where it collapses."""
    cfg = build(
        ProbeConfig, flags, base_urls=tuple(base_url), model=model, out=out, resume=resume, bundles=bundles
    )
    if bisect:
        bis = BisectConfig(
            resolution=resolution,
            ci_width=ci_width,
            boundaries=parse_int_list(boundaries, "--boundaries") if boundaries is not None else None,
        )
        render_bisect(run_bisect(cfg, bis, _bisect_events), cfg.out)
        return
    summary = run_with_progress(cfg)
    render_summary(summary, cfg.out)
    empty = summary["cells_without_data"]
    if empty:
        err_console.print(
            f"[bold red]error:[/] {empty} of {len(summary['cells'])} cells have no scored case (every "
            f"request failed or missed its length); see {cfg.out}/report.md and results.jsonl",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(1)


def run_with_progress(cfg: ProbeConfig) -> dict:
    """Run the probe; the progress bar appears only once every input has been checked and the
    cases are built, so a bad input prints its one error line and nothing else."""
    counts = {"ok": 0, "correct": 0, "error": 0}
    columns = (
        TextColumn("[bold]probing"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("recall {task.fields[recall]}  errors {task.fields[errors]}"),
        TimeRemainingColumn(),
    )
    with contextlib.ExitStack() as stack:
        bar: dict = {}

        def on_event(name: str, payload: dict) -> None:
            if name == "difficulty_level":
                render_difficulty_level(payload)
            elif name == "run_start":
                if "p" in bar:  # an auto-difficulty level finished; its bar gives way to the next
                    bar["p"].stop()
                progress = stack.enter_context(Progress(*columns, console=console, transient=False))
                bar["p"], bar["task"] = (
                    progress,
                    progress.add_task("", total=payload["todo"], recall="-", errors=0),
                )
            elif name == "result":
                if payload.get("status") == "ok":
                    counts["ok"] += 1
                    counts["correct"] += int(bool(payload.get("correct")))
                else:
                    counts["error"] += 1
                recall = f"{counts['correct'] / counts['ok']:.2f}" if counts["ok"] else "-"
                bar["p"].update(bar["task"], advance=1, recall=recall, errors=counts["error"])

        return probe_with_difficulty(cfg, on_event)


def render_difficulty_level(payload: dict) -> None:
    """One line per auto-difficulty level tried on the reference."""
    recall = "no data" if payload["recall"] is None else f"{payload['recall']:.2f}"
    console.print(
        f"difficulty level {payload['level']}: {payload['distractors']} distractors, "
        f"{payload['value_digits']}-digit values: reference recall {recall} (n={payload['n']})"
    )


def _bisect_events(name: str, payload: dict) -> None:
    if name == "bisect_step" and payload["lengths"]:
        console.print(
            f"{payload['phase']}: {', '.join(map(str, payload['lengths']))} tokens ({payload['requests']} requests)"
        )


def render_bisect(res: dict, out: Path) -> None:
    console.print(f"[bold]{res['message']}[/]")
    for line in residue_lines(res["residue"]):
        console.print(line, highlight=False)
    console.print(
        f"requests: {res['requests_used']} vs {res['full_grid_requests']} for a full grid at {res['resolution']} "
        f"tokens ({100 * res['request_ratio']:.1f}%)"
    )
    console.print(f"wrote {out}/bisect.json, bisect.md, results.jsonl")
    if not res["bracketed"] and not any(r["flagged"] for r in res["residue"]):
        # Nothing found in the range: the user's range is wrong for this server.
        raise typer.Exit(2)


def render_summary(summary: dict, out: Path) -> None:
    console.print(f"kind [bold]{summary['kind']}[/]  model [bold]{summary['model']}[/]")
    console.print(f"needle values: {summary['value_digits']} digits, from {summary['value_digits_source']}")
    for line in summary["headline"]:
        console.print(line, style="bold", markup=False, highlight=False, soft_wrap=True)
    errors = sum(cell["errors"] for cell in summary["cells"])
    if errors:
        console.print(f"[yellow]{errors} requests failed and were counted as errors, not misses[/]")
    if summary["length_mismatches"]:
        console.print(
            f"[yellow]WARNING: {summary['length_mismatches']} case(s) have a length disagreement "
            f"({summary['unreachable_lengths']} unreachable, {summary['server_length_mismatches']} counted "
            "differently by the server); see report.md[/]"
        )
    failures = summary.get("failures")
    if failures and failures["misses"]:
        console.print("misses by class: " + ", ".join(f"{k} {v}" for k, v in failures["counts"].items() if v))
    endpoints = summary.get("endpoints")
    if endpoints and endpoints["differs"]:
        console.print(f"[red]differs from the other endpoints: {', '.join(endpoints['differs'])}[/]")
    graded = summary.get("graded")
    if graded is not None:
        console.print(graded["note"], highlight=False)
        for g in (g for g in graded["lengths"] if g["margin_tokens"]):
            console.print(
                f"  {g['length']} tokens: median token margin {g['margin_p50']:+.2f} nats, min "
                f"{g['margin_min']:+.2f}, {g['below_threshold']}/{g['n']} answers won by < "
                f"{graded['margin_threshold']:g}",
                highlight=False,
            )
    console.print(f"wrote {out}/summary.json, report.md, heatmap.png, results.jsonl")
