"""The group-max filter top-k (``triton_filter.filter_topk``) against the reference and the radix select.

Under Triton's interpreter (tests/conftest.py) at rows of a few thousand entries; on a GPU,
``NEEDLESCOPE_KERNEL_SHAPES=full`` runs the same checks compiled at 64K-entry rows. Every check
holds the output to the contract: the reference's set, entries above the threshold key in index
order then the ties in index order (the output of ``triton_bisect``'s radix threshold search), and
every slot written. ``counts`` (each row's candidate count) is checked against a torch model of the
filter's threshold, so the filter is seen to filter, and to keep at least k candidates; the model's
per-chunk counts show which of launch 3's paths (register tile, or lists in blocks) a test takes.
Small ``block`` (chunk) widths split the interpreter's rows over several programs.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from needlescope.kernels import topk, triton_filter  # noqa: E402
from needlescope.kernels.reference import topk_reference  # noqa: E402
from test_kernels import _ordered_keys as _keys  # noqa: E402  (the ordered key in torch)
from test_kernels import _ranges  # noqa: E402  (ragged rows: full, empty, < k, k from 5, k + 1, random)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FULL = os.environ.get("NEEDLESCOPE_KERNEL_SHAPES") == "full"
ROWS, LENGTH = (16, 65_536) if FULL else (6, 3_000)
KS = (1, 16, 100, 512)
POISON_IDX = -7
KINDS = ("random", "ties", "equal", "neg-inf", "nan")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def _rows(kind: str, R: int, L: int, g: torch.Generator) -> torch.Tensor:
    """Scores of one kind: random, few distinct values (-0.0 and +0.0 mixed), all equal, mostly
    -inf (row i: a fraction 1 - 4**-i of it), or random with NaNs of both signs."""
    x = torch.randn(R, L, generator=g, device=DEV)
    if kind == "ties":
        x = (x * 2).round() / 2
        x[:, ::7] = -0.0
        x[:, 1::7] = 0.0
    elif kind == "equal":
        x = torch.full_like(x, 1.25)
        x[1::2, ::2] = -0.0  # odd rows: -0.0 and +0.0, one key
        x[1::2, 1::2] = 0.0
    elif kind == "neg-inf":
        for i in range(R):
            x[i, torch.rand(L, generator=g, device=DEV) < 1 - 4.0**-i] = float("-inf")
    elif kind == "nan":
        x[:, 3::11] = float("nan")
        x[:, 5::13] = -float("nan")
    return x


def _model_candidates(x, k, st, en, gmax=None, group=16) -> torch.Tensor:
    """bool [R, L]: the entries the filter must keep, those of the range with key >= t, t the top
    16 bits of the k-th largest group maximum (0 if that is <= key(-inf) or there are fewer than k
    groups); none in rows of at most k entries. ``gmax``: int64 [R, G] maxima; None: contiguous
    groups."""
    R, L = x.shape
    key = _keys(x)
    cols = torch.arange(L, device=x.device).view(1, L)
    inside = (cols >= st.long().view(R, 1)) & (cols < en.long().view(R, 1))
    key = torch.where(inside, key, 0)
    if gmax is None:
        G = -(-L // group)
        gmax = torch.nn.functional.pad(key, (0, G * group - L)).view(R, G, group).amax(-1)
    out = torch.zeros(R, L, dtype=torch.bool, device=x.device)
    for r in range(R):
        if en[r] - st[r] <= k:
            continue
        m = gmax[r].sort(descending=True).values
        t = (int(m[k - 1]) >> 16) << 16 if m.numel() >= k else 0
        t = t if t > triton_filter.KNEG else 0
        out[r] = inside[r] & (key[r] >= t)
    return out


def _model_counts(x, k, st, en, gmax=None, group=16) -> torch.Tensor:
    """The candidate count the filter must find per row (``_model_candidates``)."""
    return _model_candidates(x, k, st, en, gmax, group).sum(1).int()


def _model_chunk_counts(x, k, st, en, block: int) -> torch.Tensor:
    """int [R, S]: the candidates of each ``block``-column chunk (launch 2's counts)."""
    c = _model_candidates(x, k, st, en)
    S = -(-x.shape[1] // block)
    return torch.nn.functional.pad(c, (0, S * block - x.shape[1])).view(x.shape[0], S, block).sum(-1)


def _check_order(x: torch.Tensor, out: torch.Tensor, st, en, k: int) -> None:
    """Per row: the entries above the smallest key taken, in index order, then those equal to it,
    in index order; short rows start..end-1 in order; -1 after the taken entries."""
    key = _keys(x).cpu()
    out, st, en = out.cpu(), st.cpu().clamp(0, x.shape[1]), en.cpu().clamp(0, x.shape[1])
    for r in range(out.shape[0]):
        n = min(max(int(en[r] - st[r]), 0), k)
        got = out[r, :n]
        assert (out[r, n:] == -1).all(), r
        if int(en[r] - st[r]) <= k:
            assert torch.equal(got, torch.arange(int(st[r]), int(st[r]) + n, dtype=torch.int32)), r
            continue
        kk = key[r, got.long()]
        above = kk > kk.min()
        n_above = int(above.sum())
        assert above[:n_above].all(), f"row {r}: a tie before an entry above the threshold"
        for part in (got[:n_above], got[n_above:]):
            assert (part[1:] > part[:-1]).all(), f"row {r}: not in index order"


def _run(x, k, st, en, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.full((x.shape[0], k), POISON_IDX, dtype=torch.int32, device=DEV)
    counts = torch.full((x.shape[0],), POISON_IDX, dtype=torch.int32, device=DEV)
    got = triton_filter.filter_topk(x, k, st, en, out=out, counts=counts, **kw)
    assert got is out
    assert not (out == POISON_IDX).any(), "an output slot was never written"
    return out, counts


def _check(x, k, st, en, out, counts, reference: bool = True) -> None:
    """The radix select's output exactly (order included), the reference's set (not with NaNs:
    torch orders every NaN first), the order contract, and at least k candidates in long rows."""
    want = topk.topk(x, k, st, en, method="bisect", bits=8, block=1024)
    assert torch.equal(out, want), f"k={k}: rows {(out != want).any(1).nonzero().flatten().tolist()}"
    if reference:
        ref = topk_reference(x, k, st, en).sort(1).values
        assert torch.equal(out.sort(1).values, ref), k
    _check_order(x, out, st, en, k)
    long = (en.clamp(0, x.shape[1]) - st.clamp(0, x.shape[1])) > k
    assert (counts[long] >= k).all(), counts.tolist()


@pytest.mark.parametrize("block", [None, 512])
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("kind", KINDS)
def test_filter_topk_is_exact_and_keeps_the_order(kind: str, k: int, block: int | None) -> None:
    """Every kind of row and range, with the default chunk (interpreter: the whole row one chunk)
    and with 512-column chunks (several programs a row in launches 1-2, several lists in launch 3)."""
    g = _gen(KINDS.index(kind) * 10 + KS.index(k))
    x = _rows(kind, ROWS, LENGTH, g)
    st, en = _ranges(ROWS, LENGTH, k, g)
    out, counts = _run(x, k, st, en, block=block)
    _check(x, k, st, en, out, counts, reference=kind != "nan")
    assert torch.equal(counts, _model_counts(x, k, st, en)), (counts.tolist(), k)


def test_the_filter_filters_random_rows() -> None:
    """On random rows with many more groups than k the candidates are a small part of the row (the
    point of the method), and exactly the model's count."""
    g = _gen(50)
    x = _rows("random", ROWS, LENGTH, g)
    st, en = torch.zeros(ROWS, dtype=torch.int32, device=DEV), torch.full((ROWS,), LENGTH, device=DEV)
    k = LENGTH // 16 // 8  # an eighth of the groups
    out, counts = _run(x, k, st, en)
    _check(x, k, st, en, out, counts)
    assert torch.equal(counts, _model_counts(x, k, st, en))
    assert (counts < LENGTH // 4).all() and (counts >= k).all(), counts.tolist()


@pytest.mark.parametrize("kind", ["random", "ties", "equal"])
def test_many_candidates_take_the_chunked_search(kind: str) -> None:
    """More candidates than ``cand_block`` (a small block on random rows; ties; all-equal rows, where
    every entry is a candidate): the threshold search runs over the candidate list in chunks."""
    g = _gen(60 + len(kind))
    x = _rows(kind, ROWS, LENGTH, g)
    for k, cand_block in ((16, 16), (100, 64), (512, 256)):
        st, en = _ranges(ROWS, LENGTH, k, g)
        out, counts = _run(x, k, st, en, cand_block=cand_block)
        _check(x, k, st, en, out, counts)
        assert (counts > cand_block).any(), (counts.tolist(), cand_block)


@pytest.mark.parametrize(
    ("group", "block", "gmax_block"), [(4, 256, None), (1, 1024, 256), (64, 64, None), (16, 128, 64)]
)
def test_group_widths_and_maxima_in_chunks(group: int, block: int, gmax_block: int | None) -> None:
    """Other group widths and chunk widths (a group as wide as the chunk), and more groups than
    ``gmax_block`` (the threshold passes read the maxima in blocks instead of holding them in
    registers)."""
    g = _gen(70 + group)
    x = _rows("ties", ROWS, LENGTH, g)
    for k in (16, 100):
        st, en = _ranges(ROWS, LENGTH, k, g)
        out, counts = _run(x, k, st, en, group=group, block=block, gmax_block=gmax_block)
        _check(x, k, st, en, out, counts)
        assert torch.equal(counts, _model_counts(x, k, st, en, group=group))


def _partition_maxima(x, st, en, groups: int, outside: int, g) -> torch.Tensor:
    """int64 [R, groups]: the largest key over a random partition of each row into ``groups``
    groups of unequal sizes (a random permutation cut at random points), entries outside the range
    entering as key ``outside``."""
    R, L = x.shape
    key = _keys(x)
    cols = torch.arange(L, device=DEV)
    out = torch.empty(R, groups, dtype=torch.long, device=DEV)
    for r in range(R):
        kr = torch.where((cols >= st[r]) & (cols < en[r]), key[r], outside)
        perm = torch.randperm(L, generator=g, device=DEV)
        cuts = torch.randperm(L - 1, generator=g, device=DEV)[: groups - 1].sort().values + 1
        owner = torch.zeros(L, dtype=torch.long, device=DEV)
        owner[cuts] = 1
        owner = owner.cumsum(0)  # group of the i-th permuted entry
        m = torch.zeros(groups, dtype=torch.long, device=DEV)
        out[r] = m.scatter_reduce(0, owner, kr[perm], "amax", include_self=True)
    return out


def _as_int32(keys: torch.Tensor) -> torch.Tensor:
    return torch.where(keys >= 2**31, keys - 2**32, keys).to(torch.int32)


@pytest.mark.parametrize("outside", [0, triton_filter.KNEG])
def test_caller_maxima_over_a_random_partition(outside: int) -> None:
    """Maxima over a random partition of each row give the same output, with the maxima in
    registers (one chunk a row) and read in blocks by every program of 512-column chunks. The partition is not contiguous groups: on random rows the candidate
    counts differ from the contiguous filter's."""
    g = _gen(80)
    for kind, k in (("random", 16), ("random", 100), ("ties", 100)):
        x = _rows(kind, ROWS, LENGTH, g)
        st, en = _ranges(ROWS, LENGTH, k, g)
        gm = _partition_maxima(x, st, en, LENGTH // 12, outside, g)
        for block, gmax_block in ((None, None), (512, 64)):
            out, counts = _run(x, k, st, en, gmax=_as_int32(gm), block=block, gmax_block=gmax_block)
            _check(x, k, st, en, out, counts)
            assert torch.equal(counts, _model_counts(x, k, st, en, gmax=gm))
        if kind == "random":
            assert not torch.equal(counts, _model_counts(x, k, st, en)), "the partition is contiguous"


def test_maxima_above_the_entries_give_a_wrong_answer() -> None:
    """The filter trusts the maxima: ones larger than every entry (too high a threshold) leave too
    few candidates, and the checks here see it (so they can fail)."""
    g = _gen(90)
    x = _rows("random", ROWS, LENGTH, g)
    k = 100
    st, en = _ranges(ROWS, LENGTH, k, g)
    gm = torch.full((ROWS, LENGTH // 16), -1, dtype=torch.int32, device=DEV)  # key 0xFFFFFFFF
    out = torch.full((ROWS, k), POISON_IDX, dtype=torch.int32, device=DEV)
    counts = torch.zeros(ROWS, dtype=torch.int32, device=DEV)
    triton_filter.filter_topk(x, k, st, en, gmax=gm, out=out, counts=counts)
    long = (en - st) > k
    assert (counts[long] < k).all()
    assert not torch.equal(out.sort(1).values, topk_reference(x, k, st, en).sort(1).values)


def test_raw_ranges_are_clamped_in_the_kernel() -> None:
    """Starts below 0 or past the row, ends past the row or before the start, and no starts (every
    row from 0): what the bisection gives after torch clamps the ranges."""
    g = _gen(100)
    R, L, k = 6, LENGTH, 100
    x = _rows("ties", R, L, g)
    st = torch.tensor([-5, 0, L + 3, 10, 7, 0], dtype=torch.int32, device=DEV)
    en = torch.tensor([L + 100, 2, L + 9, 4, L, -3], dtype=torch.int32, device=DEV)
    out, counts = _run(x, k, st, en)
    _check(x, k, st, en, out, counts)
    out, counts = _run(x, k, None, en)
    zeros = torch.zeros_like(en)
    assert torch.equal(out, topk.topk(x, k, zeros, en, method="bisect", bits=8, block=1024))


def test_filter_refuses_bad_arguments() -> None:
    x = torch.randn(2, 100, device=DEV)
    en = torch.full((2,), 100, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="k must be"):
        triton_filter.filter_topk(x, 0, None, en)
    with pytest.raises(ValueError, match="group must be a power of two"):
        triton_filter.filter_topk(x, 4, None, en, group=12)
    with pytest.raises(ValueError, match="at most block"):
        triton_filter.filter_topk(x, 4, None, en, group=64, block=32)
    with pytest.raises(ValueError, match="gmax must be int32"):
        triton_filter.filter_topk(x, 4, None, en, gmax=torch.zeros(2, 7, device=DEV))
    with pytest.raises(ValueError, match="method must be"):
        topk.topk(x, 4, None, en, method="nope")


def test_empty_rows_and_rows_shorter_than_k() -> None:
    """No rows, rows of width 0, and k above the width: start..end-1 then -1, every slot written."""
    assert triton_filter.filter_topk(
        torch.empty(0, 50, device=DEV), 4, None, torch.empty(0, device=DEV)
    ).shape == (0, 4)
    en = torch.tensor([0, 0], dtype=torch.int32, device=DEV)
    out, counts = _run(torch.empty(2, 0, device=DEV), 3, None, en)
    assert (out == -1).all() and (counts == 0).all()
    x = torch.randn(3, 40, device=DEV)
    st = torch.tensor([0, 7, 30], dtype=torch.int32, device=DEV)
    en = torch.tensor([40, 39, 40], dtype=torch.int32, device=DEV)
    out, _ = _run(x, 64, st, en)
    assert torch.equal(out, topk_reference(x, 64, st, en))


@pytest.mark.parametrize("cand_block", [None, 64])
def test_topk_dispatches_to_the_filter(cand_block: int | None) -> None:
    """``topk.topk(method="filter")`` gives ``filter_topk``'s output, also with a small
    candidate block (the chunked search), on random and tied rows."""
    g = _gen(110)
    for kind in ("random", "ties"):
        x = _rows(kind, ROWS, LENGTH, g)
        for k in (16, 512):
            st, en = _ranges(ROWS, LENGTH, k, g)
            out = torch.full((ROWS, k), POISON_IDX, dtype=torch.int32, device=DEV)
            topk.topk(x, k, st, en, method="filter", cand_block=cand_block, block=1024, out=out)
            want, counts = _run(x, k, st, en, cand_block=cand_block, block=1024)
            assert torch.equal(out, want), (kind, k)
            _check(x, k, st, en, out, counts)


def _capl(L: int, block: int, cand_block: int) -> int:
    """Launch 3's register tile: candidates a chunk (``filter_topk``'s CAPL)."""
    return max(cand_block // triton.next_power_of_2(-(-L // block)), 1)


@pytest.mark.parametrize("block", [256, 512])
def test_chunk_lists_in_the_register_tile(block: int) -> None:
    """Random rows over several chunks (starting mid-chunk, many more groups than k), every chunk's
    list within the tile (the fast path, as the model's chunk counts show) and candidates in more
    than one chunk: the lists join in order."""
    g = _gen(120 + block)
    x = _rows("random", ROWS, LENGTH, g)
    st = torch.randint(0, LENGTH // 4, (ROWS,), generator=g, device=DEV).int()
    en = torch.full((ROWS,), LENGTH, dtype=torch.int32, device=DEV)
    for k in (16, 64):
        out, counts = _run(x, k, st, en, block=block)
        _check(x, k, st, en, out, counts)
        chunks = _model_chunk_counts(x, k, st, en, block)
        assert torch.equal(counts, chunks.sum(1).int())
        assert chunks.max() <= _capl(LENGTH, block, triton_filter.filter_defaults(LENGTH, k)[1]), chunks
        assert ((chunks > 0).sum(1) > 1).all(), chunks


@pytest.mark.parametrize("kind", ["clustered", "equal", "ties"])
def test_a_chunk_over_the_tile_takes_the_slow_path(kind: str) -> None:
    """A chunk with more candidates than the tile holds (CAPL): rows whose large values all sit in
    one chunk, all-equal rows (every entry a candidate), few distinct values. Launch 3 then searches
    the chunks' lists in blocks, a small ``cand_block`` making those blocks several per chunk."""
    g = _gen(130 + len(kind))
    block, cand_block, k = 512, 256, 100
    if kind == "clustered":
        x = _rows("random", ROWS, LENGTH, g)
        x[:, 1024:1536] += 8.0  # one chunk: 32 groups, fewer than k, so candidates elsewhere too
    else:
        x = _rows(kind, ROWS, LENGTH, g)
    st, en = _ranges(ROWS, LENGTH, k, g)
    for cb in (cand_block, 64):
        out, counts = _run(x, k, st, en, block=block, cand_block=cb)
        _check(x, k, st, en, out, counts)
        chunks = _model_chunk_counts(x, k, st, en, block)
        assert torch.equal(counts, chunks.sum(1).int())
        assert (chunks.max(1).values > _capl(LENGTH, block, cb)).any(), chunks


def test_ranges_inside_and_across_chunks() -> None:
    """Rows starting mid-chunk, rows inside one chunk (shorter than a chunk), a range ending in the
    last, partial chunk, and chunks before the start or after the end (no candidates there)."""
    g = _gen(140)
    block, k = 512, 100
    ranges = [(700, 900), (500, 1100), (1020, 2900), (2600, LENGTH), (0, LENGTH), (511, 513 + k)]
    st = torch.tensor([a for a, _ in ranges], dtype=torch.int32, device=DEV)
    en = torch.tensor([b for _, b in ranges], dtype=torch.int32, device=DEV)
    for kind in ("random", "ties", "equal"):
        x = _rows(kind, len(ranges), LENGTH, g)
        for cand_block in (None, 64):
            out, counts = _run(x, k, st, en, block=block, cand_block=cand_block)
            _check(x, k, st, en, out, counts)
            assert torch.equal(counts, _model_counts(x, k, st, en)), (kind, counts.tolist())


def test_maxima_of_minus_inf_from_outside_the_range_give_no_threshold() -> None:
    """Caller maxima where entries outside the range entered as -inf, rows whose range holds fewer
    than k entries above -NaN: the k-th largest maximum is -inf, a key that is no entry of the
    range, so t must be 0 (every entry a candidate), not the top bits of key(-inf)."""
    g = _gen(150)
    R, k = 3, 100
    x = torch.full((R, LENGTH), float("-inf"), device=DEV)
    st = torch.tensor([1000, 0, 2500], dtype=torch.int32, device=DEV)
    en = torch.tensor([1400, 300, LENGTH], dtype=torch.int32, device=DEV)
    for r in range(R):  # at most k // 2 finite entries a row, whatever LENGTH is
        a, b = int(st[r]), int(en[r])
        x[r, a:b] = -float("nan")
        fin = min(b, a + 8 * (k // 2))
        x[r, a:fin:8] = torch.randn(-(-(fin - a) // 8), generator=g, device=DEV)
    gm = _partition_maxima(x, st, en, LENGTH // 12, triton_filter.KNEG, g)
    out, counts = _run(x, k, st, en, gmax=_as_int32(gm), block=512)
    _check(x, k, st, en, out, counts, reference=False)
    assert torch.equal(counts, en - st), counts.tolist()
