"""Triton indexer kernels against the reference math on the same quantized inputs.

On a machine without CUDA these run the Triton kernels under Triton's interpreter
(TRITON_INTERPRET=1, set by tests/conftest.py before triton is imported) at small shapes. On a GPU,
``NEEDLESCOPE_KERNEL_SHAPES=full`` runs the same checks at full shapes (H=64, D=128, rows up to
256K, k = 512/1024/2048): ``bench/indexer_gpu.sh`` does that on the H200.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from needlescope.dsa.reference import topk_indices  # noqa: E402
from needlescope.errors import BadInput  # noqa: E402
from needlescope.kernels import (  # noqa: E402
    KERNEL_FAULTS,
    cuda_topk,
    indexer_logits,
    indexer_topk,
    page_keys,
    quantize_keys,
    quantize_queries,
    resolve_kernel,
    topk,
    triton_decode,
    triton_logits,
    triton_radix,
)
from needlescope.kernels.reference import logits_reference, paged_logits_reference, topk_reference  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FULL = os.environ.get("NEEDLESCOPE_KERNEL_SHAPES") == "full"
# (rows, row length, k values, heads, dim, queries, keys, pages per request)
SHAPES = (
    {
        "rows": 8,
        "length": 262_144,
        "ks": (512, 1024, 2048),
        "H": 64,
        "D": 128,
        "T": 96,
        "N": 4_096,
        "pages": 512,
    }
    if FULL
    else {"rows": 5, "length": 1_500, "ks": (16, 512), "H": 6, "D": 64, "T": 7, "N": 300, "pages": 5}
)
POISON_IDX = -7


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def _ranges(rows: int, length: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged [start, end) rows: full, empty, below k, exactly k, k + 1, random."""
    st = torch.randint(0, length // 4, (rows,), generator=g, device=DEV)
    en = torch.randint(length // 2, length + 1, (rows,), generator=g, device=DEV)
    special = [(0, length), (3, 3), (0, max(k // 2, 1)), (5, 5 + k), (0, k + 1)]
    for i, (a, b) in enumerate(special[:rows]):
        st[i], en[i] = a, min(b, length)
    return st.int(), en.int()


# Threshold searches: bisection with the row in registers, bisection over chunks, radix select; rows
# split over several programs (exact per-segment top-k, then a merge over the candidates); and the
# cooperative radix select of triton_radix (every row split into chunks, 8 bits a pass); the
# group-max filter of triton_filter (one program a row), also with more candidates than registers.
ALGOS = {
    "bisect-registers": {"method": "bisect", "bits": 0},
    "bisect-chunks": {"method": "bisect", "bits": 0, "block": 1024},
    "radix8": {"method": "bisect", "bits": 8, "block": 1024},
    "split-bisect": {"method": "bisect", "segment": 256},  # per-segment candidates, then the merge
    "split-radix8": {"method": "bisect", "segment": 512, "bits": 8, "block": 256},
    "split-radix4": {"method": "bisect", "segment": 256, "bits": 4},
    "coop-radix": {"method": "radix"},
    "coop-radix-small-chunks": {"method": "radix", "chunk": 256},
    "coop-radix11": {"method": "radix", "bits": 11, "chunk": 512},
    "filter": {"method": "filter"},  # triton_filter: group maxima, candidates, exact search
    "filter-small-cand": {"method": "filter", "cand_block": 64, "block": 1024},  # chunked search
    "default": {},
}


@pytest.mark.parametrize("algo", list(ALGOS))
@pytest.mark.parametrize("ties", [False, True])
def test_topk_is_exact_with_lower_index_ties(ties: bool, algo: str) -> None:
    g = _gen(1 + ties)
    for k in SHAPES["ks"]:
        R, L = SHAPES["rows"], SHAPES["length"]
        x = torch.randn(R, L, generator=g, device=DEV)
        if ties:  # few distinct values: the k-th score is shared by many entries
            x = (x * 2).round() / 2
            x[:, ::7] = -0.0
            x[:, 1::7] = 0.0
        st, en = _ranges(R, L, k, g)
        out = torch.full((R, k), POISON_IDX, dtype=torch.int32, device=DEV)
        topk.topk(x, k, st, en, out=out, **ALGOS[algo])
        ref = topk_reference(x, k, st, en)
        assert not (out == POISON_IDX).any(), "an output slot was never written"
        got, want = out.sort(dim=1).values, ref.sort(dim=1).values
        assert torch.equal(got, want), (
            f"k={k}: top-k sets differ in rows {(got != want).any(1).nonzero().flatten().tolist()}"
        )


@pytest.mark.parametrize("bits", triton_radix.DIGIT_BITS)
def test_radix_workspace_is_left_zero_for_the_next_call(bits: int) -> None:
    """The cached histograms clean themselves: after a call every digit's histogram but the last
    is zero again (the last, read by the output pass, is cleared by the next call's second
    launch), so calls need no memset and a later call (another k, other rows) is still exact."""
    g = _gen(11)
    R, L = SHAPES["rows"], SHAPES["length"]
    for k in SHAPES["ks"]:
        x = torch.randn(R, L, generator=g, device=DEV)
        st, en = _ranges(R, L, k, g)
        got = triton_radix.radix_topk(x, k, st, torch.maximum(en, st), bits=bits, chunk=512)
        assert torch.equal(got.sort(1).values, topk_reference(x, k, st, en).sort(1).values)
        ws = triton_radix.radix_workspace(R, DEV, bits)
        assert not ws[:-1].any(), "histograms left non-zero"
        assert ws[-1].any()


def test_topk_reference_matches_dsa_reference_without_ties() -> None:
    g = _gen(3)
    k = SHAPES["ks"][-1]
    x = torch.randn(4, 3 * k, generator=g, device=DEV)
    visible = torch.tensor([3 * k, k, k + 1, 0], device=DEV)
    ours = topk_reference(x, k, torch.zeros_like(visible), visible).long().sort(1).values
    theirs = topk_indices(x, k, visible).sort(1).values
    assert torch.equal(ours, theirs)


def _qwk(key_dtype: str, T: int, N: int, g: torch.Generator):
    H, D = SHAPES["H"], SHAPES["D"]
    q = torch.randn(T, H, D, generator=g, device=DEV)
    w = torch.randn(T, H, generator=g, device=DEV)
    k = torch.randn(N, D, generator=g, device=DEV) * (1 + torch.rand(N, 1, generator=g, device=DEV))
    qc, wf = quantize_queries(q, w, key_dtype)
    return qc, wf, quantize_keys(k, key_dtype)


def _check_logits(got: torch.Tensor, ref64: torch.Tensor) -> None:
    assert not got.isnan().any(), "a logit was never written (poison survived)"
    fin = torch.isfinite(ref64)
    assert torch.equal(torch.isfinite(got), fin), "-inf pattern differs from the query ranges"
    assert bool((got[~fin] == float("-inf")).all())
    err = (got.double()[fin] - ref64[fin]).norm() / ref64[fin].norm()
    assert err < 1e-3, f"relative error {err:.2e}"


@pytest.mark.parametrize("key_dtype", ["bf16", "fp8_e4m3"])
def test_prefill_logits_match_float64_reference(key_dtype: str) -> None:
    g = _gen(4)
    T, N = SHAPES["T"], SHAPES["N"]
    qc, wf, keys = _qwk(key_dtype, T, N, g)
    st, en = _ranges(T, N, 16, g)
    out = torch.full((T, N), float("nan"), device=DEV)
    triton_logits.prefill_logits(qc, wf, keys, st, en, out=out)
    _check_logits(out, logits_reference(qc, wf, keys, st, en, dtype=torch.float64))


def _paged(key_dtype: str, g: torch.Generator):
    """A batch whose pages are scattered over a shared pool; request i's entries are keys[:len_i]."""
    pages = SHAPES["pages"]
    B = 3
    qc, wf, keys = _qwk(key_dtype, B, pages * 64, g)
    pool = B * pages + 3
    bt = (
        torch.randperm(pool, generator=torch.Generator().manual_seed(5))[: B * pages]
        .view(B, pages)
        .int()
        .to(DEV)
    )
    lens = torch.tensor([pages * 64, 1, pages * 64 - 37], dtype=torch.int32, device=DEV)
    entry_of = torch.arange(pages * 64, device=DEV).view(1, -1).expand(B, -1)
    entry_of = torch.where(entry_of < lens.view(-1, 1), entry_of, torch.full_like(entry_of, -1))
    return qc, wf, keys, page_keys(keys, bt, pool, entry_of), lens


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("pages_per_mma", [1, 2])
@pytest.mark.parametrize("key_dtype", ["bf16", "fp8_e4m3"])
def test_paged_logits_match_contiguous_reference(key_dtype: str, pages_per_mma: int, prefetch: bool) -> None:
    qc, wf, keys, paged, lens = _paged(key_dtype, _gen(6))
    out = torch.full((3, paged.width), float("nan"), device=DEV)
    triton_logits.paged_logits(
        qc, wf, paged, lens, out=out, pages_per_mma=pages_per_mma, prefetch=prefetch, pages_per_prog=4
    )
    zeros = torch.zeros_like(lens)
    ref = logits_reference(qc, wf, keys, zeros, lens, dtype=torch.float64)
    _check_logits(out, ref)


PERSISTENT_LOOPS = {  # programs per SM, then paged_logits' loop keywords
    "1-per-sm": (1, {}),
    "2-per-sm": (2, {}),
    "4-per-sm": (4, {}),
    "occupancy": (None, {}),
    "tma": (2, {"tma": True}),
    "tma-occupancy": (None, {"tma": True}),
}


@pytest.mark.parametrize("loop", list(PERSISTENT_LOOPS))
@pytest.mark.parametrize("key_dtype", ["bf16", "fp8_e4m3"])
def test_persistent_paged_logits_match_reference_histogram_and_group_maxima(
    key_dtype: str, loop: str
) -> None:
    """The persistent loop (equal runs of consecutive pages, crossing rows mid-run: under the
    interpreter one SM, so 1, 2, 4 or, left to the occupancy rule, 8 programs over 3 rows; on a
    GPU that rule asks the occupancy calculator), with plain or TMA loads and either MMA operand
    order, gives the reference's logits and the same pass-0 histograms as the program-per-pages
    kernel; its group maxima are the largest keys of each 16 consecutive entries."""
    programs_per_sm, loop_kw = PERSISTENT_LOOPS[loop]
    qc, wf, keys, paged, lens = _paged(key_dtype, _gen(6))
    out = torch.full((3, paged.width), float("nan"), device=DEV)
    hist = torch.zeros(3, 256, dtype=torch.int32, device=DEV)
    pages = paged.block_table.shape[1]
    gmax = torch.full((3, pages * 4 + 1), POISON_IDX, dtype=torch.int32, device=DEV)
    kw = {"persistent": True, "programs_per_sm": programs_per_sm, **loop_kw}
    triton_logits.paged_logits(qc, wf, paged, lens, out=out, hist=hist, gmax=gmax, **kw)
    zeros = torch.zeros_like(lens)
    _check_logits(out, logits_reference(qc, wf, keys, zeros, lens, dtype=torch.float64))
    want = torch.zeros_like(hist)
    triton_logits.paged_logits(qc, wf, paged, lens, hist=want)
    assert torch.equal(hist, want)
    assert hist.sum(1).tolist() == lens.tolist()
    assert (gmax[:, -1] == POISON_IDX).all(), "written past the page groups"
    want_max = _ordered_keys(out).view(3, pages * 4, 16).max(dim=2).values
    assert torch.equal(gmax[:, :-1].long() & 0xFFFFFFFF, want_max)


def _ordered_keys(x: torch.Tensor) -> torch.Tensor:
    """int64 keys with the float order of fp32 ``x`` (``topk_parts.ordered_key``'s mapping)."""
    u = x.contiguous().view(torch.int32).long() & 0xFFFFFFFF
    u = torch.where(u == 0x80000000, 0, u)
    return torch.where(u >= 0x80000000, u ^ 0xFFFFFFFF, u ^ 0x80000000)


@pytest.mark.parametrize("key_dtype", ["bf16", "fp8_e4m3"])
def test_fused_decode_topk_equals_logits_then_topk(key_dtype: str) -> None:
    """The fused paths (pass 0 of the radix select, or the filter's group maxima, inside the
    logits kernel) give their select's result on the kernel's logits exactly, order included;
    their sets equal the unfused path's and the reference's. (Orders differ between methods: the bisection's threshold need
    not be an entry's key, so with no tie at the k-th entry it lists all k in index order.)"""
    qc, wf, keys, paged, lens = _paged(key_dtype, _gen(10))
    zeros = torch.zeros_like(lens)
    ref_logits = paged_logits_reference(qc, wf, paged, lens)
    for k in (*SHAPES["ks"], 100):
        fused = triton_decode.decode_topk(qc, wf, paged, lens, k, fused=True, select="radix")
        fused11 = triton_decode.decode_topk(qc, wf, paged, lens, k, fused=True, select="radix", bits=11)
        fused_filter = triton_decode.decode_topk(qc, wf, paged, lens, k, fused=True, select="filter")
        logits = triton_logits.paged_logits(qc, wf, paged, lens)
        assert torch.equal(fused, topk.topk(logits, k, zeros, lens, method="radix")), k
        assert torch.equal(fused11, fused), k
        # The filter path from the logits kernel's group maxima gives what it gives from its own.
        assert torch.equal(fused_filter, topk.topk(logits, k, zeros, lens, method="filter")), k
        assert torch.equal(fused_filter.sort(1).values, fused.sort(1).values), k
        unfused = triton_decode.decode_topk(qc, wf, paged, lens, k, fused=False)
        assert torch.equal(fused.sort(1).values, unfused.sort(1).values), k
        if cuda_topk.available():  # the CUDA group path from the same maxima: the CUDA method's output
            fused_cuda = triton_decode.decode_topk(qc, wf, paged, lens, k, fused=True, select="cuda")
            assert torch.equal(fused_cuda, topk.topk(logits, k, zeros, lens, method="cuda")), k
        # Exact selection on the kernel's logits; those are checked against the float64
        # reference elsewhere (at full shapes a near-tie at the k-th entry can differ between them).
        want = topk_reference(logits, k, zeros, lens)
        assert torch.equal(fused.sort(1).values, want.sort(1).values), k
        _check_logits(logits, ref_logits)


@pytest.mark.parametrize("fault", KERNEL_FAULTS)
def test_kernel_faults_are_the_reference_faults_and_change_the_logits(fault: str) -> None:
    qc, wf, keys, paged, lens = _paged("fp8_e4m3", _gen(7))
    got = indexer_logits(qc, wf, paged, context_lens=lens, kernel="triton", fault=fault)
    _check_logits(got, paged_logits_reference(qc, wf, paged, lens, dtype=torch.float64, fault=fault))
    healthy = indexer_logits(qc, wf, paged, context_lens=lens, kernel="triton")
    fin = torch.isfinite(healthy)
    assert (got[fin] - healthy[fin]).abs().max() > 1e-2, "the fault left the logits unchanged"


@pytest.mark.parametrize("fault", KERNEL_FAULTS)
def test_fused_filter_decode_with_a_fault_selects_from_the_faulty_logits(fault: str) -> None:
    """The fault variants have no persistent loop to write group maxima, so the fused filter
    path runs the faulty logits and the filter's own maxima: the selection is the filter's on
    the faulty logits, and differs from the healthy one."""
    qc, wf, keys, paged, lens = _paged("fp8_e4m3", _gen(11))
    k = SHAPES["ks"][0]
    got = triton_decode.decode_topk(qc, wf, paged, lens, k, fused=True, select="filter", fault=fault)
    faulty = triton_logits.paged_logits(qc, wf, paged, lens, fault=fault)
    assert torch.equal(got, topk.topk(faulty, k, None, lens, method="filter"))
    healthy = triton_decode.decode_topk(qc, wf, paged, lens, k, fused=True, select="filter")
    assert not torch.equal(got.sort(1).values, healthy.sort(1).values), (
        "the fault left the selection unchanged"
    )


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_indexer_topk_triton_equals_reference(layout: str) -> None:
    g = _gen(8)
    k = SHAPES["ks"][0]
    if layout == "paged":
        qc, wf, _, keys, lens = _paged("fp8_e4m3", g)
        kw = {"context_lens": lens}
    else:
        T, N = SHAPES["T"], SHAPES["N"]
        qc, wf, keys = _qwk("bf16", T, N, g)
        st, en = _ranges(T, N, k, g)
        kw = {"starts": st, "ends": en}
    got = indexer_topk(qc, wf, keys, k, kernel="triton", **kw)
    want = indexer_topk(qc, wf, keys, k, kernel="reference", **kw)
    assert got.dtype == want.dtype == torch.int32
    assert torch.equal(got.sort(1).values, want.sort(1).values)


def test_dispatch_refuses_what_cannot_run() -> None:
    with pytest.raises(BadInput, match="kernel must be one of"):
        resolve_kernel("cuda", DEV)
    assert resolve_kernel("reference", DEV) == "reference"
    assert resolve_kernel("auto", torch.device("cpu")) == "reference"
    qc, wf, keys = _qwk("bf16", 2, 64, _gen(9))
    with pytest.raises(BadInput, match="unknown kernel fault"):
        indexer_logits(qc, wf, keys, fault="nope")
    with pytest.raises(BadInput, match="needs a paged cache"):
        indexer_logits(qc, wf, keys, fault="indexer_page_table")
    with pytest.raises(BadInput, match="context_lens"):
        indexer_logits(qc, wf, keys, context_lens=torch.ones(2, dtype=torch.int32))


@pytest.mark.parametrize("bits", triton_radix.DIGIT_BITS)
def test_one_launch_select_equals_the_launch_per_pass(bits: int) -> None:
    """Every pass in one launch (programs of a row meeting at a counter barrier) gives the
    launch-per-pass result, order included, from pass 0 and from a pass-0 histogram built by the
    logits kernel (the fused decode path), and leaves histograms and counters as it found them.
    Under the interpreter a row is one chunk (programs run in turn); on a GPU rows span many."""
    g = _gen(12)
    R, L = SHAPES["rows"], SHAPES["length"]
    chunk = 16384 if FULL else triton.next_power_of_2(L)
    for k in SHAPES["ks"]:
        x = torch.randn(R, L, generator=g, device=DEV)
        st, en = _ranges(R, L, k, g)
        en = torch.maximum(en, st)
        per_pass = triton_radix.radix_topk(x, k, st, en, bits=bits, chunk=chunk, one_launch=False)
        one = triton_radix.radix_topk(x, k, st, en, bits=bits, chunk=chunk, one_launch=True)
        assert torch.equal(one, per_pass), k
        assert torch.equal(one.sort(1).values, topk_reference(x, k, st, en).sort(1).values), k
        ws = triton_radix.radix_workspace(R, DEV, bits)
        assert not ws[:-1].any(), "histograms left non-zero"
        assert not triton_radix._cached_zeros("barrier", (R,), DEV, bits).any(), (
            "barrier counters left non-zero"
        )
    qc, wf, _, paged, lens = _paged("fp8_e4m3", _gen(13))
    zeros = torch.zeros_like(lens)
    for k in (*SHAPES["ks"], 100):
        hist = triton_radix.radix_workspace(lens.shape[0], DEV, bits)
        logits = triton_logits.paged_logits(qc, wf, paged, lens, hist=hist[0], hist_bits=bits)
        width = logits.shape[1]
        fused = triton_radix.radix_topk(
            logits,
            k,
            zeros,
            lens,
            bits=bits,
            hist=hist,
            first_pass=1,
            one_launch=True,
            chunk=16384 if FULL else triton.next_power_of_2(width),
        )
        assert torch.equal(
            fused, triton_radix.radix_topk(logits, k, zeros, lens, bits=bits, one_launch=False)
        ), k
        assert not hist[:-1].any()


def test_one_launch_refuses_programs_that_cannot_meet() -> None:
    x = torch.randn(2, 3000, device=DEV)
    st, en = (
        torch.zeros(2, dtype=torch.int32, device=DEV),
        torch.full((2,), 3000, dtype=torch.int32, device=DEV),
    )
    with pytest.raises(ValueError, match="resident at once"):
        triton_radix.radix_topk(x, 16, st, en, chunk=256 if not FULL else 16, one_launch=True)


@pytest.mark.parametrize("one_launch", [False, True])
def test_radix_clamps_raw_ranges_itself(one_launch: bool) -> None:
    """The radix kernels take ranges as given (no clamping launches): a start below 0 or past the
    row, an end past the row or before the start, and no starts at all (every row from 0) give
    what the bisection gives on the same ranges, which torch clamps first."""
    g = _gen(14)
    R, L, k = 6, SHAPES["length"], SHAPES["ks"][0]
    x = torch.randn(R, L, generator=g, device=DEV)
    st = torch.tensor([-5, 0, L + 3, 10, 7, 0], dtype=torch.int32, device=DEV)
    en = torch.tensor([L + 100, 2, L + 9, 4, L, -3], dtype=torch.int32, device=DEV)
    chunk = 16384 if FULL else triton.next_power_of_2(L)
    kw = {"method": "radix", "chunk": chunk, "one_launch": one_launch}
    want = topk.topk(x, k, st, en, method="bisect")
    assert torch.equal(topk.topk(x, k, st, en, **kw).sort(1).values, want.sort(1).values)
    got = triton_radix.radix_topk(x, k, None, en, chunk=chunk, one_launch=one_launch)
    zeros = torch.zeros_like(st)
    assert torch.equal(got.sort(1).values, topk.topk(x, k, zeros, en, method="bisect").sort(1).values)
