"""The graded scoring helpers (analysis.margins) at their edges, against hand counts and brute force.

Every expectation is worked out in the comments or computed independently: quantiles by hand,
Wilcoxon null distributions by enumerating every sign assignment (or, for 60 pairs, by counting
subsets with Python integers), normal quantiles from scipy. ``test_margins.py`` holds the
typical cases.
"""

from __future__ import annotations

import itertools
import math
import statistics
from fractions import Fraction

import pytest
from scipy.stats import norm, rankdata, wilcoxon

from needlescope.analysis.margins import (
    answer_score,
    compare_margins,
    detectable_shift,
    group_margins,
    hodges_lehmann,
    margin_direction,
    margin_summary,
    paired_differences,
    quantile,
    token_score,
    wilcoxon_signed_rank,
)

INF = math.inf


# -- token and answer scores ------------------------------------------------------------------


def test_a_rival_tied_with_gold_does_not_push_gold_down_a_rank():
    tie = token_score(5, -1.0, {5: -1.0, 7: -1.0})
    assert (tie.rank, tie.margin) == (1, 0.0)
    # Gold not returned, but likelier than one returned rival: it is second, not beyond.
    unlisted = token_score(5, -1.0, {1: -0.5, 2: -3.0})
    assert (unlisted.rank, unlisted.best_other, unlisted.margin) == (2, -0.5, -0.5)


def test_answer_score_records_every_token_in_order():
    won = token_score(1, -0.25, {1: -0.25, 2: -1.5})  # margin +1.25, rank 1
    beyond = token_score(3, -2.0, {4: -0.5})  # not returned, the rival likelier: rank None, -1.5
    alone = token_score(5, -0.5, {5: -0.5})  # no rival returned: margin None
    assert answer_score([won, beyond, alone]) == {
        "tokens": 3,
        "first_logprob": -0.25,
        "first_rank": 1,
        "gold_logprob": -2.75,
        "logprobs": [-0.25, -2.0, -0.5],
        "ranks": [1, None, 1],
        "margins": [1.25, -1.5, None],
        "min_margin": -1.5,
    }
    assert answer_score([alone])["min_margin"] is None
    with pytest.raises(ValueError, match="^a gold answer has at least one token$"):
        answer_score([])


def test_quantile_interpolates_between_order_statistics_up_to_both_ends():
    v = [4.0, 1.0, 3.0, 2.0, 10.0]  # sorted 1, 2, 3, 4, 10
    assert quantile(v, 0.0) == 1.0 and quantile(v, 1.0) == 10.0 and quantile(v, 0.5) == 3.0
    assert quantile(v, 0.1) == pytest.approx(1.4)  # position 0.4: 1 + 0.4 * (2 - 1)
    assert quantile(v, 0.8) == pytest.approx(5.2)  # position 3.2: 4 + 0.2 * (10 - 4)
    assert quantile(v, 0.9) == pytest.approx(7.6)  # position 3.6: 4 + 0.6 * (10 - 4)
    with pytest.raises(ValueError, match="^quantile of no values$"):
        quantile([], 0.5)


def _score(margins, first_logprob, gold_logprob, first_rank) -> dict:
    known = [m for m in margins if m is not None]
    return {
        "margins": margins,
        "min_margin": min(known) if known else None,
        "first_logprob": first_logprob,
        "gold_logprob": gold_logprob,
        "first_rank": first_rank,
    }


S1 = _score([2.0, 0.5], -0.5, -1.0, 1)
S2 = _score([None, 1.0], -1.5, -3.0, 2)
S3 = _score([0.0], -2.5, -2.5, 1)
S4 = _score([None], -0.5, -0.25, None)


