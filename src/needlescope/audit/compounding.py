"""Compounding: a reduced-precision substitute in every layer, the final logits compared with the
reference's at every prompt position (top-1 agreement and mean KL).

The reference and the candidate run side by side, each through its own KV cache when the prompt
runs in chunks, so that only one chunk's logits exist at a time:

* in memory, token-major: chunk by chunk, each chunk through every layer (``dsa.passes.prefill``);
* streamed (``dsa.streaming``), layer-major: one pass for both runs, each layer read once, run
  over every chunk for the reference and then, with the substitute applied, for the candidate
  (two ``LayerMajor`` runs, each with its own hidden streams of every token); the head is then
  applied chunk by chunk. Running the token-major loop on a streamed model would read every layer
  twice per chunk.

Both give the same logits (a layer's output at a token depends only on that layer's inputs at
that token and earlier ones, through its own cache entry: ``dsa.streaming``'s docstring).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from needlescope.dsa.passes import new_cache, prefill
from needlescope.dsa.streaming import LayerMajor, is_streamed, layers_of

__all__ = ["TOP1_MIN", "KL_MAX", "compounding"]

TOP1_MIN = 0.99
KL_MAX = 1e-3

Substitute = Callable[[torch.nn.Module], Callable[[], None]]


@contextmanager
def _substituted(model, substitute: Substitute) -> Iterator[None]:
    """``substitute`` applied to ``model`` inside the block, undone afterwards even when it raises."""
    undo = substitute(model)
    try:
        yield
    finally:
        undo()


def _token_major(model, ids: torch.Tensor, substitute: Substitute, chunk: int | None) -> Iterator:
    """(reference, candidate) logits [s, V] of each chunk, each chunk through every layer."""
    S = ids.shape[1]
    step = S if chunk is None else chunk
    caches = (None, None) if chunk is None else (new_cache(model), new_cache(model))
    for lo in range(0, S, step):
        part, at = ids[:, lo : lo + step], range(lo, min(lo + step, S))
        ref = prefill(model, part, logits_at=at, cache=caches[0]).logits[0]
        with _substituted(model, substitute):
            cand = prefill(model, part, logits_at=at, cache=caches[1]).logits[0]
        yield ref, cand


def _layer_major(model, ids: torch.Tensor, substitute: Substitute, chunk: int | None) -> Iterator:
    """(reference, candidate) logits [s, V] of each chunk from one layer-major pass of both runs."""
    caches = (None, None) if chunk is None else (new_cache(model), new_cache(model))
    ref, cand = (LayerMajor(model, ids, 0, cache, chunk) for cache in caches)
    for i in layers_of(model):
        for c in range(len(ref.spans)):
            ref.run(i, c)
        with _substituted(model, substitute):
            for c in range(len(cand.spans)):
                cand.run(i, c)
    for lo, hi in ref.spans:
        with _substituted(model, substitute):
            logits = cand.logits(range(lo, hi))[0]
        yield ref.logits(range(lo, hi))[0], logits


def compounding(model, ids: torch.Tensor, substitute: Substitute, chunk: int | None = None) -> list[dict]:
    """Top-1 agreement and mean KL(ref || cand) of the final logits over every position of the
    prompt ``ids`` [1, S] with ``substitute`` in every layer; ``chunk``: the prompt through the
    KV cache in chunks of that many tokens. Records ``{"metric", "value", "threshold"}``."""
    pairs = _layer_major if is_streamed(model) else _token_major
    agree, kl = 0, 0.0
    for ref, cand in pairs(model, ids, substitute, chunk):
        agree += int((ref.argmax(-1) == cand.argmax(-1)).sum())
        kl += float(
            F.kl_div(cand.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum()
        )
    S = ids.shape[1]
    return [
        {"metric": "compounded top-1 agreement", "value": agree / S, "threshold": TOP1_MIN},
        {"metric": "compounded mean KL (nats)", "value": kl / S, "threshold": KL_MAX},
    ]
