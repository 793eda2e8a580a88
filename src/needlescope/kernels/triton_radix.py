"""Exact top-k by cooperative radix select: every row split over many programs, 8 bits a pass.

Same contract as ``triton_topk.topk`` (ties to the lower index, row lengths, -1 padding, output:
entries above the threshold in index order, then the ties in index order). Keys are the fp32
scores mapped to order-preserving uint32 (``triton_topk._ordered_key``).

Five launches over a grid of (row, chunk) programs, each program holding ``chunk`` columns in
registers:

* passes 0-3: the 256-bin histogram of digit p (bits 31-24, 23-16, 15-8, 7-0) over the chunk's
  entries whose higher digits equal the prefix found so far, added to the row's global histogram
  with integer atomics (only the non-empty bins). Each program of pass p first resolves digit p-1
  from the row's histogram of the previous pass (the bin holding the k-th largest key, and how
  many of k are still to be found inside it); program (r, 0) writes that state for the next pass.
* pass 3 also stores, per program, how many of its entries lie above and at each candidate last
  digit, so that the output pass knows how many entries above the threshold, and how many ties,
  come before its chunk without another scan over the row.
* the output pass resolves the last digit (the exact key of the k-th largest entry and how many
  equal to it are taken) and writes its chunk's entries at their final positions.

Why not a serial search per program (``triton_topk``): that is ~20 dependent block-wide counts in
one program (docs/perf/indexer-notes.md), where here each program makes four histogram passes
over a short chunk, all chunks of all rows in parallel, and the serial part is five launches.
``first_pass`` lets a producer (the fused decode path in ``triton_logits``) build pass 0's
histogram while it writes the logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from needlescope.kernels.triton_topk import _ordered_key

__all__ = ["radix_topk", "radix_chunk", "radix_workspace", "digit0_histogram"]

NBINS = 256


@triton.jit
def digit0_histogram(logit, valid):
    """int32 [256]: how many of the valid fp32 ``logit`` fall in each bin of their key's top 8 bits."""
    key = _ordered_key(logit)
    return tl.histogram((key >> 24).to(tl.int32), 256, mask=valid)


@triton.jit
def _resolve(hist_row, prefix, krem):
    """From a row's 256-bin histogram of the next digit: (prefix with that digit appended, how many
    of the k still to be taken have exactly that prefix)."""
    bins = tl.arange(0, 256)
    h = tl.load(hist_row + bins)
    ge = tl.sum(h, 0) - tl.cumsum(h, 0) + h  # entries with digit >= bin
    b = tl.max(tl.where(ge >= krem, bins, 0), 0)
    krem = krem - tl.sum(tl.where(bins > b, h, 0), 0)
    return (prefix << 8) | b.to(tl.uint32), krem


