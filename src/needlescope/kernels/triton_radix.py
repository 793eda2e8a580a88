"""Exact top-k by cooperative radix select: every row split over many programs, 8 bits a pass.

(``bits=11``: three passes of 11, 11 and 10 bits over 2048 bins, one launch fewer; measured 2-10x
slower on the H200, docs/perf/indexer.md, and kept as the measured alternative.) Same contract as ``triton_topk.topk`` (ties to the lower index, row lengths, -1 padding, output:
entries above the threshold in index order, then the ties in index order). Keys are the fp32
scores mapped to order-preserving uint32 (``triton_topk._ordered_key``).

Five launches over a grid of (row, chunk) programs, each program holding ``chunk`` columns in
registers:

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

Why not a serial search per program (``triton_topk``): that is ~20 dependent block-wide counts in
one program (docs/perf/indexer-notes.md), where here each program makes four histogram passes
over a short chunk, all chunks of all rows in parallel, and the serial part is five launches.
``first_pass`` lets a producer (the fused decode path, ``triton_decode``) build pass 0's
histogram with the logits. The histograms live in a workspace cached per device
(``radix_workspace``) that the launches leave zeroed, so a call needs no memset launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from needlescope.kernels.triton_topk import _ordered_key

__all__ = ["radix_topk", "radix_chunk", "radix_workspace", "digit0_histogram", "DIGIT_BITS"]

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
def digit0_histogram(logit, valid, BITS: tl.constexpr):
    """int32 [2**BITS]: how many of the valid fp32 ``logit`` fall in each bin of their key's top BITS bits."""
    key = _ordered_key(logit)
    return tl.histogram((key >> (32 - BITS)).to(tl.int32), 1 << BITS, mask=valid)


@triton.jit
def _resolve(hist_row, prefix, krem, NB: tl.constexpr, WIDTH: tl.constexpr):
    """From a row's histogram of the next digit (WIDTH bits, NB bins): (prefix with that digit
    appended, how many of the k still to be taken have exactly that prefix)."""
    bins = tl.arange(0, NB)
    h = tl.load(hist_row + bins)
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
    NB: tl.constexpr,
    LWIDTH: tl.constexpr,
    SB: tl.constexpr,
):
    """Output pass: write this chunk's entries above the threshold key ``thr`` and its first ties
    at their final positions, from the per-chunk counts the last histogram pass stored."""
    d = (thr & ((1 << LWIDTH) - 1)).to(tl.int32)  # the threshold's last digit
    gt_before = tl.zeros([], dtype=tl.int32)
    eq_before = tl.zeros([], dtype=tl.int32)
    for c in range(0, s, SB):
        j = c + tl.arange(0, SB)
        row = below_ptr + (r.to(tl.int64) * S + j) * (NB + 1)
        at_or_above = tl.load(row + d, mask=j < s, other=0)
        above = tl.load(row + d + 1, mask=j < s, other=0)
        gt_before += tl.sum(above, 0)
        eq_before += tl.sum(at_or_above - above, 0)
    gt = (m & (key > thr)).to(tl.int32)
    eq = (m & (key == thr)).to(tl.int32)
    pos_gt = gt_before + tl.cumsum(gt, 0) - 1
    tl.store(orow + pos_gt, cols, mask=gt != 0)
    pos_eq = eq_before + tl.cumsum(eq, 0) - 1
    tl.store(orow + (K - krem) + pos_eq, cols, mask=(eq != 0) & (pos_eq < krem))


@triton.jit
def _radix_pass(
    x_ptr,  # fp32 [R, x_stride]
    starts_ptr,  # int32 [R]
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
    NB: tl.constexpr,  # bins: 2**digit bits
    SHIFT: tl.constexpr,  # this pass's digit: key >> SHIFT, WIDTH bits
    WIDTH: tl.constexpr,
    PWIDTH: tl.constexpr,  # the previous digit's width
    SB: tl.constexpr,  # how many earlier chunks the output pass reads at a time
):
    r = tl.program_id(0)
    s = tl.program_id(1)
    st = tl.load(starts_ptr + r)
    en = tl.load(ends_ptr + r)
    bins = tl.arange(0, NB)
    orow = out_ptr + r.to(tl.int64) * out_stride
    # Self-cleaning workspace: a histogram is zeroed once the last pass that reads it is over
    # (launch p clears digit p-2's; launch 1 the last digit's, read by the previous call's output).
    if (PASS >= 1) & (s == 0):
        tl.store(
            hist_ptr + ((NP - 1 if PASS == 1 else PASS - 2) * h_stride + r * NB) + bins,
            tl.zeros([NB], tl.int32),
        )
    if en - st <= K:
        if PASS == NP:  # every entry of the range, in order, then -1
            for c in range(s * CH, K, S * CH):
                j = c + tl.arange(0, CH)
                tl.store(orow + j, tl.where(j < en - st, st + j, -1), mask=j < K)
    else:
        prefix = tl.zeros([], dtype=tl.uint32)
        krem = K + tl.zeros([], dtype=tl.int32)
        if PASS >= 2:
            prefix = tl.load(state_ptr + (r * NP + PASS - 2) * 2).to(tl.uint32, bitcast=True)
            krem = tl.load(state_ptr + (r * NP + PASS - 2) * 2 + 1)
        if PASS >= 1:
            prefix, krem = _resolve(hist_ptr + (PASS - 1) * h_stride + r * NB, prefix, krem, NB, PWIDTH)
            if s == 0:
                tl.store(state_ptr + (r * NP + PASS - 1) * 2, prefix.to(tl.int32, bitcast=True))
                tl.store(state_ptr + (r * NP + PASS - 1) * 2 + 1, krem)
        cols = s * CH + tl.arange(0, CH)
        m = (cols >= st) & (cols < en)
        key = _ordered_key(tl.load(x_ptr + r.to(tl.int64) * x_stride + cols, mask=cols < L, other=0.0))
        if PASS < NP:
            sel = m
            if PASS > 0:
                sel = m & ((key >> (SHIFT + WIDTH)) == prefix)
            h = tl.histogram(((key >> SHIFT) & ((1 << WIDTH) - 1)).to(tl.int32), NB, mask=sel)
            tl.atomic_add(hist_ptr + PASS * h_stride + r * NB + bins, h, mask=h != 0, sem="relaxed")
            if PASS == NP - 1:
                above = tl.sum((m & ((key >> WIDTH) > prefix)).to(tl.int32), 0)
                ge = tl.sum(h, 0) - tl.cumsum(h, 0) + h + above
                row = below_ptr + (r.to(tl.int64) * S + s) * (NB + 1)
                tl.store(row + bins, ge)
                tl.store(row + NB, above)
        else:
            _place(orow, below_ptr, r, s, S, cols, m, key, prefix, krem, K, NB, PWIDTH, SB)


