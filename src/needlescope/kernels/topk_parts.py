"""Pieces the three top-k methods (``triton_bisect``, ``triton_radix``, ``triton_filter``) share.

The contract they all keep (``topk``'s docstring has it whole): each fp32 score maps to a uint32
key whose unsigned order is the float order (``ordered_key``: flip all bits of negatives, the
sign bit of positives; -0.0 is folded onto +0.0, so a NaN with the sign bit clear ranks above
+inf and one with it set below -inf). Once a method knows the exact key of the k-th largest
entry and how many entries equal to it to take, ``write_chunk`` writes every entry above it,
then the first ties in index order. Rows with ``end - start <= k`` write start..end-1 in order
(``short_row``); unused slots are -1.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "ordered_key",
    "load_chunk",
    "select_bin",
    "write_chunk",
    "row_range",
    "short_row",
    "digit0_histogram",
]


@triton.jit
def ordered_key(x):
    """fp32 -> uint32 with the same order; -0.0 and +0.0 share one key."""
    u = x.to(tl.uint32, bitcast=True)
    u = tl.where(u == 0x80000000, 0, u)
    flip = tl.where((u >> 31) != 0, 0xFFFFFFFF, 0x80000000).to(tl.uint32)
    return u ^ flip


@triton.jit
def load_chunk(row, cand, c, offs, L, st, en, CAND: tl.constexpr):
    """Entries c + offs: (index, inside [st, en), ordered key). Loads are masked by the row
    width L only (uniform in 16s, so 16-byte wide); the range is applied after.

    CAND (the merge of a split row): positions c + offs index the candidate row ``cand``
    (int32, -1 = no candidate) and the returned index is the candidate's column in ``row``."""
    pos = c + offs
    if CAND:
        idx = tl.load(cand + pos, mask=pos < L, other=-1)
        ok = (idx >= 0) & (pos >= st) & (pos < en)
        key = ordered_key(tl.load(row + idx, mask=ok, other=0.0))
        return idx, ok, key
    else:
        key = ordered_key(tl.load(row + pos, mask=pos < L, other=0.0))
        return pos, (pos >= st) & (pos < en), key


@triton.jit
def select_bin(hist, krem, NB: tl.constexpr):
    """(the bin holding the krem-th largest of the keys counted in ``hist``, how many of the krem
    are left to take inside that bin). Fewer than krem keys in all: bin 0."""
    bins = tl.arange(0, NB)
    ge = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # entries with digit >= bin
    b = tl.max(tl.where(ge >= krem, bins, 0), 0)
    return b, krem - tl.sum(tl.where(bins > b, hist, 0), 0)


@triton.jit
def write_chunk(orow, idx, m, key, thr, krem, K, cnt_gt, cnt_eq):
    """Output of one chunk (entries ``idx`` with keys ``key``, mask ``m``) given the threshold key
    ``thr`` and krem (how many entries equal to it are taken): entries above ``thr`` go to slot
    cnt_gt onwards, ties to slot K - krem + cnt_eq onwards while fewer than krem are placed, both
    in the chunk's order. cnt_gt / cnt_eq: how many of each the earlier chunks had; returns the
    counts after this chunk."""
    gt = (m & (key > thr)).to(tl.int32)
    eq = (m & (key == thr)).to(tl.int32)
    pos_gt = cnt_gt + tl.cumsum(gt, 0) - 1
    tl.store(orow + pos_gt, idx, mask=gt != 0)
    pos_eq = cnt_eq + tl.cumsum(eq, 0) - 1
    tl.store(orow + (K - krem) + pos_eq, idx, mask=(eq != 0) & (pos_eq < krem))
    return cnt_gt + tl.sum(gt, 0), cnt_eq + tl.sum(eq, 0)


@triton.jit
def row_range(starts_ptr, ends_ptr, r, L, HAS_START: tl.constexpr):
    """Row r's [start, end) clamped to [0, L] with end >= start: the callers pass raw ranges, so a
    call needs no clamping kernels (each a launch: ~1 us of a 15 us select)."""
    st = tl.zeros([], dtype=tl.int32)
    if HAS_START:
        st = tl.minimum(tl.maximum(tl.load(starts_ptr + r), 0), L)
    return st, tl.maximum(tl.minimum(tl.load(ends_ptr + r), L), st)


@triton.jit
def short_row(orow, st, en, s, S, K, CH: tl.constexpr):
    """A row with end - start <= k: program s of S's share of start..end-1 in order, then -1."""
    for c in range(s * CH, K, S * CH):
        j = c + tl.arange(0, CH)
        tl.store(orow + j, tl.where(j < en - st, st + j, -1), mask=j < K)


@triton.jit
def digit0_histogram(logit, valid, BITS: tl.constexpr):
    """int32 [2**BITS]: how many of the valid fp32 ``logit`` fall in each bin of their key's top
    BITS bits: the radix select's first histogram, which a producer (the paged logits kernel of
    the fused decode path) can build while it writes the logits."""
    key = ordered_key(logit)
    return tl.histogram((key >> (32 - BITS)).to(tl.int32), 1 << BITS, mask=valid)