@triton.jit
def _radix_pass(
    x_ptr,  # fp32 [R, x_stride]
    starts_ptr,  # int32 [R]
    ends_ptr,  # int32 [R]
    hist_ptr,  # int32 [4, R, 256], zeroed before pass 0
    state_ptr,  # int32 [R, 4, 2]: (prefix, krem) after digits 0..p
    below_ptr,  # int32 [R, S, 257]: pass 3's per-chunk counts of keys >= (prefix, digit d); [256]: > prefix
    out_ptr,  # int32 [R, out_stride]
    R,
    S,
    x_stride,
    out_stride,
    L,
    K,
    CH: tl.constexpr,
    PASS: tl.constexpr,  # 0-3: histogram of digit PASS; 4: output
    SB: tl.constexpr,  # how many earlier chunks the output pass reads at a time
):
    r = tl.program_id(0)
    s = tl.program_id(1)
    st = tl.load(starts_ptr + r)
    en = tl.load(ends_ptr + r)
    bins = tl.arange(0, 256)
    orow = out_ptr + r.to(tl.int64) * out_stride
    if en - st <= K:
        if PASS == 4:  # every entry of the range, in order, then -1
            for c in range(s * CH, K, S * CH):
                j = c + tl.arange(0, CH)
                tl.store(orow + j, tl.where(j < en - st, st + j, -1), mask=j < K)
    else:
        prefix = tl.zeros([], dtype=tl.uint32)
        krem = K + tl.zeros([], dtype=tl.int32)
        if PASS >= 2:
            prefix = tl.load(state_ptr + (r * 4 + PASS - 2) * 2).to(tl.uint32, bitcast=True)
            krem = tl.load(state_ptr + (r * 4 + PASS - 2) * 2 + 1)
        if PASS >= 1:
            prefix, krem = _resolve(hist_ptr + ((PASS - 1) * R + r) * 256, prefix, krem)
            if s == 0:
                tl.store(state_ptr + (r * 4 + PASS - 1) * 2, prefix.to(tl.int32, bitcast=True))
                tl.store(state_ptr + (r * 4 + PASS - 1) * 2 + 1, krem)
        cols = s * CH + tl.arange(0, CH)
        m = (cols >= st) & (cols < en)
        key = _ordered_key(tl.load(x_ptr + r.to(tl.int64) * x_stride + cols, mask=cols < L, other=0.0))
        if PASS < 4:
            sel = m
            if PASS > 0:
                sel = m & ((key >> (32 - 8 * PASS)) == prefix)
            h = tl.histogram(((key >> (24 - 8 * PASS)) & 255).to(tl.int32), 256, mask=sel)
            tl.atomic_add(hist_ptr + (PASS * R + r) * 256 + bins, h, mask=h != 0, sem="relaxed")
            if PASS == 3:
                above = tl.sum((m & ((key >> 8) > prefix)).to(tl.int32), 0)
                ge = tl.sum(h, 0) - tl.cumsum(h, 0) + h + above
                row = below_ptr + (r.to(tl.int64) * S + s) * 257
                tl.store(row + bins, ge)
                tl.store(row + 256, above)
        else:
            d = (prefix & 255).to(tl.int32)  # the threshold's last digit
            gt_before = tl.zeros([], dtype=tl.int32)
            eq_before = tl.zeros([], dtype=tl.int32)
            for c in range(0, s, SB):
                j = c + tl.arange(0, SB)
                row = below_ptr + (r.to(tl.int64) * S + j) * 257
                at_or_above = tl.load(row + d, mask=j < s, other=0)
                above = tl.load(row + d + 1, mask=j < s, other=0)
                gt_before += tl.sum(above, 0)
                eq_before += tl.sum(at_or_above - above, 0)
            gt = (m & (key > prefix)).to(tl.int32)
            eq = (m & (key == prefix)).to(tl.int32)
            pos_gt = gt_before + tl.cumsum(gt, 0) - 1
            tl.store(orow + pos_gt, cols, mask=gt != 0)
            pos_eq = eq_before + tl.cumsum(eq, 0) - 1
            tl.store(orow + (K - krem) + pos_eq, cols, mask=(eq != 0) & (pos_eq < krem))


def radix_chunk(rows: int, width: int) -> int:
    """Columns per program: enough programs to cover the GPU a few times over, each chunk
    at least 1024 columns (the histogram's fixed cost) and at most 8192 (registers)."""
    return min(max(triton.next_power_of_2(max(rows * width // 512, 1)), 1024), 8192)


def radix_workspace(rows: int, device) -> torch.Tensor:
    """The zeroed int32 [4, rows, 256] histograms one call needs (a producer may fill pass 0's)."""
    return torch.zeros(4, rows, NBINS, dtype=torch.int32, device=device)


def radix_topk(
    logits: torch.Tensor,
    k: int,
    starts: torch.Tensor,
    ends: torch.Tensor,
    *,
    chunk: int | None = None,
    num_warps: int | None = None,
    out: torch.Tensor | None = None,
    hist: torch.Tensor | None = None,
    first_pass: int = 0,
) -> torch.Tensor:
    """logits fp32 [R, L], starts/ends int32 [R] (clamped, end >= start, contiguous) -> int32 [R, k].

    ``chunk`` (a power of two) columns per program, None: ``radix_chunk``. ``hist``: the
    workspace from ``radix_workspace``, with pass 0's histogram already built when
    ``first_pass`` is 1 (over exactly the entries in [start, end)).
    """
    R, L = logits.shape
    ch = radix_chunk(R, L) if chunk is None else chunk
    S = triton.cdiv(max(L, 1), ch)
    dev = logits.device
    out = torch.empty(R, k, dtype=torch.int32, device=dev) if out is None else out
    if R == 0:
        return out
    hist = radix_workspace(R, dev) if hist is None else hist
    state = torch.empty(R, 4, 2, dtype=torch.int32, device=dev)
    below = torch.empty(R, S, NBINS + 1, dtype=torch.int32, device=dev)
    warps = num_warps or (4 if ch <= 2048 else 8)
    for p in range(first_pass, 5):
        _radix_pass[(R, S)](
            logits,
            starts,
            ends,
            hist,
            state,
            below,
            out,
            R,
            S,
            logits.stride(0),
            out.stride(0),
            L,
            k,
            CH=ch,
            PASS=p,
            SB=min(triton.next_power_of_2(S), 256),
            num_warps=warps,
        )
    return out
