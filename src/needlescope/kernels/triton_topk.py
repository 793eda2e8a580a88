"""Exact top-k over fp32 rows in Triton: one program per row, or a row split over many programs.

``topk`` also dispatches to the cooperative radix select of ``triton_radix`` and to the group-max
filter of ``triton_filter`` (``method``; ``topk_method`` is the measured rule, which does not pick the
filter yet); what follows describes this module's threshold searches.

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

from needlescope.kernels.launch import INTERPRET, launch

__all__ = ["topk", "split_segment", "topk_method", "INTERPRET"]


@triton.jit
def _ordered_key(x):
    """fp32 -> uint32 with the same order; -0.0 and +0.0 share one key."""
    u = x.to(tl.uint32, bitcast=True)
    u = tl.where(u == 0x80000000, 0, u)
    flip = tl.where((u >> 31) != 0, 0xFFFFFFFF, 0x80000000).to(tl.uint32)
    return u ^ flip


@triton.jit
def _chunk(row, cand, c, offs, L, st, en, CAND: tl.constexpr):
    """Entries c + offs: (index, inside [st, en), ordered key). Loads are masked by the row
    width L only (uniform in 16s, so 16-byte wide); the range is applied after.

    CAND (the merge of a split row): positions c + offs index the candidate row ``cand``
    (int32, -1 = no candidate) and the returned index is the candidate's column in ``row``."""
    pos = c + offs
    if CAND:
        idx = tl.load(cand + pos, mask=pos < L, other=-1)
        ok = (idx >= 0) & (pos >= st) & (pos < en)
        key = _ordered_key(tl.load(row + idx, mask=ok, other=0.0))
        return idx, ok, key
    else:
        key = _ordered_key(tl.load(row + pos, mask=pos < L, other=0.0))
        return pos, (pos >= st) & (pos < en), key


@triton.jit
def _select_bin(hist, krem, NB: tl.constexpr):
    """(the bin holding the krem-th largest of the keys counted in ``hist``, how many of the krem
    are left to take inside that bin). Fewer than krem keys in all: bin 0."""
    bins = tl.arange(0, NB)
    ge = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # entries with digit >= bin
    b = tl.max(tl.where(ge >= krem, bins, 0), 0)
    return b, krem - tl.sum(tl.where(bins > b, hist, 0), 0)


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
            idx, m, key = _chunk(row, cand, c, offs, L, st, en, CAND)
            sel = m & ((key & pmask) == prefix)
            hist += tl.histogram(((key >> shift) & dmask).to(tl.int32), NB, mask=sel)
        b, krem = _select_bin(hist, krem, NB)
        prefix = prefix | (b.to(tl.uint32) << shift)
        pmask = pmask | (tl.full([], dmask, tl.uint32) << shift)
    return prefix, krem


@triton.jit
def _count_above(row, cand, st, en, c0, L, t, BLOCK: tl.constexpr, STRICT: tl.constexpr, CAND: tl.constexpr):
    """Entries in [st, en) whose key is >= t (> t when STRICT), one pass over the row."""
    offs = tl.arange(0, BLOCK)
    n = tl.zeros([], dtype=tl.int32)
    for c in range(c0, en, BLOCK):
        idx, m, key = _chunk(row, cand, c, offs, L, st, en, CAND)
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
        idx, m, key = _chunk(row, cand, c0, tl.arange(0, BLOCK), L, st, en, CAND)
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
def _write_chunk(orow, idx, m, key, thr, krem, K, cnt_gt, cnt_eq):
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
def _write_topk(orow, row, cand, st, en, c0, L, thr, krem, K, BLOCK: tl.constexpr, CAND: tl.constexpr):
    """The output pass: one ``_write_chunk`` per BLOCK entries of [st, en) from c0 (``_chunk``'s
    positions; CAND: over a candidate list), so above-threshold entries and then the ties land in
    index order."""
    offs = tl.arange(0, BLOCK)
    cnt_gt = tl.zeros([], dtype=tl.int32)
    cnt_eq = tl.zeros([], dtype=tl.int32)
    for c in range(c0, en, BLOCK):
        idx, m, key = _chunk(row, cand, c, offs, L, st, en, CAND)
        cnt_gt, cnt_eq = _write_chunk(orow, idx, m, key, thr, krem, K, cnt_gt, cnt_eq)


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
    offs = tl.arange(0, BLOCK)
    if en - st <= K:  # also a merge's short rows: every entry of the original range
        for c in range(0, K, BLOCK):
            j = c + offs
            tl.store(orow + j, tl.where(j < en - st, st + j, -1), mask=j < K)
    else:
        if CAND:  # search the candidate positions; _chunk masks the -1 slots
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


