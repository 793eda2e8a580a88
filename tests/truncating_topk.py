"""A deliberately truncating top-k (issue 40): a radix select whose candidate buffer holds 4,096
entries and keeps the first arrivals.

The k-th largest entry's bin of the top 8 key bits is found exactly; entries in higher bins are
all taken; the cut-off bin's entries go to the buffer in index order (first arrivals kept, the
rest dropped), and the exact top of the buffer fills the remaining slots. This is the bug class
of sglang#35257, vllm#51782 and sglang#36807. ``truncating_topk_small`` scales the buffer with
the suite's small shapes (``SHAPES["small"]``).
"""

from __future__ import annotations

import torch

from needlescope.kernels.conformance import SHAPES, ordered_keys

BUFFER = 4096


def truncating(scores: torch.Tensor, k: int, lengths: torch.Tensor, buffer: int) -> torch.Tensor:
    out = torch.full((scores.shape[0], k), -1, dtype=torch.int64)
    keys = ordered_keys(scores, lengths).cpu()
    for r, n in enumerate(lengths.tolist()):
        key = keys[r, :n]
        if n <= k:
            out[r, :n] = torch.arange(n)
            continue
        digit = key >> 24
        cut = int(torch.topk(key, k).values[-1]) >> 24
        higher = (digit > cut).nonzero().flatten()
        kept = (digit == cut).nonzero().flatten()[:buffer]
        take = min(k - higher.numel(), kept.numel())
        best = kept[torch.topk(key[kept], take).indices]
        out[r, : higher.numel() + take] = torch.cat([higher, best])
    return out


def truncating_topk(scores: torch.Tensor, k: int, lengths: torch.Tensor) -> torch.Tensor:
    """The full-size fixture: a buffer of 4,096 entries."""
    return truncating(scores, k, lengths, BUFFER)


def truncating_topk_small(scores: torch.Tensor, k: int, lengths: torch.Tensor) -> torch.Tensor:
    """The same at the suite's small shapes: the buffer divided as every count is."""
    return truncating(scores, k, lengths, BUFFER // SHAPES["small"])
