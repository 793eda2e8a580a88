"""Decode top-k over a paged key cache: logits and exact top-k, fused or as two kernels.

The fused path builds the first radix-select histogram (``triton_radix``, top 8 bits of every
row's keys) in the paged logits kernel: each program re-reads the logits it just wrote (after a
barrier) and adds one histogram, so the top-k starts at its second pass: one launch and one full
read of the logits row fewer than logits then top-k. (A histogram per page inside the page loop
measured 4-41 us slower: its barriers sit in the pipelined loop.) The logits row is still
written and read back by the remaining passes: a per-segment candidate list instead would need
each program to finish a serial selection over its segment, which measured 8-40 us a stage
(docs/perf/indexer-notes.md).

Where the CUDA top-k is the method, the fused path's logits kernel writes each page's four group
maxima (16 entries a group) and ``cuda_topk.group_topk`` reads them: its bound comes from the
maxima, and only the groups that reach it (about k of them) are read back, not the whole row.
"""

from __future__ import annotations

import torch

from needlescope.kernels import topk, triton_logits, triton_radix
from needlescope.kernels.layout import PagedKeys

__all__ = ["decode_topk", "fuse_decode", "groups_fit"]


def fuse_decode(batch: int, width: int, k: int) -> bool:
    """Whether the fused path is used for a [batch, width] decode top-k: at batch >= 32 wherever
    the filter or the radix select is the top-k method (``topk.topk_method``), or the CUDA method
    is and its group path fits (``groups_fit``). Measured on an H100 (docs/perf/indexer.md,
    CUDA-graph replays): the fused filter path (group maxima from the logits kernel) 73.3 / 130.7
    us against logits + filter 75.9 / 134.7 at 32 / 64 x 128K (run 17); fused radix 154.5 / 286.7
    against logits + radix 157.1 / 295.1 at 32 / 64 x 256K (run 15). Below batch 32 the unfused
    path's persistent logits loop measured faster in five of six cells (runs 10 and 12: 1 x 32K
    14.3-14.5 us against 16.8-16.9; 8 x 256K 50.3 against 53.2). Where the bisection is the
    method (8K tokens) logits + bisection is as fast or faster. Where the CUDA top-k is the method
    (the four 128K/256K goal cells since run 29) the fused filter path measured 1.7-7.1% slower
    than logits + top-k (run 33); there the fused CUDA group path (``select="cuda"``) measured
    2.7 / 2.1 / 7.3 / 8.8% faster than logits + top-k at 32 / 64 x 128K and 32 / 64 x 256K (66.8 /
    115.6 / 115.4 / 213.8 us against 68.7 / 118.1 / 124.5 / 234.4; run 36), so it is the fused path
    there. Neither fused path was measured below batch 32 with the CUDA top-k."""
    return _plan(batch, width, k)[0]


def groups_fit(batch: int, width: int, k: int) -> bool:
    """The fused path's top-k can be the CUDA group path (``cuda_topk.group_topk``) for a [batch,
    width] decode top-k: the CUDA method is the top-k (``topk_method``), rows fit
    ``cuda_topk.GROUP_WIDTH``, k <= 512 (the bound then keeps about k of the >= 4k groups a 32K row
    has), and a CUDA graph being captured finds the kernel loaded."""
    return _groups_ok(topk.topk_method(batch, width, k), width, k)


def _groups_ok(method: str, width: int, k: int) -> bool:
    """``groups_fit`` given the top-k method ``topk_method`` chose."""
    from needlescope.kernels import cuda_topk

    if k > 512 or width > cuda_topk.GROUP_WIDTH or method != "cuda":
        return False
    capturing = torch.cuda.is_current_stream_capturing()
    return not capturing or cuda_topk.group_loaded(torch.device("cuda"), width)


def _plan(batch: int, width: int, k: int) -> tuple[bool, str]:
    """(``fuse_decode``'s answer, the fused path's default ``select``) from one ``topk_method`` call
    (a decode call's host time: it may ask the CUDA top-k what is loaded)."""
    method = topk.topk_method(batch, width, k)
    groups = _groups_ok(method, width, k)
    fused = batch >= 32 and (method in ("radix", "filter") or groups)
    return fused, "cuda" if groups else "filter" if method == "filter" else "radix"


def decode_topk(
    q: torch.Tensor,
    w: torch.Tensor,
    paged: PagedKeys,
    context_lens: torch.Tensor,
    k: int,
    *,
    fused: bool | None = None,
    select: str | None = None,
    bits: int = 8,
    fault: str | None = None,
    logits_args: dict | None = None,
) -> torch.Tensor:
    """q [B, H, D] codes, w [B, H] fp32, context_lens int32 [B] -> int32 [B, k]: the exact top-k
    entries of each request (ties to the lower index, -1 padding). ``fused`` None: ``fuse_decode``.
    ``select``: the fused path's top-k: ``radix`` (pass 0's histogram in the logits kernel, ``bits``
    its digit width), ``filter`` (the logits kernel writes the group maxima ``triton_filter``
    starts from, so its first launch is skipped) or ``cuda`` (the logits kernel writes the same
    maxima, ``cuda_topk.group_topk`` reads them and only the groups that reach its bound; with a
    ``fault`` variant, which writes no maxima, logits then the top-k); None: ``cuda`` where
    ``groups_fit``, ``filter`` where ``topk_method`` picks the filter, else ``radix``.
    ``logits_args``: tuning keywords of ``triton_logits.paged_logits``."""
    B = q.shape[0]
    # No clamping kernel: every kernel here bounds entries by the width as well as by the length.
    lens = context_lens.to(device=q.device, dtype=torch.int32).contiguous()
    if fused is None or select is None:
        plan = _plan(B, paged.width, k)
        fused = plan[0] if fused is None else fused
        select = plan[1] if select is None else select
    kw = logits_args or {}
    if not fused or (select == "cuda" and fault is not None):
        logits = triton_logits.paged_logits(q, w, paged, lens, fault=fault, **kw)
        return topk.topk(logits, k, None, lens)
    if select == "cuda":
        from needlescope.kernels import cuda_topk

        gmax = torch.empty(
            B, paged.block_table.shape[1] * triton_logits.GROUPS_PER_PAGE, dtype=torch.int32, device=q.device
        )
        logits = triton_logits.paged_logits(q, w, paged, lens, gmax=gmax, **kw)
        return cuda_topk.group_topk(logits, k, lens, gmax)
    if select == "filter":
        from needlescope.kernels import triton_filter

        # The fault variants have no persistent loop to write group maxima: the filter builds its own.
        gmax = None
        if fault is None:
            groups = paged.block_table.shape[1] * triton_logits.GROUPS_PER_PAGE
            gmax = torch.empty(B, groups, dtype=torch.int32, device=q.device)
        logits = triton_logits.paged_logits(q, w, paged, lens, fault=fault, gmax=gmax, **kw)
        return triton_filter.filter_topk(logits, k, None, lens, gmax=gmax)
    if select != "radix":
        raise ValueError(f"select must be radix, filter or cuda, got {select!r}")
    hist = triton_radix.radix_workspace(B, q.device, bits)
    logits = triton_logits.paged_logits(q, w, paged, lens, fault=fault, hist=hist[0], hist_bits=bits, **kw)
    return triton_radix.radix_topk(logits, k, None, lens, bits=bits, hist=hist, first_pass=1)