def test_margin_summary_every_field_by_hand():
    # Token margins 2, 0.5, 1, 0 (sorted 0, 0.5, 1, 2); answer margins 0.5, 1, 0 (S4 has none).
    assert margin_summary([S1, S2, S3, S4], threshold=1.0) == {
        "n": 4,
        "first_logprob_mean": -1.25,  # (-0.5 - 1.5 - 2.5 - 0.5) / 4
        "first_rank1": 2,
        "gold_logprob_mean": -1.6875,  # -6.75 / 4
        "gold_logprob_median": -1.75,  # sorted -3, -2.5, -1, -0.25: (-2.5 - 1) / 2
        "margin_tokens": 4,
        "margin_mean": 0.875,  # 3.5 / 4
        "margin_p10": pytest.approx(0.15),  # position 0.3: 0 + 0.3 * 0.5
        "margin_p50": 0.75,  # position 1.5
        "margin_p90": pytest.approx(1.7),  # position 2.7: 1 + 0.7 * 1
        "margin_min": 0.0,
        "answer_margin_median": 0.5,
        "below_threshold": 2,  # 0.5 and 0; a margin of exactly 1.0 is not below 1.0
        "lost": 0,  # a margin of exactly 0 is a tie, not a loss
    }


def test_margin_summary_of_no_scores_has_no_statistics():
    s = margin_summary([], threshold=1.0)
    assert s["n"] == s["first_rank1"] == s["margin_tokens"] == s["below_threshold"] == s["lost"] == 0
    stats = {
        k: v
        for k, v in s.items()
        if k not in ("n", "first_rank1", "margin_tokens", "below_threshold", "lost")
    }
    assert len(stats) == 9 and set(stats.values()) == {None}


def test_group_margins_summarises_each_cell_and_each_length_in_order():
    scored = [(2000, 0.5, S1), (1000, 0.5, S2), (1000, 0.0, S3), (1000, 0.5, S4)]
    t = 0.75
    assert group_margins(scored, t) == {
        "cells": [
            {"length": 1000, "depth": 0.0, **margin_summary([S3], t)},
            {"length": 1000, "depth": 0.5, **margin_summary([S2, S4], t)},
            {"length": 2000, "depth": 0.5, **margin_summary([S1], t)},
        ],
        "lengths": [
            {"length": 1000, **margin_summary([S2, S3, S4], t)},
            {"length": 2000, **margin_summary([S1], t)},
        ],
    }
    # The threshold reaches the summaries: S1's answer margin 0.5 is below 0.75.
    assert group_margins(scored, t)["lengths"][1]["below_threshold"] == 1


# -- the signed-rank test ---------------------------------------------------------------------


def _brute_wilcoxon(d: list[float]) -> tuple[float, float]:
    """(W+, two-sided p) by enumerating all 2^n sign assignments of the midranks of |d|."""
    ranks = [Fraction(r).limit_denominator(2) for r in rankdata([abs(x) for x in d])]
    w = sum(r for r, x in zip(ranks, d) if x > 0)
    sums = [sum(r for r, s in zip(ranks, signs) if s) for signs in itertools.product((0, 1), repeat=len(d))]
    low = sum(1 for s in sums if s <= w) / len(sums)
    high = sum(1 for s in sums if s >= w) / len(sums)
    return float(w), min(1.0, 2 * min(low, high))


@pytest.mark.parametrize(
    "d",
    [
        # Mostly negative, ties among the largest: W+ in the lower tail, odd doubled ranks.
        [0.5, -0.5, -1.0, -1.0, -2.0, 3.0, -3.0, -3.0, -4.0, -4.0],
        # Mostly positive, ties everywhere.
        [1.0, 1.0, 2.0, -2.0, 2.0, 3.0, 3.0, -0.5, 4.0, 4.0, 4.0],
        # A tied pair at the bottom (doubled ranks 3, 3), W+ = 4: the sum one above W+'s is
        # reachable (3 + 6), so the lower tail must stop at W+.
        [-0.1, -0.1, -1.0, 2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0],
        # No ties.
        [0.1, -0.2, 0.3, 0.4, -0.5, 0.6, 0.7, 0.8],
    ],
)
def test_exact_wilcoxon_with_ties_equals_enumerating_every_sign(d):
    n, w_plus, p = wilcoxon_signed_rank(d)
    w_ref, p_ref = _brute_wilcoxon(d)
    assert n == len(d) and w_plus == w_ref and p == pytest.approx(p_ref, rel=1e-12)


