"""Triton kernels for the lightning-indexer logits (prefill: contiguous keys; decode: paged keys).

``I[t, s] = scale_k[s] * sum_h w[t, h] * ReLU(q[t, h] . k[s])``, fp32 accumulation, -inf outside
each query's range. Imported lazily by ``needlescope.kernels`` (needs the ``[gpu]`` extra).

Matrix products: fp8 x fp8 runs natively on the tensor cores (``NATIVE_FP8``); otherwise both
operands go to bf16, which is exact for e4m3 codes. Under ``TRITON_INTERPRET=1`` the operands go
to fp32 with ``input_precision="ieee"``: Triton 3.6's interpreter keeps bf16 as raw uint16 bit
patterns and its ``tl.dot`` multiplies those integers (``create_dot`` in
triton/runtime/interpreter.py converts only 8-bit floats), so a bf16 dot is garbage there.
Products of bf16-representable values are exact in fp32, so the math is the same.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from needlescope.kernels.launch import INTERPRET, launch
from needlescope.kernels.layout import ContiguousKeys, PagedKeys
from needlescope.kernels.occupancy import cached_blocks_per_sm, sm_count
from needlescope.kernels.topk_parts import digit0_histogram, ordered_key

__all__ = ["prefill_logits", "paged_logits", "INTERPRET"]

_ASM_LOADS = tl.constexpr(not INTERPRET)  # the interpreter runs no PTX


@triton.jit
def _scores(q, k, NATIVE_FP8: tl.constexpr, IEEE: tl.constexpr):
    """q [M, D], k [N, D] -> q @ k^T [M, N] fp32."""
    if NATIVE_FP8:
        return tl.dot(q, tl.trans(k))
    elif IEEE:
        return tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        return tl.dot(q.to(tl.bfloat16), tl.trans(k.to(tl.bfloat16)))


@triton.jit
def _page_rows(
    bt_row,
    page,
    n,
    offs_e,
    PAGES_PER_MMA: tl.constexpr,
    FAULT_PAGE_TABLE: tl.constexpr,
    FAULT_KEY_SLOT: tl.constexpr,
):
    """(physical page, slot) of each of the 64 * PAGES_PER_MMA logical entries from ``page`` on."""
    ent = page * 64 + offs_e
    if FAULT_KEY_SLOT or FAULT_PAGE_TABLE:  # debug variants: gather entry by entry
        src = ent
        if FAULT_KEY_SLOT:
            src = tl.maximum(ent - 1, 0)
        if FAULT_PAGE_TABLE:
            phys = (src // 64).to(tl.int64)
        else:
            phys = tl.load(bt_row + src // 64, mask=ent < n, other=0).to(tl.int64)
        return phys, src % 64
    elif PAGES_PER_MMA == 1:  # one page: its 64 entries are contiguous, so the loads are wide
        return tl.load(bt_row + page, mask=page * 64 < n, other=0).to(tl.int64), offs_e
    else:  # two pages: two block-table loads; each entry's 128 B (fp8) stay one wide load
        p0 = tl.load(bt_row + page, mask=page * 64 < n, other=0).to(tl.int64)
        p1 = tl.load(bt_row + page + 1, mask=(page + 1) * 64 < n, other=0).to(tl.int64)
        return tl.where(offs_e < 64, p0, p1), offs_e % 64


@triton.jit
def _page_scales(scales_ptr, phys, slot, valid, D: tl.constexpr, FP8: tl.constexpr):
    """fp32 key scales at (physical page, slot): an fp8 page holds 64 rows of D codes then 64
    fp32 scales; bf16 keys have scale 1."""
    if FP8:
        return tl.load(scales_ptr + phys * (16 * (D + 4)) + 16 * D + slot, mask=valid, other=0.0)
    return tl.where(valid, 1.0, 1.0)


@triton.jit
def _paged_kernel(
    q_ptr,  # [B, H, D] codes
    w_ptr,  # [B, H] fp32
    vals_ptr,  # fp8 page bytes viewed as float8 (FP8) or bf16 [P, 64, D]
    scales_ptr,  # same fp8 pages viewed as fp32 (unused for bf16)
    bt_ptr,  # int32 [B, max_pages]
    lens_ptr,  # int32 [B]
    out_ptr,  # fp32 [B, width]
    hist_ptr,  # HIST_BITS > 0: int32 [B, 2**HIST_BITS] pass-0 histograms of triton_radix
    H,
    bt_stride,
    out_stride,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PAGES_PER_PROG: tl.constexpr,
    PAGES_PER_MMA: tl.constexpr,  # 1 or 2: entries of one or two pages as the MMA's rows
    FP8: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
    IEEE: tl.constexpr,
    FAULT_PAGE_TABLE: tl.constexpr,
    FAULT_KEY_SLOT: tl.constexpr,
    PREFETCH: tl.constexpr,  # block-table entries up front, scales a page ahead (one page per MMA)
    HIST_BITS: tl.constexpr,  # > 0: also build triton_radix's first histogram of each row
):
    b = tl.program_id(0)
    chunk = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    offs_e = tl.arange(0, 64 * PAGES_PER_MMA)  # SGLang's page: layout.PAGE_ENTRIES entries
    hmask = offs_h < H
    q = tl.load(q_ptr + b * H * D + offs_h[:, None] * D + offs_d[None, :], mask=hmask[:, None], other=0.0)
    w = tl.load(w_ptr + b * H + offs_h, mask=hmask, other=0.0)
    n = tl.load(lens_ptr + b)
    bt_row = bt_ptr + b * bt_stride
    page0 = chunk * PAGES_PER_PROG
    if PREFETCH:  # the program's block-table entries in one load; page i+1's scales during page i
        pages = tl.arange(0, PAGES_PER_PROG)
        bts = tl.load(bt_row + page0 + pages, mask=(page0 + pages) * 64 < n, other=0).to(tl.int64)
        sc_a = _page_scales(
            scales_ptr, tl.sum(tl.where(pages == 0, bts, 0), 0), offs_e, page0 * 64 + offs_e < n, D, FP8
        )
    for i in range(PAGES_PER_PROG // PAGES_PER_MMA):
        page = page0 + i * PAGES_PER_MMA
        ent = page * 64 + offs_e  # logical entries of this page (these pages)
        valid = ent < n
        # No branch on the page: masked loads move no bytes, and a branch-free loop pipelines.
        if PREFETCH:
            phys, slot, sc = tl.sum(tl.where(pages == i, bts, 0), 0), offs_e, sc_a
            nxt = tl.sum(tl.where(pages == i + 1, bts, 0), 0)
            sc_a = _page_scales(scales_ptr, nxt, offs_e, (page + 1) * 64 + offs_e < n, D, FP8)
        else:
            phys, slot = _page_rows(bt_row, page, n, offs_e, PAGES_PER_MMA, FAULT_PAGE_TABLE, FAULT_KEY_SLOT)
            sc = _page_scales(scales_ptr, phys, slot, valid, D, FP8)
        logit = _page_logit(q, w, vals_ptr, phys, slot, sc, valid, offs_d, D, FP8, NATIVE_FP8, IEEE)
        tl.store(out_ptr + b.to(tl.int64) * out_stride + ent, logit, mask=ent < out_stride)
    if HIST_BITS > 0:  # the program's logits again (this SM just wrote them), one histogram
        tl.debug_barrier()
        _row_histogram(
            out_ptr + b.to(tl.int64) * out_stride,
            hist_ptr,
            b,
            page0 * 64,
            (page0 + PAGES_PER_PROG) * 64,
            n,
            PAGES_PER_PROG * 64,
            HIST_BITS,
        )


@triton.jit
def _paged_persistent_kernel(
    q_ptr,
    w_ptr,
    vals_ptr,
    scales_ptr,
    kdesc,  # TMA: a tensor descriptor of the key codes [P, 64, D] (vals_ptr otherwise, unused)
    bt_ptr,
    lens_ptr,
    out_ptr,
    hist_ptr,
    gmax_ptr,  # GMAX: int32 [B, gmax_stride] group maxima (unused otherwise)
    H,
    bt_stride,
    out_stride,
    pages_per_row,
    total,  # B * pages_per_row: the pages of all rows, row after row
    progs,  # programs: program p scores pages [p * total // progs, (p + 1) * total // progs)
    gmax_stride,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    FP8: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
    IEEE: tl.constexpr,
    HIST_BITS: tl.constexpr,
    HIST_BLOCK: tl.constexpr,
    TMA: tl.constexpr,  # key codes by tensor-memory-accelerator loads
    GMAX: tl.constexpr,  # also write each page's 4 group maxima (``GROUPS_PER_PAGE``)
):
    """A few programs per SM, each scoring an equal run of consecutive pages (crossing into the
    next row at most a few times): no program tail, one prologue (queries, weights, pipeline
    fill) per row run instead of per 8 pages. Runs differ by at most a page, so every SM gets
    the same share (whole runs of ceil(total / progs) pages left ~3% of the SMs a program short)."""
    pid = tl.program_id(0).to(tl.int64)
    lo = (pid * total // progs).to(tl.int32)  # runs differ by at most one page
    hi = ((pid + 1) * total // progs).to(tl.int32)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    offs_e = tl.arange(0, 64)
    hmask = offs_h < H
    for b in range(lo // pages_per_row, (hi - 1) // pages_per_row + 1):
        first = tl.maximum(lo - b * pages_per_row, 0)
        last = tl.minimum(hi - b * pages_per_row, pages_per_row)
        q = tl.load(q_ptr + b * H * D + offs_h[:, None] * D + offs_d[None, :], mask=hmask[:, None], other=0.0)
        w = tl.load(w_ptr + b * H + offs_h, mask=hmask, other=0.0)
        n = tl.load(lens_ptr + b)
        bt_row = bt_ptr + b * bt_stride
        orow = out_ptr + (tl.zeros([], tl.int64) + b) * out_stride  # b: a plain int under the interpreter
        grow = gmax_ptr + (tl.zeros([], tl.int64) + b) * gmax_stride
        sc = _page_scales(scales_ptr, _bt_entry(bt_row, first), offs_e, first * 64 + offs_e < n, D, FP8)
        for page in range(first, last):
            ent = page * 64 + offs_e
            valid = ent < n
            # The next page's scales now (a load the pipeliner leaves in the loop, where it would
            # wait a full memory latency every page); its key codes come through the pipeline.
            # (Loading them after this page's math instead measured the same: run 14.)
            ahead = (ent + 64 < n) & (ent + 64 < last * 64)  # page + 1 < last
            sc_next = _page_scales(
                scales_ptr, _bt_entry(bt_row, tl.minimum(page + 1, last - 1)), offs_e, ahead, D, FP8
            )
            phys = _bt_entry(bt_row, page)
            if TMA:  # out-of-range pages (past the length, any table entry) load zeros or unused codes
                k = tl.reshape(kdesc.load([phys.to(tl.int32), 0, 0]), (64, D))
            else:
                k = _page_codes(vals_ptr, phys, offs_e, valid, offs_d, D, FP8)
            logit = _entry_logits(q, w, k, sc, valid, NATIVE_FP8, IEEE)
            tl.store(orow + ent, logit, mask=ent < out_stride)
            if GMAX:
                _store_group_max(grow, page, logit)
            sc = sc_next
        if HIST_BITS > 0:
            tl.debug_barrier()
            _row_histogram(orow, hist_ptr, b, first * 64, last * 64, n, HIST_BLOCK, HIST_BITS)


GROUPS_PER_PAGE = 4
"""Group maxima a page gives the filter top-k (``triton_filter``): 16 entries a group."""


@triton.jit
def _store_group_max(grow, page, logit):
    """The ordered-key maxima of the page's 4 groups of 16 consecutive logits."""
    key = ordered_key(logit)
    g = tl.max(tl.reshape(key, (4, 16)), axis=1)
    tl.store(grow + page * 4 + tl.arange(0, 4), g.to(tl.int32, bitcast=True))


