"""Planning and reading a collapse bisection over prompt lengths (pure; the runner sends the cases).

The search: a coarse grid over [lo, hi]; the first grid length whose pooled recall is below the
threshold, with the grid length before it passing, brackets the boundary; binary search narrows
the bracket to ``resolution`` tokens; then fine offsets around the boundary and around the nearest
multiples of each kernel boundary (page size, window, compression ratio, ratio x index_topk).

**Evidence per step.** A bracket (last passing, first failing) is accepted, and a binary step
narrows it, only when the recall at its two ends differs significantly (``ends_differ``: Fisher's
exact test, two-sided, ``p < alpha``); one miss never moves it. The final bracket carries the
Wilson intervals of its ends and ``crossing_confidence``: ``1 - P(X >= k_pass) - P(X <= k_fail)``
with X binomial at the threshold, a Bonferroni lower bound on the confidence that recall is at or
above the threshold at the passing end *and* below it at the failing end, so that (if recall falls
monotonically with length) the true crossing lies inside. The ends are chosen by the data, so this
level is nominal; docs/compare.md gives its simulated coverage.

**Residue classes.** Small moduli (at most ``RESIDUE_MAX_MOD``) get runs of consecutive lengths;
each run is a stratum (it holds every class mod m once, at nearly the same length), and each class
is tested against the rest of its strata by the exact conditional test of a common odds ratio
(``stratified_class_test``: the sum over strata of the class's correct answers, hypergeometric in
each stratum), one-sided (worse than the rest). ``correct_residues`` Holm-corrects every class of
every modulus of one bisection together.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from .significance import fisher_exact, holm
from .stats import binomial_tail, wilson_interval

__all__ = [
    "RESIDUE_MAX_MOD",
    "cases_for_ci_width",
    "coarse_grid",
    "bracket",
    "midpoint",
    "fine_lengths",
    "residue_runs",
    "residue_test",
    "stratified_class_test",
    "correct_residues",
    "ends_differ",
    "end_evidence",
    "crossing_confidence",
    "boundaries_from_server_info",
    "full_grid_points",
    "ints_in",
    "RATIO_KEYS",
]

RESIDUE_MAX_MOD = 16
Tally = Mapping[int, tuple[int, int]]
"""length -> (correct, n) pooled over depths and trials."""


def cases_for_ci_width(width: float, threshold: float, z: float = 1.959964) -> int:
    """Scored cases per length so a recall near ``threshold`` has a 95% interval about ``width`` wide.

    Normal approximation n = (2 z)^2 p (1 - p) / width^2, at least 1.
    """
    if not 0 < width < 1:
        raise ValueError(f"width must lie in (0, 1); got {width}")
    p = min(max(threshold, 0.05), 0.95)
    return max(1, math.ceil((2 * z) ** 2 * p * (1 - p) / width**2))


def coarse_grid(lo: int, hi: int, points: int) -> list[int]:
    """``points`` lengths spread evenly over [lo, hi], both ends included, no duplicates."""
    if points < 2 or hi <= lo:
        return sorted({lo, hi})
    return sorted({round(lo + i * (hi - lo) / (points - 1)) for i in range(points)})


def _passes(tally: Tally, length: int, threshold: float) -> bool:
    k, n = tally[length]
    return n > 0 and k / n >= threshold


def bracket(tally: Tally, threshold: float) -> tuple[int, int] | None:
    """(last passing, first failing) adjacent tested lengths, scanning up from the shortest.

    None when the shortest tested length already fails or no tested length fails.
    """
    lengths = sorted(length for length, (_k, n) in tally.items() if n > 0)
    for prev, cur in zip(lengths, lengths[1:]):
        if not _passes(tally, prev, threshold):
            return None
        if not _passes(tally, cur, threshold):
            return prev, cur
    return None


def midpoint(last_pass: int, first_fail: int, resolution: int) -> int | None:
    """The next length to test inside the bracket, or None once it is ``resolution`` wide or less."""
    if first_fail - last_pass <= resolution:
        return None
    return (last_pass + first_fail) // 2


def fine_lengths(first_fail: int, boundaries: Iterable[int], lo: int, hi: int) -> list[int]:
    """Offsets around the boundary (+-1) and around the multiple of each boundary nearest to it."""
    out = {first_fail - 1, first_fail + 1}
    for m in boundaries:
        if m < 2:
            continue
        near = max(m, round(first_fail / m) * m)
        out.update((near - 1, near, near + 1))
    return sorted(x for x in out if lo <= x <= hi)


def residue_runs(modulus: int, lo: int, hi: int, bases: int) -> list[list[int]]:
    """``bases`` runs of ``modulus`` consecutive lengths spread over [lo, hi] (the strata of the
    residue test); every class mod m appears once per full run."""
    top = max(lo, hi - modulus + 1)
    starts = coarse_grid(lo, top, bases) if bases > 1 else [lo]
    return [[s + i for i in range(modulus) if s + i <= hi] for s in starts]


def _hypergeom(k: int, N: int, K: int, n: int) -> float:
    """P(k of the n drawn are correct) when K of N are correct (drawn without replacement);
    0 outside the support (``math.comb`` is 0 when asked for more than there are)."""
    return math.comb(K, k) * math.comb(N - K, n - k) / math.comb(N, n)


def stratified_class_test(strata: Sequence[tuple[int, int, int, int]]) -> float:
    """One-sided exact p that a class is worse than the rest over strata of
    ``(class_correct, class_n, rest_correct, rest_n)``: P(T <= t) for T the class's correct
    answers summed over strata, each hypergeometric given its stratum's margins."""
    dist = [1.0]
    t = 0
    for kc, nc, kr, nr in strata:
        N, K = nc + nr, kc + kr
        pmf = [_hypergeom(k, N, K, nc) for k in range(nc + 1)]
        out = [0.0] * (len(dist) + nc)
        for i, p in enumerate(dist):
            if p:
                for k, q in enumerate(pmf):
                    out[i + k] += p * q
        dist, t = out, t + kc
    return min(1.0, math.fsum(dist[: t + 1]))


