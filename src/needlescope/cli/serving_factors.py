"""``needlescope serving-factors``: which serving factor moves recall (docs/serving_factors.md).

Exit 0: no factor moves recall or greedy output; 1: a factor (or a two-factor interaction)
does, or a request failed everywhere; 2: bad input."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from needlescope.cli.engine_state import SKIP_LONG_LENGTHS, VALUE_DIGITS
from needlescope.cli.output import console, err_console
from needlescope.cli.outputs import FORCE, guard
from needlescope.cli.probe_options import API_KEY_ENV
from needlescope.cli.progress import ProgressView
from needlescope.errors import BadInput, ProbeError
from needlescope.run.config import parse_float_list, parse_int_list

if TYPE_CHECKING:
    from needlescope.run.serving_factors import FactorConfig


def _labels(text: str) -> tuple[str, str]:
    parts = tuple(x.strip() for x in text.split(",") if x.strip())
    if len(parts) != 2:
        raise BadInput(f"--endpoint-labels takes two names, comma-separated; got {text!r}")
    return parts[0], parts[1]


def _parsed_options(
    factors: str | None,
    endpoint_labels: str,
    lengths: str,
    depths: str,
    batch_mates: str,
    draft_depths: str,
    chunk_sizes: str,
) -> dict:
    """The comma-separated options as ``FactorConfig`` fields; ``BadInput`` names the bad flag."""
    return {
        "factors": tuple(f.strip() for f in factors.split(",") if f.strip()) if factors else None,
        "endpoint_labels": _labels(endpoint_labels),
        "lengths": parse_int_list(lengths, "--lengths"),
        "depths": parse_float_list(depths, "--depths"),
        "batch_mates": parse_int_list(batch_mates, "--batch-mates"),
        "draft_depths": parse_int_list(draft_depths, "--draft-depths"),
        "chunk_sizes": parse_int_list(chunk_sizes, "--chunk-sizes"),
    }


BASE_URLS = typer.Option(
    ...,
    "--base-url",
    metavar="<url>",
    help="Server URL (root or ending in /v1). Twice: two servers that differ in one launch flag.",
)


def serving_factors_command(
    base_url: list[str] = BASE_URLS,
    model: str = typer.Option(..., "--model", help="Model name the server serves."),
    out: Path = typer.Option(..., "--out", help="Directory for serving_factors.json and serving_factors.md."),
    factors: str = typer.Option(
        None,
        "--factors",
        help="Any of cache,batch,draft,chunk,endpoint,repeat; default: cache,batch,repeat plus "
        "draft/chunk when their levels are given and endpoint with two --base-url.",
        show_default=False,
    ),
    batch_mates: str = typer.Option(
        "1,7,31", "--batch-mates", help="Batch mates beside each case, per level."
    ),
    draft_depths: str = typer.Option(
        "", "--draft-depths", help="Per-request speculative draft depths to try (sent in --draft-field)."
    ),
    draft_field: str = typer.Option("speculative_num_draft_tokens", "--draft-field"),
    chunk_sizes: str = typer.Option(
        "", "--chunk-sizes", help="Per-request prefill chunk sizes to try (sent in --chunk-field)."
    ),
    chunk_field: str = typer.Option("prefill_chunk", "--chunk-field"),
    endpoint_factor: str = typer.Option(
        "endpoint",
        "--endpoint-factor",
        help="The factor the two --base-url differ in (cache, batch, draft, chunk, or endpoint).",
    ),
    endpoint_labels: str = typer.Option(
        "A,B", "--endpoint-labels", help="The launch flag's level at each --base-url, e.g. off,8."
    ),
    interactions: bool = typer.Option(
        True, "--interactions/--no-interactions", help="Also each pair of factors at their last levels."
    ),
    echo: int = typer.Option(0, "--echo", help="Exact-copy tasks per draft depth (0: no echo probe)."),
    echo_items: int = typer.Option(8, "--echo-items", help="Numbers per copy task."),
    echo_digits: int = typer.Option(4, "--echo-digits", help="Digits per number of a copy task."),
    continuation: int = typer.Option(
        0,
        "--continuation",
        help="Greedy tokens per send with ignore_eos (0: stop at the answer's end); output identity "
        "compares them, recall reads the answer.",
    ),
    min_loss: float = typer.Option(
        0.1, "--min-loss", help="The recall loss whose detection power is printed."
    ),
    alpha: float = typer.Option(0.05, "--alpha", help="Family-wise error rate (Holm across the arms)."),
    kind: str = typer.Option("single", "--kind"),
    lengths: str = typer.Option("512", "--lengths", help="Comma-separated prompt lengths in tokens."),
    depths: str = typer.Option("0,50,100", "--depths", help="Comma-separated needle depths in percent."),
    trials: int = typer.Option(4, "--trials"),
    seed: int = typer.Option(0, "--seed"),
    value_digits: int = VALUE_DIGITS,
    skip_long_lengths: bool = SKIP_LONG_LENGTHS,
    timeout: float = typer.Option(300.0, "--timeout", help="Per request, seconds."),
    api_key: str = typer.Option(None, "--api-key", envvar=API_KEY_ENV, show_default=False),
    force: bool = FORCE,
) -> None:
    """Name the serving factor (prefix cache, batch, draft depth, chunk, a launch flag, repeat) that moves recall or greedy output.

    Over 80 lines: one typer option per flag of the command, and the one config they fill."""
    from needlescope.run.serving_factors import FactorConfig

    cfg = FactorConfig(
        base_urls=tuple(base_url),
        model=model,
        **_parsed_options(factors, endpoint_labels, lengths, depths, batch_mates, draft_depths, chunk_sizes),
        endpoint_factor=endpoint_factor,
        kind=kind,
        trials=trials,
        seed=seed,
        value_digits=value_digits,
        draft_field=draft_field,
        chunk_field=chunk_field,
        interactions=interactions,
        echo=echo,
        echo_items=echo_items,
        echo_digits=echo_digits,
        alpha=alpha,
        min_loss=min_loss,
        continuation=continuation,
        timeout_s=timeout,
        skip_long_lengths=skip_long_lengths,
        api_key=api_key,
    )
    _run_and_report(cfg, out, force)


def _run_and_report(cfg: FactorConfig, out: Path, force: bool) -> None:
    """Run the factor probe of ``cfg``, write its report under ``out`` and exit 1 on a finding
    (a named factor, or an arm with no scored pair)."""
    from needlescope.report.serving_factors import serving_factors_markdown, write_serving_factors
    from needlescope.run.serving_factors import run_serving_factors

    with guard(out, "serving-factors", force):
        try:
            with ProgressView(console) as view:
                body = run_serving_factors(cfg, progress=view, note=view.note)
        except ProbeError as exc:  # only before any send (sizing the cases); a failed send is a row
            err_console.say("[bold red]target failed:[/] {}", exc, soft_wrap=True)
            sys.exit(1)
        js, md = write_serving_factors(body, out)
    console.print(serving_factors_markdown(body), highlight=False, soft_wrap=True)
    console.print(f"wrote {js} and {md}", highlight=False)
    untested = [t["arm"] for t in body["tests"] if t["pairs"] == 0]
    if untested:
        err_console.print(f"no scored pair in: {', '.join(untested)}", highlight=False)
    changed = body["identity"] is not None and body["identity"]["verdict"]["named"] is not None
    if body["verdict"]["named"] is not None or changed or untested:
        sys.exit(1)
