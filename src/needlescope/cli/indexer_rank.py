"""``needlescope indexer rank-dump`` and ``needlescope indexer sweep``.

Flags become a ``Setting`` (``cli.setting_options``), a ``RankDumpConfig`` or a ``SweepConfig``
here; the workflows (``needlescope.investigate.rankdump``, ``needlescope.dsa.sweep``) do the work. Every bad input
(unknown dtype, missing needle, patch without ``apply``, non-DeepSeek-V4 checkpoint) raises
``BadInput`` before the model runs, which ``needlescope.cli.main`` turns into one line and exit 2.
torch and transformers are imported inside the commands so ``needlescope --help`` stays fast.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from needlescope.cli import setting_options as opt
from needlescope.cli.indexer import indexer_app
from needlescope.errors import BadInput
from needlescope.investigate.rankdump import RankDumpConfig
from needlescope.paths import check_out_dir
from needlescope.run.config import parse_float_list, parse_int_list
from needlescope.setting import REFERENCE

console = Console()


def _parse_span(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        a, b = text.split(":")
        return int(a), int(b)
    except ValueError:
        raise BadInput(f"--needle-span takes START:END token indices such as 120:135; got {text!r}") from None


def _parse_names(text: str, flag: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if not names:
        raise BadInput(f"{flag} takes comma-separated names such as fp32,bf16,fp8_e4m3; got {text!r}")
    return names


@indexer_app.command("rank-dump")
def rank_dump_command(
    model: str = typer.Option(..., "--model", help="DeepSeek-V4 checkpoint directory, or 'organism'."),
    prompt: list[Path] = typer.Option(
        ..., "--prompt", help="Prompt file (text, or JSON chat messages); repeat for several prompts."
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
    out: Path = typer.Option(..., "--out", help="Output directory."),
) -> None:
    """Rank of the needle's compressed entries in every CSA layer at the answer positions."""
    from needlescope.investigate import rankdump

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
    )
    check_out_dir(out)
    cfg = replace(cfg, setting=opt.with_patch(setting, patch))  # resolved last; it runs when first applied
    result = rankdump.run(cfg)
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
                    escape(d["label"]), str(d["prompt_tokens"]), str(layer["layer"]), "-", "-", "-", "window"
                )
                continue
            p = layer["positions"][0]
            table.add_row(
                escape(d["label"]),
                str(d["prompt_tokens"]),
                str(layer["layer"]),
                str(p["best_rank"]),
                str(min(d["index_topk"], p["visible_entries"])),
                f"{p['margin_frac']:+.3f}",
                "yes" if p["selected"] else "[bold red]no[/]",
            )
    console.print(table)
    if stab is not None:
        for d, one in zip(dumps, stab.get("prompts", [stab]), strict=True):
            s = one["summary"]
            console.print(
                f"{escape(d['label'])} vs reference: mean top-k recall {s['mean_recall']:.4f}, "
                f"{s['changed_positions']}/{s['rows']} rows changed, {s['needle_flips']} needle flips"
            )


@indexer_app.command("sweep")
def sweep_command(
    model: str = typer.Option(..., "--model", help="DeepSeek-V4 checkpoint directory, or 'organism'."),
    kind: str = typer.Option("multiturn", "--kind", help="single | multikey | multivalue | multiturn"),
    lengths: str = typer.Option("256,1024", "--lengths", help="Context lengths in tokens."),
    depths: str = typer.Option("50", "--depths", help="Needle depths in percent."),
    trials: int = typer.Option(1, "--trials"),
    seed: int = typer.Option(0, "--seed"),
    index_k: str = typer.Option(REFERENCE.index_k, "--index-k", help="Comma-separated index-key precisions."),
    index_q: str = typer.Option(
        REFERENCE.index_q, "--index-q", help="Comma-separated index-query precisions."
    ),
    score_dtype: opt.ScoreDtype = None,
    index_topk: str = typer.Option(..., "--index-topk", help="Comma-separated index_topk values."),
    target_length: int = typer.Option(None, "--target-length", help="Length to restore (default: longest)."),
    target_rate: float = typer.Option(0.9, "--target-rate", help="Selection rate that counts as restored."),
    generate: bool = typer.Option(
        True, "--generate/--no-generate", help="Generate answers (answer recall) or only prefill."
    ),
    max_new_tokens: int = typer.Option(12, "--max-new-tokens"),
    value_digits: int = typer.Option(
        None,
        "--value-digits",
        help="Digits per needle value (default: the checkpoint's training.json, else 7).",
    ),
    patch: opt.Patch = None,
    device: str = typer.Option("cpu", "--device", help="cpu | cuda | cuda:N"),
    kernel: str = typer.Option(
        "auto",
        "--kernel",
        help="Indexer scoring: auto (Triton on CUDA where it applies) | reference | triton.",
    ),
    out: Path = typer.Option(..., "--out", help="Output directory."),
) -> None:
    """Grid of precision x index_topk x length: needle selection rate, answer recall, cheapest fix."""
    from needlescope.dsa.checkpoint import require_deepseek_v4, resolve_model_dir, trained_value_digits
    from needlescope.dsa.sweep import SweepConfig, render_sweep_md, validate_sweep

    cfg = SweepConfig(
        lengths=parse_int_list(lengths, "--lengths"),
        index_topk=parse_int_list(index_topk, "--index-topk"),
        index_k=_parse_names(index_k, "--index-k"),
        index_q=_parse_names(index_q, "--index-q"),
        score_dtype=score_dtype or REFERENCE.score_dtype,
        kind=kind,
        depths=parse_float_list(depths, "--depths"),
        trials=trials,
        seed=seed,
        target_length=target_length,
        target_rate=target_rate,
        generate=generate,
        max_new_tokens=max_new_tokens,
        value_digits=value_digits or trained_value_digits(resolve_model_dir(model)),
    )
    require_deepseek_v4(resolve_model_dir(model))
    check_out_dir(out)
    cfg = replace(cfg, patch=opt.with_patch(REFERENCE, patch).patch)  # resolved last; runs when first applied
    result = _sweep_with_progress(model, cfg, device=device, kernel=kernel)
    validate_sweep(result)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (out / "sweep.md").write_text(render_sweep_md(result), encoding="utf-8")
    for line in result["verdict"]:
        console.print(f"- {escape(line)}")
    console.print(f"wrote {escape(str(out))}/sweep.json, sweep.md")


def _sweep_with_progress(model: str, cfg, *, device: str, kernel: str) -> dict:
    """Load ``model`` and run the sweep ``cfg`` on it under a progress bar; the ``sweep.json`` body."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from needlescope.dsa.checkpoint import load_bundle
    from needlescope.dsa.sweep import run_sweep
    from needlescope.kernels.scoring import kernel_backend

    mdl, tokenizer, path = load_bundle(model, device=device)
    with Progress(
        TextColumn("[bold]sweep"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), console=console
    ) as progress:
        task = progress.add_task("sweep", total=None)

        def on_progress(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        with kernel_backend(kernel, device):
            return run_sweep(
                mdl,
                tokenizer,
                cfg,
                model_label=str(path),
                on_progress=on_progress,
                reload=lambda: load_bundle(model, device=device)[0],
            )
