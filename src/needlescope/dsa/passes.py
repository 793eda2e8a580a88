"""Run a transformers DeepSeek-V4 model through its KV cache: chunked prefill and token-by-token decode.

Every in-process measurement needs the model's logits at a few positions and the indexer's
top-k rows, never the full ``T x vocab`` logits. A one-pass forward over T tokens materializes
per-layer score tensors of ``T x T`` (sliding attention) and ``T x T/4`` (CSA indexer and
attention) entries, so a 128K-token prompt does not fit on full widths even where the weights
do. ``prefill(model, ids, chunk=C)`` runs the prompt in chunks of C tokens through a
``DynamicCache``: peak activation memory is bounded by ``C x (window + T/4)`` instead of
``T x T``, and the results are those of the one-pass run (tested on the organism at 8K, chunk 1K,
token for token and rank for rank). ``decode`` feeds tokens one at a time from a position, as a
server's decode path does; ``greedy`` is chunked prefill followed by greedy decode.

How transformers 5.23's DeepSeek-V4 cache carries state across chunks (read in
``models/deepseek_v4/modeling_deepseek_v4.py``), and why no patch of ours is needed:

* sliding window: ``DeepseekV4HCACache`` / ``DeepseekV4CSACache`` (and ``DynamicSlidingWindowLayer``
  for the sliding layers) keep the last ``sliding_window - 1`` keys and return them concatenated
  with the chunk's; the model's sliding-window mask is built from ``get_mask_sizes`` with the
  same offsets;
* compressor and indexer windows: ``store_compression_weights`` keeps the tokens of an
  unfinished window in ``buffer_kv`` / ``buffer_gate`` until the window closes in a later call, and
  ``entry_count`` gives the absolute position of the next window (its RoPE position);
* CSA overlap: ``update_overlap_state`` hands the previous call's last window's Ca slice to the
  first window of the next call, so the overlapping 2m-wide pooling crosses chunk boundaries;
* causality: the compressor's block bias and the indexer's future mask are computed from the
  absolute ``position_ids`` we pass, against all entries emitted so far.

One limit found there: for a one-token call the CSA layer's indexer block bias is only applied
when the attention mask is a tensor (``DeepseekV4Attention.forward``); the eager mask at decode
is a tensor, and ``decode`` is tested against teacher-forced logits with a small ``index_topk``
(where a dropped bias would change the answer).

How a forward hook on ``DeepseekV4Indexer`` tells calls apart: the indexer is called once per
chunk and once per decoded token, with ``(hidden_states, q_residual, position_ids,
past_key_values, layer_idx)``. ``position_ids`` [B, S] are the absolute positions of the call's
query rows (a chunk: S = chunk length, a decode step: S = 1), and the output top-k row of query
position t only ever names entries < (t+1)//4, so rows concatenated in call order, keyed by
``position_ids``, are the one-pass rows (``emulate.IndexerCapture`` does exactly that). With a
cache, the k of a call is ``min(index_topk, entries emitted so far)`` rather than
``min(index_topk, T/4)``: rows differ only in trailing ``-1`` padding, so compare rows padded to
``index_topk`` (``IndexerCapture.rows``) and as sets where scores tie.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from needlescope.dsa.streaming import is_streamed, streamed_forward
from needlescope.errors import BadInput
from needlescope.setting import check_chunk

__all__ = ["Pass", "new_cache", "prefill", "decode", "greedy", "greedy_batch"]


@dataclass
class Pass:
    """What a run through the model returns: logits at the requested positions and the cache.

    ``logits`` [B, N, V] fp32 in the order of ``positions`` (absolute token positions);
    ``cache`` the ``DynamicCache`` after the last token (None for a cacheless one-pass run);
    ``length``: tokens the model has seen (the next token's position).
    """

    logits: torch.Tensor
    positions: list[int]
    cache: DynamicCache | None
    length: int


def new_cache(model) -> DynamicCache:
    """An empty cache with DeepSeek-V4's per-layer cache classes (built from the model's config)."""
    return DynamicCache(config=model.config)


def _device(model) -> torch.device:
    return model.get_input_embeddings().weight.device


def _logits_positions(logits_at: Sequence[int], start: int, end: int) -> list[int]:
    positions = [int(p) for p in logits_at]
    bad = [p for p in positions if not start <= p < end]
    if bad:
        raise BadInput(f"logits requested at positions {bad[:5]} outside the tokens run ({start}..{end - 1})")
    return positions


def _run(
    model,
    ids: torch.Tensor,
    start: int,
    cache: DynamicCache | None,
    keep: list[int],
    chunk: int | None = None,
) -> torch.Tensor:
    """One forward over ``ids`` [B, S] at absolute positions start..start+S-1; logits [B, len(keep), V].

    A streamed model (``dsa.streaming``) runs it as one layer-major pass, each layer over chunks
    of ``chunk`` tokens; an in-memory model ignores ``chunk`` (its callers split the ids).
    """
    if is_streamed(model):
        return streamed_forward(model, ids, start, cache, keep, chunk)
    S = ids.shape[1]
    dev = _device(model)
    position_ids = torch.arange(start, start + S, device=dev).unsqueeze(0).expand(ids.shape[0], -1)
    local = torch.tensor([p - start for p in keep], dtype=torch.long, device=dev)
    out = model(
        input_ids=ids.to(dev),
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=cache is not None,
        logits_to_keep=local,
    )
    return out.logits.float()


def prefill(
    model,
    ids: torch.Tensor,
    *,
    chunk: int | None = None,
    logits_at: Sequence[int] = (),
    cache: DynamicCache | None = None,
    keep_cache: bool = False,
) -> Pass:
    """Run ``ids`` [B, S] through ``model``; logits only at ``logits_at`` (absolute positions).

    The tokens sit at positions ``start .. start+S-1`` with ``start`` the tokens ``cache`` has
    seen (0 without one). ``chunk=None`` and no cache: one cacheless forward, exactly today's
    ``model(ids, use_cache=False)`` (the organism path); ``keep_cache=True`` then runs the one
    pass through a new cache so that decoding can continue. ``chunk=C``: forwards of at most C
    tokens through ``cache`` (a new one when None). A streamed model (``dsa.streaming``) runs
    the whole prompt as one layer-major pass, each layer over the same chunks, reading each
    layer once. Call under ``torch.no_grad()``.
    """
    chunk = check_chunk(chunk)
    if ids.dim() != 2 or ids.shape[1] < 1:
        raise BadInput(f"ids must be [batch, tokens] with at least one token, got shape {tuple(ids.shape)}")
    start = 0 if cache is None else cache.get_seq_length()
    end = start + ids.shape[1]
    positions = _logits_positions(logits_at, start, end)
    if chunk is None and cache is None and not keep_cache:
        return Pass(_run(model, ids, 0, None, positions), positions, None, end)
    if cache is None:
        cache = new_cache(model)
    if is_streamed(model):  # one layer-major pass: each layer read once, run over the chunks
        return Pass(_run(model, ids, start, cache, positions, chunk), positions, cache, end)
    step = ids.shape[1] if chunk is None else chunk
    parts = []
    for lo in range(start, end, step):
        hi = min(lo + step, end)
        keep = [p for p in positions if lo <= p < hi]
        parts.append((keep, _run(model, ids[:, lo - start : hi - start], lo, cache, keep)))
    return Pass(_ordered(parts, positions), positions, cache, end)


def _ordered(parts: list[tuple[list[int], torch.Tensor]], positions: list[int]) -> torch.Tensor:
    """Logits of every part, reordered to ``positions`` (which may repeat or be unsorted)."""
    where: dict[int, torch.Tensor] = {}
    for keep, logits in parts:
        for i, p in enumerate(keep):
            where[p] = logits[:, i]
    if not positions:
        return parts[0][1][:, :0]
    return torch.stack([where[p] for p in positions], dim=1)


def decode(model, ids: torch.Tensor, cache: DynamicCache, *, logits_at: Sequence[int] | None = None) -> Pass:
    """Feed ``ids`` [B, S] one token per forward through ``cache`` (a server's decode path).

    The tokens take positions ``cache.get_seq_length()`` onwards; ``logits_at`` defaults to
    every one of them. Call under ``torch.no_grad()``.
    """
    start = cache.get_seq_length()
    end = start + ids.shape[1]
    positions = list(range(start, end)) if logits_at is None else _logits_positions(logits_at, start, end)
    parts = []
    for p in range(start, end):
        keep = [p] if p in positions else []
        parts.append((keep, _run(model, ids[:, p - start : p - start + 1], p, cache, keep)))
    return Pass(_ordered(parts, positions), positions, cache, end)


def greedy(
    model, ids: torch.Tensor, max_new_tokens: int, *, eos_token_id: int | None, chunk: int | None = None
) -> list[int]:
    """Greedy continuation of the single prompt ``ids`` [1, P]: chunked prefill, then decode.

    Stops after ``max_new_tokens`` or at ``eos_token_id`` (included). The last generated
    token is never fed back, as in ``model.generate``. Call under ``torch.no_grad()``.
    """
    if ids.shape[0] != 1:
        raise BadInput(f"greedy decodes one prompt at a time, got a batch of {ids.shape[0]}")
    out = greedy_batch(model, ids, max_new_tokens, eos_token_id=eos_token_id, chunk=chunk)[0].tolist()
    return out[: out.index(eos_token_id) + 1] if eos_token_id in out else out


def greedy_batch(
    model, ids: torch.Tensor, max_new_tokens: int, *, eos_token_id: int | None, chunk: int | None = None
) -> torch.Tensor:
    """Greedy continuation of the unpadded batch ``ids`` [B, P]: the new tokens [B, n] (CPU).

    Every row is decoded until it emits ``eos_token_id`` or ``max_new_tokens`` are out; a row
    that is done repeats ``eos_token_id`` while the others go on (``model.generate`` pads it the
    same way), so ``n`` is the longest row's count. Rows never mix: each row's tokens are those
    it gets alone. The prompt runs in chunks of ``chunk`` tokens through the KV cache
    (``prefill``), the answer one token per forward (``decode``), logits at the last position
    only. Call under ``torch.no_grad()``.
    """
    if max_new_tokens < 1:
        raise BadInput(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    run = prefill(model, ids, chunk=chunk, logits_at=[ids.shape[1] - 1], keep_cache=True)
    done = torch.zeros(ids.shape[0], dtype=torch.bool)
    out: list[torch.Tensor] = []
    while True:
        token = run.logits[:, -1].argmax(-1).cpu()  # [B]
        if eos_token_id is not None:
            token = torch.where(done, torch.full_like(token, eos_token_id), token)
            done |= token == eos_token_id
        out.append(token)
        if len(out) >= max_new_tokens or bool(done.all()):
            return torch.stack(out, dim=1)
        run = decode(model, token.view(-1, 1).to(ids.dtype), run.cache)