def topk_method(rows: int, width: int, k: int) -> str:
    """``radix`` (``triton_radix``: cooperative radix select), ``filter`` (``triton_filter``:
    group-max filter, rows split over chunks) or ``bisect`` (this module) for a [rows, width]
    top-k. Measured: one program per row wins up to 2048 entries (8K-token decode rows: 10-12 us,
    launch-bound either way; H200, run 7). At 32-64 rows with k = 512 the filter wins (H100,
    docs/perf/indexer.md): 32 / 64 x 32K 23.4 / 33.8 us against the split bisection's 36.4 / 52.7
    (run 16), 32 / 64 x 64K 39.6 / 63.8 against the radix select's 56.5 / 100.3 (run 17). Radix
    select elsewhere: the filter lost at 1 x 32K (18 against 12 us), 8 x 256K (94 against 58) and
    every k = 2048 shape (run 16), where too few groups leave the threshold unselective."""
    if width <= 4096:
        return "bisect"
    if rows >= 32 and k <= 512 and width <= 65536:
        return "filter"
    return "radix"


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


def topk(
    logits: torch.Tensor,
    k: int,
    starts: torch.Tensor | None,
    ends: torch.Tensor,
    *,
    block: int | None = None,
    bits: int | None = None,
    num_warps: int | None = None,
    segment: int | None = None,
    method: str | None = None,
    chunk: int | None = None,
    one_launch: bool | None = None,
    cand_block: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits fp32 [R, L], starts (None: all 0) / ends int32 [R] (clamped to [0, L]) -> int32 [R, k] (module docstring).

    ``segment`` splits each row: the exact top-k of every ``segment`` columns in parallel
    (``block``/``num_warps`` tune that stage, ``bits`` both stages), then a merge program per row picks the
    top-k among those candidates (same threshold search, ties to the lower index: the result
    equals the unsplit one). None: ``split_segment``'s choice; 0: never split.
    ``method``: ``radix`` (``triton_radix.radix_topk``: ``chunk`` columns a program, ``bits`` its
    digit width, 8 or 11, ``one_launch`` every pass in one launch), ``filter``
    (``triton_filter.filter_topk``: group-max filtering, ``block`` and ``cand_block`` its blocks) or
    ``bisect`` (the threshold searches here); None: ``topk_method``'s choice.
    ``out`` (int32 [R, k], optional) is written in place; every element gets written.
    """
    R, L = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(R, k, dtype=torch.int32, device=logits.device) if out is None else out
    if R == 0:
        return out
    if method is None:
        method = topk_method(R, L, k)
    if method == "radix":  # its kernels clamp the ranges themselves: no clamping launches
        from needlescope.kernels.triton_radix import radix_topk

        return radix_topk(
            logits,
            k,
            starts,
            ends,
            chunk=chunk,
            bits=bits or 8,
            num_warps=num_warps,
            out=out,
            one_launch=one_launch,
        )
    if method == "filter":  # one launch; the kernel clamps the ranges itself
        from needlescope.kernels.triton_filter import filter_topk

        return filter_topk(
            logits, k, starts, ends, block=block, cand_block=cand_block, num_warps=num_warps, out=out
        )
    if method != "bisect":
        raise ValueError(f"method must be radix, filter or bisect, got {method!r}")
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
