"""An adversarial exactness suite for any top-k ``(scores, k, lengths) -> indices``, generated on the fly.

Each case is a batch of fp32 rows built to break a class of top-k kernels that public engines
shipped in 2026 (issue 40): more than 4K, 16K or 64K entries in one radix bin (equal keys, and
keys within one ulp), monotonic rows, low-contrast rows, ReLU rows whose cut-off is at 0.0,
``-inf`` padding, NaN, ``+inf``, rows shorter than k, k equal to the row length, the full 64 x
256K, k = 2048 shape, ties at the cut-off. ``SHAPES`` has two sizes: ``full`` (for a GPU) and
``small`` (every count divided by 16, for the CPU and Triton's interpreter).

The reference (``expected``) orders entries by an integer key: fp32 bits mapped so that integer
order is float order, -0.0 folded onto +0.0 (IEEE 754 totalOrder otherwise: a NaN with the sign
bit clear, the only NaN the suite writes, ranks above +inf, as in ``torch.sort``). For each row of
length n it states the expected set exactly: with kth the key of the k-th largest entry (no
kth when n <= k), every entry above kth plus ``take`` of the ``tied`` entries equal to it.

**Tie rule.** Which ``take`` of the tied entries are selected is free: a selection is exact when
it holds min(k, n) distinct indices in [0, n) whose keys are the expected multiset (a key multiset
equal to the reference's). Slots past min(k, n) hold negative indices. ``lower_index_ties`` also
reports whether the ties taken were the lowest-index ones (needlescope's kernels' rule;
``torch.topk`` promises none); it is information, not part of exactness.

Per row, with ``need`` = min(k, n): ``matched`` = selected entries above kth plus at most ``take``
selected ties; ``missed`` = need - matched (true top-k entries left out); ``wrong`` = non-negative
slots - matched (entries kept that are not in the top-k, out of range or repeated);
selected-value recall = matched / need (1 when need is 0).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch

__all__ = [
    "CASES",
    "SHAPES",
    "Case",
    "CaseResult",
    "Expected",
    "build_case",
    "cases",
    "run_case",
    "expected",
    "ordered_keys",
    "score",
]

SHAPES = {"full": 1, "small": 64}
"""Size mode -> the divisor of every count in a case (rows of the 64 x 256K case, bin sizes, k)."""

PAD_KEY = -1  # below every real key: entries at or past a row's length


@dataclass(frozen=True)
class Case:
    """One batch of rows: ``scores`` fp32 [R, W], ``lengths`` int32 [R] (row r's entries are
    columns [0, lengths[r])), ``k``; ``about`` says what it reproduces; ``params`` the counts it was
    built from (for the docs and for tests that predict a kernel's failures)."""

    name: str
    about: str
    scores: torch.Tensor
    lengths: torch.Tensor
    k: int
    params: dict


@dataclass(frozen=True)
class Expected:
    """The reference's answer for every row of a case, int64 [R] each: ``kth`` the k-th largest
    key (``PAD_KEY`` when the row has at most k entries), ``above`` entries with a larger key,
    ``tied`` entries equal to it, ``take`` how many of those belong to the top-k."""

    kth: torch.Tensor
    above: torch.Tensor
    tied: torch.Tensor
    take: torch.Tensor


@dataclass(frozen=True)
class CaseResult:
    """One case run through one implementation (module docstring for the counts). ``error``: the
    implementation raised (any exception, ``SystemExit`` included: only ``KeyboardInterrupt``
    stops the run) or returned no integer ``[R, k]`` tensor; the case then fails (``exact``
    false) and has no score: every count and recall is None, never a recall of 0 that would read
    as an implementation that answered and missed everything. ``inputs_written``: the inputs
    (``scores``, ``lengths``) the implementation changed, a finding of its own (a kernel that
    writes into its inputs corrupts the caller's logits); the selection is scored against the
    inputs as they were, kept aside, never against what the implementation left in them."""

    name: str
    rows: int
    width: int
    k: int
    exact: bool
    rows_inexact: int | None
    recall_mean: float | None
    recall_min: float | None
    worst_row: int | None
    worst_missed: int | None
    worst_wrong: int | None
    missed: int | None
    wrong: int | None
    lower_index_ties: bool | None
    error: str | None = None
    inputs_written: list[str] = field(default_factory=list)


def ordered_keys(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """fp32 [R, W] -> int64 [R, W] keys whose integer order is the float order (-0.0 = +0.0);
    ``PAD_KEY`` at and past each row's length."""
    u = scores.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    u = torch.where(u == 0x80000000, 0, u)
    key = torch.where(u >= 0x80000000, u ^ 0xFFFFFFFF, u ^ 0x80000000)
    cols = torch.arange(scores.shape[1], device=scores.device)
    return torch.where(cols < lengths.to(scores.device).long()[:, None], key, PAD_KEY)


def expected(case: Case) -> Expected:
    """The exact expected set of every row of ``case`` (``Expected``), from integer keys."""
    key = ordered_keys(case.scores, case.lengths)
    n = case.lengths.to(key.device).long()
    R, W = key.shape
    if W >= case.k:
        kth = torch.topk(key, case.k, dim=1).values[:, -1]
    else:
        kth = torch.full((R,), PAD_KEY, dtype=torch.int64, device=key.device)
    kth = torch.where(n > case.k, kth, PAD_KEY)
    valid = key != PAD_KEY
    above = (valid & (key > kth[:, None])).sum(1)
    tied = (valid & (key == kth[:, None])).sum(1)
    return Expected(kth, above, tied, torch.clamp(n, max=case.k) - above)


def _lowest_ties(key: torch.Tensor, exp: Expected, idx: torch.Tensor, sel: torch.Tensor) -> bool:
    """Whether every selected tie is among the ``take`` lowest-index entries equal to kth."""
    tie = (key == exp.kth[:, None]) & (key != PAD_KEY)
    rank = torch.cumsum(tie.long(), 1)  # 1-based rank of each tie in index order
    ok_tie = tie & (rank <= exp.take[:, None])
    picked = sel & tie.gather(1, idx)
    return bool((~picked | ok_tie.gather(1, idx)).all())


def score(case: Case, indices: torch.Tensor, exp: Expected | None = None) -> CaseResult:
    """``indices`` (int [R, k] from the implementation under test) against the reference."""
    exp = expected(case) if exp is None else exp
    key = ordered_keys(case.scores, case.lengths)
    R, W = key.shape
    idx = indices.to(device=key.device, dtype=torch.int64)
    filled = idx >= 0
    n = case.lengths.to(key.device).long()
    in_range = filled & (idx < n[:, None])
    # Each in-range index counted once: sorted, a repeat is an index equal to its predecessor.
    srt = torch.where(in_range, idx, -1).sort(1).values
    first = srt >= 0
    first[:, 1:] &= srt[:, 1:] != srt[:, :-1]
    got = key.gather(1, srt.clamp(min=0))
    got_above = (first & (got > exp.kth[:, None])).sum(1)
    got_tied = (first & (got == exp.kth[:, None]) & (got != PAD_KEY)).sum(1)
    matched = got_above + torch.minimum(got_tied, exp.take)
    need = torch.clamp(n, max=case.k)
    missed = need - matched
    wrong = filled.sum(1) - matched
    recall = torch.where(need > 0, matched.double() / need.clamp(min=1).double(), 1.0)
    bad = (missed > 0) | (wrong > 0)
    worst = int(torch.argmin(recall - 1e-9 * wrong.double()))
    return CaseResult(
        name=case.name,
        rows=R,
        width=W,
        k=case.k,
        exact=not bool(bad.any()),
        rows_inexact=int(bad.sum()),
        recall_mean=float(recall.mean()),
        recall_min=float(recall.min()),
        worst_row=worst,
        worst_missed=int(missed[worst]),
        worst_wrong=int(wrong[worst]),
        missed=int(missed.sum()),
        wrong=int(wrong.sum()),
        lower_index_ties=_lowest_ties(key, exp, srt.clamp(min=0), first),
    )


def failed(case: Case, error: str, inputs_written: list[str] | None = None) -> CaseResult:
    """The result of a case whose implementation raised or returned a malformed answer."""
    R, W = case.scores.shape
    return CaseResult(case.name, R, W, case.k, False, *[None] * 9, error, inputs_written or [])


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (NaN payloads and -0.0 included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _written(case: Case, scores: torch.Tensor, lengths: torch.Tensor) -> list[str]:
    """The inputs whose copies handed to the implementation differ from the case's own."""
    given = {"scores": (case.scores, scores), "lengths": (case.lengths, lengths)}
    return [name for name, (kept, handed) in given.items() if not _bits_equal(kept, handed)]


def _integer(t: torch.Tensor) -> bool:
    """An integer dtype (bool and complex are not indices)."""
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


TopK = Callable[[torch.Tensor, int, torch.Tensor], torch.Tensor]


def run_case(impl: TopK, case: Case, exp: Expected | None = None) -> CaseResult:
    """``impl(scores, k, lengths)`` on copies of one case's inputs, scored against the case's own
    (kept aside, so an implementation that writes into its inputs can neither change its own score
    nor hand a changed case to the next implementation; the inputs it wrote are named in
    ``inputs_written``). A raised exception (any ``BaseException`` but ``KeyboardInterrupt``, the
    user's Ctrl-C, which stops the run) or an answer that is not an integer [R, k] tensor becomes
    the case's ``error`` (the case fails; nothing is hidden)."""
    scores, lengths = case.scores.clone(), case.lengths.clone()
    try:
        out = impl(scores, case.k, lengths)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # arbitrary code under test (sys.exit included): report, never hide
        return failed(case, f"{type(e).__name__}: {e}", _written(case, scores, lengths))
    wrote = _written(case, scores, lengths)
    R = case.scores.shape[0]
    if not isinstance(out, torch.Tensor) or out.shape != (R, case.k) or not _integer(out):
        got = (
            f"a {str(out.dtype).removeprefix('torch.')} tensor of shape {list(out.shape)}"
            if isinstance(out, torch.Tensor)
            else f"a {type(out).__name__}"
        )
        return failed(case, f"expected an integer tensor [{R}, {case.k}], got {got}", wrote)
    result = score(case, out, exp)
    return replace(result, inputs_written=wrote)


# --- the cases --------------------------------------------------------------------------------


def _ulps(base: float, steps: torch.Tensor) -> torch.Tensor:
    """fp32 values ``steps`` ulps above positive ``base`` (steps int64, any shape)."""
    b = torch.tensor([base], dtype=torch.float32).view(torch.int32).to(torch.int64)
    return (b.to(steps.device) + steps).to(torch.int32).view(torch.float32)


def _below(shape: tuple[int, ...], g: torch.Generator, dev) -> torch.Tensor:
    """Background scores in [-5, -1): in other radix bins than anything at or above 1.0."""
    return -1.0 - 4.0 * torch.rand(shape, generator=g, device=dev)


def _placement(row: int, members: int, width: int, g: torch.Generator, dev) -> torch.Tensor:
    """Columns of a bin's ``members`` entries in row ``row``, in index order: a block at the
    start, scattered, a block at the end, or strided (rows cycle through the four)."""
    kind = row % 4
    if kind == 0:
        return torch.arange(members, device=dev)
    if kind == 2:
        return torch.arange(width - members, width, device=dev)
    if kind == 3:
        return torch.arange(members, device=dev) * (width // members)
    return torch.randperm(width, generator=g, device=dev)[:members].sort().values


def _one_bin(size: int, exact: bool, d: int, g: torch.Generator, dev) -> Case:
    """Rows where ``size`` (over 4K/16K/64K at full size) entries share one radix bin: they lie at
    1.0 and a few ulps above, so every leading digit of 8-20 bits is the same. ``exact``: all at
    1.0 but the ``higher`` last ones in index order (1..8 ulps up; a buffer keeping first arrivals
    drops those); else 1.0 or one ulp up, the ``higher`` ones (one ulp) scattered among them, the
    last one in index order among them."""
    R, k, width = 4, 2048 // d, max(4 * size, 32768) // d
    members, above, higher = size // d + 1, 1000 // d, 500 // d
    scores = _below((R, width), g, dev)
    for r in range(R):
        cols = _placement(r, members, width, g, dev)
        if exact:
            steps = torch.zeros(members, dtype=torch.int64, device=dev)
            steps[-higher:] = torch.randint(1, 9, (higher,), generator=g, device=dev)
        else:
            steps = torch.zeros(members, dtype=torch.int64, device=dev)
            steps[torch.randperm(members - 1, generator=g, device=dev)[: higher - 1]] = 1
            steps[-1] = 1  # the last arrival is one of them: dropping it is always wrong
        scores[r, cols] = _ulps(1.0, steps)
        rest = torch.ones(width, dtype=torch.bool, device=dev)
        rest[cols] = False
        free = rest.nonzero().flatten()
        pick = free[torch.randperm(free.numel(), generator=g, device=dev)[:above]]
        scores[r, pick] = 2.0 + torch.rand(above, generator=g, device=dev)
    kind = "equal keys" if exact else "keys within one ulp"
    return Case(
        f"bin-{size // 1024}k-{'exact' if exact else 'ulp'}",
        f"{members} entries share one radix bin ({kind}); the cut-off falls inside it",
        scores,
        torch.full((R,), width, dtype=torch.int32, device=dev),
        k,
        {"members": members, "above": above, "higher": higher, "higher_last": exact},
    )


def _monotonic(length: int, ascending: bool, d: int, g: torch.Generator, dev) -> Case:
    """Consecutive fp32 values from 1.0 up (one ulp apart: one radix bin), ascending or descending."""
    n = length // d
    steps = torch.arange(n, device=dev) if ascending else torch.arange(n - 1, -1, -1, device=dev)
    scores = _ulps(1.0, steps).expand(2, n).contiguous()
    return Case(
        f"monotonic-{'ascending' if ascending else 'descending'}-{length}",
        f"{n} consecutive fp32 values, {'ascending' if ascending else 'descending'} (b12x PR #55's sizes)",
        scores,
        torch.full((2,), n, dtype=torch.int32, device=dev),
        2048 // d,
        {"length": n},
    )


def _low_contrast(length: int, d: int, g: torch.Generator, dev) -> Case:
    """Every score within 3 ulps of 1.0, uniformly: a few huge tie groups."""
    n = length // d
    scores = _ulps(1.0, torch.randint(0, 4, (4, n), generator=g, device=dev))
    return Case(
        f"low-contrast-{length}",
        f"{n} scores all within 3 ulps of 1.0",
        scores,
        torch.full((4,), n, dtype=torch.int32, device=dev),
        2048 // d,
        {"length": n},
    )


def _relu(d: int, g: torch.Generator, dev) -> Case:
    """ReLU rows: fewer positive entries than k, so the cut-off is at 0.0 (-0.0 mixed in)."""
    R, width, k = 4, 32768 // d, 2048 // d
    positives = (1500 // d, k - 1, k // 2, 1)
    scores = torch.zeros(R, width, device=dev)
    scores[:, 1::3] = -0.0
    for r, p in enumerate(positives):
        cols = torch.randperm(width, generator=g, device=dev)[:p]
        scores[r, cols] = torch.rand(p, generator=g, device=dev) + 1e-3
    return Case(
        "relu-zeros",
        f"{width - max(positives)}+ exact zeros (+0.0 and -0.0) at the cut-off, {min(positives)}-{max(positives)} positives",
        scores,
        torch.full((R,), width, dtype=torch.int32, device=dev),
        k,
        {"positives": list(positives)},
    )


def _neg_inf_padding(d: int, g: torch.Generator, dev) -> Case:
    """Finite scores, then -inf to the row's end; finite counts around k (cut-off at -inf when fewer)."""
    k, width = 2048 // d, 65536 // d
    finite = (k // 2, k - 1, k, k + 1, 3 * k, width)
    scores = torch.randn(len(finite), width, generator=g, device=dev)
    for r, f in enumerate(finite):
        scores[r, f:] = float("-inf")
    lengths = torch.tensor([width, width, width - 7, width, width // 2, width], dtype=torch.int32, device=dev)
    return Case(
        "neg-inf-padding",
        "rows padded with -inf, finite entries fewer than, equal to and more than k",
        scores,
        lengths,
        k,
        {"finite": list(finite)},
    )


def _past_length(d: int, g: torch.Generator, dev) -> Case:
    """Huge scores (and +inf) past each row's length, which must never be selected."""
    k, width = 2048 // d, 65536 // d
    lengths = torch.tensor([width // 2, k + 1, k, 3], dtype=torch.int32, device=dev)
    scores = torch.randn(4, width, generator=g, device=dev)
    cols = torch.arange(width, device=dev)
    scores = torch.where(cols < lengths[:, None], scores, 1e30)
    scores[:, -1] = float("inf")
    return Case("past-length", "1e30 and +inf past each row's length", scores, lengths, k, {})


def _planted(
    name: str, about: str, value: float, counts, d: int, g: torch.Generator, dev, neg_inf_every=0
) -> Case:
    """Random normal rows of 64K (full size) with ``counts(k)[r]`` entries of row r set to ``value``
    (and every ``neg_inf_every``-th entry -inf first, if set)."""
    k, width = 2048 // d, 65536 // d
    per_row = counts(k)
    scores = torch.randn(len(per_row), width, generator=g, device=dev)
    if neg_inf_every:
        scores[:, ::neg_inf_every] = float("-inf")
    for r, count in enumerate(per_row):
        scores[r, torch.randperm(width, generator=g, device=dev)[:count]] = value
    lengths = torch.full((len(per_row),), width, dtype=torch.int32, device=dev)
    return Case(name, about, scores, lengths, k, {"planted": per_row})


def _nan(d: int, g: torch.Generator, dev) -> Case:
    """A few NaNs (rank above +inf), and a row with more NaNs than k (the cut-off among NaNs)."""
    about = "1, 3, k/2 and k+5 NaNs a row (NaN ranks above +inf)"
    return _planted("nan", about, float("nan"), lambda k: [1, 3, k // 2, k + 5], d, g, dev)


def _pos_inf(d: int, g: torch.Generator, dev) -> Case:
    """+inf entries: a few, k - 1, k and more than k (ties at +inf), with -inf mixed in."""
    about = "2, k-1, k and 2k +inf entries a row, every fifth entry -inf"
    return _planted("pos-inf", about, float("inf"), lambda k: [2, k - 1, k, 2 * k], d, g, dev, 5)


def _short_rows(d: int, g: torch.Generator, dev) -> Case:
    k = 2048 // d
    lengths = torch.tensor([0, 1, k // 2, k - 1], dtype=torch.int32, device=dev)
    scores = torch.randn(4, 2 * k, generator=g, device=dev)
    return Case("shorter-than-k", "rows of 0, 1, k/2 and k-1 entries", scores, lengths, k, {})


def _k_is_length(d: int, g: torch.Generator, dev) -> Case:
    k = 2048 // d
    scores = torch.randn(4, k, generator=g, device=dev)
    scores[1] = 0.0
    return Case(
        "k-equals-length",
        "rows of exactly k entries (one all zeros)",
        scores,
        torch.full((4,), k, dtype=torch.int32, device=dev),
        k,
        {},
    )


def _full_shape(d: int, g: torch.Generator, dev) -> Case:
    R, width, k = 64 // min(d, 16), 262144 // d, 2048 // d
    return Case(
        "full-64x256k",
        f"{R} x {width} random normal rows, k = {k} (sglang#36807's shape at full size)",
        torch.randn(R, width, generator=g, device=dev),
        torch.full((R,), width, dtype=torch.int32, device=dev),
        k,
        {},
    )


def _ties(d: int, g: torch.Generator, dev) -> Case:
    """Scores rounded to halves: the k-th value is shared by thousands of entries."""
    R, width, k = 8, 32768 // d, 2048 // d
    scores = (torch.randn(R, width, generator=g, device=dev) * 2).round() / 2
    scores[:, ::7] = -0.0
    return Case(
        "ties-at-cutoff",
        "scores rounded to halves (-0.0 and +0.0 among them): thousands tied at the k-th value",
        scores,
        torch.full((R,), width, dtype=torch.int32, device=dev),
        k,
        {},
    )


CASES: dict[str, Callable[[int, torch.Generator, torch.device], Case]] = {
    "bin-4k-exact": lambda d, g, dev: _one_bin(4096, True, d, g, dev),
    "bin-4k-ulp": lambda d, g, dev: _one_bin(4096, False, d, g, dev),
    "bin-16k-exact": lambda d, g, dev: _one_bin(16384, True, d, g, dev),
    "bin-16k-ulp": lambda d, g, dev: _one_bin(16384, False, d, g, dev),
    "bin-64k-exact": lambda d, g, dev: _one_bin(65536, True, d, g, dev),
    "bin-64k-ulp": lambda d, g, dev: _one_bin(65536, False, d, g, dev),
    "monotonic-ascending-16448": lambda d, g, dev: _monotonic(16448, True, d, g, dev),
    "monotonic-descending-16448": lambda d, g, dev: _monotonic(16448, False, d, g, dev),
    "monotonic-ascending-32768": lambda d, g, dev: _monotonic(32768, True, d, g, dev),
    "monotonic-descending-32768": lambda d, g, dev: _monotonic(32768, False, d, g, dev),
    "low-contrast-16448": lambda d, g, dev: _low_contrast(16448, d, g, dev),
    "low-contrast-32768": lambda d, g, dev: _low_contrast(32768, d, g, dev),
    "relu-zeros": _relu,
    "neg-inf-padding": _neg_inf_padding,
    "past-length": _past_length,
    "nan": _nan,
    "pos-inf": _pos_inf,
    "shorter-than-k": _short_rows,
    "k-equals-length": _k_is_length,
    "ties-at-cutoff": _ties,
    "full-64x256k": _full_shape,
}
"""Case name -> builder(divisor, generator, device). Names give the full-size counts."""


def build_case(name: str, shapes: str = "full", device: str | torch.device = "cpu", seed: int = 0) -> Case:
    """The case ``name`` at ``shapes`` (a key of ``SHAPES``) on ``device``, from ``seed``."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed + sum(map(ord, name)))
    return CASES[name](SHAPES[shapes], g, dev)


def cases(
    shapes: str = "full", device: str | torch.device = "cpu", names: list[str] | None = None, seed: int = 0
) -> Iterator[Case]:
    """Every case (or ``names``, in ``CASES`` order), built one at a time so that only one case's
    rows are in memory at once."""
    unknown = set(names or ()) - set(CASES)
    if unknown:
        raise ValueError(f"unknown case(s) {sorted(unknown)}; the cases are {', '.join(CASES)}")
    if shapes not in SHAPES:
        raise ValueError(f"shapes must be one of {', '.join(SHAPES)}, got {shapes!r}")
    for name in CASES:
        if names is None or name in names:
            yield build_case(name, shapes, device, seed)
