"""Fault: the indexer's top-k drops candidates when its cut-off bin overflows a candidate buffer.

A radix top-k (SGLang's ``fast_topk``, vLLM's ``persistent_topk``) histograms a coarse key of
every logit, finds the bin holding the k-th value, keeps every entry of the bins above it, and
copies the entries of that cut-off bin into a fixed candidate buffer to rank them exactly. When
the bin holds more candidates than the buffer, the kernels that broke kept the first arrivals and
silently dropped the rest, whatever their values (sglang#36807: a 4,096-entry buffer at k=2048;
vllm#51782: 16,384 per bin). The scores are untouched; only the selection is wrong, and only
in rows whose cut-off bin is crowded, so ``needlescope indexer topk-audit`` is what finds it.

Emulated here with the coarse key of those kernels' first pass (the top 8 bits of the fp16
order-preserving key) and a buffer of ``BUFFER_FACTOR * k`` entries (the 2k of sglang#36807,
scaled to the row), arrivals in column order. Every ``topk`` inside a CSA compressor goes
through it; the watcher that records the indexer's logits (``IndexerCapture``) still sees the
logits the kernel was given.

    needlescope serve --index-topk 4 --patch fault:indexer_topk_overflow
"""

import torch
from torch.overrides import TorchFunctionMode

from needlescope.dsa.emulate import csa_indexers

BUFFER_FACTOR = 2
COARSE_BITS = 8


def coarse_bins(scores: torch.Tensor) -> torch.Tensor:
    """int32 bins (same shape) ordering like the scores: the top COARSE_BITS bits of the fp16 key."""
    bits = scores.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    key = torch.where(bits >= 0x8000, 0xFFFF - bits, bits | 0x8000)  # negatives flipped, sign set on the rest
    return key >> (16 - COARSE_BITS)


def overflowing_topk(scores: torch.Tensor, k: int) -> torch.return_types.topk:
    """``scores.topk(k, dim=-1)`` as a kernel whose cut-off-bin buffer keeps first arrivals.

    scores: [..., L]; returns (values, indices) [..., k], largest first, like ``torch.topk``.
    """
    if k == 0 or scores.shape[-1] == 0:
        return torch.topk(scores, k, dim=-1)
    bins = coarse_bins(scores)
    cut = bins.sort(dim=-1, descending=True).values[..., k - 1 : k]  # the k-th value's bin
    in_cut = bins == cut
    arrival = in_cut.to(torch.int32).cumsum(dim=-1)  # 1-based order of arrival within the bin
    kept = (bins > cut) | (in_cut & (arrival <= BUFFER_FACTOR * k))
    ranked = torch.where(kept, scores, torch.full_like(scores, float("-inf")))
    indices = ranked.topk(k, dim=-1).indices
    return torch.return_types.topk((scores.gather(-1, indices), indices))


class _OverflowingTopk(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.topk or func is torch.topk:
            k = args[1] if len(args) > 1 else kwargs["k"]
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            if dim in (-1, args[0].dim() - 1):
                return overflowing_topk(args[0], int(k))
        return func(*args, **kwargs)


def apply(model):
    # Wrap each CSA indexer's parent: its topk watcher (entered by a hook on the indexer) then
    # sees the logits first, and the call it passes on reaches this kernel.
    parents = []
    for _, indexer in csa_indexers(model):
        parent = next(m for m in model.modules() if any(c is indexer for c in m.children()))
        inner = parent.forward

        def forward(*args, _inner=inner, **kwargs):
            with _OverflowingTopk():
                return _inner(*args, **kwargs)

        parent.forward = forward
        parents.append(parent)

    def undo():
        for parent in parents:
            parent.__dict__.pop("forward", None)

    return undo