def radix_chunk(rows: int, width: int) -> int:
    """Columns per program, measured on the H200 (docs/perf/indexer.md, run 7: chunks of 512 to
    8192 at 1 x 32K, 64 x 32K, 1 x 256K and 8 x 256K): 512 up to 64K entries in all, 1024 up to
    512K, 2048 above (more entries a chunk once the rows alone fill the GPU)."""
    n = rows * width
    return 512 if n <= 65536 else 1024 if n <= 524288 else 2048


def radix_workspace(rows: int, device, bits: int = 8) -> torch.Tensor:
    """int32 [passes, rows, 2**bits] histograms, zero on entry and left zero by every call.

    Cached per (device, digit width) so that a call needs no memset launch: calls that share it
    must be ordered (one stream, as a decode loop's); run concurrent streams with their own
    ``hist`` (a fresh ``torch.zeros`` of this shape). Not cached while a CUDA graph is captured.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # "cuda" and "cuda:0" must share one workspace
        dev = torch.device("cuda", torch.cuda.current_device())
    key = (dev, bits)
    ws = _WORKSPACES.get(key)
    if ws is None or ws.shape[1] < rows:
        ws = torch.zeros(len(_digits(bits)), rows, 1 << bits, dtype=torch.int32, device=dev)
        if not (dev.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _WORKSPACES[key] = ws
    return ws[:, :rows]


def radix_topk(
    logits: torch.Tensor,
    k: int,
    starts: torch.Tensor,
    ends: torch.Tensor,
    *,
    chunk: int | None = None,
    bits: int = 8,
    num_warps: int | None = None,
    out: torch.Tensor | None = None,
    hist: torch.Tensor | None = None,
    first_pass: int = 0,
) -> torch.Tensor:
    """logits fp32 [R, L], starts/ends int32 [R] (clamped, end >= start, contiguous) -> int32 [R, k].

    ``chunk`` (a power of two) columns per program, None: ``radix_chunk``; ``bits`` the digit
    width (``DIGIT_BITS``). ``hist``: a workspace as ``radix_workspace`` returns (None: the cached
    one), with pass 0's histogram already built when ``first_pass`` is 1 (over exactly the
    entries in [start, end)).
    """
    R, L = logits.shape
    ch = radix_chunk(R, L) if chunk is None else chunk
    S = triton.cdiv(max(L, 1), ch)
    dev = logits.device
    out = torch.empty(R, k, dtype=torch.int32, device=dev) if out is None else out
    if R == 0:
        return out
    digits = _digits(bits)
    NP, NB = len(digits), 1 << bits
    hist = radix_workspace(R, dev, bits) if hist is None else hist
    state = torch.empty(R, NP, 2, dtype=torch.int32, device=dev)
    below = torch.empty(R, S, NB + 1, dtype=torch.int32, device=dev)
    warps = num_warps or (4 if ch <= 2048 else 8)
    for p in range(first_pass, NP + 1):
        shift, width = digits[min(p, NP - 1)]
        _radix_pass[(R, S)](
            logits,
            starts,
            ends,
            hist,
            state,
            below,
            out,
            S,
            hist.stride(0),
            logits.stride(0),
            out.stride(0),
            L,
            k,
            CH=ch,
            PASS=p,
            NP=NP,
            NB=NB,
            SHIFT=shift,
            WIDTH=width,
            PWIDTH=digits[max(p - 1, 0)][1],
            SB=min(triton.next_power_of_2(S), 256),
            num_warps=warps,
        )
    return out
