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
