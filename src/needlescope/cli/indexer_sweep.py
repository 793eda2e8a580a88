"""``needlescope indexer sweep`` and ``needlescope indexer synthetic``: precision grids over the indexer.

``sweep`` runs a checkpoint (``--model DIR`` or ``organism``) or, with ``--model random-layer``,
one random full-size indexer layer with a planted needle (``needlescope.dsa.random_layer``; no
checkpoint, any length). ``synthetic`` plants a needle among random keys. Both score through
``--kernel`` (``needlescope.kernels.scoring.kernel_backend``: Triton on CUDA, the reference
elsewhere). A flag left out takes its default from the library's config object
(``SweepConfig``, ``RandomLayerConfig``, ``SyntheticConfig``): the CLI passes only the flags given.
torch is imported inside the commands so ``needlescope --help`` does not need it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer

from needlescope.cli import setting_options as opt
from needlescope.cli.indexer import indexer_app
from needlescope.cli.model_context import check_lengths, check_topk
from needlescope.cli.output import console
from needlescope.cli.outputs import FORCE, guard
from needlescope.cli.progress import ProgressView
from needlescope.errors import BadInput
from needlescope.paths import check_out_dir
from needlescope.progress import Progress
from needlescope.run.config import parse_float_list, parse_int_list
from needlescope.setting import REFERENCE

KernelOpt = typer.Option(
    "auto", "--kernel", help="Indexer scoring: auto (Triton on CUDA where it applies) | reference | triton."
)


def _given(**flags: object) -> dict:
    """The flags that were given (not None): the config object supplies every other default."""
    return {k: v for k, v in flags.items() if v is not None}


def _names(text: str | None, flag: str) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if not names:
        raise BadInput(f"{flag} takes comma-separated names such as fp32,bf16,fp8_e4m3; got {text!r}")
    return names


def _ints(text: str | None, flag: str) -> tuple[int, ...] | None:
    return None if text is None else tuple(parse_int_list(text, flag))


def _floats(text: str | None, flag: str) -> tuple[float, ...] | None:
    return None if text is None else tuple(parse_float_list(text, flag))


def _write(out: Path, files: dict[str, str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")


@indexer_app.command("sweep")
def sweep_command(
    model: str = typer.Option(
        ..., "--model", help="DeepSeek-V4 checkpoint directory, 'organism', or 'random-layer'."
    ),
    kind: str = typer.Option(None, "--kind", help="single | multikey | multivalue | multiturn."),
    lengths: str = typer.Option(None, "--lengths", help="Context lengths in tokens."),
    depths: str = typer.Option(None, "--depths", help="Needle depths in percent."),
    trials: int = typer.Option(None, "--trials"),
    seed: int = typer.Option(None, "--seed"),
    index_k: str = typer.Option(REFERENCE.index_k, "--index-k", help="Comma-separated index-key precisions."),
    index_q: str = typer.Option(
        REFERENCE.index_q, "--index-q", help="Comma-separated index-query precisions."
    ),
    score_dtype: opt.ScoreDtype = None,
    index_topk: str = typer.Option(..., "--index-topk", help="Comma-separated index_topk values."),
    target_length: int = typer.Option(None, "--target-length", help="Length to restore (default: longest)."),
    target_rate: float = typer.Option(None, "--target-rate", help="Selection rate that counts as restored."),
    generate: bool = typer.Option(
        None,
        "--generate/--no-generate",
        help="Generate answers (answer recall) or only prefill (default: generate; a random layer never does).",
    ),
    max_new_tokens: int = typer.Option(None, "--max-new-tokens"),
    value_digits: int = typer.Option(
        None,
        "--value-digits",
        help="Digits per needle value (default: the checkpoint's training.json, else 7).",
    ),
    needle_strength: float = typer.Option(
        None,
        "--needle-strength",
        help="random-layer only: 1 plants the strongest needle key, 0 a random one (default: RandomLayerConfig's).",
    ),
    patch: opt.Patch = None,
    device: str = typer.Option("cpu", "--device", help="cpu | cuda | cuda:N"),
    kernel: str = KernelOpt,
    out: Path = typer.Option(..., "--out", help="Output directory."),
    force: bool = FORCE,
) -> None:
    """Grid of precision x index_topk x length: needle selection rate, answer recall, cheapest fix.

    Flags left out take SweepConfig's defaults (lengths 256,1024; depth 50; 1 trial; target rate 0.9).
    Over 80 lines: one typer option per SweepConfig field, then the checks and the run.
    """
    from needlescope.dsa.random_layer import RANDOM_LAYER, RandomLayerConfig
    from needlescope.dsa.sweep import SweepConfig, render_sweep_md, validate_sweep
    from needlescope.kernels.scoring import kernel_backend

    random_layer = model == RANDOM_LAYER
    if needle_strength is not None and not random_layer:
        raise BadInput(f"--needle-strength applies to --model {RANDOM_LAYER} only")
    cfg = SweepConfig(
        **_given(
            lengths=_ints(lengths, "--lengths"),
            index_topk=_ints(index_topk, "--index-topk"),
            index_k=_names(index_k, "--index-k"),
            index_q=_names(index_q, "--index-q"),
            score_dtype=score_dtype,
            kind=kind,
            depths=_floats(depths, "--depths"),
            trials=trials,
            seed=seed,
            target_length=target_length,
            target_rate=target_rate,
            generate=False if random_layer and generate is None else generate,
            max_new_tokens=max_new_tokens,
            value_digits=value_digits,
        )
    )
    if not random_layer:  # a random layer has no context: any length
        _check_fits(model, cfg)
    check_out_dir(out)
    layer_cfg = RandomLayerConfig(**_given(strength=needle_strength)) if random_layer else None
    with guard(out, "indexer sweep", force):
        with _progress() as progress, kernel_backend(kernel, device):
            result = _sweep(model, cfg, layer_cfg, patch, device, value_digits is None, progress)
        validate_sweep(result)
        _write(out, {"sweep.json": json.dumps(result, indent=2) + "\n", "sweep.md": render_sweep_md(result)})
    for line in result["verdict"]:
        console.print(f"- {line}")
    console.print(f"wrote {out}/sweep.json, sweep.md")


def _check_fits(model: str, cfg) -> None:
    """The checkpoint's context holds every length with its answer, and every index_topk."""
    check_lengths(model, cfg.lengths, cfg.max_new_tokens if cfg.generate else 1)
    check_topk(model, cfg.index_topk)