def test_wilcoxon_edges_no_pair_one_pair_the_tolerance_and_the_centre():
    assert wilcoxon_signed_rank([]) == (0, 0.0, 1.0)
    assert wilcoxon_signed_rank([0.0, 1e-12]) == (0, 0.0, 1.0)
    # One pair: W+ is its rank, 1; either sign is as likely: p = 1.
    assert wilcoxon_signed_rank([0.5]) == (1, 1.0, 1.0)
    # A difference of exactly the tolerance is dropped (|d| must exceed it).
    assert wilcoxon_signed_rank([1e-9, -1e-9, 2.0])[0] == 1
    assert wilcoxon_signed_rank([0.5, 0.5], zero_tol=0.5)[0] == 0
    # W+ at its mean (1 + 4 = 5 = 4 * 5 / 4): both tails exceed 1/2, the p-value is capped at 1.
    assert wilcoxon_signed_rank([1.0, -2.0, -3.0, 4.0]) == (4, 5.0, 1.0)


def test_sixty_pairs_still_get_the_exact_test():
    d = [0.3 * ((-1) ** (i % 3 == 0)) * (1 + i / 7) + 0.01 * i for i in range(60)]
    assert len({abs(x) for x in d}) == 60  # no ties: scipy's exact test applies
    n, _, p = wilcoxon_signed_rank(d)
    exact, approx = wilcoxon(d, method="exact").pvalue, wilcoxon(d, method="approx", correction=True).pvalue
    assert n == 60 and p == pytest.approx(exact, rel=1e-9) and abs(exact - approx) > 1e-4 * exact


def test_normal_approximation_at_the_centre_gives_p_one():
    # 64 pairs, each |d| once positive and once negative: W+ is exactly its mean 64 * 65 / 4.
    d = [float(i) for i in range(1, 33)] + [-float(i) for i in range(1, 33)]
    n, w_plus, p = wilcoxon_signed_rank(d)
    assert (n, w_plus, p) == (64, 1040.0, 1.0)
    assert wilcoxon(d, method="approx", correction=True).pvalue == pytest.approx(1.0)


# -- Hodges-Lehmann ---------------------------------------------------------------------------


def _walsh(d: list[float]) -> list[float]:
    return sorted((d[i] + d[j]) / 2 for i in range(len(d)) for j in range(i, len(d)))


