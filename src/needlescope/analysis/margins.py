"""The graded signal: how surely a model prefers the gold answer, token by token.

Recall saturates (every case right) long before a precision change stops mattering; the margin by
which the gold token beats its strongest rival keeps moving. Everything here is a pure function
over numbers a server returned (no I/O, stdlib only), so the probe, ``compare`` and the logprob
oracle score the same way.

Terms (natural-log units, "nats"):
- a gold token's **logprob** is the model's log-probability of that token, teacher-forced on the
  prompt and the gold tokens before it;
- its **rank** is 1 when no other token is more likely (None when it lies beyond the alternatives
  the server returned);
- its **margin** is its logprob minus the best *other* token's: positive when gold wins that
  position, negative when a rival would be chosen greedily;
- an answer's **margin** is its smallest token margin (a greedy decode keeps the whole answer only
  if every token wins), its **gold logprob** the sum of its tokens' logprobs.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist

from .paired import bucket_of
from .significance import holm

__all__ = [
    "TokenScore",
    "token_score",
    "answer_score",
    "margin_summary",
    "quantile",
    "wilcoxon_signed_rank",
    "paired_differences",
    "group_margins",
    "detectable_shift",
    "compare_margins",
    "hodges_lehmann",
    "margin_direction",
]


@dataclass(frozen=True)
class TokenScore:
    """One gold token at its position."""

    logprob: float
    rank: int | None
    best_other: float | None
    """The highest logprob of any other token there; None when the server returned no rival."""

    @property
    def margin(self) -> float | None:
        return None if self.best_other is None else self.logprob - self.best_other


def token_score(
    gold: Hashable, logprob: float, alternatives: Mapping[Hashable, float], rank: int | None = None
) -> TokenScore:
    """Score gold token ``gold`` (an id or its text) from the top alternatives at its position.

    ``alternatives`` maps tokens to logprobs (the server's top-k there, which may or may not hold
    ``gold``). ``rank`` is the server's own rank when it gives one; otherwise it is derived, and is
    None when ``gold`` is not among the alternatives and all of them are likelier (it lies beyond
    the top-k). The best other is the likeliest alternative that is not ``gold``.
    """
    others = [v for k, v in alternatives.items() if k != gold]
    best = max(others) if others else None
    if rank is None:
        ahead = sum(1 for v in others if v > logprob)
        in_list = gold in alternatives or ahead < len(others)
        rank = 1 + ahead if in_list else None
    return TokenScore(logprob=float(logprob), rank=rank, best_other=None if best is None else float(best))


def answer_score(tokens: Sequence[TokenScore]) -> dict:
    """The per-case graded record of one gold answer (its tokens in order).

    ``first_logprob``/``first_rank``: the answer's first token at the answer position;
    ``gold_logprob``: the teacher-forced log-probability of the whole answer; ``margins``: per token
    (None where no rival was returned); ``min_margin``: the smallest known token margin.
    """
    if not tokens:
        raise ValueError("a gold answer has at least one token")
    margins = [t.margin for t in tokens]
    known = [m for m in margins if m is not None]
    return {
        "tokens": len(tokens),
        "first_logprob": tokens[0].logprob,
        "first_rank": tokens[0].rank,
        "gold_logprob": math.fsum(t.logprob for t in tokens),
        "logprobs": [t.logprob for t in tokens],
        "ranks": [t.rank for t in tokens],
        "margins": margins,
        "min_margin": min(known) if known else None,
    }


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("quantile of no values")
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def margin_summary(scores: Iterable[dict], threshold: float) -> dict:
    """Aggregate per-case ``answer_score`` records of one group (a cell or a length).

    Token margins: mean, 10/50/90th percentiles and minimum over every answer token; answers:
    how many were won by less than ``threshold`` nats (lost ones included) and how many lost
    (margin < 0, a greedy decode would not give the gold answer).
    """
    scores = list(scores)
    tok = [m for s in scores for m in s["margins"] if m is not None]
    answer = [s["min_margin"] for s in scores if s["min_margin"] is not None]
    first = [s["first_logprob"] for s in scores]
    gold = [s["gold_logprob"] for s in scores]
    ranks = [s["first_rank"] for s in scores]

    def stat(values: list[float], fn) -> float | None:
        return fn(values) if values else None

    return {
        "n": len(scores),
        "first_logprob_mean": stat(first, lambda v: math.fsum(v) / len(v)),
        "first_rank1": sum(1 for r in ranks if r == 1),
        "gold_logprob_mean": stat(gold, lambda v: math.fsum(v) / len(v)),
        "gold_logprob_median": stat(gold, lambda v: quantile(v, 0.5)),
        "margin_tokens": len(tok),
        "margin_mean": stat(tok, lambda v: math.fsum(v) / len(v)),
        "margin_p10": stat(tok, lambda v: quantile(v, 0.1)),
        "margin_p50": stat(tok, lambda v: quantile(v, 0.5)),
        "margin_p90": stat(tok, lambda v: quantile(v, 0.9)),
        "margin_min": stat(tok, min),
        "answer_margin_median": stat(answer, lambda v: quantile(v, 0.5)),
        "below_threshold": sum(1 for m in answer if m < threshold),
        "lost": sum(1 for m in answer if m < 0),
    }


# Exact null distribution up to this many non-zero differences (the DP costs O(n^3)).
_EXACT_MAX_N = 60


def _midranks(values: Sequence[float]) -> list[float]:
    """Ranks 1..n of ``values`` with ties given their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def _signed_rank_null(ranks: Sequence[int]) -> list[float]:
    """P(sum of the ranks given a + sign = s), s = 0..sum(ranks), each sign + with probability 1/2."""
    dist = [1.0] + [0.0] * sum(ranks)
    top = 0
    for r in ranks:
        top += r
        for s in range(top, r - 1, -1):
            dist[s] = 0.5 * (dist[s] + dist[s - r])
        for s in range(r - 1, -1, -1):
            dist[s] *= 0.5
    return dist


