"""The shipped organism's recipe: two training stages and a bf16 cast, as data plus one runner.

``needlescope organism train --out DIR`` (no recipe flags) calls ``train_recipe``: stage 1 to
``DIR/stage1``, stage 2 from it to ``DIR``, then the fp32 weights in ``DIR`` are cast to bf16
for the package. The stages are the ones whose run produced the shipped weights (their
``training.json`` configs are in docs/organism_runs/ and the package; a test holds the two
equal), and this runner on an H200 reproduced all 195 tensors bit for bit
(docs/organism.md).

    stage 1: dense training, 1400-step schedule stopped at step 607: a 256-token sliding
             window on short examples for the first 420 steps, then the real 32-token window
             with the length ramp; then 150 steps of indexer distillation.
    stage 2: dense training from stage 1, lengths 128-4096 ramped over 160 steps, chats
             weighted towards multi-turn; then 100 steps of indexer distillation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from needlescope.organism.train import TrainConfig, train

__all__ = ["SHIPPED_STAGES", "recipe_configs", "train_recipe", "cast_bf16"]

_COMMON = {"value_digits": 3, "eval_every": 200, "min_len": 128, "max_len": 4096}

SHIPPED_STAGES: tuple[tuple[str, TrainConfig], ...] = (
    (
        "stage1",
        TrainConfig(
            **_COMMON,
            steps_dense=1400,
            dense_stop=607,
            steps_distil=150,
            wide_window=256,
            wide_window_frac=0.3,
            ramp_frac=0.5,
        ),
    ),
    (
        "stage2",
        TrainConfig(
            **_COMMON,
            steps_dense=400,
            steps_distil=100,
            lr=2e-3,
            ramp_frac=0.4,
            kind_weights=(0.2, 0.1, 0.05, 0.55, 0.1),
        ),
    ),
)
"""(name, config) per stage; every stage after the first continues from the one before."""


def recipe_configs(
    out: Path, *, seed: int = 0, stages: tuple[tuple[str, TrainConfig], ...] = SHIPPED_STAGES
) -> list[tuple[Path, TrainConfig]]:
    """(output dir, config) per stage: the last stage writes ``out``, the others ``out/NAME``,
    each continuing from the previous stage's directory."""
    plan, previous = [], None
    for i, (name, cfg) in enumerate(stages):
        target = out if i == len(stages) - 1 else out / name
        plan.append((target, replace(cfg, seed=seed, init_from=str(previous) if previous else None)))
        previous = target
    return plan


def train_recipe(
    out: Path,
    *,
    seed: int = 0,
    device: str = "cuda",
    workers: int | None = None,
    stages: tuple[tuple[str, TrainConfig], ...] = SHIPPED_STAGES,
    on_log: Callable[[dict], None] | None = None,
) -> dict:
    """Run every stage, cast the final weights to bf16; returns ``{"stages": [...], "wall_s"}``."""
    t0 = time.monotonic()
    records = []
    for target, cfg in recipe_configs(out, seed=seed, stages=stages):
        if workers is not None:
            cfg = replace(cfg, workers=workers)
        rec = train(cfg, target, device=device, on_log=on_log)
        records.append({"out": str(target), "steps": rec["steps"], "wall_s": rec["wall_s"]})
    cast_bf16(out)
    return {"stages": records, "wall_s": round(time.monotonic() - t0, 1)}


def cast_bf16(directory: Path) -> None:
    """Rewrite ``directory/model.safetensors``' fp32 tensors as bf16 in place (half the bytes)."""
    path = Path(directory) / "model.safetensors"
    tensors = load_file(path)
    save_file({k: v.to(torch.bfloat16) if v.dtype == torch.float32 else v for k, v in tensors.items()}, path)
