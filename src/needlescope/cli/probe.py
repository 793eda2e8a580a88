"""``needlescope probe``: token-exact recall sweep against OpenAI-compatible servers."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from needlescope.report.bisect import residue_lines
from needlescope.run.bisect import BisectConfig, run_bisect
from needlescope.run.config import ProbeConfig, parse_extra_body, parse_float_list, parse_int_list
from needlescope.run.probe import run_probe

console = Console()
err_console = Console(stderr=True)


def probe_command(
    base_url: list[str] = typer.Option(
        ..., "--base-url", help="Server URL (root or ending in /v1); repeat to spread load."
    ),
    model: str = typer.Option(..., "--model", help="Model name as served in /v1/models."),
    kind: str = typer.Option("single", "--kind", help="single | multikey | multivalue | multiturn"),
    lengths: str = typer.Option("1000,2000,4000,8000", "--lengths", help="Target prompt lengths in tokens."),
    depths: str = typer.Option("0,10,25,50,75,90,100", "--depths", help="Needle depths in percent."),
    trials: int = typer.Option(5, "--trials"),
    seed: int = typer.Option(0, "--seed"),
    out: Path = typer.Option(Path("out"), "--out", help="Output directory."),
    concurrency: int = typer.Option(8, "--concurrency"),
    tokenizer: str = typer.Option(
        "server",
        "--tokenizer",
        help="'server' (its /tokenize), or the checkpoint's tokenizer directory (tokenizer.json + "
        "chat_template.jinja), or its tokenizer.json with the template beside it.",
    ),
    chat_template: Path = typer.Option(
        None, "--chat-template", help="With --tokenizer PATH: the chat template file, if not beside it."
    ),
    extra_body: str = typer.Option(
        None, "--extra-body", help="JSON object merged into each request unchanged."
    ),
    resume: bool = typer.Option(
        False, "--resume", help="Continue the run in --out, re-running unfinished cases only."
    ),
    threshold: float = typer.Option(0.85, "--threshold", help="Recall threshold of the effective length."),
    max_tokens: int = typer.Option(32, "--max-tokens"),
    timeout: float = typer.Option(120.0, "--timeout", help="Per-request timeout in seconds."),
    retry_budget: float = typer.Option(
        60.0, "--retry-budget", help="Seconds a request may keep retrying while the server answers 429/503."
    ),
    haystack_file: Path = typer.Option(
        None, "--haystack-file", help="Filler text to use instead of the generated one."
    ),
    value_digits: int = typer.Option(
        None,
        "--value-digits",
        help="Digits per needle value; default: the target's advertised trained_value_digits, else 7.",
    ),
    api_key: str = typer.Option(
        None,
        "--api-key",
        help="Bearer key for the server (else NEEDLESCOPE_API_KEY or OPENAI_API_KEY); sent on every "
        "request, never written anywhere.",
        show_default=False,
    ),
    bundles: int = typer.Option(5, "--bundles", help="Reproducer bundles to write for failing cases."),
    bisect: bool = typer.Option(
        False, "--bisect", help="Search [min, max] of --lengths for the collapse length instead of a grid."
    ),
    resolution: int = typer.Option(16, "--resolution", help="--bisect: bracket width to stop at, in tokens."),
    ci_width: float = typer.Option(
        None, "--ci-width", help="--bisect: raise trials until a 95% CI near the threshold is this wide."
    ),
    boundaries: str = typer.Option(
        None,
        "--boundaries",
        help="--bisect: kernel lengths (e.g. 4,64,128,256); default from /get_server_info.",
    ),
) -> None:
    """Measure needle recall across lengths and depths and find where it collapses."""
    cfg = ProbeConfig(
        base_urls=tuple(base_url),
        model=model,
        kind=kind,
        lengths=parse_int_list(lengths, "--lengths"),
        depths=parse_float_list(depths, "--depths"),
        trials=trials,
        seed=seed,
        out=out,
        concurrency=concurrency,
        tokenizer=tokenizer,
        chat_template=chat_template,
        extra_body=parse_extra_body(extra_body),
        resume=resume,
        threshold=threshold,
        max_tokens=max_tokens,
        timeout_s=timeout,
        retry_budget_s=retry_budget,
        haystack_file=haystack_file,
        value_digits=value_digits,
        bundles=bundles,
        api_key=api_key or os.environ.get("NEEDLESCOPE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
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
            if name == "run_start":
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

        return run_probe(cfg, on_event)


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
    eff = summary["effective_length"]
    console.print(f"kind [bold]{summary['kind']}[/]  model [bold]{summary['model']}[/]")
    console.print(f"needle values: {summary['value_digits']} digits, from {summary['value_digits_source']}")
    console.print(
        f"effective length: [bold]{eff if eff is not None else 'none'}[/] (threshold {summary['threshold']})"
    )
    if summary.get("cliff"):
        c = summary["cliff"]
        console.print(f"cliff: {c['from']} -> {c['to']} tokens, recall drops {c['drop']:.2f}")
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
    console.print(f"wrote {out}/summary.json, report.md, heatmap.png, results.jsonl")
