"""Exact top-k by a threshold search in one program per row, or a row split over many programs.

The ``bisect`` method of ``topk`` (kept for rows of up to 4096 entries, where one program per
row wins; ``topk.topk_method``). Keys and output as in ``topk_parts``: a threshold search finds
the exact key t of the k-th largest entry and how many entries equal to it to take; a final
pass writes every entry above t, then the first ``k - above`` entries equal to t in index
order, so ties go to the lower index and the result is deterministic. Output order within a
row: above the threshold in index order, then the ties.

Two threshold searches (docs/perf/indexer-notes.md has the measurements):

* ``bits=0`` (default up to 32K entries) bisection on the key bits: one count per bit, stopping once exactly k
  entries lie at or above the candidate. Rows up to 32K stay in registers across the passes.
* ``bits=B`` (default B=8 above 32K) radix select: ``ceil(32 / B)`` passes of a ``2**B``-bin ``tl.histogram`` of the
  next digit over the entries that still match the prefix found so far.

One program per row is bound by one SM's serial passes over the row, so ``segment=S`` splits it:
program (row, s) writes the exact top-k of columns [s*S, (s+1)*S) (the same kernel on a clipped
range; short segments write all their entries, -1 padded), then one merge program per row runs
the same search over those candidates (``CAND``: positions index the candidate list, -1 slots
masked, keys gathered from the row). Exact under the same order (higher score, then lower
index): every member of the row's top-k is in its segment's top-k. The output order is the
unsplit one too: candidates keep index order within a segment and segments are in order.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from needlescope.kernels.launch import launch
from needlescope.kernels.topk_parts import load_chunk, select_bin, short_row, write_chunk

__all__ = ["bisect_topk", "split_segment"]


@triton.jit
def _radix_threshold(
    row, cand, st, en, c0, L, K: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr, CAND: tl.constexpr
):
    """(key of the k-th largest entry, how many entries equal to it to take): one histogram pass per digit."""
    offs = tl.arange(0, BLOCK)
    NB: tl.constexpr = 1 << BITS
    prefix = tl.zeros([], dtype=tl.uint32)
    pmask = tl.zeros([], dtype=tl.uint32)
    krem = K + tl.zeros([], dtype=tl.int32)
    for p in tl.static_range((32 + BITS - 1) // BITS):
        shift = 32 - (p + 1) * BITS if 32 - (p + 1) * BITS > 0 else 0  # compile-time per pass
        dmask = (1 << (32 - p * BITS - shift)) - 1
        hist = tl.zeros([NB], dtype=tl.int32)
        for c in range(c0, en, BLOCK):
            idx, m, key = load_chunk(row, cand, c, offs, L, st, en, CAND)
            sel = m & ((key & pmask) == prefix)
            hist += tl.histogram(((key >> shift) & dmask).to(tl.int32), NB, mask=sel)
        b, krem = select_bin(hist, krem, NB)
        prefix = prefix | (b.to(tl.uint32) << shift)
        pmask = pmask | (tl.full([], dmask, tl.uint32) << shift)
    return prefix, krem


@triton.jit
def _count_above(row, cand, st, en, c0, L, t, BLOCK: tl.constexpr, STRICT: tl.constexpr, CAND: tl.constexpr):
    """Entries in [st, en) whose key is >= t (> t when STRICT), one pass over the row."""
    offs = tl.arange(0, BLOCK)
    n = tl.zeros([], dtype=tl.int32)
    for c in range(c0, en, BLOCK):
        idx, m, key = load_chunk(row, cand, c, offs, L, st, en, CAND)
        hit = (key > t) if STRICT else (key >= t)
        n += tl.sum((m & hit).to(tl.int32), 0)
    return n


@triton.jit
def _bisect_threshold(
    row, cand, st, en, c0, L, K: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr, CAND: tl.constexpr
):
    """Same result as ``_radix_threshold`` by bisection on the key bits, one count per bit,
    stopping as soon as exactly K entries lie at or above the candidate. SINGLE: the row fits
    one BLOCK and stays in registers across the passes."""
    if SINGLE:
        idx, m, key = load_chunk(row, cand, c0, tl.arange(0, BLOCK), L, st, en, CAND)
    t = tl.zeros([], dtype=tl.uint32)
    bit = tl.full([], 31, tl.int32)
    while bit >= 0:
        t_try = t | (tl.full([], 1, tl.uint32) << bit.to(tl.uint32))
        if SINGLE:
            cnt = tl.sum((m & (key >= t_try)).to(tl.int32), 0)
        else:
            cnt = _count_above(row, cand, st, en, c0, L, t_try, BLOCK, False, CAND)
        t = tl.where(cnt >= K, t_try, t)
        bit = tl.where(cnt == K, -1, bit - 1)
    if SINGLE:
        above = tl.sum((m & (key > t)).to(tl.int32), 0)
    else:
        above = _count_above(row, cand, st, en, c0, L, t, BLOCK, True, CAND)
    return t, K - above


@triton.jit
def _write_topk(orow, row, cand, st, en, c0, L, thr, krem, K, BLOCK: tl.constexpr, CAND: tl.constexpr):
    """The output pass: one ``write_chunk`` per BLOCK entries of [st, en) from c0 (``load_chunk``'s
    positions; CAND: over a candidate list), so above-threshold entries and then the ties land in
    index order."""
    offs = tl.arange(0, BLOCK)
    cnt_gt = tl.zeros([], dtype=tl.int32)
    cnt_eq = tl.zeros([], dtype=tl.int32)
    for c in range(c0, en, BLOCK):
        idx, m, key = load_chunk(row, cand, c, offs, L, st, en, CAND)
        cnt_gt, cnt_eq = write_chunk(orow, idx, m, key, thr, krem, K, cnt_gt, cnt_eq)


@triton.jit
def _topk_kernel(
    x_ptr,  # fp32 [R, x_stride]
    cand_ptr,  # CAND: int32 [R, L] candidate columns (-1: none); unused otherwise
    starts_ptr,  # int32 [R]
    ends_ptr,  # int32 [R]
    out_ptr,  # int32 [R, out_stride]: K slots per (row, segment)
    x_stride,
    out_stride,
    L,  # row width (CAND: candidate-row width)
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    BITS: tl.constexpr,  # radix digit width; 0 selects bisection
    SINGLE: tl.constexpr,  # L <= BLOCK (bisection keeps the row in registers)
    SEG: tl.constexpr,  # split: program (r, s) takes the top-k of columns [s*SEG, (s+1)*SEG); 0: whole rows
    CAND: tl.constexpr,  # merge: the top-k of row r among its candidate columns
):
    r = tl.program_id(0)
    s = tl.program_id(1)
    st = tl.load(starts_ptr + r)
    en = tl.load(ends_ptr + r)
    if SEG > 0:
        st = tl.maximum(st, s * SEG)
        en = tl.maximum(tl.minimum(en, (s + 1) * SEG), st)
    row = x_ptr + r.to(tl.int64) * x_stride
    cand = cand_ptr + r.to(tl.int64) * L
    orow = out_ptr + r.to(tl.int64) * out_stride + s * K
    if en - st <= K:  # also a merge's short rows: every entry of the original range
        short_row(orow, st, en, 0, 1, K, BLOCK)
    else:
        if CAND:  # search the candidate positions; load_chunk masks the -1 slots
            st = 0
            en = L
        c0 = (st // BLOCK) * BLOCK  # chunks start aligned
        if BITS == 0:
            thr, krem = _bisect_threshold(row, cand, st, en, c0, L, K, BLOCK, SINGLE, CAND)
        else:
            thr, krem = _radix_threshold(row, cand, st, en, c0, L, K, BLOCK, BITS, CAND)
        _write_topk(orow, row, cand, st, en, c0, L, thr, krem, K, BLOCK, CAND)


def split_segment(rows: int, width: int, k: int) -> int:
    """The segment ``topk`` splits rows into by default (0: no split).

    Measured on the H200 (docs/perf/indexer-notes.md, rows of 32K and 256K, k = 512 and 2048,
    1 to 64 rows): the first stage grows with the segment and the merge with the candidate count
    (width / segment * k), and the best segment sat at about sqrt(width * k), rounded up to a power
    of two, within 2048..16384. Rows split when they hold at least two such segments and there
    are fewer rows than an H200's 132 SMs (more rows already fill the GPU; not measured there).
    """
    seg = min(max(triton.next_power_of_2(math.isqrt(width * k)), 2048), 16384)
    return seg if rows < 132 and width >= 2 * seg else 0


def _search(
    width: int, bits: int | None, block: int | None, num_warps: int | None
) -> tuple[int, int, int, bool]:
    """(bits, block, warps, single) for rows of ``width`` entries; None picks the measured default."""
    if bits is None:  # measured on the H200 (docs/perf/indexer-notes.md): bisection in registers
        bits = 0 if width <= 32768 else 8  # up to 32K entries, radix-8 over 8K chunks above
    single = bits == 0 and width <= 32768  # 32K fp32 in registers: 32 per thread at 32 warps
    if block is None:
        block = max(triton.next_power_of_2(width), 1024) if single else 8192
    if num_warps is None:
        num_warps = 32 if block >= 32768 else 16 if block >= 8192 else 8
    return bits, block, num_warps, single and width <= block


def _launch(logits, cand, st, en, out, width: int, k: int, grid, seg: int, tune: tuple) -> None:
    bits, block, warps, single = tune
    launch(
        _topk_kernel,
        grid,
        logits,
        cand,
        st,
        en,
        out,
        logits.stride(0),
        out.stride(0),
        width,
        K=k,
        BLOCK=block,
        BITS=bits,
        SINGLE=single,
        SEG=seg,
        CAND=cand is not out,
        num_warps=warps,
    )


def bisect_topk(
    logits: torch.Tensor,
    k: int,
    starts: torch.Tensor | None,
    ends: torch.Tensor,
    *,
    bits: int | None = None,
    block: int | None = None,
    num_warps: int | None = None,
    segment: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits fp32 [R, L], starts (None: all 0) / ends int32 [R] (clamped to [0, L]) -> int32 [R, k] (module docstring).

    ``bits``: 0 bisection, 4/8/... the radix digit width (None: ``_search``'s measured default);
    ``block`` entries a step and ``num_warps`` of the first stage. ``segment`` splits each row:
    the exact top-k of every ``segment`` columns in parallel, then a merge program per row picks
    the top-k among those candidates (same threshold search, ties to the lower index: the result
    equals the unsplit one). None: ``split_segment``'s choice; 0: never split.
    ``out`` (int32 [R, k], optional) is written in place; every element gets written.
    """
    R, L = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(R, k, dtype=torch.int32, device=logits.device) if out is None else out
    if R == 0:
        return out
    ends = ends.to(device=logits.device, dtype=torch.int32)
    st = torch.zeros_like(ends) if starts is None else starts.to(torch.int32).clamp(0, L).contiguous()
    en = torch.maximum(ends.clamp(0, L), st).contiguous()
    if segment is None:
        segment = split_segment(R, L, k)
    if not segment or segment >= L:
        _launch(logits, out, st, en, out, L, k, (R, 1), 0, _search(L, bits, block, num_warps))
        return out
    S = triton.cdiv(L, segment)
    cand = torch.empty(R, S * k, dtype=torch.int32, device=logits.device)
    _launch(logits, cand, st, en, cand, L, k, (R, S), segment, _search(segment, bits, block, num_warps))
    _launch(logits, cand, st, en, out, S * k, k, (R, 1), 0, _search(S * k, bits, None, None))
    return out
