"""Exact and small-sample tests used to call regressions: Holm, Fisher, McNemar power.

Pure functions over counts, stdlib only (core imports neither scipy nor torch).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .stats import binomial_tail

__all__ = [
    "holm",
    "fisher_exact",
    "mcnemar_power",
    "mcnemar_pairs_needed",
    "GroupTest",
    "groups_vs_rest",
]


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values, in the input order (monotone, capped at 1)."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    out = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        out[i] = running
    return out


def _hypergeom_pmf(x: int, row1: int, col1: int, n: int) -> float:
    return math.comb(col1, x) * math.comb(n - col1, row1 - x) / math.comb(n, row1)


def fisher_exact(a: int, b: int, c: int, d: int) -> float:
    """Two-sided Fisher exact p-value of the 2x2 table [[a, b], [c, d]].

    Sums the probabilities of all tables with the same margins that are no more likely than the
    observed one (the conditional "minimum likelihood" definition R and scipy use).
    """
    row1, col1, n = a + b, a + c, a + b + c + d
    if n == 0:
        return 1.0
    lo, hi = max(0, row1 + col1 - n), min(row1, col1)
    observed = _hypergeom_pmf(a, row1, col1, n)
    # Relative tolerance so tables equal to the observed one up to rounding count as "as extreme".
    p = sum(q for x in range(lo, hi + 1) if (q := _hypergeom_pmf(x, row1, col1, n)) <= observed * (1 + 1e-7))
    return min(1.0, p)


def mcnemar_power(n: int, drop: float, alpha: float) -> float:
    """Power of the two-sided exact McNemar test to detect a recall drop of ``drop`` in n pairs.

    Assumes the drop shows as B-only misses (no A-only misses), so the discordant count is
    Binomial(n, drop), all in one direction; the test rejects once 2 * 0.5**k < alpha (the
    project's one convention: a p-value *below* alpha rejects).
    """
    if n <= 0 or drop <= 0:
        return 0.0
    k_min = max(1, math.floor(math.log2(2 / alpha)) + 1)
    if k_min > n:
        return 0.0
    drop = min(1.0, drop)
    return binomial_tail(k_min, n, drop)


def mcnemar_pairs_needed(drop: float, alpha: float, power: float = 0.8, max_pairs: int = 1000) -> int | None:
    """The fewest pairs n with ``mcnemar_power(n, drop, alpha) >= power`` (None past ``max_pairs``,
    which stays where the exact binomial sum fits a float).

    The power grows with n for a fixed drop, so the search doubles an upper bound, then bisects."""
    if drop <= 0:
        return None
    hi = 1
    while mcnemar_power(hi, drop, alpha) < power:
        hi *= 2
        if hi > max_pairs:
            return None
    lo = hi // 2  # mcnemar_power(lo) < power, or lo == 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if mcnemar_power(mid, drop, alpha) >= power:
            hi = mid
        else:
            lo = mid
    return hi


@dataclass(frozen=True)
class GroupTest:
    """One group (an endpoint, a residue class) against all the other scored cases."""

    group: str
    n: int
    correct: int
    recall: float | None
    rest_recall: float | None
    p_value: float
    p_holm: float

    def worse(self, alpha: float) -> bool:
        """Whether this group's recall is below the rest's, Holm-corrected p < ``alpha``."""
        return (
            self.p_holm < alpha
            and self.recall is not None
            and self.rest_recall is not None
            and self.recall < self.rest_recall
        )


def groups_vs_rest(outcomes: Iterable[tuple[str, bool]]) -> list[GroupTest]:
    """Fisher exact test of each group's recall against the rest, Holm-corrected across groups.

    ``outcomes`` are (group, correct) per scored case. Groups are returned sorted by name.
    """
    acc: dict[str, list[int]] = {}
    for group, correct in outcomes:
        a = acc.setdefault(group, [0, 0])
        a[0] += 1
        a[1] += int(bool(correct))
    total_n = sum(v[0] for v in acc.values())
    total_k = sum(v[1] for v in acc.values())
    names = sorted(acc)
    raw = []
    for g in names:
        n, k = acc[g]
        rn, rk = total_n - n, total_k - k
        raw.append(fisher_exact(k, n - k, rk, rn - rk))
    adjusted = holm(raw)
    out = []
    for g, p, ph in zip(names, raw, adjusted):
        n, k = acc[g]
        rn, rk = total_n - n, total_k - k
        out.append(GroupTest(g, n, k, k / n if n else None, rk / rn if rn else None, p, ph))
    return out