def _subset_sum_counts(n: int) -> list[int]:
    """Number of subsets of {1..n} with each sum: 2^n times the untied null of W+."""
    c = [1] + [0] * (n * (n + 1) // 2)
    for r in range(1, n + 1):
        for s in range(len(c) - 1, r - 1, -1):
            c[s] += c[s - r]
    return c


def _exact_k(n: int, level: float) -> int:
    """The largest k with P(W+ < k) <= (1 - level) / 2, in exact rational arithmetic."""
    counts, tail = _subset_sum_counts(n), Fraction((1 - level) / 2) * 2**n
    k, cum = 0, 0
    while cum + counts[k] <= tail:
        cum += counts[k]
        k += 1
    return k


def test_hodges_lehmann_exact_interval_equals_counting_subsets():
    d = [0.3, -1.2, 2.5, 0.8, 1.9, -0.4, 3.1, 1.1, 0.05, 2.2]
    w = _walsh(d)
    k = _exact_k(10, 0.9)
    assert k == 11  # P(W+ <= 10) = 43/1024 <= 0.05 < P(W+ <= 11) = 55/1024 (signed-rank table)
    assert hodges_lehmann(d, level=0.9) == (pytest.approx(statistics.median(w)), w[k - 1], w[len(w) - k])


def test_hodges_lehmann_counts_a_tail_equal_to_the_level():
    # n = 5: P(W+ = 0) = 1/32 and level 1 - 2/32 puts the tail at exactly 1/32: k = 1, the
    # interval is [smallest, largest] Walsh average.
    assert hodges_lehmann([1.0, 2.0, 3.0, 4.0, 5.0], level=0.9375) == (3.0, 1.0, 5.0)
    assert hodges_lehmann([0.3]) == (0.3, -INF, INF)
    with pytest.raises(ValueError, match="^Hodges-Lehmann estimate of no differences$"):
        hodges_lehmann([])


def test_hodges_lehmann_sixty_pairs_use_the_exact_bound():
    d = [math.sin(1.7 * i) + i / 100 for i in range(60)]  # no ties among the Walsh averages
    w = _walsh(d)
    assert len(set(w)) == len(w)
    k = _exact_k(60, 0.95)
    assert k == 649  # the normal formula would give floor(915 - 1.96 * 135.84) = 648
    _, lo, hi = hodges_lehmann(d)
    assert (lo, hi) == (w[k - 1], w[len(w) - k])


def test_hodges_lehmann_above_sixty_pairs_uses_the_normal_bound():
    # n = 80: M = 3240 averages; sd = sqrt(80 * 81 * 161 / 24) = sqrt(43470) = 208.49;
    # k = floor(1620 - 1.959964 * 208.49) = floor(1211.36) = 1211 (the exact count gives 1212).
    d = [math.sin(2.3 * i) + i / 50 for i in range(80)]
    w = _walsh(d)
    assert len(set(w)) == len(w)
    assert abs(1211 - _exact_k(80, 0.95)) <= 1
    est, lo, hi = hodges_lehmann(d)
    assert (lo, hi) == (w[1210], w[3240 - 1211]) and est == pytest.approx(statistics.median(w))
    # A level so close to 1 that no average is far enough out: unbounded.
    assert hodges_lehmann(d[:61], level=1 - 1e-13)[1:] == (-INF, INF)


# -- paired differences, direction, detectable shift ------------------------------------------


def test_paired_differences_every_field_by_hand():
    # Differences 0.5, 0, 1: the zero is dropped from the test (ranks 1, 2: W+ = 3 of 3, p = 2/4);
    # Walsh averages of all three 0, 0.25, 0.5, 0.5, 0.75, 1: median 0.5; 3 pairs give no interval.
    assert paired_differences([1.0, 2.0, 3.0], [1.5, 2.0, 4.0]) == {
        "n": 3,
        "n_nonzero": 2,
        "a_median": 2.0,
        "b_median": 2.0,
        "delta_mean": 0.5,
        "delta_median": 0.5,
        "w_plus": 3.0,
        "w_plus_mean": 1.5,
        "hl_shift": 0.5,
        "hl_low": None,
        "hl_high": None,
        "p_value": 0.5,
    }
    assert paired_differences([], []) == {
        "n": 0,
        "n_nonzero": 0,
        "a_median": None,
        "b_median": None,
        "delta_mean": None,
        "delta_median": None,
        "w_plus": 0.0,
        "w_plus_mean": 0.0,
        "hl_shift": None,
        "hl_low": None,
        "hl_high": None,
        "p_value": 1.0,
    }
    with pytest.raises(ValueError, match="paired values differ in number: 1 vs 0"):
        paired_differences([1.0], [])


def _direction(w_plus, mean, median, hl) -> str:
    return margin_direction({"w_plus": w_plus, "w_plus_mean": mean, "delta_median": median, "hl_shift": hl})


def test_margin_direction_each_outcome():
    assert _direction(21, 10.5, 0.5, 0.4) == "widens"
    assert _direction(0, 10.5, -0.5, -0.4) == "thins"
    assert _direction(10.5, 10.5, 0.5, 0.4) == "none"
    assert _direction(21, 10.5, 0.5, -0.4) == "mixed"
    assert _direction(0, 10.5, -0.5, 0.0) == "mixed"


def _power_shift(diffs: list[float], alpha: float) -> float:
    """(z_{1-alpha/2} + z_{0.8}) * sd / sqrt(3/pi * n), the normal power formula, from scipy."""
    sd = statistics.stdev(diffs)
    return (norm.ppf(1 - alpha / 2) + norm.ppf(0.8)) * sd / math.sqrt(3 / math.pi * len(diffs))


def test_detectable_shift_value_and_the_pairs_it_needs():
    d = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert detectable_shift(d, 0.05) == pytest.approx(_power_shift(d, 0.05), rel=1e-9)
    assert detectable_shift(d, 0.01) is None  # 2 / 2^6 = 0.031 > 0.01: the exact test cannot
    # The smallest exact p with 5 pairs is 2 / 32 = 0.0625: reachable at alpha 0.0625, not below.
    assert detectable_shift(d[:5], 0.0625) == pytest.approx(_power_shift(d[:5], 0.0625), rel=1e-9)
    assert detectable_shift(d[:5], 0.0624) is None
    assert detectable_shift(d[:2], 0.6) == pytest.approx(_power_shift(d[:2], 0.6), rel=1e-9)
    assert detectable_shift(d[:1], 0.99) is None and detectable_shift([], 0.99) is None


# -- compare_margins and its verdict ----------------------------------------------------------


def _pairs(length: int, a: list[float | None], d: list[float]) -> list[tuple[int, dict, dict]]:
    out = []
    for x, dx in zip(a, d, strict=True):
        b = None if x is None else x + dx
        out.append((length, {"min_margin": x, "gold_logprob": -1.0}, {"min_margin": b, "gold_logprob": -1.0}))
    return out


def test_two_significant_buckets_each_get_a_line():
    # Bucket [0, 1000): lengths 100 and 200, six margins widen by 0.25..1.5 (W+ 21 of 21,
    # p = 2/64) and one pair without a margin; bucket [1000, ...): six margins thin by 0.5
    # (W+ 0, p = 2/64). Holm over two buckets: 0.0625 each, below alpha 0.1.
    a0 = [1.0, 2.0, 0.5, 1.5, 3.0, 0.25]
    d0 = [0.25, 0.5, 0.75, 1.0, 1.25, 1.5]
    pairs = (
        _pairs(100, a0[:3], d0[:3])
        + _pairs(200, [*a0[3:], None], [*d0[3:], 0.0])
        + _pairs(1000, [1.0] * 6, [-0.5] * 6)
    )
    res = compare_margins(pairs, [0, 1000], alpha=0.1)
    wide, thin = res["buckets"]
    assert (wide["length_lo"], wide["length_hi"], wide["n"], wide["margin"]["n"]) == (100, 200, 7, 6)
    assert (thin["length_lo"], thin["length_hi"], thin["n"]) == (1000, 1000, 6)
    assert wide["margin"]["p_holm"] == thin["margin"]["p_holm"] == 0.0625
    assert wide["gold_logprob"]["p_holm"] == 1.0
    # Detectable shifts at the strictest Holm level 0.1 / 2 = 0.05, over the margin differences.
    assert wide["detectable_shift"] == pytest.approx(_power_shift(d0, 0.05), rel=1e-9)
    assert thin["detectable_shift"] == 0.0
    # Walsh averages of 0.25..1.5 in steps of 0.25 centre on 0.875; six pairs give k = 1, the
    # interval [0.25, 1.5]. Medians: A 1.25, B (1.75 + 2.5) / 2 = 2.125.
    assert res["verdict"] == (
        "B widens the margin by 0.88 nats at 100-200 tokens (Hodges-Lehmann shift +0.88 nats, "
        "95% CI [+0.25, +1.5]; W+ 21 against 10.5 expected, Wilcoxon p=0.062 Holm-corrected; "
        "median margin 1.25 -> 2.12); "
        "B thins the margin by 0.50 nats at 1000 tokens (Hodges-Lehmann shift -0.5 nats, "
        "95% CI [-0.5, -0.5]; W+ 0 against 10.5 expected, Wilcoxon p=0.062 Holm-corrected; "
        "median margin 1.00 -> 0.50)"
    )


def test_a_significant_bucket_too_small_for_an_interval_and_a_shift_below_a_tenth():
    # Five pairs thinning by 0.003 or so: p = 2/32 < 0.1, no 95% interval (k = 0), and the shift
    # is written with two significant digits (0.003), not rounded to two decimals (0.00).
    d = [-0.003, -0.002, -0.004, -0.003, -0.003]
    res = compare_margins(_pairs(300, [1.0] * 5, d), [0], alpha=0.1)
    assert res["verdict"] == (
        "B thins the margin by 0.003 nats at 300 tokens (Hodges-Lehmann shift -0.003 nats; "
        "W+ 0 against 7.5 expected, Wilcoxon p=0.062 Holm-corrected; median margin 1.00 -> 1.00)"
    )
    # One bucket: the detectable shift is at alpha itself (0.1), not at a half of it.
    assert res["buckets"][0]["detectable_shift"] == pytest.approx(_power_shift(d, 0.1), rel=1e-6)


def test_nats_switch_to_significant_digits_below_a_tenth():
    from needlescope.analysis.margins import _nats

    assert (_nats(0.1), _nats(1.234), _nats(-0.0029), _nats(0.099)) == ("0.10", "1.23", "-0.0029", "0.099")


def test_a_p_value_equal_to_alpha_is_not_significant():
    # Five widening pairs: p = 2/32 = 0.0625 exactly; at alpha 0.0625 nothing is called, and the
    # exact test can just reach that level, so a detectable shift is stated.
    d = [0.25, 0.5, 0.75, 1.0, 1.25]
    res = compare_margins(_pairs(300, [1.0] * 5, d), [0], alpha=0.0625)
    assert res["buckets"][0]["margin"]["p_holm"] == 0.0625
    shift = _power_shift(d, 0.0625)
    assert res["verdict"] == (
        f"no detectable margin change (5 pairs in the smallest bucket; a shift of {shift:.2g} nats "
        "would be found with 80% power)"
    )


def test_the_null_verdicts():
    assert compare_margins([], [0], 0.05)["verdict"] == (
        "no margin change: B's margins equal A's on every pair (0 pairs in the smallest bucket)"
    )
    unchanged = _pairs(100, [1.0] * 4, [0.0] * 4) + _pairs(900, [1.0] * 7, [0.0] * 7)
    assert compare_margins(unchanged, [0, 500], 0.05)["verdict"] == (
        "no margin change: B's margins equal A's on every pair (4 pairs in the smallest bucket)"
    )
    # One bucket of 3 pairs that move: the exact test cannot reach 0.05 there (2/8).
    few = _pairs(100, [1.0] * 3, [0.5, -0.25, 0.125]) + _pairs(900, [1.0] * 7, [0.0] * 7)
    assert compare_margins(few, [0, 500], 0.05)["verdict"] == (
        "no detectable margin change, and too few pairs to detect one (3 in the smallest bucket; "
        "the exact test needs more pairs to reach the Holm level)"
    )
    # Two buckets that move both ways (p = 1 in each): the larger detectable shift is quoted.
    d1 = [1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 3.0, -3.0]
    d2 = [0.25, -0.25, 0.5, -0.5, 0.75, -0.75, 1.0, -1.0, 0.1]
    both = _pairs(100, [1.0] * 8, d1) + _pairs(900, [1.0] * 9, d2)
    shift = max(_power_shift(d1, 0.025), _power_shift(d2, 0.025))
    assert compare_margins(both, [0, 500], 0.05)["verdict"] == (
        f"no detectable margin change (8 pairs in the smallest bucket; a shift of {shift:.2g} nats "
        "would be found with 80% power)"
    )
