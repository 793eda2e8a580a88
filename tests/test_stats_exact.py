"""The small exact routines against scipy and by hand, at their edges (mutation-tested:
docs/mutation.md): Wilson, binomial tail, mean of present values, Fisher, Holm, McNemar power,
groups against the rest."""

from __future__ import annotations

import math

import pytest
from scipy.stats import binom, binomtest
from scipy.stats import fisher_exact as scipy_fisher

from needlescope.analysis.significance import GroupTest, fisher_exact, groups_vs_rest, holm, mcnemar_power
from needlescope.analysis.stats import binomial_tail, mcnemar_exact, mean_present, wilson_interval


@pytest.mark.parametrize("n", [1, 4, 10, 69, 75, 200])
def test_wilson_matches_scipy_and_pins_its_ends(n):
    for k in range(n + 1):
        lo, hi = wilson_interval(k, n)
        ref = binomtest(k, n).proportion_ci(method="wilson")
        assert lo == pytest.approx(ref.low, abs=1e-6) and hi == pytest.approx(ref.high, abs=1e-6)
    # Exactly 0 and 1 at the ends (unpinned, n = 69 gives a positive lower bound at k = 0 and
    # n = 4 an upper bound below 1 at k = n, by rounding).
    assert wilson_interval(0, n)[0] == 0.0 and wilson_interval(n, n)[1] == 1.0
    assert wilson_interval(1, n)[0] > 0.0
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_binomial_tail_matches_scipy():
    for n in (1, 5, 24):
        for p in (0.1, 0.5, 0.85):
            for k in range(1, n + 1):
                assert binomial_tail(k, n, p) == pytest.approx(
                    float(binom.sf(k - 1, n, p)), rel=1e-12, abs=1e-300
                )
            assert binomial_tail(0, n, p) == 1.0 and binomial_tail(-3, n, p) == 1.0
            assert binomial_tail(n + 1, n, p) == 0.0
    assert binomial_tail(1, 5, 0.5) == pytest.approx(31 / 32)


def test_mean_present():
    assert mean_present([1.0, None, 3.0]) == 2.0
    assert mean_present([0.0, None]) == 0.0
    assert mean_present([None, None]) is None and mean_present([]) is None
    assert mean_present([2.0, 4.0, 9.0]) == 5.0


def test_mcnemar_exact_edges():
    assert mcnemar_exact(0, 0) == 1.0 and mcnemar_exact(1, 0) == 1.0
    assert mcnemar_exact(6, 0) == pytest.approx(2 / 64) and mcnemar_exact(0, 6) == mcnemar_exact(6, 0)
    assert mcnemar_exact(3, 3) == 1.0


def test_fisher_exact_matches_scipy_on_every_small_table():
    for a in range(5):
        for b in range(5):
            for c in range(5):
                for d in range(5):
                    got = fisher_exact(a, b, c, d)
                    ref = 1.0 if a + b + c + d == 0 else float(scipy_fisher([[a, b], [c, d]]).pvalue)
                    assert got == pytest.approx(min(1.0, ref), rel=1e-9), (a, b, c, d)
                    assert got <= 1.0


def test_holm_caps_at_one_and_keeps_order():
    assert holm([0.6, 0.7]) == [1.0, 1.0]
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([]) == []


def test_mcnemar_power_edges():
    assert mcnemar_power(0, 0.5, 0.05) == 0.0 and mcnemar_power(10, 0.0, 0.05) == 0.0
    assert mcnemar_power(-1, 0.5, 0.05) == 0.0
    # k_min = 6 at alpha 0.05: P(Binomial(10, 0.3) >= 6).
    assert mcnemar_power(10, 0.3, 0.05) == pytest.approx(float(binom.sf(5, 10, 0.3)))
    assert mcnemar_power(10, 1.5, 0.05) == pytest.approx(1.0)  # a drop above 1 is 1
    # The cap is applied before the binomial (with p = 1.5 the sum over 6..7 of 7 is negative),
    # and a negative drop has no power (it is not fed to the binomial either).
    assert mcnemar_power(7, 1.5, 0.05) == pytest.approx(1.0) and mcnemar_power(10, -0.2, 0.05) == 0.0
    # alpha 0.07: 5 one-way pairs give p = 0.0625 < 0.07 (k_min 5), 4 give 0.125.
    assert mcnemar_power(5, 1.0, 0.07) == pytest.approx(1.0) and mcnemar_power(4, 1.0, 0.07) == 0.0


def test_group_test_worse_and_groups_vs_rest():
    g = GroupTest("a", 10, 2, 0.2, 0.8, 0.001, 0.01)
    assert g.worse(0.05) and not g.worse(0.01)
    assert not GroupTest("a", 10, 9, 0.9, 0.8, 0.001, 0.01).worse(0.05)
    assert not GroupTest("a", 10, 8, 0.8, 0.8, 0.001, 0.01).worse(0.05)
    assert not GroupTest("a", 0, 0, None, 0.8, 0.001, 0.01).worse(0.05)
    assert not GroupTest("a", 10, 2, 0.2, None, 0.001, 0.01).worse(0.05)
    outcomes = [("x", True)] * 8 + [("x", False)] * 2 + [("y", True)] * 1 + [("y", False)] * 5
    x, y = groups_vs_rest(outcomes)
    assert (x.group, x.n, x.correct, x.recall, x.rest_recall) == ("x", 10, 8, 0.8, pytest.approx(1 / 6))
    assert (y.n, y.correct, y.rest_recall) == (6, 1, 0.8)
    p = float(scipy_fisher([[1, 5], [8, 2]]).pvalue)
    assert y.p_value == pytest.approx(p) and x.p_value == pytest.approx(p)
    assert y.p_holm == pytest.approx(min(1.0, 2 * p))
    assert math.isclose(y.recall, 1 / 6)


def test_groups_vs_rest_with_one_group_has_no_rest():
    (only,) = groups_vs_rest([("a", True), ("a", False)])
    assert (only.n, only.correct, only.recall, only.rest_recall, only.p_value) == (2, 1, 0.5, None, 1.0)
