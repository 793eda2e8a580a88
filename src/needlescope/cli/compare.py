"""``needlescope compare``: paired A/B on byte-identical prompts, live or from two finished runs."""

from __future__ import annotations

import os
from dataclasses import fields, replace
from pathlib import Path

import typer
from rich.console import Console

from needlescope.errors import BadInput
from needlescope.investigate.compare import compare_live
from needlescope.report.oracle import append_oracle_section, read_oracle
from needlescope.run.compare import compare_runs
from needlescope.run.config import ProbeConfig, parse_extra_body, parse_float_list, parse_int_list

console = Console()
_DEFAULTS = {f.name: f.default for f in fields(ProbeConfig)}


def _csv(values: tuple) -> str:
    return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)


def compare_command(
    a: str = typer.Option(None, "--a", help="Base URL of side A (the reference)."),
    b: str = typer.Option(None, "--b", help="Base URL of side B (the candidate)."),
    a_run: Path = typer.Option(None, "--a-run", help="A finished probe --out directory for side A."),
    b_run: Path = typer.Option(None, "--b-run", help="A finished probe --out directory for side B."),
    out: Path = typer.Option(..., "--out", help="Output directory."),
    model: str = typer.Option(None, "--model", help="Model name on A (and on B unless --model-b)."),
    model_b: str = typer.Option(None, "--model-b", help="Model name on B when it differs from A's."),
    kind: str = typer.Option(_DEFAULTS["kind"], "--kind"),
    lengths: str = typer.Option(_csv(_DEFAULTS["lengths"]), "--lengths"),
    depths: str = typer.Option(_csv(_DEFAULTS["depths"]), "--depths"),
    trials: int = typer.Option(_DEFAULTS["trials"], "--trials"),
    seed: int = typer.Option(_DEFAULTS["seed"], "--seed"),
    concurrency: int = typer.Option(_DEFAULTS["concurrency"], "--concurrency"),
    tokenizer: str = typer.Option(_DEFAULTS["tokenizer"], "--tokenizer", help="A's tokenizer counts."),
    extra_body: str = typer.Option(None, "--extra-body", help="JSON object merged into each request."),
    max_tokens: int = typer.Option(_DEFAULTS["max_tokens"], "--max-tokens"),
    timeout: float = typer.Option(_DEFAULTS["timeout_s"], "--timeout"),
    value_digits: int = typer.Option(_DEFAULTS["value_digits"], "--value-digits"),
    haystack_file: Path = typer.Option(None, "--haystack-file"),
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
        result = compare_runs(a_run, b_run, out, alpha=alpha, power_drop=power_drop, bucket_edges=edges)
    else:
        if a is None or b is None:
            raise BadInput("--a and --b go together; give both base URLs")
        if not model:
            raise BadInput("--model is required with --a/--b; pass the model name as served in /v1/models")
        cfg_a = ProbeConfig(
            base_urls=(a,),
            model=model,
            kind=kind,
            lengths=parse_int_list(lengths, "--lengths"),
            depths=parse_float_list(depths, "--depths"),
            trials=trials,
            seed=seed,
            out=out / "a",
            concurrency=concurrency,
            tokenizer=tokenizer,
            extra_body=parse_extra_body(extra_body),
            resume=resume,
            max_tokens=max_tokens,
            timeout_s=timeout,
            haystack_file=haystack_file,
            value_digits=value_digits,
            api_key=os.environ.get("NEEDLESCOPE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        )
        cfg_b = replace(cfg_a, base_urls=(b,), model=model_b or model, out=out / "b")

        def on_event(name: str, payload: dict) -> None:
            if name == "side":
                console.print(f"probing side {payload['side']}: {', '.join(payload['base_urls'])}")

        result = compare_live(
            cfg_a, cfg_b, out, alpha=alpha, power_drop=power_drop, bucket_edges=edges, on_event=on_event
        )
    console.print(f"[bold]{result['verdict']}[/]")
    console.print(f"{result['cases_matched']} cases matched")
    if oracle_result is not None:
        append_oracle_section(out / "report.md", oracle_result)
        console.print(f"logprob oracle: {oracle_result['summary']['verdict']} (section added to report.md)")
    console.print(f"wrote {out}/compare.json, report.md, delta_heatmap.png, pairs.jsonl")
