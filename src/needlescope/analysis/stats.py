"""Small, dependency-free statistics for recall estimates."""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["wilson_interval", "mcnemar_exact", "binomial_tail", "mean_present", "jaccard"]


def wilson_interval(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval for k successes of n; (0.0, 1.0) when n == 0 (nothing is known)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # The bounds are exactly 0 / 1 at k == 0 / k == n; pin them so float rounding cannot show 0.9999.
    lo = 0.0 if k == 0 else max(0.0, centre - half)
    hi = 1.0 if k == n else min(1.0, centre + half)
    return lo, hi


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts b and c (binomial, p=0.5)."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), exact; 1.0 for k <= 0."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    return min(1.0, sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1)))


def mean_present(xs) -> float | None:
    """The mean of the values that are not None; None when there are none."""
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


def jaccard(a: Iterable[int], b: Iterable[int]) -> float:
    """|a & b| / |a | b| of two collections taken as sets; 1.0 for two empty ones. The one
    overlap measure of top-k selections (the live comparison, the rank paths)."""
    sa, sb = set(a), set(b)
    return len(sa & sb) / len(sa | sb) if sa | sb else 1.0