def _sweep(
    model: str, cfg, layer_cfg, patch: str | None, device: str, trained_digits: bool, progress
) -> dict:
    """The sweep on the random layer (``layer_cfg``) or on a checkpoint (checked: DeepSeek-V4, needle
    digits); the patch is resolved last, then the model is loaded."""
    from dataclasses import replace

    from needlescope.dsa.checkpoint import (
        load_bundle,
        require_deepseek_v4,
        resolve_model_dir,
        trained_value_digits,
    )
    from needlescope.dsa.sweep import run_random_layer_sweep, run_sweep

    if layer_cfg is not None:
        cfg = replace(cfg, patch=opt.with_patch(REFERENCE, patch).patch)
        return run_random_layer_sweep(cfg, layer_cfg, device=device, progress=progress)
    path = resolve_model_dir(model)
    if trained_digits:
        cfg = replace(cfg, value_digits=trained_value_digits(path))
    require_deepseek_v4(path)
    cfg = replace(cfg, patch=opt.with_patch(REFERENCE, patch).patch)  # resolved last; runs when first applied
    mdl, tokenizer, path = load_bundle(model, device=device)
    return run_sweep(
        mdl,
        tokenizer,
        cfg,
        model_label=Path(model).name or model,  # the name given, never the weights' absolute path
        progress=progress,
        reload=lambda: load_bundle(model, device=device)[0],
    )


@contextmanager
def _progress() -> Iterator[Progress]:
    """The sweep's progress (``cli.progress``); yields the ``Progress`` callback it renders."""
    with ProgressView(console) as view:
        yield view


@indexer_app.command("synthetic")
def synthetic_command(
    entries: str = typer.Option(None, "--entries", help="Compressed-entry counts (up to 262144)."),
    heads: int = typer.Option(None, "--heads"),
    dim: int = typer.Option(None, "--dim"),
    queries: int = typer.Option(None, "--queries", help="Query rows per trial (they share the keys)."),
    topk: int = typer.Option(None, "--topk"),
    margins: str = typer.Option(None, "--margins", help="Needle margins, comma-separated."),
    margin_unit: str = typer.Option(
        None, "--margin-unit", help="abs (fp32 score units) | spread (fraction)."
    ),
    margin_ref: str = typer.Option(None, "--margin-ref", help="Margin over the best | kth distractor."),
    trials: int = typer.Option(None, "--trials"),
    precisions: str = typer.Option(
        None, "--precisions", help="NAME (keys=queries) or K:Q[:ACC], comma-separated."
    ),
    seed: int = typer.Option(None, "--seed"),
    chunk: int = typer.Option(None, "--chunk", help="Entries scored per chunk (bounds memory)."),
    device: str = typer.Option(None, "--device", help="cpu | cuda"),
    kernel: str = KernelOpt,
    out: Path = typer.Option(Path("synthetic-out"), "--out", help="Output directory (synthetic.json, .md)."),
    force: bool = FORCE,
) -> None:
    """Plant a needle among random keys at real dimensions; measure how often each precision keeps it.

    Flags left out take SyntheticConfig's defaults (64 heads x 128 dims, top-512, 20 trials, device cpu).
    """
    from needlescope.dsa.synthetic import (
        SyntheticConfig,
        parse_precisions,
        render_synthetic_md,
        run_synthetic,
        validate_synthetic,
    )
    from needlescope.kernels.scoring import kernel_backend

    cfg = SyntheticConfig(
        **_given(
            entries=_ints(entries, "--entries"),
            heads=heads,
            dim=dim,
            queries=queries,
            topk=topk,
            margins=_floats(margins, "--margins"),
            margin_unit=margin_unit,
            margin_ref=margin_ref,
            trials=trials,
            precisions=None if precisions is None else parse_precisions(precisions),
            seed=seed,
            chunk=chunk,
            device=device,
        )
    )
    check_out_dir(out)
    with guard(out, "indexer synthetic", force):
        with kernel_backend(kernel, cfg.device):
            result = run_synthetic(cfg)
        validate_synthetic(result)
        md = render_synthetic_md(result)
        _write(out, {"synthetic.json": json.dumps(result, indent=2), "synthetic.md": md})
    console.print(md, markup=False, highlight=False, soft_wrap=True)
    console.print(f"wrote {out}/synthetic.json, synthetic.md")