@triton.jit
def _bt_entry(bt_row, page):
    """int64: the block-table entry of ``page`` (inside the table's width).

    Read by inline PTX on the GPU: as a ``tl.load`` the pipeliner turns it into an async copy
    into a one-slot buffer and the page loop then waits on every copy in flight (``async_wait
    0``, TTGIR read on Triton 3.9), so each page's key codes load only after the previous page's
    math; read so, the key loads get ``num_stages`` buffers and ``num_stages - 2`` stay in flight
    across the math. ``.nc``: the table is read-only here, and its lines stay in L1. Measured
    with the other persistent-loop changes of run 12: ~1% faster (docs/perf/indexer-notes.md)."""
    if _ASM_LOADS:
        one = bt_row + page + tl.zeros([1], tl.int32)  # a tensor operand, as every Triton version takes
        e = tl.sum(
            tl.inline_asm_elementwise(
                "ld.global.nc.b32 $0, [$1];", "=r,l", [one], dtype=tl.int32, is_pure=True, pack=1
            ),
            0,
        )
    else:
        e = tl.load(bt_row + page)
    return e.to(tl.int64)


@triton.jit
def _page_codes(vals_ptr, phys, slot, valid, offs_d, D: tl.constexpr, FP8: tl.constexpr):
    """[E, D] key codes of E paged entries (physical page, slot); 0 where not valid."""
    if FP8:
        kp = vals_ptr + phys * (64 * (D + 4)) + slot * D
    else:
        kp = vals_ptr + (phys * 64 + slot) * D
    return tl.load(kp[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def _entry_logits(q, w, k, sc, valid, NATIVE_FP8: tl.constexpr, IEEE: tl.constexpr):
    """fp32 [E]: ``sc * sum_h w[h] * ReLU(q[h] . k[e])``, -inf where not valid (q [H, D], k [E, D]).

    Entries as the MMA's rows, heads as its columns: the head sum stays inside each warp. (Heads
    as the rows, the queries then the A operand kept in shared memory across pages, measured
    25-40% slower in the persistent loop: the head sum crosses warps; run 14.)"""
    s = _scores(k, q, NATIVE_FP8, IEEE)  # [E, H]
    logit = tl.sum(tl.maximum(s, 0.0) * w[None, :], axis=1) * sc
    return tl.where(valid, logit, float("-inf"))


@triton.jit
def _page_logit(
    q,
    w,
    vals_ptr,
    phys,
    slot,
    sc,
    valid,
    offs_d,
    D: tl.constexpr,
    FP8: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
    IEEE: tl.constexpr,
):
    """fp32 [E]: the logits of E paged entries (physical page, slot, key scale), -inf where not valid."""
    k = _page_codes(vals_ptr, phys, slot, valid, offs_d, D, FP8)
    return _entry_logits(q, w, k, sc, valid, NATIVE_FP8, IEEE)


@triton.jit
def _row_histogram(orow, hist_ptr, b, lo, hi, n, BLOCK: tl.constexpr, HIST_BITS: tl.constexpr):
    """Add the pass-0 radix histogram of logits [lo, hi) of row b (this program just wrote them;
    the caller's barrier makes them visible to all its threads) to the row's."""
    for c in range(lo, hi, BLOCK):
        ents = c + tl.arange(0, BLOCK)
        ok = (ents < hi) & (ents < n)
        h = digit0_histogram(tl.load(orow + ents, mask=ok, other=0.0), ok, HIST_BITS)
        tl.atomic_add(
            hist_ptr + (b << HIST_BITS) + tl.arange(0, 1 << HIST_BITS), h, mask=h != 0, sem="relaxed"
        )


@triton.jit
def _prefill_kernel(
    q_ptr,  # [T, H, D] codes
    w_ptr,  # [T, H] fp32
    k_ptr,  # [N, D] codes
    ks_ptr,  # [N] fp32
    starts_ptr,  # int32 [T]
    ends_ptr,  # int32 [T]
    out_ptr,  # fp32 [T, N]
    T,
    N,
    H,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
    IEEE: tl.constexpr,
    FAULT_KEY_SLOT: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    tmask = offs_t < T
    nmask = offs_n < N
    st = tl.load(starts_ptr + offs_t, mask=tmask, other=2147483647)
    en = tl.load(ends_ptr + offs_t, mask=tmask, other=0)
    # Tiles outside every row's range cost one store of -inf (causal prefill skips about half).
    if (pid_n * BLOCK_N < tl.max(en)) & ((pid_n + 1) * BLOCK_N > tl.min(st)):
        src = offs_n
        if FAULT_KEY_SLOT:
            src = tl.maximum(offs_n - 1, 0)
        k = tl.load(k_ptr + src[:, None] * D + offs_d[None, :], mask=nmask[:, None], other=0.0)
        sc = tl.load(ks_ptr + src, mask=nmask, other=0.0)
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for h in range(H):
            qh = tl.load(
                q_ptr + offs_t[:, None] * (H * D) + h * D + offs_d[None, :], mask=tmask[:, None], other=0.0
            )
            wh = tl.load(w_ptr + offs_t * H + h, mask=tmask, other=0.0)
            acc += tl.maximum(_scores(qh, k, NATIVE_FP8, IEEE), 0.0) * wh[:, None]
        acc = acc * sc[None, :]
        inside = (offs_n[None, :] >= st[:, None]) & (offs_n[None, :] < en[:, None])
        acc = tl.where(inside, acc, float("-inf"))
    else:
        acc = tl.full([BLOCK_T, BLOCK_N], float("-inf"), tl.float32)
    out = out_ptr + offs_t[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc, mask=tmask[:, None] & nmask[None, :])


def _modes(q: torch.Tensor, key_fp8: bool, native_fp8: bool) -> dict:
    both_fp8 = key_fp8 and q.dtype == torch.float8_e4m3fn
    return {"NATIVE_FP8": bool(both_fp8 and native_fp8 and not INTERPRET), "IEEE": INTERPRET}


def _paged_args(q, w, paged: PagedKeys, context_lens, out, hist, hist_bits: int, native_fp8: bool) -> tuple:
    """(positional operands, constexpr keywords) shared by both paged kernels."""
    B, H, D = q.shape
    fp8 = paged.key_dtype == "fp8_e4m3"
    operands = (
        q.contiguous(),
        w.float().contiguous(),
        paged.data.view(torch.float8_e4m3fn) if fp8 else paged.data,  # codes
        paged.data.view(torch.float32) if fp8 else paged.data,  # the fp8 pages' scales
        paged.block_table,
        context_lens.to(torch.int32).contiguous(),
        out,
        out if hist is None else hist,
        H,
        paged.block_table.stride(0),
        paged.width,
    )
    meta = {
        "D": D,
        "BLOCK_H": max(16, triton.next_power_of_2(H)),
        "FP8": fp8,
        "HIST_BITS": 0 if hist is None else hist_bits,
        **_modes(q, fp8, native_fp8),
    }
    return operands, meta


def _key_descriptor(paged: PagedKeys, D: int):
    """A TMA descriptor of a paged cache's key codes [P, 64, D] (page stride from the layout).
    (The fp8 scales stay plain loads: Triton 3.9's pipeliner leaves a TMA load that feeds no dot
    in its own iteration, issued and waited on at once, TTGIR read on sm_90.)"""
    from triton.tools.tensor_descriptor import TensorDescriptor

    P = paged.data.shape[0]
    if paged.key_dtype == "fp8_e4m3":
        codes = paged.data.view(torch.float8_e4m3fn)
        return TensorDescriptor(codes, [P, 64, D], [64 * (D + 4), D, 1], [1, 64, D])
    return TensorDescriptor(paged.data, [P, 64, D], [64 * D, D, 1], [1, 64, D])


def _launch_persistent(
    q, paged: PagedKeys, operands: tuple, meta: dict, loop: dict, out, gmax, programs_per_sm
):
    """``_paged_persistent_kernel`` over ``programs_per_sm`` programs a SM (None: the occupancy
    calculator's answer for this compiled variant, cached)."""
    B, _, D = q.shape
    total, ppr = B * paged.block_table.shape[1], paged.block_table.shape[1]
    if gmax is not None and gmax.shape[1] < ppr * GROUPS_PER_PAGE:
        raise ValueError(f"gmax needs {ppr * GROUPS_PER_PAGE} columns, got {gmax.shape[1]}")
    args = (
        *operands[:4],
        _key_descriptor(paged, D) if loop["TMA"] else operands[2],
        *operands[4:8],
        out if gmax is None else gmax,
        *operands[8:],
        ppr,
        total,
    )
    pmeta = {**meta, **loop, "GMAX": gmax is not None, "HIST_BLOCK": 512}
    gstride = 0 if gmax is None else gmax.stride(0)
    sms = sm_count(q.device)
    if programs_per_sm is None:
        programs_per_sm = (
            8
            if INTERPRET or not q.is_cuda
            else cached_blocks_per_sm(
                ("paged_persistent", q.device, *sorted(pmeta.items())),
                lambda: _paged_persistent_kernel.warmup(*args, sms * 8, gstride, grid=(1,), **pmeta),
            )
        )
    progs = max(1, min(total, sms * programs_per_sm))
    launch(_paged_persistent_kernel, (progs,), *args, progs, gstride, **pmeta)


def paged_logits(
    q: torch.Tensor,
    w: torch.Tensor,
    paged: PagedKeys,
    context_lens: torch.Tensor,
    *,
    fault: str | None = None,
    pages_per_prog: int = 8,
    pages_per_mma: int = 1,
    native_fp8: bool = True,
    num_warps: int = 4,
    num_stages: int | None = None,
    prefetch: bool = False,
    persistent: bool | None = None,
    programs_per_sm: int | None = None,
    tma: bool = False,
    out: torch.Tensor | None = None,
    hist: torch.Tensor | None = None,
    hist_bits: int = 8,
    gmax: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, D] codes, w [B, H] fp32, context_lens int32 [B] -> logits fp32 [B, width] (into ``out`` if given).

    ``prefetch`` (one page per MMA, no fault): load the program's block-table entries in one
    load before the loop and each page's scales one page early. Without it the compiled loop
    (PTX read on Triton 3.9, sm_90) waits on a block-table load right before the ``cp.async`` of
    the page it addresses and on a scale load in the same iteration's epilogue.
    ``persistent`` (one page per MMA, no prefetch, no fault): ``programs_per_sm`` programs per SM
    (None: as many as the occupancy calculator says one SM holds at once), each scoring an equal
    run of consecutive pages of the row-after-row page sequence, instead of one program per
    ``pages_per_prog`` pages of a row. ``persistent`` None: on CUDA wherever it applies, except
    with ``hist``: its per-run histograms made the fused decode path 0-50 us slower than with the
    program-per-pages loop (docs/perf/indexer.md, runs 10 and 12), while the logits alone gain 1-4 us.
    ``num_stages`` None: 3 for the persistent loop (the fastest of 2-4 on an H100, run 12, by
    ~1%), 2 for the other.
    ``tma`` (persistent loop only): key codes by TMA loads (a tensor descriptor; on the GPU,
    Hopper or later). Measured the same as the default loads on an H100 (run 14); kept for the
    H200, which needs more bytes in flight a SM.
    ``hist`` (int32 [B, 2**hist_bits], a ``triton_radix`` workspace row): also add each row's
    pass-0 histogram of the radix select (the fused radix decode path).
    ``gmax`` (int32 [B, >= pages * GROUPS_PER_PAGE], persistent loop only): also write each
    page's group maxima as ordered keys (the fused filter decode path, ``triton_filter``).
    """
    B, H, D = q.shape
    if pages_per_mma not in (1, 2) or pages_per_prog % pages_per_mma:
        raise ValueError(f"pages_per_mma must be 1 or 2 and divide pages_per_prog={pages_per_prog}")
    if fault is not None:  # the fault variants gather entry by entry, one page per MMA
        pages_per_mma = 1
    out = torch.empty(B, paged.width, dtype=torch.float32, device=q.device) if out is None else out
    operands, meta = _paged_args(q, w, paged, context_lens, out, hist, hist_bits, native_fp8)
    if persistent is None:
        persistent = q.is_cuda and not INTERPRET and pages_per_mma == 1 and not prefetch and hist is None
    loop_only = tma or gmax is not None
    persistent = (persistent or loop_only) and fault is None
    if loop_only and not persistent:
        raise ValueError("tma and gmax need the persistent loop, which no fault variant has")
    meta.update(num_warps=num_warps, num_stages=num_stages or (3 if persistent else 2))
    if persistent:
        loop = {"TMA": tma}
        _launch_persistent(q, paged, operands, meta, loop, out, gmax, programs_per_sm)
        return out
    grid = (B, triton.cdiv(paged.block_table.shape[1], pages_per_prog))
    launch(
        _paged_kernel,
        grid,
        *operands,
        PAGES_PER_PROG=pages_per_prog,
        PAGES_PER_MMA=pages_per_mma,
        FAULT_PAGE_TABLE=fault == "indexer_page_table",
        FAULT_KEY_SLOT=fault == "indexer_key_slot",
        PREFETCH=prefetch and pages_per_mma == 1 and fault is None,
        **meta,
    )
    return out


def prefill_logits(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: ContiguousKeys,
    starts: torch.Tensor,
    ends: torch.Tensor,
    *,
    fault: str | None = None,
    block_t: int = 64,
    block_n: int = 128,
    native_fp8: bool = True,
    num_warps: int = 8,
    num_stages: int = 3,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D] codes, w [T, H] fp32, keys N entries, starts/ends int32 [T] -> logits fp32 [T, N] (into ``out`` if given)."""
    T, H, D = q.shape
    N = keys.codes.shape[0]
    out = torch.empty(T, N, dtype=torch.float32, device=q.device) if out is None else out
    grid = (triton.cdiv(T, block_t), triton.cdiv(N, block_n))
    launch(
        _prefill_kernel,
        grid,
        q.contiguous(),
        w.float().contiguous(),
        keys.codes.contiguous(),
        keys.scales.contiguous(),
        starts.to(torch.int32).contiguous(),
        ends.to(torch.int32).contiguous(),
        out,
        T,
        N,
        H,
        D=D,
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        FAULT_KEY_SLOT=fault == "indexer_key_slot",
        num_warps=num_warps,
        num_stages=num_stages,
        **_modes(q, keys.key_dtype == "fp8_e4m3", native_fp8),
    )
    return out
