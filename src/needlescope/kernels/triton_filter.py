"""Exact top-k by group-max filtering, each row split over many programs, in three launches.

The ``filter`` method of ``topk``. Same contract as every method (``topk``: ties to the lower
index, rows with ``end - start <= k`` written start..end-1 then -1, output: entries above the
threshold key in index order, then the ties in index order; scores ordered by
``topk_parts.ordered_key``). The kernels clamp each row's
range to [0, L] themselves (no clamping launches).

Why: the searches of ``triton_bisect`` make ~20 dependent passes over the whole row (a count per key
bit, or four radix passes of histograms); here the row is read about twice (group maxima, then
compaction), both over chunks of ``CH`` columns in parallel, and the serial radix passes run over
~1/16 of the row (the maxima) and over ~k entries (the candidates). One program per row (the first
version, e8da246) was latency-bound at ~41-50 us whatever the row count on an H100: every step a
chain of dependent CTA-wide operations on one SM. Per row, with key(x) = ``ordered_key(x)``,
KNEG = key(-inf) = 0x007FFFFF and S = ceil(L / CH) chunks, chunk s = columns [s*CH, (s+1)*CH):

A. Launch 1, grid (R, S), only without ``gmax``: the entries of [start, end) in groups of ``group``
   consecutive columns (aligned to column 0, so each group lies in one chunk; entries outside the
   range count as key 0), gmax_j = the largest key in group j, stored at j in a scratch row. A
   caller may pass ``gmax`` instead (uint32 keys stored as int32): the maxima over any partition of
   the row, e.g. the logits kernel's four 16-entry groups a page, provided entries outside
   [start, end) entered them as -inf (key <= KNEG) or key 0.
B. Launch 2, grid (R, S), every program of the row alike: threshold t from two 8-bit radix passes
   (256-bin ``tl.histogram``) over all the row's maxima (those of the groups meeting the range, or
   every given one), in registers when they fit ``gmax_block``, else read in chunks: the top 16 bits
   of the k-th largest maximum m_k; t = those bits << 16 (so t <= m_k). If t <= KNEG (also when
   there are fewer than k maxima: the passes then return 0), t = 0: every entry is a candidate.
C. Launch 2, on the program's own chunk: the columns (and keys) of its entries in [start, end) with
   key >= t, in index order, to the row's candidate scratch at the chunk's own slots
   [s*CH, s*CH + c_s), and c_s to a counts scratch [R, S]. Chunk-major order is index order.
D. Launch 3, grid (R,): exact threshold among the n = sum c_s candidates: four 8-bit radix passes
   give thr, the key of the k-th largest candidate, and krem, how many candidates equal to thr to
   take. Fast path, when every c_s <= CAPL = cand_block / SB (SB = S rounded up to a power of two;
   CAPL = 1 if that is 0): the [SB, CAPL] tile of the chunks' lists, flattened chunk-major, is
   loaded once and stays in registers. Else the same passes over the chunks' lists in blocks of ``cand_block`` (many ties,
   adversarial or clustered rows; a runtime branch of the same kernel, no fallback launch).
E. Output (``topk_parts.write_chunk``, shared with the other methods), same launch: candidates above
   thr in index order, then the first krem equal to thr.

Exactness: if t > 0, then t > KNEG, and at least k maxima are >= m_k >= t. Each of them is the key
of an entry inside [start, end) (entries outside entered the maxima as keys <= KNEG < t), and
distinct groups hold distinct entries, so at least k entries of the range have key >= t: the k-th
largest entry of the range has key >= t, and so does every member of the top-k, ties at the k-th
key included. Hence the candidates (every entry with key >= t, in index order) contain the top-k
and all entries equal to its k-th key, and n >= k. If t = 0 the candidates are the whole range. The
top-k among the candidates, by (key, then lower index), is therefore the row's top-k; thr and krem
are the ones the row's own radix select finds, so the output (order included) is the one
``triton_bisect.bisect_topk(..., bits=8)`` writes.

Scratch (``torch.empty``, no launch): int32 [R, ceil(L / group)] group maxima (not when ``gmax`` is
given), int32 [R, S*CH] candidate columns and keys, int32 [R, S] chunk counts. ``counts``
(optional, int32 [R]) receives each row's candidate count n (0 for rows of at most k entries): the
filter's selectivity, for tests and measurements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from needlescope.kernels.launch import launch
from needlescope.kernels.topk_parts import (
    load_chunk,
    ordered_key,
    row_range,
    select_bin,
    short_row,
    write_chunk,
)

__all__ = ["filter_topk", "filter_defaults"]

KNEG = 0x007FFFFF  # ordered_key(-inf) (the kernel spells it out: Triton reads no plain globals)


@triton.jit
def _maxima_kernel(
    x_ptr,  # fp32 [R, x_stride]
    starts_ptr,  # int32 [R] (HAS_START)
    ends_ptr,  # int32 [R]
    gmax_ptr,  # int32 [R, g_stride] scratch: group j's maximum at j
    x_stride,
    g_stride,
    L,
    K: tl.constexpr,
    GROUP: tl.constexpr,
    CH: tl.constexpr,
    HAS_START: tl.constexpr,
):
    """Step A on chunk s: the largest key of each of its groups that meet [st, en), entries outside
    counting as key 0."""
    r = tl.program_id(0)
    s = tl.program_id(1)
    st, en = row_range(starts_ptr, ends_ptr, r, L, HAS_START)
    GB: tl.constexpr = CH // GROUP
    g = s * GB + tl.arange(0, GB)
    if (en - st > K) & (s * CH < en) & ((s + 1) * CH > st):
        cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        key = ordered_key(tl.load(x_ptr + r.to(tl.int64) * x_stride + cols, mask=cols < L, other=0.0))
        key = tl.where((cols >= st) & (cols < en), key, 0)
        ok = (g >= st // GROUP) & (g < (en + GROUP - 1) // GROUP)
        tl.store(gmax_ptr + r.to(tl.int64) * g_stride + g, tl.max(key, 1).to(tl.int32, bitcast=True), mask=ok)


@triton.jit
def _load_keys(kptr, c, n, CB: tl.constexpr):
    """Keys c .. c + CB - 1 of a list of n uint32 keys stored as int32, and which exist."""
    pos = c + tl.arange(0, CB)
    return tl.load(kptr + pos, mask=pos < n, other=0).to(tl.uint32, bitcast=True), pos < n


@triton.jit
def _key_hist(key, m, prefix, pmask, SHIFT: tl.constexpr):
    """256-bin histogram of the 8 bits at SHIFT of the keys whose higher bits equal ``prefix``."""
    sel = m & ((key & pmask) == prefix)
    return tl.histogram(((key >> SHIFT) & 0xFF).to(tl.int32), 256, mask=sel)


@triton.jit
def _seg_count(cnt_ptr, s, n, SEG: tl.constexpr):
    """Entries in list segment s: the chunk counts (SEG), or n (one plain list)."""
    if SEG:
        return tl.load(cnt_ptr + s)
    else:
        return n


@triton.jit
def _radix(key, m, kptr, cnt_ptr, NS, n, SEGW, K, NP: tl.constexpr, CB: tl.constexpr, MODE: tl.constexpr):
    """(the top 8 * NP bits of the K-th largest key, followed by zeros; how many of the K have
    exactly that prefix). MODE 0: the keys ``key`` (mask ``m``), in registers; 1: the n keys at
    ``kptr``, read in blocks of CB each pass; 2: NS lists, list s at ``kptr + s * SEGW`` holding
    ``cnt_ptr[s]`` keys. Fewer than K keys: prefix 0."""
    prefix = tl.zeros([], dtype=tl.uint32)
    pmask = tl.zeros([], dtype=tl.uint32)
    krem = K + tl.zeros([], dtype=tl.int32)
    for p in tl.static_range(NP):
        SHIFT = 24 - 8 * p  # constexpr (a constexpr annotation cannot be reassigned by the unrolled loop)
        if MODE == 0:
            hist = _key_hist(key, m, prefix, pmask, SHIFT)
        else:
            hist = tl.zeros([256], dtype=tl.int32)
            for s in range(0, NS):
                cs = _seg_count(cnt_ptr, s, n, MODE == 2)
                for c in range(0, cs, CB):
                    ck, cm = _load_keys(kptr + s * SEGW, c, cs, CB)
                    hist += _key_hist(ck, cm, prefix, pmask, SHIFT)
        b, krem = select_bin(hist, krem, 256)
        prefix = prefix | (b.to(tl.uint32) << SHIFT)
        pmask = pmask | (tl.full([], 0xFF, tl.uint32) << SHIFT)
    return prefix, krem


@triton.jit
def _compact_kernel(
    x_ptr,  # fp32 [R, x_stride]
    starts_ptr,  # int32 [R] (HAS_START)
    ends_ptr,  # int32 [R]
    gmax_ptr,  # int32 [R, g_stride]: group maxima (keys), given (HAS_GMAX) or launch 1's
    cidx_ptr,  # int32 [R, S * CH] scratch: candidate columns, chunk s's from s * CH on
    ckey_ptr,  # int32 [R, S * CH] scratch: their keys
    cnt_ptr,  # int32 [R, S] scratch: candidates per chunk
    x_stride,
    g_stride,
    L,
    G,  # HAS_GMAX: maxima per row
    S,
    K: tl.constexpr,
    GROUP: tl.constexpr,
    CH: tl.constexpr,  # columns a program
    GBLOCK: tl.constexpr,  # maxima a block of B
    GSINGLE: tl.constexpr,  # every row's maxima fit one GBLOCK (B keeps them in registers)
    HAS_GMAX: tl.constexpr,
    HAS_START: tl.constexpr,
):
    """Steps B and C for chunk s of row r."""
    r = tl.program_id(0)
    s = tl.program_id(1)
    st, en = row_range(starts_ptr, ends_ptr, r, L, HAS_START)
    if en - st > K:
        n = tl.zeros([], dtype=tl.int32)
        if (s * CH < en) & ((s + 1) * CH > st):
            grow = gmax_ptr + r.to(tl.int64) * g_stride
            if HAS_GMAX:
                ng = G
            else:
                grow += st // GROUP
                ng = (en + GROUP - 1) // GROUP - st // GROUP
            if GSINGLE:
                gk, gm = _load_keys(grow, 0, ng, GBLOCK)
                t, _ = _radix(gk, gm, grow, grow, 1, ng, 0, K, 2, GBLOCK, 0)
            else:
                t, _ = _radix(ng, ng, grow, grow, 1, ng, 0, K, 2, GBLOCK, 1)
            t = tl.where(t > 0x007FFFFF, t, tl.zeros([], dtype=tl.uint32))  # t <= KNEG: every entry
            idx, m, key = load_chunk(
                x_ptr + r.to(tl.int64) * x_stride, x_ptr, s * CH, tl.arange(0, CH), L, st, en, False
            )
            hit = (m & (key >= t)).to(tl.int32)
            pos = r.to(tl.int64) * S * CH + s * CH + tl.cumsum(hit, 0) - 1
            tl.store(cidx_ptr + pos, idx, mask=hit != 0)
            tl.store(ckey_ptr + pos, key.to(tl.int32, bitcast=True), mask=hit != 0)
            n = tl.sum(hit, 0)
        tl.store(cnt_ptr + r * S + s, n)


@triton.jit
def _write_lists(orow, cidx, ckey, cnt_ptr, S, thr, krem, K, CH: tl.constexpr, CB: tl.constexpr):
    """Step E over the chunks' candidate lists in blocks of CB (the slow path)."""
    cnt_gt = tl.zeros([], dtype=tl.int32)
    cnt_eq = tl.zeros([], dtype=tl.int32)
    for s in range(0, S):
        cs = tl.load(cnt_ptr + s)
        for c in range(0, cs, CB):
            key, m = _load_keys(ckey + s * CH, c, cs, CB)
            idx = tl.load(cidx + s * CH + c + tl.arange(0, CB), mask=m, other=-1)
            cnt_gt, cnt_eq = write_chunk(orow, idx, m, key, thr, krem, K, cnt_gt, cnt_eq)


