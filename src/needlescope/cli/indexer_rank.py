"""``needlescope indexer rank-dump`` and ``needlescope indexer sweep``.

Flags become ``Numerics`` / ``SweepConfig`` here; the library does the work. Every bad input
(unknown dtype, missing needle, patch without ``apply``, non-DeepSeek-V4 checkpoint) raises
``BadInput`` before the model runs, which ``needlescope.cli.main`` turns into one line and exit 2.
torch and transformers are imported inside the commands so ``needlescope --help`` stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from needlescope.cli.indexer import indexer_app
from needlescope.errors import BadInput
from needlescope.run.config import parse_float_list, parse_int_list

console = Console()


def _parse_span(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        a, b = text.split(":")
        span = (int(a), int(b))
    except ValueError:
        raise BadInput(f"--needle-span takes START:END token indices such as 120:135; got {text!r}") from None
    if not 0 <= span[0] < span[1]:
        raise BadInput(f"--needle-span {text!r} must satisfy 0 <= START < END")
    return span


def _parse_names(text: str, flag: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if not names:
        raise BadInput(f"{flag} takes comma-separated names such as fp32,bf16,fp8_e4m3; got {text!r}")
    return names


def _load_v4(model: str, device: str = "cpu"):
    from transformers.utils import logging as hf_logging

    from needlescope.organism.bundle import load_bundle, require_deepseek_v4, resolve_model_dir

    require_deepseek_v4(resolve_model_dir(model))
    hf_logging.disable_progress_bar()  # the weight-loading bar would bury the summary and errors
    return load_bundle(model, device=device)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


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
    index_k: str = typer.Option("fp32", "--index-k", help="Index-key precision (fp32, bf16, fp8_e4m3, ...)."),
    index_q: str = typer.Option("fp32", "--index-q", help="Index-query precision."),
    score_dtype: str = typer.Option("fp32", "--score-dtype", help="Score accumulation dtype: fp32 | bf16."),
    index_topk: int = typer.Option(None, "--index-topk", help="Override the checkpoint's index_topk."),
    patch: Path = typer.Option(
        None, "--patch", help="Python file defining apply(model), or a built-in fault:NAME."
    ),
    positions: str = typer.Option(
        None, "--positions", help="Comma-separated query positions (default: the answer positions)."
    ),
    max_new_tokens: int = typer.Option(12, "--max-new-tokens", help="Greedy answer length (stops at EOS)."),
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
    from needlescope.dsa.emulate import Numerics, load_patch
    from needlescope.dsa.prompt import needle_token_span, read_prompt_file, render_prompt
    from needlescope.dsa.rankdump import (
        combine_dumps,
        plot_margin_vs_length,
        plot_rank_vs_layer,
        rank_dump,
        render_rankdump_md,
        validate_rankdump,
    )
    from needlescope.dsa.stability import selection_stability, validate_stability

    numerics = Numerics(index_k=index_k, index_q=index_q, score_dtype=score_dtype, index_topk=index_topk)
    span = _parse_span(needle_span)
    if span is None and not needle:
        raise BadInput(
            "give the needle: --needle TEXT (as it appears in the prompt) or --needle-span START:END"
        )
    if patch is not None:
        load_patch(patch)
    query_positions = parse_int_list(positions, "--positions") if positions else None
    messages = [read_prompt_file(p) for p in prompt]
    mdl, tokenizer, path = _load_v4(model)
    if compare_to_reference and compare_model:
        raise BadInput("give either --compare-to-reference or --compare-model, not both")
    other, other_path = (None, None)
    if compare_model:
        other, other_tok, other_path = _load_v4(compare_model)
        if other_tok.get_vocab() != tokenizer.get_vocab():
            raise BadInput(
                f"{compare_model!r} has a different tokenizer; stability compares the same prompt tokens"
            )
    # Find every needle before running anything, so a bad prompt fails fast.
    for p, msgs in zip(prompt, messages, strict=True):
        if span is None:
            try:
                needle_token_span(render_prompt(tokenizer, msgs), needle)
            except BadInput as exc:
                raise BadInput(f"{p}: {exc}") from None

    dumps, stabs = [], []
    for p, msgs in zip(prompt, messages, strict=True):
        kw = dict(needle=needle, needle_span=span)
        dumps.append(
            rank_dump(
                mdl,
                tokenizer,
                msgs,
                **kw,
                numerics=numerics,
                patch=patch,
                query_positions=query_positions,
                max_new_tokens=max_new_tokens,
                label=p.stem,
            )
        )
        if compare_to_reference or other is not None:
            # Reference side: fp32 numerics on --compare-model (or on --model itself).
            ref_model, ref_path = (other, other_path) if other is not None else (mdl, path)
            stabs.append(
                selection_stability(
                    ref_model,
                    tokenizer,
                    msgs,
                    **kw,
                    reference=Numerics(index_topk=index_topk),
                    candidate=numerics,
                    candidate_model=mdl,
                    candidate_patch=patch,
                    reference_label=str(ref_path),
                    candidate_label=str(path),
                )
            )
    obj = combine_dumps(dumps)
    obj["model"] = str(path)
    validate_rankdump(obj)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "rankdump.json", obj)
    written = ["rankdump.json", "rankdump.md", "rank_vs_layer.png"]
    stab_obj = None
    if stabs:
        stab_obj = stabs[0] if len(stabs) == 1 else {**stabs[0], "prompts": stabs}
        validate_stability(stab_obj)
        _write_json(out / "stability.json", stab_obj)
        written.append("stability.json")
    (out / "rankdump.md").write_text(render_rankdump_md(obj, stability=stab_obj), encoding="utf-8")
    plot_rank_vs_layer(obj, out / "rank_vs_layer.png")
    if len(dumps) > 1:
        plot_margin_vs_length(obj, out / "margin_vs_length.png")
        written.append("margin_vs_length.png")
    _render_rank_summary(dumps, numerics.label(), stab_obj)
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
                "yes" if p["selected"] else "[bold red]no[/]",
            )
    console.print(table)
    if stab is not None:
        for d, one in zip(dumps, stab.get("prompts", [stab]), strict=True):
            s = one["summary"]
            console.print(
                f"{d['label']} vs reference: mean top-k recall {s['mean_recall']:.4f}, "
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
    index_k: str = typer.Option("fp32", "--index-k", help="Comma-separated index-key precisions."),
    index_q: str = typer.Option("fp32", "--index-q", help="Comma-separated index-query precisions."),
    score_dtype: str = typer.Option("fp32", "--score-dtype", help="Score accumulation dtype: fp32 | bf16."),
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
    patch: Path = typer.Option(
        None, "--patch", help="Python file defining apply(model), or a built-in fault:NAME."
    ),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda | cuda:N"),
    kernel: str = typer.Option(
        "auto",
        "--kernel",
        help="Indexer scoring: auto (Triton on CUDA where it applies) | reference | triton.",
    ),
    out: Path = typer.Option(..., "--out", help="Output directory."),
) -> None:
    """Grid of precision x index_topk x length: needle selection rate, answer recall, cheapest fix."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from needlescope.dsa.emulate import load_patch
    from needlescope.dsa.sweep import SweepConfig, render_sweep_md, run_sweep, validate_sweep
    from needlescope.kernels.scoring import kernel_backend
    from needlescope.organism.bundle import resolve_model_dir, trained_value_digits

    cfg = SweepConfig(
        lengths=parse_int_list(lengths, "--lengths"),
        index_topk=parse_int_list(index_topk, "--index-topk"),
        index_k=_parse_names(index_k, "--index-k"),
        index_q=_parse_names(index_q, "--index-q"),
        score_dtype=score_dtype,
        kind=kind,
        depths=parse_float_list(depths, "--depths"),
        trials=trials,
        seed=seed,
        target_length=target_length,
        target_rate=target_rate,
        generate=generate,
        max_new_tokens=max_new_tokens,
        value_digits=value_digits or trained_value_digits(resolve_model_dir(model)),
        patch=str(patch) if patch is not None else None,
    )
    if patch is not None:
        load_patch(patch)
    mdl, tokenizer, path = _load_v4(model, device)
    with Progress(
        TextColumn("[bold]sweep"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), console=console
    ) as progress:
        task = progress.add_task("sweep", total=None)

        def on_progress(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        with kernel_backend(kernel, device):
            result = run_sweep(mdl, tokenizer, cfg, model_label=str(path), on_progress=on_progress)
    validate_sweep(result)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "sweep.json", result)
    (out / "sweep.md").write_text(render_sweep_md(result), encoding="utf-8")
    for line in result["verdict"]:
        console.print(f"- {line}")
    console.print(f"wrote {out}/sweep.json, sweep.md")
