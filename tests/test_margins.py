"""The graded signal's pure scoring (analysis.margins): token margins, summaries, the paired test."""

from __future__ import annotations

import random

import pytest
from scipy.stats import wilcoxon

from needlescope.analysis.margins import (
    answer_score,
    margin_summary,
    paired_differences,
    quantile,
    token_score,
    wilcoxon_signed_rank,
)


def test_token_margin_is_gold_minus_best_other_whether_gold_wins_or_not():
    won = token_score(5, -0.1, {5: -0.1, 7: -3.0})
    assert won.rank == 1 and won.margin == pytest.approx(2.9)
    second = token_score(5, -2.0, {1: -0.1, 5: -2.0, 7: -3.0})
    assert second.rank == 2 and second.margin == pytest.approx(-1.9)
    # Beyond the returned top-k: the rank is unknown, the margin still is (the best is returned).
    beyond = token_score(5, -4.0, {1: -0.1, 7: -3.0})
    assert beyond.rank is None and beyond.margin == pytest.approx(-3.9)
    # A server's own rank wins over the derived one; no rival leaves the margin unknown.
    assert token_score(5, -4.0, {1: -0.1}, rank=9).rank == 9
    assert token_score(5, -0.1, {5: -0.1}).margin is None


def test_answer_margin_is_its_weakest_token_and_summary_counts_thin_wins():
    strong = answer_score(
        [token_score(1, -0.01, {1: -0.01, 2: -6.0}), token_score(3, -0.02, {3: -0.02, 4: -5.0})]
    )
    thin = answer_score([token_score(1, -0.5, {1: -0.5, 2: -0.9}), token_score(3, -0.1, {3: -0.1, 4: -4.0})])
    lost = answer_score([token_score(1, -2.0, {2: -0.2, 1: -2.0})])
    assert thin["min_margin"] == pytest.approx(0.4) and thin["gold_logprob"] == pytest.approx(-0.6)
    assert lost["first_rank"] == 2 and lost["min_margin"] == pytest.approx(-1.8)
    s = margin_summary([strong, thin, lost], threshold=1.0)
    assert s["n"] == 3 and s["margin_tokens"] == 5
    assert s["below_threshold"] == 2 and s["lost"] == 1 and s["first_rank1"] == 2
    assert s["margin_min"] == pytest.approx(-1.8)
    assert s["margin_p50"] == pytest.approx(3.9)  # token margins -1.8, 0.4, 3.9, 4.98, 5.99
    with pytest.raises(ValueError):
        answer_score([])


def test_quantile_matches_linear_interpolation():
    assert quantile([3.0, 1.0, 2.0, 4.0], 0.5) == pytest.approx(2.5)
    assert quantile([1.0], 0.9) == 1.0


@pytest.mark.parametrize("n", [6, 15, 40])
def test_wilcoxon_exact_matches_scipy_without_ties(n):
    rng = random.Random(n)
    d = [rng.gauss(0.4, 1.0) for _ in range(n)]
    _, w_plus, p = wilcoxon_signed_rank(d)
    ref = wilcoxon(d, method="exact")
    assert p == pytest.approx(ref.pvalue, rel=1e-9)
    assert min(w_plus, n * (n + 1) / 2 - w_plus) == pytest.approx(ref.statistic)


def test_wilcoxon_large_sample_with_ties_matches_scipy_normal_approximation():
    rng = random.Random(3)
    d = [round(rng.gauss(0.2, 1.0), 1) for _ in range(150)]
    n, _, p = wilcoxon_signed_rank(d)
    ref = wilcoxon(d, method="approx", correction=True, zero_method="wilcox")
    assert n == sum(1 for x in d if x != 0) and p == pytest.approx(ref.pvalue, rel=1e-9)