@triton.jit
def _select_kernel(
    starts_ptr,  # int32 [R] (HAS_START)
    ends_ptr,  # int32 [R]
    cidx_ptr,  # int32 [R, S * CH]: launch 2's candidate columns
    ckey_ptr,  # int32 [R, S * CH]: their keys
    cnt_ptr,  # int32 [R, S]: candidates per chunk
    out_ptr,  # int32 [R, out_stride]
    counts_ptr,  # int32 [R] (HAS_COUNTS): candidate counts
    out_stride,
    L,
    S,
    K: tl.constexpr,
    CH: tl.constexpr,
    SB: tl.constexpr,  # S rounded up to a power of two
    CAPL: tl.constexpr,  # candidates a chunk in the register tile of SB * CAPL
    CBLOCK: tl.constexpr,  # candidates a block of the slow path
    HAS_START: tl.constexpr,
    HAS_COUNTS: tl.constexpr,
):
    """Steps D and E for row r."""
    r = tl.program_id(0)
    st, en = row_range(starts_ptr, ends_ptr, r, L, HAS_START)
    orow = out_ptr + r.to(tl.int64) * out_stride
    if en - st <= K:
        short_row(orow, st, en, 0, 1, K, CBLOCK)
        if HAS_COUNTS:
            tl.store(counts_ptr + r, 0)
    else:
        crow = cnt_ptr + r * S
        cs = tl.load(crow + tl.arange(0, SB), mask=tl.arange(0, SB) < S, other=0)
        if HAS_COUNTS:
            tl.store(counts_ptr + r, tl.sum(cs, 0))
        cidx = cidx_ptr + r.to(tl.int64) * S * CH
        ckey = ckey_ptr + r.to(tl.int64) * S * CH
        if tl.max(cs, 0) <= CAPL:  # chunk s's list at s * CAPL .. of the tile
            p = tl.arange(0, SB * CAPL)
            seg = p // CAPL
            pos = seg * CH + p % CAPL
            m = p % CAPL < tl.load(crow + seg, mask=seg < S, other=0)
            key = tl.load(ckey + pos, mask=m, other=0).to(tl.uint32, bitcast=True)
            thr, krem = _radix(key, m, ckey, crow, S, 0, CH, K, 4, CBLOCK, 0)
            write_chunk(orow, tl.load(cidx + pos, mask=m, other=-1), m, key, thr, krem, K, 0, 0)
        else:
            thr, krem = _radix(cs, cs, ckey, crow, S, 0, CH, K, 4, CBLOCK, 2)
            _write_lists(orow, cidx, ckey, crow, S, thr, krem, K, CH, CBLOCK)


