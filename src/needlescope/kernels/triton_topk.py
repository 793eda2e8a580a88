"""Exact top-k over fp32 rows in Triton, one program per row.

Each fp32 score maps to a uint32 key whose unsigned order is the float order (flip all bits of
negatives, the sign bit of positives; -0.0 is folded onto +0.0). A threshold search finds the
exact key t of the k-th largest entry and how many entries equal to t to take; a final pass
writes every entry above t, then the first ``k - above`` entries equal to t in index order, so
ties go to the lower index and the result is deterministic. Rows with ``end - start <= k``
write start..end-1 in order; unused slots are -1. Output order within a row: above the
threshold in index order, then the ties.

Two threshold searches (docs/perf/indexer-notes.md has the measurements):

* ``bits=0`` (default up to 32K entries) bisection on the key bits: one count per bit, stopping once exactly k
  entries lie at or above the candidate. Rows up to 32K stay in registers across the passes.
* ``bits=B`` (default B=8 above 32K) radix select: ``ceil(32 / B)`` passes of a ``2**B``-bin ``tl.histogram`` of the
  next digit over the entries that still match the prefix found so far.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["topk"]


@triton.jit
def _ordered_key(x):
    """fp32 -> uint32 with the same order; -0.0 and +0.0 share one key."""
    u = x.to(tl.uint32, bitcast=True)
    u = tl.where(u == 0x80000000, 0, u)
    flip = tl.where((u >> 31) != 0, 0xFFFFFFFF, 0x80000000).to(tl.uint32)
    return u ^ flip


@triton.jit
def _chunk(row, c, offs, L, st, en):
    """Entries c + offs: (index, inside [st, en), ordered key). Loads are masked by the row
    width L only (uniform in 16s, so 16-byte wide); the range is applied after."""
    idx = c + offs
    key = _ordered_key(tl.load(row + idx, mask=idx < L, other=0.0))
    return idx, (idx >= st) & (idx < en), key


@triton.jit
def _radix_threshold(row, st, en, c0, L, K: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr):
    """(key of the k-th largest entry, how many entries equal to it to take): one histogram pass per digit."""
    offs = tl.arange(0, BLOCK)
    NB: tl.constexpr = 1 << BITS
    bins = tl.arange(0, NB)
    prefix = tl.zeros([], dtype=tl.uint32)
    pmask = tl.zeros([], dtype=tl.uint32)
    krem = K + tl.zeros([], dtype=tl.int32)
    for p in tl.static_range((32 + BITS - 1) // BITS):
        shift = 32 - (p + 1) * BITS if 32 - (p + 1) * BITS > 0 else 0  # compile-time per pass
        dmask = (1 << (32 - p * BITS - shift)) - 1
        hist = tl.zeros([NB], dtype=tl.int32)
        for c in range(c0, en, BLOCK):
            idx, m, key = _chunk(row, c, offs, L, st, en)
            sel = m & ((key & pmask) == prefix)
            hist += tl.histogram(((key >> shift) & dmask).to(tl.int32), NB, mask=sel)
        ge = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # entries with digit >= bin
        b = tl.max(tl.where(ge >= krem, bins, 0), 0)
        krem -= tl.sum(tl.where(bins > b, hist, 0), 0)
        prefix = prefix | (b.to(tl.uint32) << shift)
        pmask = pmask | (tl.full([], dmask, tl.uint32) << shift)
    return prefix, krem


@triton.jit
def _count_above(row, st, en, c0, L, t, BLOCK: tl.constexpr, STRICT: tl.constexpr):
    """Entries in [st, en) whose key is >= t (> t when STRICT), one pass over the row."""
    offs = tl.arange(0, BLOCK)
    n = tl.zeros([], dtype=tl.int32)
    for c in range(c0, en, BLOCK):
        idx, m, key = _chunk(row, c, offs, L, st, en)
        hit = (key > t) if STRICT else (key >= t)
        n += tl.sum((m & hit).to(tl.int32), 0)
    return n


@triton.jit
def _bisect_threshold(row, st, en, c0, L, K: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr):
    """Same result as ``_radix_threshold`` by bisection on the key bits, one count per bit,
    stopping as soon as exactly K entries lie at or above the candidate. SINGLE: the row fits
    one BLOCK and stays in registers across the passes."""
    if SINGLE:
        idx, m, key = _chunk(row, c0, tl.arange(0, BLOCK), L, st, en)
    t = tl.zeros([], dtype=tl.uint32)
    bit = tl.full([], 31, tl.int32)
    while bit >= 0:
        cand = t | (tl.full([], 1, tl.uint32) << bit.to(tl.uint32))
        if SINGLE:
            cnt = tl.sum((m & (key >= cand)).to(tl.int32), 0)
        else:
            cnt = _count_above(row, st, en, c0, L, cand, BLOCK, False)
        t = tl.where(cnt >= K, cand, t)
        bit = tl.where(cnt == K, -1, bit - 1)
    if SINGLE:
        above = tl.sum((m & (key > t)).to(tl.int32), 0)
    else:
        above = _count_above(row, st, en, c0, L, t, BLOCK, True)
    return t, K - above


@triton.jit
def _topk_kernel(
    x_ptr,  # fp32 [R, L]
    starts_ptr,  # int32 [R]
    ends_ptr,  # int32 [R]
    out_ptr,  # int32 [R, K]
    x_stride,
    L,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    BITS: tl.constexpr,  # radix digit width; 0 selects bisection
    SINGLE: tl.constexpr,  # L <= BLOCK (bisection keeps the row in registers)
):
    r = tl.program_id(0)
    st = tl.load(starts_ptr + r)
    en = tl.load(ends_ptr + r)
    row = x_ptr + r.to(tl.int64) * x_stride
    orow = out_ptr + r.to(tl.int64) * K
    offs = tl.arange(0, BLOCK)
    if en - st <= K:
        for c in range(0, K, BLOCK):
            j = c + offs
            tl.store(orow + j, tl.where(j < en - st, st + j, -1), mask=j < K)
    else:
        c0 = (st // BLOCK) * BLOCK  # chunks start aligned
        if BITS == 0:
            thr, krem = _bisect_threshold(row, st, en, c0, L, K, BLOCK, SINGLE)
        else:
            thr, krem = _radix_threshold(row, st, en, c0, L, K, BLOCK, BITS)
        n_above = K - krem
        cnt_gt = tl.zeros([], dtype=tl.int32)
        cnt_eq = tl.zeros([], dtype=tl.int32)
        for c in range(c0, en, BLOCK):
            idx, m, key = _chunk(row, c, offs, L, st, en)
            gt = (m & (key > thr)).to(tl.int32)
            eq = (m & (key == thr)).to(tl.int32)
            pos_gt = cnt_gt + tl.cumsum(gt, 0) - 1
            tl.store(orow + pos_gt, idx, mask=gt != 0)
            pos_eq = cnt_eq + tl.cumsum(eq, 0) - 1
            tl.store(orow + n_above + pos_eq, idx, mask=(eq != 0) & (pos_eq < krem))
            cnt_gt += tl.sum(gt, 0)
            cnt_eq += tl.sum(eq, 0)


def topk(
    logits: torch.Tensor,
    k: int,
    starts: torch.Tensor,
    ends: torch.Tensor,
    *,
    block: int | None = None,
    bits: int | None = None,
    num_warps: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits fp32 [R, L], starts/ends int32 [R] (clamped to [0, L]) -> int32 [R, k] (module docstring).

    ``out`` (int32 [R, k], optional) is written in place; every element gets written.
    """
    R, L = logits.shape
    if bits is None:  # measured on the H200 (docs/perf/indexer-notes.md): bisection in registers
        bits = 0 if L <= 32768 else 8  # up to 32K entries, radix-8 over 8K chunks above
    single = bits == 0 and L <= 32768  # 32K fp32 in registers: 32 per thread at 32 warps
    if block is None:
        block = max(triton.next_power_of_2(L), 1024) if single else 8192
    if num_warps is None:
        num_warps = 32 if block >= 32768 else 16 if block >= 8192 else 8
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    st = starts.to(torch.int32).clamp(0, L)
    en = torch.maximum(ends.to(torch.int32).clamp(0, L), st)
    out = torch.empty(R, k, dtype=torch.int32, device=logits.device) if out is None else out
    if R == 0:
        return out
    _topk_kernel[(R,)](
        logits,
        st.contiguous(),
        en.contiguous(),
        out,
        logits.stride(0),
        L,
        K=k,
        BLOCK=block,
        BITS=bits,
        SINGLE=single and L <= block,
        num_warps=num_warps,
    )
    return out