def test_paired_differences_of_an_unchanged_side_are_not_significant():
    a = [1.0, 2.0, 3.0, 4.0]
    same = paired_differences(a, a)
    assert same["n_nonzero"] == 0 and same["p_value"] == 1.0 and same["delta_median"] == 0.0
    thinner = paired_differences([5.0] * 10, [5.0 - 0.5 - 0.01 * i for i in range(10)])
    assert thinner["delta_median"] < -0.5 and thinner["p_value"] < 0.01
    with pytest.raises(ValueError):
        paired_differences([1.0], [])


def _bucket(diffs: list[float], base: float = 1.0) -> dict:
    from needlescope.analysis.margins import compare_margins

    a = [{"min_margin": base, "gold_logprob": -1.0} for _ in diffs]
    b = [{"min_margin": base + d, "gold_logprob": -1.0} for d in diffs]
    return compare_margins([(512, x, y) for x, y in zip(a, b)], [0], 0.05)


def test_margin_direction_comes_from_the_test_not_the_median():
    from needlescope.analysis.margins import margin_direction

    # 31 pairs widen by 0.001 nats, 29 thin by 5: the median says +0.001, the signed-rank test
    # (W+ 496 against 915 expected) and the Hodges-Lehmann shift (-2.5) say "thins": mixed.
    res = _bucket([0.001] * 31 + [-5.0] * 29)
    m = res["buckets"][0]["margin"]
    assert m["w_plus"] == 496 and m["w_plus_mean"] == 915 and m["p_holm"] < 0.05
    assert m["delta_median"] == pytest.approx(0.001) and m["hl_shift"] == pytest.approx(-2.4995)
    assert margin_direction(m) == "mixed"
    assert res["verdict"].startswith(
        "B's margin change at 512 tokens is mixed: the median paired difference is +0.001 nats while"
    )
    # A zero median never reads "widens".
    zero = _bucket([0.0] * 21 + [0.5] * 20)
    zm = zero["buckets"][0]["margin"]
    assert zm["delta_median"] == 0.0 and zm["p_holm"] < 0.05 and margin_direction(zm) == "mixed"
    # A clear shift: the verb, the Hodges-Lehmann estimate and its interval.
    rng = random.Random(4)
    clear = _bucket([rng.gauss(-0.8, 0.3) for _ in range(30)])
    cm = clear["buckets"][0]["margin"]
    assert margin_direction(cm) == "thins" and clear["verdict"].startswith("B thins the margin by ")
    assert cm["hl_low"] < cm["hl_shift"] < cm["hl_high"] < 0
    assert f"{abs(cm['hl_shift']):.2f}" in clear["verdict"]


def test_hodges_lehmann_interval_matches_the_signed_rank_table():
    from needlescope.analysis.margins import hodges_lehmann

    # n = 10: P(W+ <= 8) = 0.0244 <= 0.025 < P(W+ <= 9): the 95% interval is [W_(9), W_(47)].
    d = [0.3, -1.2, 2.5, 0.8, 1.9, -0.4, 3.1, 1.1, 0.05, 2.2]
    walsh = sorted((d[i] + d[j]) / 2 for i in range(10) for j in range(i, 10))
    est, lo, hi = hodges_lehmann(d)
    assert (lo, hi) == (walsh[8], walsh[46]) and est == pytest.approx(quantile(walsh, 0.5))
    # Too few pairs for any 95% interval (the smallest tail 2/2^5 > 0.05): unbounded.
    assert hodges_lehmann([1.0, 2.0, 3.0, 4.0, 5.0])[1:] == (float("-inf"), float("inf"))
    # Coverage of the true shift over simulated samples (t-distributed, shift 0.5).
    rng = random.Random(9)
    hits = sum(
        lo <= 0.5 <= hi
        for lo, hi in (hodges_lehmann([0.5 + rng.gauss(0, 1) for _ in range(15)])[1:] for _ in range(400))
    )
    assert 0.92 <= hits / 400 <= 0.98
    with pytest.raises(ValueError):
        hodges_lehmann([])