def hodges_lehmann(diffs: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(estimate, low, high): the Hodges-Lehmann shift of paired differences (the median of the
    Walsh averages (d_i + d_j) / 2, i <= j) and its signed-rank confidence interval
    [W_(k), W_(M + 1 - k)] over the M sorted averages, k the largest count with
    P(W+ < k) <= (1 - level) / 2 under the untied null (exact up to 60 pairs, normal above)."""
    n = len(diffs)
    if n == 0:
        raise ValueError("Hodges-Lehmann estimate of no differences")
    walsh = sorted((diffs[i] + diffs[j]) / 2 for i in range(n) for j in range(i, n))
    m = len(walsh)
    est = quantile(walsh, 0.5)
    tail = (1 - level) / 2
    if n <= _EXACT_MAX_N:
        dist = _signed_rank_null(range(1, n + 1))
        k, cum = 0, 0.0
        while cum + dist[k] <= tail:
            cum += dist[k]
            k += 1
    else:
        sd = math.sqrt(n * (n + 1) * (2 * n + 1) / 24)
        k = max(0, math.floor(m / 2 - NormalDist().inv_cdf(1 - tail) * sd))
    if k == 0:
        return est, -math.inf, math.inf
    return est, walsh[k - 1], walsh[m - k]


def wilcoxon_signed_rank(diffs: Sequence[float], zero_tol: float = 1e-9) -> tuple[int, float, float]:
    """Two-sided Wilcoxon signed-rank test that paired differences ``diffs`` centre on 0.

    Returns (n_used, W+, p). Differences within ``zero_tol`` of zero are dropped (Wilcoxon's
    method: a pair the change did not move carries no sign). Ties get midranks. Up to 60
    non-zero differences the p-value is exact, from the permutation distribution of W+ given the
    observed ranks (each sign flipped with probability 1/2; midranks doubled to integers); above
    that, the normal approximation with the tie-corrected variance and a continuity correction.
    """
    d = [x for x in diffs if abs(x) > zero_tol]
    n = len(d)
    if n == 0:
        return 0, 0.0, 1.0
    ranks = _midranks([abs(x) for x in d])
    w_plus = sum(r for r, x in zip(ranks, d, strict=True) if x > 0)
    if n <= _EXACT_MAX_N:
        doubled = [round(2 * r) for r in ranks]
        dist = _signed_rank_null(doubled)
        w2 = round(2 * w_plus)
        low = math.fsum(dist[: w2 + 1])
        high = math.fsum(dist[w2:])
        return n, w_plus, min(1.0, 2 * min(low, high))
    counts: dict[float, int] = {}
    for r in ranks:
        counts[r] = counts.get(r, 0) + 1
    mean = n * (n + 1) / 4
    var = n * (n + 1) * (2 * n + 1) / 24 - sum(t**3 - t for t in counts.values()) / 48
    if var <= 0:
        return n, w_plus, 1.0
    z = max(0.0, abs(w_plus - mean) - 0.5) / math.sqrt(var)
    return n, w_plus, min(1.0, math.erfc(z / math.sqrt(2)))


def paired_differences(a: Sequence[float], b: Sequence[float]) -> dict:
    """B minus A over paired values: n, mean and median difference, and the Wilcoxon test."""
    if len(a) != len(b):
        raise ValueError(f"paired values differ in number: {len(a)} vs {len(b)}")
    diffs = [y - x for x, y in zip(a, b, strict=True)]
    n_used, w_plus, p = wilcoxon_signed_rank(diffs)
    hl = hodges_lehmann(diffs) if diffs else (None, None, None)
    return {
        "n": len(diffs),
        "n_nonzero": n_used,
        "a_median": quantile(a, 0.5) if a else None,
        "b_median": quantile(b, 0.5) if b else None,
        "delta_mean": math.fsum(diffs) / len(diffs) if diffs else None,
        "delta_median": quantile(diffs, 0.5) if diffs else None,
        "w_plus": w_plus,
        "w_plus_mean": n_used * (n_used + 1) / 4,
        "hl_shift": hl[0],
        "hl_low": _finite(hl[1]),
        "hl_high": _finite(hl[2]),
        "p_value": p,
    }


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _sign(x: float | None) -> int:
    return 0 if not x else (1 if x > 0 else -1)


def margin_direction(d: dict) -> str:
    """ "widens" | "thins" from the signed-rank statistic (W+ against its null mean n(n+1)/4);
    "mixed" when the median paired difference or the Hodges-Lehmann shift does not share that
    sign (a zero median included); "none" when W+ sits at its mean."""
    test = _sign(d["w_plus"] - d["w_plus_mean"])
    if test == 0:
        return "none"
    if _sign(d["delta_median"]) != test or _sign(d["hl_shift"]) != test:
        return "mixed"
    return "widens" if test > 0 else "thins"


def group_margins(scored: Iterable[tuple[int, float, dict]], threshold: float) -> dict:
    """``margin_summary`` per (length, depth) cell and per length of ``(length, depth, answer_score)``."""
    cells: dict[tuple[int, float], list[dict]] = {}
    lengths: dict[int, list[dict]] = {}
    for length, depth, score in scored:
        cells.setdefault((length, depth), []).append(score)
        lengths.setdefault(length, []).append(score)
    return {
        "cells": [
            {"length": n, "depth": d, **margin_summary(s, threshold)} for (n, d), s in sorted(cells.items())
        ],
        "lengths": [{"length": n, **margin_summary(s, threshold)} for n, s in sorted(lengths.items())],
    }


# Asymptotic efficiency of the signed-rank test relative to the paired t-test under normality.
_WILCOXON_ARE = 3 / math.pi
_Z_POWER80 = NormalDist().inv_cdf(0.8)


def _z(p: float) -> float:
    """The standard normal quantile at ``1 - p`` (p in (0, 1))."""
    return NormalDist().inv_cdf(1 - p)


def detectable_shift(diffs: Sequence[float], alpha: float) -> float | None:
    """The shift (nats) the signed-rank test finds with 80% power at two-sided ``alpha``, given
    the spread of ``diffs``: (z(alpha/2) + z(0.2)) sd / sqrt(ARE n), a normal approximation.

    None when no shift can be found: fewer pairs than the exact test needs to reach ``alpha``
    at all (its smallest p-value is 2 / 2^n).
    """
    n = len(diffs)
    if n < 2 or 2 * 0.5**n > alpha:
        return None
    mean = math.fsum(diffs) / n
    sd = math.sqrt(math.fsum((d - mean) ** 2 for d in diffs) / (n - 1))
    return (_z(alpha / 2) + _Z_POWER80) * sd / math.sqrt(_WILCOXON_ARE * n)


def compare_margins(pairs: Iterable[tuple[int, dict, dict]], edges: Sequence[int], alpha: float) -> dict:
    """Paired graded differences (B - A) per length bucket over ``(length, a_score, b_score)``.

    Per bucket: the answer margin's and the gold logprob's paired differences with the Wilcoxon
    signed-rank test (``paired_differences``), p-values Holm-corrected across buckets, and the
    margin shift detectable with 80% power at the strictest Holm level (alpha / buckets).
    """
    groups: dict[int, list[tuple[int, dict, dict]]] = {}
    for length, a, b in pairs:
        groups.setdefault(bucket_of(length, edges), []).append((length, a, b))
    rows = []
    level = alpha / max(1, len(groups))
    for i in sorted(groups):
        g = groups[i]
        both = [
            (a["min_margin"], b["min_margin"])
            for _, a, b in g
            if None not in (a["min_margin"], b["min_margin"])
        ]
        margin = paired_differences([x for x, _ in both], [y for _, y in both])
        gold = paired_differences([a["gold_logprob"] for _, a, _ in g], [b["gold_logprob"] for _, _, b in g])
        rows.append(
            {
                "length_lo": min(n for n, _, _ in g),
                "length_hi": max(n for n, _, _ in g),
                "n": len(g),
                "margin": margin,
                "gold_logprob": gold,
                "detectable_shift": detectable_shift([y - x for x, y in both], level),
            }
        )
    for key in ("margin", "gold_logprob"):
        for row, p in zip(rows, holm([r[key]["p_value"] for r in rows]), strict=True):
            row[key]["p_holm"] = p
    return {"buckets": rows, "verdict": _margin_verdict(rows, alpha)}


def _nats(x: float) -> str:
    """Two decimals, or two significant digits below 0.1 (a shift of 0.0029 is not 0.00)."""
    return f"{x:.2f}" if abs(x) >= 0.1 else f"{x:.2g}"


def _margin_verdict(rows: list[dict], alpha: float) -> str:
    lines = []
    for r in rows:
        m = r["margin"]
        if m["n"] and m["p_holm"] < alpha:
            span = (
                str(r["length_lo"])
                if r["length_lo"] == r["length_hi"]
                else f"{r['length_lo']}-{r['length_hi']}"
            )
            hl = f"Hodges-Lehmann shift {m['hl_shift']:+.2g} nats" + (
                f", 95% CI [{m['hl_low']:+.2g}, {m['hl_high']:+.2g}]" if m["hl_low"] is not None else ""
            )
            test = f"W+ {m['w_plus']:g} against {m['w_plus_mean']:g} expected, Wilcoxon p={m['p_holm']:.2g} Holm-corrected"
            verb = margin_direction(m)
            if verb == "mixed":
                lines.append(
                    f"B's margin change at {span} tokens is mixed: the median paired difference is "
                    f"{m['delta_median']:+.2g} nats while the signed-rank test points the other way or nowhere "
                    f"({test}; {hl})"
                )
            else:
                lines.append(
                    f"B {verb} the margin by {_nats(abs(m['hl_shift']))} nats at {span} tokens ({hl}; {test}; "
                    f"median margin {m['a_median']:.2f} -> {m['b_median']:.2f})"
                )
    if lines:
        return "; ".join(lines)
    n_min = min((r["margin"]["n"] for r in rows), default=0)
    if all(r["margin"]["n_nonzero"] == 0 for r in rows):
        return f"no margin change: B's margins equal A's on every pair ({n_min} pairs in the smallest bucket)"
    shifts = [r["detectable_shift"] for r in rows]
    if any(s is None for s in shifts):
        return (
            f"no detectable margin change, and too few pairs to detect one ({n_min} in the smallest "
            "bucket; the exact test needs more pairs to reach the Holm level)"
        )
    return (
        f"no detectable margin change ({n_min} pairs in the smallest bucket; a shift of "
        f"{max(shifts):.2g} nats would be found with 80% power)"
    )
