"""Exact top-k by group-max filtering: one program per row, the row read about twice.

Same contract as ``triton_topk.topk`` (ties to the lower index, rows with ``end - start <= k``
written start..end-1 then -1, output: entries above the threshold key in index order, then the
ties in index order; scores ordered by ``triton_topk._ordered_key``). One launch: the kernel clamps
each row's range to [0, L] itself.

Why: the one-program searches of ``triton_topk`` make ~20 dependent passes over the whole row (a
count per key bit, or four radix passes of histograms); here a program makes two passes over the row
(group maxima, then compaction) and its serial radix passes run over ~1/16 of the row (the maxima)
and over ~k entries (the candidates). Per row, with key(x) = ``_ordered_key(x)`` and
KNEG = key(-inf) = 0x007FFFFF:

A. Group maxima: the entries of [start, end) in groups of ``group`` consecutive columns (aligned to
   column 0; entries outside the range count as key 0), gmax_j = the largest key in group j, stored
   in a scratch row (``tl.debug_barrier`` before it is read back). A caller may pass ``gmax``
   instead (uint32 keys stored as int32): the maxima over any partition of the row, e.g. the logits
   kernel's arbitrary 16-entry subsets of a page, provided entries outside [start, end) entered
   them as -inf (key <= KNEG) or key 0.
B. Threshold t: two 8-bit radix passes (256-bin ``tl.histogram``) over the maxima give the top 16
   bits of the k-th largest maximum m_k; t = those bits << 16 (so t <= m_k). If t <= KNEG (also when
   there are fewer than k groups: the passes then return 0), t = 0: every entry is a candidate.
C. Compaction: one pass over [start, end) writes the columns (and keys) of the entries with key >= t
   to a scratch candidate list, in index order; n = their count (``tl.debug_barrier`` after).
D. Exact threshold among the candidates: four 8-bit radix passes give thr, the key of the k-th
   largest candidate, and krem, how many candidates equal to thr to take; with the keys in
   registers when n <= ``cand_block``, else ``triton_topk._radix_threshold`` over the candidate
   list in chunks (many ties or adversarial rows; the same kernel, no fallback launch).
E. Output (``triton_topk._write_chunk``/``_write_topk``, shared with ``_topk_kernel``): candidates
   above thr in index order, then the first krem equal to thr.

Exactness: if t > 0, then t > KNEG, and at least k maxima are >= m_k >= t. Each of them is the key
of an entry inside [start, end) (entries outside entered the maxima as keys <= KNEG < t), and
distinct groups hold distinct entries, so at least k entries of the range have key >= t: the k-th
largest entry of the range has key >= t, and so does every member of the top-k, ties at the k-th
key included. Hence the candidates (every entry with key >= t, in index order) contain the top-k
and all entries equal to its k-th key, and n >= k. If t = 0 the candidates are the whole range. The
top-k among the candidates, by (key, then lower index), is therefore the row's top-k; thr and krem
are the ones the row's own radix select finds, so the output (order included) is the one
``triton_topk.topk(..., method="bisect", bits=8)`` writes.

Scratch (``torch.empty``, no launch): int32 [R, ceil(L / group)] group maxima (not when ``gmax`` is
given), int32 [R, L] candidate columns and int32 [R, L] candidate keys. ``counts`` (optional,
int32 [R]) receives each row's candidate count n (0 for rows of at most k entries): the filter's
selectivity, for tests and measurements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from needlescope.kernels.triton_radix import _row_range, _short_row
from needlescope.kernels.triton_topk import (
    _chunk,
    _ordered_key,
    _radix_threshold,
    _select_bin,
    _write_chunk,
    _write_topk,
)

__all__ = ["filter_topk", "filter_defaults"]

KNEG = 0x007FFFFF  # _ordered_key(-inf) (the kernel spells it out: Triton reads no plain globals)


@triton.jit
def _group_maxima(row, gout, st, en, L, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """Step A: the largest key of each ``GROUP`` columns (aligned to column 0) that meet [st, en),
    entries outside counting as key 0, stored from ``gout`` on; returns how many groups."""
    GB: tl.constexpr = BLOCK // GROUP
    gi = tl.arange(0, GB)
    gs = st // GROUP
    ge = (en + GROUP - 1) // GROUP
    for g0 in range(gs, ge, GB):
        cols = (g0 + gi)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        key = _ordered_key(tl.load(row + cols, mask=cols < L, other=0.0))
        key = tl.where((cols >= st) & (cols < en), key, 0)
        tl.store(gout + (g0 - gs) + gi, tl.max(key, 1).to(tl.int32, bitcast=True), mask=g0 + gi < ge)
    return ge - gs


@triton.jit
def _load_keys(kptr, c, n, CH: tl.constexpr):
    """Keys c .. c + CH - 1 of a list of n uint32 keys stored as int32, and which exist."""
    pos = c + tl.arange(0, CH)
    return tl.load(kptr + pos, mask=pos < n, other=0).to(tl.uint32, bitcast=True), pos < n


@triton.jit
def _key_hist(key, m, prefix, pmask, SHIFT: tl.constexpr):
    """256-bin histogram of the 8 bits at SHIFT of the keys whose higher bits equal ``prefix``."""
    sel = m & ((key & pmask) == prefix)
    return tl.histogram(((key >> SHIFT) & 0xFF).to(tl.int32), 256, mask=sel)


@triton.jit
def _list_radix(kptr, n, K, NP: tl.constexpr, CH: tl.constexpr, INREG: tl.constexpr):
    """(the top 8 * NP bits of the K-th largest of the n keys at ``kptr``, followed by zeros; how many
    of the K have exactly that prefix). INREG: n <= CH, the keys are loaded once and stay in
    registers; else each pass reads them in chunks of CH. Fewer than K keys: prefix 0."""
    if INREG:
        key, m = _load_keys(kptr, 0, n, CH)
    prefix = tl.zeros([], dtype=tl.uint32)
    pmask = tl.zeros([], dtype=tl.uint32)
    krem = K + tl.zeros([], dtype=tl.int32)
    for p in tl.static_range(NP):
        SHIFT = 24 - 8 * p  # constexpr (a constexpr annotation cannot be reassigned by the unrolled loop)
        if INREG:
            hist = _key_hist(key, m, prefix, pmask, SHIFT)
        else:
            hist = tl.zeros([256], dtype=tl.int32)
            for c in range(0, n, CH):
                ck, cm = _load_keys(kptr, c, n, CH)
                hist += _key_hist(ck, cm, prefix, pmask, SHIFT)
        b, krem = _select_bin(hist, krem, 256)
        prefix = prefix | (b.to(tl.uint32) << SHIFT)
        pmask = pmask | (tl.full([], 0xFF, tl.uint32) << SHIFT)
    return prefix, krem


@triton.jit
def _compact(row, cidx, ckey, st, en, t, L, BLOCK: tl.constexpr):
    """Step C: the columns and keys of the entries of [st, en) with key >= t, in index order, to
    ``cidx`` / ``ckey``; returns their count."""
    offs = tl.arange(0, BLOCK)
    n = tl.zeros([], dtype=tl.int32)
    for c in range((st // BLOCK) * BLOCK, en, BLOCK):
        idx, m, key = _chunk(row, row, c, offs, L, st, en, False)
        hit = (m & (key >= t)).to(tl.int32)
        pos = n + tl.cumsum(hit, 0) - 1
        tl.store(cidx + pos, idx, mask=hit != 0)
        tl.store(ckey + pos, key.to(tl.int32, bitcast=True), mask=hit != 0)
        n += tl.sum(hit, 0)
    return n


@triton.jit
def _filter_kernel(
    x_ptr,  # fp32 [R, x_stride]
    starts_ptr,  # int32 [R] (HAS_START)
    ends_ptr,  # int32 [R]
    gmax_ptr,  # int32 [R, g_stride]: group maxima (keys), given (HAS_GMAX) or scratch
    cidx_ptr,  # int32 [R, L] scratch: candidate columns
    ckey_ptr,  # int32 [R, L] scratch: candidate keys
    out_ptr,  # int32 [R, out_stride]
    counts_ptr,  # int32 [R] (HAS_COUNTS): candidate counts
    x_stride,
    g_stride,
    out_stride,
    L,
    G,  # HAS_GMAX: groups per row
    K: tl.constexpr,
    GROUP: tl.constexpr,  # step A's group width
    BLOCK: tl.constexpr,  # columns a step of A and C
    GBLOCK: tl.constexpr,  # group maxima a chunk of B
    GSINGLE: tl.constexpr,  # every row's maxima fit one GBLOCK (B keeps them in registers)
    CBLOCK: tl.constexpr,  # candidates kept in registers in D
    HAS_GMAX: tl.constexpr,
    HAS_START: tl.constexpr,
    HAS_COUNTS: tl.constexpr,
):
    r = tl.program_id(0)
    st, en = _row_range(starts_ptr, ends_ptr, r, L, HAS_START)
    orow = out_ptr + r.to(tl.int64) * out_stride
    if en - st <= K:
        _short_row(orow, st, en, 0, 1, K, BLOCK)
        if HAS_COUNTS:
            tl.store(counts_ptr + r, 0)
    else:
        row = x_ptr + r.to(tl.int64) * x_stride
        grow = gmax_ptr + r.to(tl.int64) * g_stride
        if HAS_GMAX:
            ng = G
        else:
            ng = _group_maxima(row, grow, st, en, L, GROUP, BLOCK)
            tl.debug_barrier()
        t, _ = _list_radix(grow, ng, K, 2, GBLOCK, GSINGLE)
        t = tl.where(t > 0x007FFFFF, t, tl.zeros([], dtype=tl.uint32))  # t <= KNEG: every entry
        cidx = cidx_ptr + r.to(tl.int64) * L
        ckey = ckey_ptr + r.to(tl.int64) * L
        n = _compact(row, cidx, ckey, st, en, t, L, BLOCK)
        tl.debug_barrier()
        if HAS_COUNTS:
            tl.store(counts_ptr + r, n)
        if n <= CBLOCK:
            thr, krem = _list_radix(ckey, n, K, 4, CBLOCK, True)
            key, m = _load_keys(ckey, 0, n, CBLOCK)
            idx = tl.load(cidx + tl.arange(0, CBLOCK), mask=m, other=-1)
            _write_chunk(orow, idx, m, key, thr, krem, K, 0, 0)
        else:  # many candidates: the same search over the list in chunks, keys gathered from the row
            thr, krem = _radix_threshold(row, cidx, 0, n, 0, n, K, CBLOCK, 8, True)
            _write_topk(orow, row, cidx, 0, n, 0, n, thr, krem, K, CBLOCK, True)


def filter_defaults(width: int, k: int) -> tuple[int, int, int]:
    """(block, cand_block, num_warps) for rows of ``width`` entries (not measured yet): blocks of up
    to 4096 columns, candidate blocks of 2k rounded up to a power of two within 2048..8192, 16 warps
    at 4096-column blocks, else 8. Random rows with at least 2k groups of 16 give 1.1k-1.4k
    candidates (torch model of the filter: 550-600 for k = 512 at 32K-256K entries, 2.2k-2.8k for
    k = 2048 at 64K-256K); with k groups (k = 2048 at 32K) about 6k, the chunked search."""
    block = min(max(triton.next_power_of_2(max(width, 1)), 1024), 4096)
    cand = min(max(triton.next_power_of_2(2 * k), 2048), 8192)
    return block, cand, 16 if block >= 4096 else 8


def _pow2(name: str, v: int) -> None:
    if v < 1 or v & (v - 1):
        raise ValueError(f"{name} must be a power of two, got {v}")


def filter_topk(
    logits: torch.Tensor,
    k: int,
    starts: torch.Tensor | None,
    ends: torch.Tensor,
    *,
    gmax: torch.Tensor | None = None,
    group: int = 16,
    block: int | None = None,
    cand_block: int | None = None,
    num_warps: int | None = None,
    out: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits fp32 [R, L], starts (None: all 0) / ends int32 [R] (the kernel clamps them to [0, L])
    -> int32 [R, k], the exact top-k of each row (module docstring), in one launch.

    ``gmax`` (int32 [R, G], uint32 keys stored bitcast): group maxima over any partition of each row
    (entries outside [start, end) entered as -inf or key 0); None: computed over ``group`` (a power
    of two) consecutive columns. ``block``: columns a step (a power of two, at least ``group``),
    ``cand_block``: candidates held in registers (a power of two), ``num_warps``: None, the
    ``filter_defaults``. ``out`` (int32 [R, k]) is written in place, every element; ``counts``
    (int32 [R]), if given, receives each row's candidate count.
    """
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    R, L = logits.shape
    dev = logits.device
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(R, k, dtype=torch.int32, device=dev) if out is None else out
    if R == 0:
        return out
    d_block, d_cand, d_warps = filter_defaults(L, k)
    block, cand_block = block or d_block, cand_block or d_cand
    for name, v in (("group", group), ("block", block), ("cand_block", cand_block)):
        _pow2(name, v)
    if group > block:
        raise ValueError(f"group ({group}) must be at most block ({block})")
    if gmax is None:
        G = triton.cdiv(max(L, 1), group)
        gbuf = torch.empty(R, G, dtype=torch.int32, device=dev)
    else:
        if gmax.dtype != torch.int32 or gmax.dim() != 2 or gmax.shape[0] != R or gmax.shape[1] < 1:
            raise ValueError(f"gmax must be int32 [{R}, G >= 1], got {gmax.dtype} {tuple(gmax.shape)}")
        gbuf = gmax if gmax.stride(1) == 1 else gmax.contiguous()
        G = gbuf.shape[1]
    gblock = min(triton.next_power_of_2(G), block)
    cidx = torch.empty(R, L, dtype=torch.int32, device=dev)
    ckey = torch.empty(R, L, dtype=torch.int32, device=dev)
    ends = ends.to(device=dev, dtype=torch.int32).contiguous()
    has_start = starts is not None
    starts = starts.to(device=dev, dtype=torch.int32).contiguous() if has_start else ends
    _filter_kernel[(R,)](
        logits,
        starts,
        ends,
        gbuf,
        cidx,
        ckey,
        out,
        ends if counts is None else counts,
        logits.stride(0),
        gbuf.stride(0),
        out.stride(0),
        L,
        G,
        K=k,
        GROUP=group,
        BLOCK=block,
        GBLOCK=gblock,
        GSINGLE=G <= gblock,
        CBLOCK=cand_block,
        HAS_GMAX=gmax is not None,
        HAS_START=has_start,
        HAS_COUNTS=counts is not None,
        num_warps=num_warps or d_warps,
    )
    return out
