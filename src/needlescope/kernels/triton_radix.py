"""Exact top-k by cooperative radix select: every row split over many programs, 8 bits a pass.

The ``radix`` method of ``topk``. (``bits=11``: three passes of 11, 11 and 10 bits over 2048
bins, one launch fewer; measured 2-10x slower on the H200, docs/perf/indexer.md, and kept as the
measured alternative.) Same contract as every method (``topk``: ties to the lower index, row
lengths, -1 padding, output: entries above the threshold in index order, then the ties in index
order). Keys are the fp32 scores mapped to order-preserving uint32 (``topk_parts.ordered_key``).

Five passes over a grid of (row, chunk) programs, each program holding ``chunk`` columns in
registers; either a launch per pass (``_radix_pass``) or all of them in one launch
(``_radix_one_launch``: the programs of a row meet at a counter barrier between passes, which
needs every program resident at once, so ``radix_plan`` uses it only where they fit one per SM).
The kernels clamp each row's range themselves, so a call launches nothing else.

* passes 0-3: the 256-bin histogram of digit p (bits 31-24, 23-16, 15-8, 7-0) over the chunk's
  entries whose higher digits equal the prefix found so far, added to the row's global histogram
  with integer atomics (only the non-empty bins; ``tl.histogram`` itself lowers to one
  shared-memory atomic per entry, PTX read on Triton 3.9). Each program of pass p first resolves digit p-1
  from the row's histogram of the previous pass (the bin holding the k-th largest key, and how
  many of k are still to be found inside it); program (r, 0) writes that state for the next pass.
* pass 3 also stores, per program, how many of its entries lie above and at each candidate last
  digit, so that the output pass knows how many entries above the threshold, and how many ties,
  come before its chunk without another scan over the row.
* the output pass resolves the last digit (the exact key of the k-th largest entry and how many
  equal to it are taken) and writes its chunk's entries at their final positions.

Why not a serial search per program (``triton_bisect``): that is ~20 dependent block-wide counts in
one program (docs/perf/indexer-notes.md), where here each program makes four histogram passes
over a short chunk, all chunks of all rows in parallel, and the serial part is five launches
(or four barriers).
``first_pass`` lets a producer (the fused decode path, ``triton_decode``) build pass 0's
histogram with the logits. The histograms live in a workspace cached per device
(``radix_workspace``) that the launches leave zeroed, so a call needs no memset launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from needlescope.kernels.launch import INTERPRET, launch
from needlescope.kernels.occupancy import normal_device, sm_count
from needlescope.kernels.topk_parts import ordered_key, row_range, short_row, write_chunk

__all__ = ["radix_topk", "radix_chunk", "radix_plan", "radix_workspace", "DIGIT_BITS"]

DIGIT_BITS = (8, 11)  # 8: four passes of 256 bins; 11: three passes (11, 11, 10 bits) of 2048 bins
_WORKSPACES: dict = {}


def _digits(bits: int) -> list[tuple[int, int]]:
    """(shift, width) of each digit of a 32-bit key, most significant first."""
    if bits not in DIGIT_BITS:
        raise ValueError(f"bits must be one of {DIGIT_BITS}, got {bits}")
    out, hi = [], 32
    while hi > 0:
        out.append((max(hi - bits, 0), hi - max(hi - bits, 0)))
        hi -= bits
    return out


@triton.jit
def _resolve(hist_row, prefix, krem, P: tl.constexpr, BITS: tl.constexpr):
    """From a row's histogram of digit P: (prefix with that digit appended, how many of the k
    still to be taken have exactly that prefix). Read through L2 (``.cg``): the one-launch select
    reads counts other SMs just added."""
    NB: tl.constexpr = 1 << BITS
    WIDTH: tl.constexpr = BITS if 32 - (P + 1) * BITS > 0 else 32 - P * BITS
    bins = tl.arange(0, NB)
    h = tl.load(hist_row + bins, cache_modifier=".cg")
    ge = tl.sum(h, 0) - tl.cumsum(h, 0) + h  # entries with digit >= bin
    b = tl.max(tl.where(ge >= krem, bins, 0), 0)
    krem = krem - tl.sum(tl.where(bins > b, h, 0), 0)
    return (prefix << WIDTH) | b.to(tl.uint32), krem


@triton.jit
def _place(
    orow,
    below_ptr,
    r,
    s,
    S,
    cols,
    m,
    key,
    thr,
    krem,
    K,
    NP: tl.constexpr,
    BITS: tl.constexpr,
    SB: tl.constexpr,
):
    """Output pass: write this chunk's entries above the threshold key ``thr`` and its first ties
    at their final positions, from the per-chunk counts the last histogram pass stored."""
    NB: tl.constexpr = 1 << BITS
    LWIDTH: tl.constexpr = 32 - (NP - 1) * BITS  # the last digit's width
    d = (thr & ((1 << LWIDTH) - 1)).to(tl.int32)  # the threshold's last digit
    gt_before = tl.zeros([], dtype=tl.int32)
    eq_before = tl.zeros([], dtype=tl.int32)
    for c in range(0, s, SB):
        j = c + tl.arange(0, SB)
        row = below_ptr + (r.to(tl.int64) * S + j) * (NB + 1)
        at_or_above = tl.load(row + d, mask=j < s, other=0, cache_modifier=".cg")
        above = tl.load(row + d + 1, mask=j < s, other=0, cache_modifier=".cg")
        gt_before += tl.sum(above, 0)
        eq_before += tl.sum(at_or_above - above, 0)
    write_chunk(orow, cols, m, key, thr, krem, K, gt_before, eq_before)


@triton.jit
def _clear(hist_ptr, h_stride, r, P: tl.constexpr, NP: tl.constexpr, NB: tl.constexpr):
    """Self-cleaning workspace: a histogram is zeroed once the last pass that reads it is over
    (at pass P, digit P-2's; at pass 1 the last digit's, read by the previous call's output)."""
    if P >= 1:
        tl.store(
            hist_ptr + ((NP - 1 if P == 1 else P - 2) * h_stride + r * NB) + tl.arange(0, NB),
            tl.zeros([NB], tl.int32),
        )


@triton.jit
def _hist_pass(
    hist_ptr,
    below_ptr,
    r,
    s,
    S,
    h_stride,
    m,
    key,
    prefix,
    P: tl.constexpr,
    NP: tl.constexpr,
    BITS: tl.constexpr,
):
    """Pass P: add the histogram of digit P over the chunk's entries matching ``prefix`` (digits
    0..P-1) to the row's; the last pass also stores the chunk's counts for the output pass."""
    NB: tl.constexpr = 1 << BITS
    SHIFT: tl.constexpr = 32 - (P + 1) * BITS if 32 - (P + 1) * BITS > 0 else 0  # digit P: key >> SHIFT,
    WIDTH: tl.constexpr = 32 - P * BITS - SHIFT  # WIDTH bits (BITS but for the last digit)
    bins = tl.arange(0, NB)
    sel = m
    if P > 0:
        sel = m & ((key >> (SHIFT + WIDTH)) == prefix)
    h = tl.histogram(((key >> SHIFT) & ((1 << WIDTH) - 1)).to(tl.int32), NB, mask=sel)
    tl.atomic_add(hist_ptr + P * h_stride + r * NB + bins, h, mask=h != 0, sem="relaxed")
    if P == NP - 1:
        above = tl.sum((m & ((key >> WIDTH) > prefix)).to(tl.int32), 0)
        ge = tl.sum(h, 0) - tl.cumsum(h, 0) + h + above
        row = below_ptr + (r.to(tl.int64) * S + s) * (NB + 1)
        tl.store(row + bins, ge)
        tl.store(row + NB, above)


@triton.jit
def _chunk_keys(x_ptr, r, s, st, en, x_stride, L, CH: tl.constexpr):
    """(columns, inside [st, en), ordered keys) of chunk s of row r."""
    cols = s * CH + tl.arange(0, CH)
    key = ordered_key(tl.load(x_ptr + r.to(tl.int64) * x_stride + cols, mask=cols < L, other=0.0))
    return cols, (cols >= st) & (cols < en), key


@triton.jit
def _radix_pass(
    x_ptr,  # fp32 [R, x_stride]
    starts_ptr,  # int32 [R] (HAS_START)
    ends_ptr,  # int32 [R]
    hist_ptr,  # int32 [NP, >= R, NB] (pass stride h_stride): the workspace, zero between calls
    state_ptr,  # int32 [R, NP, 2]: (prefix, krem) after digits 0..p
    below_ptr,  # int32 [R, S, NB + 1]: last pass's per-chunk counts of keys >= (prefix, digit d); [NB]: > prefix
    out_ptr,  # int32 [R, out_stride]
    S,
    h_stride,
    x_stride,
    out_stride,
    L,
    K,
    CH: tl.constexpr,
    PASS: tl.constexpr,  # 0..NP-1: histogram of digit PASS; NP: output
    NP: tl.constexpr,
    BITS: tl.constexpr,  # digit width (the last digit may be narrower)
    SB: tl.constexpr,  # how many earlier chunks the output pass reads at a time
    HAS_START: tl.constexpr,  # False: every row starts at 0 (starts_ptr unused)
):
    """One pass of the multi-launch select: launch p runs pass p over a (row, chunk) grid."""
    r = tl.program_id(0)
    s = tl.program_id(1)
    st, en = row_range(starts_ptr, ends_ptr, r, L, HAS_START)
    NB: tl.constexpr = 1 << BITS
    orow = out_ptr + r.to(tl.int64) * out_stride
    if s == 0:
        _clear(hist_ptr, h_stride, r, PASS, NP, NB)
    if en - st <= K:
        if PASS == NP:
            short_row(orow, st, en, s, S, K, CH)
    else:
        prefix = tl.zeros([], dtype=tl.uint32)
        krem = K + tl.zeros([], dtype=tl.int32)
        if PASS >= 2:
            prefix = tl.load(state_ptr + (r * NP + PASS - 2) * 2).to(tl.uint32, bitcast=True)
            krem = tl.load(state_ptr + (r * NP + PASS - 2) * 2 + 1)
        if PASS >= 1:
            prefix, krem = _resolve(hist_ptr + (PASS - 1) * h_stride + r * NB, prefix, krem, PASS - 1, BITS)
            if s == 0:
                tl.store(state_ptr + (r * NP + PASS - 1) * 2, prefix.to(tl.int32, bitcast=True))
                tl.store(state_ptr + (r * NP + PASS - 1) * 2 + 1, krem)
        cols, m, key = _chunk_keys(x_ptr, r, s, st, en, x_stride, L, CH)
        if PASS < NP:
            _hist_pass(hist_ptr, below_ptr, r, s, S, h_stride, m, key, prefix, PASS, NP, BITS)
        else:
            _place(orow, below_ptr, r, s, S, cols, m, key, prefix, krem, K, NP, BITS, SB)


@triton.jit
def _row_barrier(bar_ptr, target):
    """Wait until ``target`` arrivals (this one included) at the row's counter. Release/acquire at
    GPU scope; the CTA barriers order the other threads' global writes and reads around them."""
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    n = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    while n < target:
        n = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _radix_one_launch(
    x_ptr,
    starts_ptr,
    ends_ptr,
    hist_ptr,
    bar_ptr,  # int32 [R]: arrival counters, zero on entry and left zero
    below_ptr,
    out_ptr,
    S,
    h_stride,
    x_stride,
    out_stride,
    L,
    K,
    CH: tl.constexpr,
    FIRST: tl.constexpr,  # the first pass run here (1: pass 0's histogram is already built)
    NP: tl.constexpr,
    BITS: tl.constexpr,
    SB: tl.constexpr,
    HAS_START: tl.constexpr,
):
    """Every pass in one launch: the programs of a row meet at a counter barrier after each
    histogram pass instead of at a kernel boundary. All R x S programs must be resident at once
    (``radix_topk`` launches it only when they fit one per SM); the keys stay in registers."""
    r = tl.program_id(0)
    s = tl.program_id(1)
    st, en = row_range(starts_ptr, ends_ptr, r, L, HAS_START)
    NB: tl.constexpr = 1 << BITS
    orow = out_ptr + r.to(tl.int64) * out_stride
    if en - st <= K:
        if s == 0:
            for P in tl.static_range(1 if FIRST < 1 else FIRST, NP + 1):
                _clear(hist_ptr, h_stride, r, P, NP, NB)
        short_row(orow, st, en, s, S, K, CH)
    else:
        cols, m, key = _chunk_keys(x_ptr, r, s, st, en, x_stride, L, CH)
        prefix = tl.zeros([], dtype=tl.uint32)
        krem = K + tl.zeros([], dtype=tl.int32)
        for P in tl.static_range(FIRST, NP + 1):
            if P > FIRST:
                _row_barrier(bar_ptr + r, S * (P - FIRST))
            if s == 0:
                _clear(hist_ptr, h_stride, r, P, NP, NB)
            if P >= 1:
                prefix, krem = _resolve(hist_ptr + (P - 1) * h_stride + r * NB, prefix, krem, P - 1, BITS)
            if P < NP:
                _hist_pass(hist_ptr, below_ptr, r, s, S, h_stride, m, key, prefix, P, NP, BITS)
        _place(orow, below_ptr, r, s, S, cols, m, key, prefix, krem, K, NP, BITS, SB)
        # Leave the counter zero: the last program to get here has seen every other one leave
        # the final barrier.
        done = tl.atomic_add(bar_ptr + r, 1, sem="acq_rel", scope="gpu")
        if done == S * (NP - FIRST + 1) - 1:
            tl.atomic_xchg(bar_ptr + r, 0, sem="relaxed", scope="gpu")


def radix_chunk(rows: int, width: int) -> int:
    """Columns per program, measured on the H200 (docs/perf/indexer.md, run 7: chunks of 512 to
    8192 at 1 x 32K, 64 x 32K, 1 x 256K and 8 x 256K): 512 up to 64K entries in all, 1024 up to
    512K, 2048 above (more entries a chunk once the rows alone fill the GPU)."""
    n = rows * width
    return 512 if n <= 65536 else 1024 if n <= 524288 else 2048


MAX_ONE_LAUNCH_CHUNK = 8192  # 32 keys a thread at 8 warps: still in registers


def radix_plan(rows: int, width: int, device) -> tuple[int, bool]:
    """(chunk, one launch?) for a [rows, width] select on ``device``: one launch (every pass, the
    programs of a row meeting at a counter barrier) wherever all programs fit one per SM with
    chunks of at most ``MAX_ONE_LAUNCH_CHUNK`` columns, the chunk doubled from ``radix_chunk``
    until they do; otherwise ``radix_chunk`` over five launches. Never one launch under the
    interpreter (it runs programs one after another, so a barrier would wait forever)."""
    dev = torch.device(device)
    ch = radix_chunk(rows, width)
    if dev.type != "cuda" or INTERPRET:
        return ch, False
    sms = sm_count(dev)
    one = ch
    while rows * triton.cdiv(max(width, 1), one) > sms and one < MAX_ONE_LAUNCH_CHUNK:
        one *= 2
    if rows * triton.cdiv(max(width, 1), one) <= sms:
        return one, True
    return ch, False


def _cached_zeros(kind: str, shape: tuple[int, ...], device, bits: int) -> torch.Tensor:
    """A zero int32 buffer of at least ``shape`` (rows on dim 1 for histograms, dim 0 for
    counters), cached per (device, kind, digit width); the kernels leave it zero. Calls that share
    it must be ordered (one stream, as a decode loop's). Not cached while a CUDA graph is captured."""
    dev = normal_device(device)  # "cuda" and "cuda:0" must share one workspace
    key = (dev, kind, bits)
    rows_dim = 1 if kind == "hist" else 0
    buf = _WORKSPACES.get(key)
    if buf is None or buf.shape[rows_dim] < shape[rows_dim]:
        buf = torch.zeros(shape, dtype=torch.int32, device=dev)
        if not (dev.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _WORKSPACES[key] = buf
    return buf.narrow(rows_dim, 0, shape[rows_dim])


def radix_workspace(rows: int, device, bits: int = 8) -> torch.Tensor:
    """int32 [passes, rows, 2**bits] histograms, zero on entry and left zero by every call but
    for the last digit's, which the next call clears before it needs it.

    Cached per (device, digit width) so that a call needs no memset launch: calls that share it
    must be ordered (one stream, as a decode loop's); run concurrent streams with their own
    ``hist`` (a fresh ``torch.zeros`` of this shape).
    """
    return _cached_zeros("hist", (len(_digits(bits)), rows, 1 << bits), device, bits)


def radix_topk(
    logits: torch.Tensor,
    k: int,
    starts: torch.Tensor | None,
    ends: torch.Tensor,
    *,
    chunk: int | None = None,
    bits: int = 8,
    num_warps: int | None = None,
    out: torch.Tensor | None = None,
    hist: torch.Tensor | None = None,
    first_pass: int = 0,
    one_launch: bool | None = None,
) -> torch.Tensor:
    """logits fp32 [R, L], starts (None: all 0) / ends int32 [R] -> int32 [R, k]. The kernels clamp
    each range to [0, L] (end at least start).

    ``chunk`` (a power of two) columns per program and ``one_launch`` (every pass in one launch,
    the programs of a row meeting at a counter barrier: all R x ceil(L / chunk) programs must be
    resident together), None: ``radix_plan``'s; ``bits`` the digit width (``DIGIT_BITS``).
    ``hist``: a workspace as ``radix_workspace`` returns (None: the cached one), with pass 0's
    histogram already built when ``first_pass`` is 1 (over exactly the entries in [start, end)).
    """
    R, L = logits.shape
    dev = logits.device
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    plan_chunk, plan_one = radix_plan(R, L, dev)
    ch = plan_chunk if chunk is None else chunk
    one_launch = plan_one and chunk is None if one_launch is None else one_launch
    S = triton.cdiv(max(L, 1), ch)
    if one_launch and S > 1 and (INTERPRET or R * S > sm_count(dev)):
        raise ValueError(
            f"one_launch needs all {R} x {S} programs resident at once: at most one per SM, and one "
            "chunk a row under TRITON_INTERPRET (programs run in turn); use larger chunks or one_launch=False"
        )
    out = torch.empty(R, k, dtype=torch.int32, device=dev) if out is None else out
    if R == 0:
        return out
    NP = len(_digits(bits))
    hist = radix_workspace(R, dev, bits) if hist is None else hist
    below = torch.empty(R, S, (1 << bits) + 1, dtype=torch.int32, device=dev)
    has_start = starts is not None
    ends = ends.to(device=dev, dtype=torch.int32).contiguous()
    starts = starts.to(device=dev, dtype=torch.int32).contiguous() if has_start else ends
    common = (S, hist.stride(0), logits.stride(0), out.stride(0), L, k)
    meta = {
        "CH": ch,
        "NP": NP,
        "BITS": bits,
        "SB": min(triton.next_power_of_2(S), 256),
        "HAS_START": has_start,
    }
    warps = num_warps or (4 if ch <= 2048 else 8)
    if one_launch:
        bar = _cached_zeros("barrier", (R,), dev, bits)
        operands = (logits, starts, ends, hist, bar, below, out, *common)
        launch(_radix_one_launch, (R, S), *operands, FIRST=first_pass, **meta, num_warps=warps)
        return out
    state = torch.empty(R, NP, 2, dtype=torch.int32, device=dev)
    operands = (logits, starts, ends, hist, state, below, out, *common)
    for p in range(first_pass, NP + 1):
        launch(_radix_pass, (R, S), *operands, PASS=p, **meta, num_warps=warps)
    return out
