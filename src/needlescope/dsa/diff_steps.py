"""The localizer in chunks and streamed: reference and candidate run layer-major, judged step by step.

``dsa.diff.localize(..., chunk=C)`` (or with models loaded by ``dsa.streaming``) runs both
models through their own KV caches with ``dsa.streaming.LayerMajor``: the embedding over all
tokens, then for each decoder layer i and each chunk c, layer i of the reference over chunk c,
layer i of the candidate over chunk c, and then the step's recorded calls are judged (replays and
calibrations of the reference's modules, on the cache entry as it stood before the chunk:
``module_replay.frozen``) and dropped; last the head at the final prompt position. Peak memory
is one step's records instead of every module's output over the whole prompt, and a streamed
reference reads each layer once and lends it to the streamed candidate (one copy of the weights
on the device).

Rows come in the order the steps ran (layer-major: ``model.layers.0.*`` for every chunk, then
layer 1, ...), each call keyed ``name`` for the first chunk and ``name[call c]`` for the c-th.
A decoder layer's output at a token depends only on the layers below it and on earlier tokens
of its own layer, so a module's first divergence is found at its first chunk whatever the order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from needlescope.dsa.emulate import IndexerCapture, emulate, patches_applied
from needlescope.dsa.module_replay import Call, Recorder
from needlescope.dsa.passes import new_cache
from needlescope.dsa.streaming import LayerMajor, is_streamed, layers_of
from needlescope.errors import BadInput
from needlescope.progress import Progress
from needlescope.setting import Setting

__all__ = ["judged_in_steps"]


def _check_pair(reference: torch.nn.Module, candidate: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    """The models the reference lends its streamed layers to (the candidate when both stream)."""
    if is_streamed(reference) != is_streamed(candidate):
        raise BadInput(
            "the reference and the candidate must both be streamed (--stream-layers) or both be in memory"
        )
    return (candidate,) if is_streamed(reference) else ()


def judged_in_steps(
    reference: torch.nn.Module,
    candidate: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    chunk: int | None,
    reference_setting: Setting,
    setting: Setting,
    extra_patches: tuple,
    captures: tuple[IndexerCapture, IndexerCapture],
    judge_step: Callable[[list[Call], list[Call]], None],
    progress: Progress,
) -> list[int]:
    """Run both models layer-major over ``input_ids`` [1, T] in chunks of ``chunk`` tokens (None: one
    chunk) and call ``judge_step(reference rows, candidate rows)`` after each (layer, chunk) step
    and after the head; returns the CSA layers. Call under ``torch.no_grad()``."""
    lend = _check_pair(reference, candidate)
    ref_cap, cand_cap = captures
    T = int(input_ids.shape[1])
    n_layers = len(reference.model.layers)
    with (
        emulate(reference, reference_setting, capture=ref_cap) as layers,
        emulate(candidate, setting, capture=cand_cap),
        patches_applied(candidate, extra_patches),
        Recorder(reference) as rec_ref,
        Recorder(candidate) as rec_cand,
    ):
        runs = [LayerMajor(m, input_ids, 0, new_cache(m), chunk) for m in (reference, candidate)]

        def step() -> None:
            seen = len(ref_cap.calls)
            with rec_ref.paused(), rec_cand.paused():
                judge_step(rec_ref.rows, rec_cand.rows)
            ref_cap.forget_after(seen)  # what the replays of the reference's indexers captured
            rec_ref.rows.clear()
            rec_cand.rows.clear()

        n_chunks = len(runs[0].spans)
        for i in layers_of(reference, *lend):
            for c in range(n_chunks):
                progress("layers", i, n_layers, f"chunk {c + 1}/{n_chunks}")
                for run in runs:
                    run.run(i, c)
                step()
        for run in runs:
            run.logits([T - 1])
        step()
        progress("layers", n_layers, n_layers, "")
    return layers
