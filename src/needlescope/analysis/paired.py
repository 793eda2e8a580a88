"""Paired A/B comparison of two runs over the same cases: per cell and per length bucket.

Each case was sent byte-identically to A and B, so outcomes pair up. Per group: recall of A and B,
the paired difference ``delta = recall_b - recall_a`` with a percentile bootstrap 95% interval
(cases resampled as pairs), and the two-sided exact McNemar test on the discordant pairs. Across
length buckets the McNemar p-values are Holm-corrected; ``regresses_from`` is the shortest bucket
in which B is worse with a corrected p below alpha.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .significance import holm, mcnemar_pairs_needed, mcnemar_power
from .stats import mcnemar_exact

__all__ = [
    "Pair",
    "PairedGroup",
    "paired_group",
    "compare_pairs",
    "bootstrap_delta_ci",
    "bucket_of",
    "headline",
]

TESTABLE_POWER = 0.8
"""The power below which a visible difference is reported as too few pairs to test."""


@dataclass(frozen=True)
class Pair:
    """One case scored on both sides (cases with an error on either side are not pairs)."""

    case_id: str
    length: int
    depth: float
    a: bool
    b: bool


@dataclass(frozen=True)
class PairedGroup:
    length_lo: int
    length_hi: int
    n: int
    recall_a: float
    recall_b: float
    delta: float
    ci_low: float
    ci_high: float
    p_value: float
    a_only: int
    """Pairs right on A and wrong on B (the discordant pairs that count against B)."""
    b_only: int


def bootstrap_delta_ci(
    pairs: Sequence[Pair], *, n_boot: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap interval of mean(b - a) over pairs resampled with replacement."""
    if not pairs:
        return 0.0, 0.0
    diffs = [int(p.b) - int(p.a) for p in pairs]
    if len(set(diffs)) == 1:
        return float(diffs[0]), float(diffs[0])
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(sum(rng.choices(diffs, k=n)) / n for _ in range(n_boot))
    tail = (1 - level) / 2
    lo = means[int(tail * (n_boot - 1))]
    hi = means[int(round((1 - tail) * (n_boot - 1)))]
    return lo, hi


def paired_group(pairs: Sequence[Pair], *, n_boot: int = 2000, seed: int = 0) -> PairedGroup:
    """Statistics of one group of pairs (a cell or a length bucket)."""
    n = len(pairs)
    ka = sum(p.a for p in pairs)
    kb = sum(p.b for p in pairs)
    a_only = sum(1 for p in pairs if p.a and not p.b)
    b_only = sum(1 for p in pairs if p.b and not p.a)
    lo, hi = bootstrap_delta_ci(pairs, n_boot=n_boot, seed=seed)
    lengths = [p.length for p in pairs] or [0]
    return PairedGroup(
        length_lo=min(lengths),
        length_hi=max(lengths),
        n=n,
        recall_a=ka / n if n else 0.0,
        recall_b=kb / n if n else 0.0,
        delta=(kb - ka) / n if n else 0.0,
        ci_low=lo,
        ci_high=hi,
        p_value=mcnemar_exact(a_only, b_only),
        a_only=a_only,
        b_only=b_only,
    )


def bucket_of(length: int, edges: Sequence[int]) -> int:
    """Index of the bucket [edges[i], edges[i+1]) holding ``length`` (the last bucket is closed)."""
    for i in range(len(edges) - 1, -1, -1):
        if length >= edges[i]:
            return i
    return 0


