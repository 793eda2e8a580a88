"""Engine state as a factor: paired effects of one change (cache, concurrency, repetition) on recall
and on the answer's margin. Pure.

Each case is sent in both arms of a factor, so outcomes pair up. Recall uses ``analysis.paired``
(exact McNemar on the discordant pairs, bootstrap interval of the difference). The margin of an
answer is its least confident token: the minimum over generated tokens of the chosen token's
logprob minus the best other alternative's (nats; a greedy answer's margin is >= 0, and a small
one means a tiny numerical change could flip a token). Its paired difference gets a percentile
bootstrap interval and a two-sided sign-flip permutation test (exact up to 16 pairs).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .oracle import first_difference
from .paired import Pair, paired_group

__all__ = ["ArmRow", "answer_margin", "paired_mean_delta", "factor_effect"]


@dataclass(frozen=True)
class ArmRow:
    """One case's outcome in one arm (``correct`` None: the request failed, not a miss)."""

    case_id: str
    length: int
    depth: float
    correct: bool | None
    margin: float | None
    cached_tokens: int | None
    tokens: tuple[str, ...]


def answer_margin(steps: Sequence[tuple[str, float, Mapping[str, float]]]) -> float | None:
    """min over ``(token, logprob, top)`` steps of logprob minus the best other token in ``top``."""
    margins = []
    for token, logprob, top in steps:
        others = [v for t, v in top.items() if t != token]
        if others:
            margins.append(logprob - max(others))
    return min(margins) if margins else None


def _sign_flip_p(diffs: Sequence[float], n_perm: int, rng: random.Random) -> float:
    """Two-sided p of mean(diffs) under random sign flips (exact enumeration up to 16 diffs)."""
    observed = abs(sum(diffs))
    if len(diffs) <= 16:
        flips = itertools.product((1, -1), repeat=len(diffs))
        total = hits = 0
        for signs in flips:
            total += 1
            hits += abs(sum(s * d for s, d in zip(signs, diffs, strict=True))) >= observed - 1e-12
        return hits / total
    hits = sum(
        abs(sum(d if rng.random() < 0.5 else -d for d in diffs)) >= observed - 1e-12 for _ in range(n_perm)
    )
    return (hits + 1) / (n_perm + 1)


def paired_mean_delta(
    a: Sequence[float], b: Sequence[float], *, n_boot: int = 2000, n_perm: int = 10000, seed: int = 0
) -> dict:
    """Mean of ``b - a`` over pairs, its bootstrap 95% interval and sign-flip p-value."""
    diffs = [y - x for x, y in zip(a, b, strict=True)]
    n = len(diffs)
    if not n:
        return {
            "n": 0,
            "mean_a": None,
            "mean_b": None,
            "delta": None,
            "ci_low": None,
            "ci_high": None,
            "p_value": None,
        }
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(diffs, k=n)) / n for _ in range(n_boot))
    return {
        "n": n,
        "mean_a": sum(a) / n,
        "mean_b": sum(b) / n,
        "delta": sum(diffs) / n,
        "ci_low": means[int(0.025 * (n_boot - 1))],
        "ci_high": means[int(round(0.975 * (n_boot - 1)))],
        "p_value": 1.0 if all(d == 0 for d in diffs) else _sign_flip_p(diffs, n_perm, rng),
    }


def factor_effect(arm_a: Sequence[ArmRow], arm_b: Sequence[ArmRow], *, seed: int = 0) -> dict:
    """Paired recall and margin statistics of arm B against arm A, plus how often the two
    answers differ and where (cases failed on either side are left out and counted)."""
    by_id = {r.case_id: r for r in arm_a}
    both = [(by_id[r.case_id], r) for r in arm_b if r.case_id in by_id]
    ok = [(x, y) for x, y in both if x.correct is not None and y.correct is not None]
    g = paired_group(
        [Pair(x.case_id, x.length, x.depth, bool(x.correct), bool(y.correct)) for x, y in ok], seed=seed
    )
    margins = [(x.margin, y.margin) for x, y in ok if x.margin is not None and y.margin is not None]
    diffs = [first_difference(x.tokens, y.tokens) for x, y in ok]
    return {
        "pairs": len(ok),
        "errors": len(both) - len(ok),
        "recall_a": g.recall_a,
        "recall_b": g.recall_b,
        "recall_delta": g.delta,
        "recall_ci": [g.ci_low, g.ci_high],
        "mcnemar_p": g.p_value,
        "a_only": g.a_only,
        "b_only": g.b_only,
        "margin": paired_mean_delta([m[0] for m in margins], [m[1] for m in margins], seed=seed),
        "answers_differ": sum(d is not None for d in diffs),
        "first_differing_tokens": sorted(d for d in diffs if d is not None),
        "cached_tokens_a": _mean([x.cached_tokens for x, _ in ok]),
        "cached_tokens_b": _mean([y.cached_tokens for _, y in ok]),
    }


def _mean(xs: Sequence[int | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None
