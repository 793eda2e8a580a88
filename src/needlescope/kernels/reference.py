"""Torch reference for the indexer kernels: the CPU path of the dispatch and the tests' oracle.

Same math as ``needlescope.dsa.reference.lightning_scores`` on the quantized inputs the
kernels read (codes times per-key scale; the fp8 query scale already folded into w):
``I[t, s] = scale_k[s] * sum_h w[t, h] * ReLU(q[t, h] . k[s])``, and -inf outside each
query's ``[start, end)``. The two built-in kernel faults (``KERNEL_FAULTS``) are index
transforms here too, so a faulty kernel can be checked against its own reference.

Top-k (``topk_reference``) is exact with a deterministic tie rule: higher score first, equal
scores by lower index, which is what a stable descending sort gives. Rows with at most k
entries return start..end-1 in order (the SGLang convention of ``dsa.reference.topk_indices``),
then -1.
"""

from __future__ import annotations

import torch

from needlescope.dsa.reference import NO_ENTRY, lightning_scores
from needlescope.errors import BadInput
from needlescope.kernels.layout import PAGE_ENTRIES, ContiguousKeys, PagedKeys, gather_paged
from needlescope.kernels.names import KERNEL_FAULTS

__all__ = ["KERNEL_FAULTS", "check_fault", "logits_reference", "paged_logits_reference", "topk_reference"]


def check_fault(fault: str | None, paged: bool) -> None:
    """BadInput unless ``fault`` is None or a kernel fault that applies to this layout."""
    if fault is None:
        return
    if fault not in KERNEL_FAULTS:
        raise BadInput(f"unknown kernel fault {fault!r}; kernel faults: {', '.join(KERNEL_FAULTS)}")
    if fault == "indexer_page_table" and not paged:
        raise BadInput("the indexer_page_table kernel fault needs a paged cache (it ignores the block table)")


def _source_entries(n: int, fault: str | None, device) -> torch.Tensor:
    """Long [n]: the entry whose key scores each entry (the identity unless the key-slot fault)."""
    src = torch.arange(n, device=device)
    return (src - 1).clamp_min(0) if fault == "indexer_key_slot" else src


def _mask_outside(scores: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    ar = torch.arange(scores.shape[-1], device=scores.device).view(1, -1)
    inside = (ar >= starts.view(-1, 1).long()) & (ar < ends.view(-1, 1).long())
    return scores.masked_fill(~inside, float("-inf"))


def logits_reference(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: ContiguousKeys,
    starts: torch.Tensor,
    ends: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
    fault: str | None = None,
) -> torch.Tensor:
    """q [T, H, D] codes, w [T, H], keys N entries, starts/ends [T] -> logits [T, N] in ``dtype``."""
    check_fault(fault, paged=False)
    src = _source_entries(keys.codes.shape[0], fault, keys.codes.device)
    k = keys.codes[src].to(dtype)  # [N, D]
    s = lightning_scores(q.to(dtype), k, w.to(dtype), scale=1.0, acc_dtype=dtype)  # [T, N]
    return _mask_outside(s * keys.scales[src].to(dtype).view(1, -1), starts, ends)


def paged_logits_reference(
    q: torch.Tensor,
    w: torch.Tensor,
    paged: PagedKeys,
    context_lens: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
    fault: str | None = None,
) -> torch.Tensor:
    """q [B, H, D] codes, w [B, H], paged cache, context_lens [B] -> logits [B, width] in ``dtype``."""
    check_fault(fault, paged=True)
    B = q.shape[0]
    dev = q.device
    src = _source_entries(paged.width, fault, dev)  # [W]
    logical = (src // PAGE_ENTRIES).view(1, -1).expand(B, -1)  # [B, W]
    if fault == "indexer_page_table":
        phys = logical
    else:
        phys = paged.block_table.long().gather(1, logical)
    phys = phys.clamp(0, paged.data.shape[0] - 1)  # unused columns may hold any page number
    codes, scales = gather_paged(
        paged, phys, (src % PAGE_ENTRIES).view(1, -1).expand(B, -1)
    )  # [B, W, D], [B, W]
    s = lightning_scores(
        q.to(dtype).unsqueeze(1), codes.to(dtype), w.to(dtype).unsqueeze(1), scale=1.0, acc_dtype=dtype
    )
    s = s.squeeze(1) * scales.to(dtype)  # [B, W]
    return _mask_outside(s, torch.zeros_like(context_lens), context_lens)


def topk_reference(logits: torch.Tensor, k: int, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """logits [R, L], starts/ends [R] -> int32 [R, k]: the exact top-k column indices inside
    [start, end), higher score first and ties by lower index; rows with end - start <= k give
    start..end-1; -1 padding."""
    R, L = logits.shape
    dev = logits.device
    starts = starts.long().clamp(0, L)
    ends = torch.maximum(ends.long().clamp(0, L), starts)
    ar = torch.arange(L, device=dev).view(1, L)
    inside = (ar >= starts.view(R, 1)) & (ar < ends.view(R, 1))
    # Two stable sorts: by score (descending, ties keep index order), then inside-the-range first.
    by_score = torch.sort(logits.double(), dim=1, descending=True, stable=True).indices  # [R, L]
    outside_first = (~inside).gather(1, by_score).to(torch.int8)
    order = by_score.gather(1, torch.sort(outside_first, dim=1, stable=True).indices)
    in_order = torch.sort((~inside).to(torch.int8), dim=1, stable=True).indices  # inside entries by index
    big = (ends - starts) > k
    pick = torch.where(big.view(R, 1), order, in_order)[:, : min(k, L)]
    out = torch.full((R, k), NO_ENTRY, dtype=torch.int32, device=dev)
    out[:, : pick.shape[1]] = pick.to(torch.int32)
    n = torch.minimum(ends - starts, torch.full_like(ends, k))
    return out.masked_fill(torch.arange(k, device=dev).view(1, k) >= n.view(R, 1), NO_ENTRY)