def filter_defaults(width: int, k: int) -> tuple[int, int, int, int]:
    """(block, cand_block, gmax_block, num_warps) for rows of ``width`` entries: chunks of up to
    4096 columns, candidate blocks of 2k rounded up to a power of two within 2048..8192, up to 8192
    maxima in registers, 8 warps. Measured on an H100 (run 16, k = 512): at 32 x 32K these took
    23.4 us against 26.9 at 16 warps, 28.5 at 4, 28.4 with chunks of 2048 and 38.3 with chunks of
    1024 (64 x 32K: 33.8 against 39.3-62.6). Random rows with at least 2k groups of 16
    give 1.1k-1.4k candidates (torch model of the filter: 550-600 for k = 512 at 32K-256K entries,
    2.2k-2.8k for k = 2048 at 64K-256K), ~k / 8 a 4096-column chunk at 32K; with k groups (k = 2048
    at 32K) about 6k, the slow path."""
    block = min(max(triton.next_power_of_2(max(width, 1)), 1024), 4096)
    cand = min(max(triton.next_power_of_2(2 * k), 2048), 8192)
    return block, cand, 8192, 8


def _pow2(name: str, v: int) -> None:
    if v < 1 or v & (v - 1):
        raise ValueError(f"{name} must be a power of two, got {v}")