def compare_pairs(
    pairs: Iterable[Pair],
    *,
    alpha: float = 0.05,
    power_drop: float = 0.10,
    bucket_edges: Sequence[int] | None = None,
    n_boot: int = 2000,
    seed: int = 0,
) -> dict:
    """The compare.json body plus per-cell rows under ``"cells"``.

    Buckets are one per tested length unless ``bucket_edges`` (ascending lower bounds) are given.
    The verdict states the shortest corrected regression, any corrected improvement, or, when
    nothing is significant, the power to detect a ``power_drop`` drop in the smallest bucket at the
    strictest Holm level (alpha / number of buckets).
    """
    pairs = sorted(pairs, key=lambda p: (p.length, p.depth, p.case_id))
    edges = sorted(set(bucket_edges)) if bucket_edges else sorted({p.length for p in pairs})
    groups: dict[int, list[Pair]] = {}
    for p in pairs:
        groups.setdefault(bucket_of(p.length, edges), []).append(p)
    buckets = [paired_group(groups[i], n_boot=n_boot, seed=seed + i) for i in sorted(groups)]
    p_holm = holm([b.p_value for b in buckets])
    rows = []
    for b, ph in zip(buckets, p_holm):
        rows.append(
            {
                "length_lo": b.length_lo,
                "length_hi": b.length_hi,
                "n": b.n,
                "recall_a": b.recall_a,
                "recall_b": b.recall_b,
                "delta": b.delta,
                "ci_low": b.ci_low,
                "ci_high": b.ci_high,
                "p_value": b.p_value,
                "p_holm": ph,
            }
        )
    regresses_from = min(
        (r["length_lo"] for r in rows if r["p_holm"] < alpha and r["delta"] < 0), default=None
    )
    cell_groups: dict[tuple[int, float], list[Pair]] = {}
    for p in pairs:
        cell_groups.setdefault((p.length, p.depth), []).append(p)
    cells = []
    for (length, depth), ps in sorted(cell_groups.items()):
        g = paired_group(ps, n_boot=n_boot, seed=seed)
        cells.append(
            {
                "length": length,
                "depth": depth,
                "n": g.n,
                "recall_a": g.recall_a,
                "recall_b": g.recall_b,
                "delta": g.delta,
                "ci_low": g.ci_low,
                "ci_high": g.ci_high,
                "p_value": g.p_value,
            }
        )
    return {
        "cases_matched": len(pairs),
        "recall_a": sum(p.a for p in pairs) / len(pairs) if pairs else None,
        "recall_b": sum(p.b for p in pairs) / len(pairs) if pairs else None,
        "buckets": rows,
        "verdict": _verdict(rows, alpha, power_drop),
        "regresses_from": regresses_from,
        "cells": cells,
    }


def headline(result: dict, *, alpha: float, trials: int | None = None, failed: str | None = None) -> str:
    """The verdict with the recalls it compares: ``B 0.17 vs A 1.00 on 6 pairs: ...``.

    ``result``: ``compare_pairs``'s. Where nothing is significant but a bucket shows a difference
    that its pairs could not test (power below ``TESTABLE_POWER`` for a drop of the observed
    size at the Holm level), it says so and how many trials would test it (``trials``: the run's
    trials per cell; without it, the pairs the bucket would need). ``failed``: what failed on
    either side (requests with no answer); then a null result is no verdict at all."""
    rows = result["buckets"]
    numbers = f"B {result['recall_b']:.2f} vs A {result['recall_a']:.2f} on {result['cases_matched']} pairs"
    if result["regresses_from"] is not None or any(r["p_holm"] < alpha for r in rows):
        return f"{numbers}: {result['verdict']}"
    if failed:
        return f"{numbers}: no verdict, {failed}"
    level = alpha / max(1, len(rows))
    visible = [r for r in rows if r["delta"] != 0]
    if not visible:
        return f"{numbers}: {result['verdict']}"
    widest = max(visible, key=lambda r: (abs(r["delta"]), -r["length_lo"]))
    size = abs(widest["delta"])
    if mcnemar_power(widest["n"], size, level) >= TESTABLE_POWER:
        return f"{numbers}: {result['verdict']}"
    needed = mcnemar_pairs_needed(size, level, TESTABLE_POWER)
    where = f"a {round(100 * size):d}-point difference at {widest['length_lo']} tokens"
    if needed is None:
        return f"{numbers}: too few to test {where}"
    if trials is None:
        return f"{numbers}: too few to test {where}; it needs about {needed} pairs there"
    more = math.ceil(trials * needed / widest["n"])
    return f"{numbers}: too few to test {where}; rerun with --trials {more}"


def _verdict(rows: list[dict], alpha: float, power_drop: float) -> str:
    """The shortest corrected regression, any corrected improvement, or the power of a null."""
    worse = [r for r in rows if r["p_holm"] < alpha and r["delta"] < 0]
    better = [r for r in rows if r["p_holm"] < alpha and r["delta"] > 0]
    lines = []
    if worse:
        first = min(worse, key=lambda r: r["length_lo"])
        lines.append(
            f"B regresses from {first['length_lo']} tokens (p={first['p_holm']:.2g}, Holm-corrected; "
            f"recall {first['recall_a']:.2f} -> {first['recall_b']:.2f})"
        )
    if better:
        first = min(better, key=lambda r: r["length_lo"])
        lines.append(
            f"B improves from {first['length_lo']} tokens (p={first['p_holm']:.2g}, Holm-corrected; "
            f"recall {first['recall_a']:.2f} -> {first['recall_b']:.2f})"
        )
    if not lines:
        n_min = min((r["n"] for r in rows), default=0)
        power = mcnemar_power(n_min, power_drop, alpha / max(1, len(rows)))
        lines.append(
            f"no detectable difference (power to detect a {round(100 * power_drop):d}-point drop: "
            f"{power:.2f} with {n_min} pairs in the smallest bucket)"
        )
    return "; ".join(lines)