def residue_test(runs: Sequence[Tally], modulus: int) -> dict:
    """Recall by length mod ``modulus`` over ``runs`` (each a stratum: length -> (correct, n)),
    each class against the rest of its strata (``stratified_class_test``); uncorrected."""
    classes = []
    for r in range(modulus):
        strata = []
        for run in runs:
            kc = sum(k for n, (k, _m) in run.items() if n % modulus == r)
            nc = sum(m for n, (_k, m) in run.items() if n % modulus == r)
            kt = sum(k for k, _m in run.values())
            nt = sum(m for _k, m in run.values())
            if nc and nt - nc:
                strata.append((kc, nc, kt - kc, nt - nc))
        n = sum(s[1] for s in strata)
        k = sum(s[0] for s in strata)
        rest_n = sum(s[3] for s in strata)
        classes.append(
            {
                "residue": r,
                "n": n,
                "correct": k,
                "recall": k / n if n else None,
                "rest_recall": sum(s[2] for s in strata) / rest_n if rest_n else None,
                "p": stratified_class_test(strata) if strata else 1.0,
            }
        )
    return {"modulus": modulus, "strata": len(runs), "classes": classes}


def correct_residues(tests: list[dict], alpha: float = 0.05) -> list[dict]:
    """Holm across every class of every modulus; ``flagged``: classes worse than the rest with a
    corrected p below ``alpha``; ``p_value``: the modulus's smallest corrected p."""
    flat = [c for t in tests for c in t["classes"]]
    for c, ph in zip(flat, holm([c["p"] for c in flat]), strict=True):
        c["p_holm"] = ph
    for t in tests:
        t["flagged"] = [c["residue"] for c in t["classes"] if c["p_holm"] < alpha]
        t["p_value"] = min((c["p_holm"] for c in t["classes"]), default=1.0)
    return tests


def end_evidence(tally: Tally, length: int) -> dict:
    """One bracket end: its counts, recall and Wilson 95% interval."""
    k, n = tally[length]
    lo, hi = wilson_interval(k, n)
    return {
        "length": length,
        "correct": k,
        "n": n,
        "recall": k / n if n else None,
        "ci_low": lo,
        "ci_high": hi,
    }


def ends_differ(tally: Tally, last_pass: int, first_fail: int, alpha: float) -> tuple[bool, float]:
    """Whether recall at the two ends of a bracket differs significantly (Fisher exact, p < alpha)."""
    ka, na = tally[last_pass]
    kb, nb = tally[first_fail]
    p = fisher_exact(ka, na - ka, kb, nb - kb)
    return p < alpha and ka * nb > kb * na, p


def crossing_confidence(tally: Tally, last_pass: int, first_fail: int, threshold: float) -> float:
    """Bonferroni confidence that recall is >= threshold at ``last_pass`` and < it at
    ``first_fail`` (module doc); 0 when the counts cannot support it."""
    ka, na = tally[last_pass]
    kb, nb = tally[first_fail]
    hold = binomial_tail(ka, na, threshold)  # P(X >= k_pass) at recall = threshold
    fall = 1.0 - binomial_tail(kb + 1, nb, threshold)  # P(X <= k_fail)
    return max(0.0, 1.0 - hold - fall)


def ints_in(value: object) -> list[int]:
    """Every int in ``value`` (an int, or nested lists and dict values; bools are not ints)."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, dict):
        return [x for v in value.values() for x in ints_in(v)]
    if isinstance(value, list):
        return [x for v in value for x in ints_in(v)]
    return []


_BOUNDARY_KEYS = ("page_size", "sliding_window", "window", "window_size", "sliding_window_size")
RATIO_KEYS = ("compress_ratio", "compress_ratios", "compress_rates", "compression_ratio")


def boundaries_from_server_info(info: Mapping) -> list[int]:
    """Kernel-relevant lengths a server reports: page size, window, compression ratios, and each
    ratio x ``index_topk``. Looks at the top level and at ``args`` / ``config`` / ``server_args``."""
    scopes = [info] + [info[k] for k in ("args", "config", "server_args") if isinstance(info.get(k), dict)]
    found: set[int] = set()
    ratios: set[int] = set()
    topk: set[int] = set()
    for s in scopes:
        for k in _BOUNDARY_KEYS:
            found.update(ints_in(s.get(k)))
        for k in RATIO_KEYS:
            ratios.update(ints_in(s.get(k)))
        topk.update(ints_in(s.get("index_topk")))
    found |= ratios
    found |= {r * t for r in ratios for t in topk}
    return sorted(x for x in found if x >= 2)


def full_grid_points(lo: int, hi: int, resolution: int) -> int:
    """Lengths a plain grid over [lo, hi] at step ``resolution`` tests."""
    return (hi - lo) // resolution + 1


def pooled(rows: Iterable[tuple[int, bool]]) -> dict[int, tuple[int, int]]:
    """(length, correct) per scored case -> length -> (correct, n)."""
    acc: dict[int, list[int]] = {}
    for length, correct in rows:
        a = acc.setdefault(length, [0, 0])
        a[0] += int(bool(correct))
        a[1] += 1
    return {k: (v[0], v[1]) for k, v in sorted(acc.items())}


def tally_slice(tally: Tally, lengths: Sequence[int]) -> dict[int, tuple[int, int]]:
    return {x: tally[x] for x in lengths if x in tally}