def _maxima_buffer(gmax: torch.Tensor | None, R: int, L: int, group: int, dev) -> torch.Tensor:
    """The caller's group maxima, checked (int32 [R, G >= 1], rows contiguous), or scratch for
    ``cdiv(L, group)`` of them a row."""
    if gmax is None:
        return torch.empty(R, triton.cdiv(max(L, 1), group), dtype=torch.int32, device=dev)
    if gmax.dtype != torch.int32 or gmax.dim() != 2 or gmax.shape[0] != R or gmax.shape[1] < 1:
        raise ValueError(f"gmax must be int32 [{R}, G >= 1], got {gmax.dtype} {tuple(gmax.shape)}")
    return gmax if gmax.stride(1) == 1 else gmax.contiguous()


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
    gmax_block: int | None = None,
    num_warps: int | None = None,
    out: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits fp32 [R, L], starts (None: all 0) / ends int32 [R] (the kernels clamp them to [0, L])
    -> int32 [R, k], the exact top-k of each row (module docstring), in three launches (two with
    ``gmax``).

    ``gmax`` (int32 [R, G], uint32 keys stored bitcast): group maxima over any partition of each row
    (entries outside [start, end) entered as -inf or key 0); None: computed over ``group`` (a power
    of two) consecutive columns. ``block``: CH, columns a program of launches 1-2 (a power of two,
    at least ``group``); ``cand_block``: the candidates held in registers in launch 3 (a power of
    two); ``gmax_block``: maxima held in registers in step B (a power of two; more are read in
    blocks); ``num_warps`` (every launch). None: the ``filter_defaults``. ``out`` (int32 [R, k]) is
    written in place, every element; ``counts`` (int32 [R]), if given, receives each row's
    candidate count.
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
    d_block, d_cand, d_gblock, d_warps = filter_defaults(L, k)
    block, cand_block, gmax_block = block or d_block, cand_block or d_cand, gmax_block or d_gblock
    for name, v in (
        ("group", group),
        ("block", block),
        ("cand_block", cand_block),
        ("gmax_block", gmax_block),
    ):
        _pow2(name, v)
    if group > block:
        raise ValueError(f"group ({group}) must be at most block ({block})")
    gbuf = _maxima_buffer(gmax, R, L, group, dev)
    G = gbuf.shape[1]
    gblock = min(triton.next_power_of_2(G), gmax_block)
    S = triton.cdiv(max(L, 1), block)
    SB = triton.next_power_of_2(S)
    cidx = torch.empty(R, S * block, dtype=torch.int32, device=dev)
    ckey = torch.empty(R, S * block, dtype=torch.int32, device=dev)
    cnt = torch.empty(R, S, dtype=torch.int32, device=dev)
    ends = ends.to(device=dev, dtype=torch.int32).contiguous()
    has_start = starts is not None
    starts = starts.to(device=dev, dtype=torch.int32).contiguous() if has_start else ends
    warps = num_warps or d_warps
    if gmax is None:
        launch(
            _maxima_kernel, (R, S), logits, starts, ends, gbuf, logits.stride(0), gbuf.stride(0), L,
            K=k, GROUP=group, CH=block, HAS_START=has_start, num_warps=warps,
        )  # fmt: skip
    launch(
        _compact_kernel, (R, S),
        logits, starts, ends, gbuf, cidx, ckey, cnt, logits.stride(0), gbuf.stride(0), L, G, S,
        K=k, GROUP=group, CH=block, GBLOCK=gblock, GSINGLE=G <= gblock, HAS_GMAX=gmax is not None,
        HAS_START=has_start, num_warps=warps,
    )  # fmt: skip
    launch(
        _select_kernel, (R,),
        starts, ends, cidx, ckey, cnt, out, ends if counts is None else counts, out.stride(0), L, S,
        K=k, CH=block, SB=SB, CAPL=max(cand_block // SB, 1), CBLOCK=cand_block, HAS_START=has_start,
        HAS_COUNTS=counts is not None, num_warps=warps,
    )  # fmt: skip
    return out
