"""``needlescope indexer rank-dump`` (``sweep`` lives in ``cli.indexer_sweep``).

Flags become a ``Setting`` (``cli.setting_options``) and a ``RankDumpConfig`` here; the
workflow (``needlescope.workflows.rankdump``) does the work. Every bad input
(unknown dtype, missing needle, patch without ``apply``, non-DeepSeek-V4 checkpoint) raises
``BadInput`` before the model runs, which ``needlescope.cli.main`` turns into one line and exit 2.
torch and transformers are imported inside the commands so ``needlescope --help`` stays fast.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import typer
from rich.table import Table
from rich.text import Text

from needlescope.cli import loading_options as load
from needlescope.cli import setting_options as opt
from needlescope.cli.indexer import indexer_app
from needlescope.cli.model_context import check_topk
from needlescope.cli.output import console
from needlescope.cli.outputs import FORCE, guard
from needlescope.cli.progress import ProgressView
from needlescope.errors import BadInput
from needlescope.paths import check_out_dir
from needlescope.run.config import parse_int_list
from needlescope.workflows.rankdump import RankDumpConfig


def _parse_span(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        a, b = text.split(":")
        return int(a), int(b)
    except ValueError:
        raise BadInput(f"--needle-span takes START:END token indices such as 120:135; got {text!r}") from None


@indexer_app.command("rank-dump")
def rank_dump_command(
    model: str = typer.Option(..., "--model", help="DeepSeek-V4 checkpoint directory, or 'organism'."),
    prompt: list[Path] = typer.Option(
        ...,
        "--prompt",
        metavar="<path>",
        help="Prompt file (text, or JSON chat messages); repeat for several prompts.",
    ),
    needle: str = typer.Option(None, "--needle", help="The needle's text as it appears in the prompt."),
    needle_span: str = typer.Option(
        None, "--needle-span", help="START:END token span of the needle (overrides --needle)."
    ),
    index_k: opt.IndexK = None,
    index_q: opt.IndexQ = None,
    score_dtype: opt.ScoreDtype = None,
    index_topk: opt.IndexTopk = None,
    patch: opt.Patch = None,
    positions: str = typer.Option(
        None, "--positions", help="Comma-separated query positions (default: the answer positions)."
    ),
    max_new_tokens: int = typer.Option(
        None,
        "--max-new-tokens",
        help="Greedy answer length (stops at EOS; default: rankdump.DEFAULT_MAX_NEW_TOKENS, 12).",
    ),
    compare_to_reference: bool = typer.Option(
        False, "--compare-to-reference", help="Also write stability.json against fp32 reference numerics."
    ),
    compare_model: str = typer.Option(
        None,
        "--compare-model",
        help="Also write stability.json: the reference numerics on this second checkpoint vs --model.",
    ),
    device: load.Device = "cpu",
    max_memory: load.MaxMemory = None,
    chunk: int = typer.Option(None, "--chunk", help="Prefill in chunks of this many tokens (docs/scale.md)."),
    stream_layers: load.StreamLayers = False,
    out: Path = typer.Option(..., "--out", help="Output directory."),
    force: bool = FORCE,
) -> None:
    """Rank of the needle's compressed entries in every CSA layer at the answer positions.

    Over 80 lines: one typer option per RankDumpConfig field, nothing else.
    """
    from needlescope.workflows import rankdump

    setting = opt.numerics_from_flags(index_k, index_q, score_dtype, index_topk)
    cfg = RankDumpConfig(
        model=model,
        prompts=tuple(prompt),
        setting=setting,
        needle=needle,
        needle_span=_parse_span(needle_span),
        positions=tuple(parse_int_list(positions, "--positions")) if positions else None,
        max_new_tokens=max_new_tokens,
        compare_to_reference=compare_to_reference,
        compare_model=compare_model,
        device=device,
        max_memory=max_memory,
        chunk=chunk,
        stream_layers=stream_layers,
    )
    check_topk(model, [setting.index_topk])
    check_out_dir(out)
    cfg = replace(cfg, setting=opt.with_patch(setting, patch))  # resolved last; it runs when first applied
    with guard(out, "indexer rank-dump", force):
        with ProgressView(console) as view:
            result = rankdump.run(cfg, view)
        written = rankdump.write(result, out)
    _render_rank_summary(result.dumps, setting.label(), result.stability)
    console.print(f"wrote {out}/" + ", ".join(written))


def _render_rank_summary(dumps: list[dict], label: str, stab: dict | None) -> None:
    table = Table(title=f"needle rank at the first query position ({label})")
    for col in ("prompt", "tokens", "layer", "best rank", "k", "margin frac", "selected"):
        table.add_column(col)
    for d in dumps:
        for layer in d["layers"]:
            if not layer["positions"]:
                table.add_row(
                    d["label"], str(d["prompt_tokens"]), str(layer["layer"]), "-", "-", "-", "window"
                )
                continue
            p = layer["positions"][0]
            table.add_row(
                d["label"],
                str(d["prompt_tokens"]),
                str(layer["layer"]),
                str(p["best_rank"]),
                str(min(d["index_topk"], p["visible_entries"])),
                f"{p['margin_frac']:+.3f}",
                "yes" if p["selected"] else Text("no", style="bold red"),
            )
    console.print(table)
    if stab is not None:
        for d, one in zip(dumps, stab.get("prompts", [stab]), strict=True):
            s = one["summary"]
            console.print(
                f"{d['label']} vs reference: mean top-k recall {s['mean_recall']:.4f}, "
                f"{s['changed_positions']}/{s['rows']} rows changed, {s['needle_flips']} needle flips"
            )
