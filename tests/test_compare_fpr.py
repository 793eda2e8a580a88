"""Exact false-positive rate of the compare procedure, by enumeration (issue 28 item 6).

Under the null (A and B are one model), each pair is discordant with some probability q and a
discordant pair goes either way with probability 1/2. Every outcome of a bucket is summarised by
its discordant counts (a_only, b_only), whose probability is known exactly, so the chance that
``compare_pairs`` calls any bucket significant is a finite sum: every state is run through the
real procedure (exact McNemar, Holm across buckets), and the rate is asserted at most alpha for
every q, at the sizes docs/compare.md quotes (two buckets of 10 pairs; three of 15).
"""

from __future__ import annotations

import itertools
import math

import pytest

from needlescope.analysis.paired import Pair, compare_pairs, paired_group
from needlescope.analysis.significance import holm

ALPHA = 0.05
QS = [i / 20 for i in range(1, 21)]


def _states(n: int) -> list[tuple[int, int]]:
    return [(i, j) for i in range(n + 1) for j in range(n + 1 - i)]


def _weight(n: int, i: int, j: int, q: float) -> float:
    d = i + j
    return math.comb(n, d) * q**d * (1 - q) ** (n - d) * math.comb(d, i) / 2**d


def _pairs(length: int, n: int, a_only: int, b_only: int) -> list[Pair]:
    out = []
    for k in range(n):
        a, b = (True, False) if k < a_only else (False, True) if k < a_only + b_only else (True, True)
        out.append(Pair(f"L{length}-{k}", length, 50.0, a, b))
    return out


def _rate(n: int, buckets: int, rejects) -> float:
    """The largest rate over q of ``rejects(states)`` (one state per bucket)."""
    states = _states(n)
    table = {combo: rejects(combo) for combo in itertools.product(states, repeat=buckets)}
    worst = 0.0
    for q in QS:
        w = {s: _weight(n, *s, q) for s in states}
        assert sum(w.values()) == pytest.approx(1.0)
        worst = max(worst, sum(math.prod(w[s] for s in combo) for combo, hit in table.items() if hit))
    return worst


def test_exact_false_positive_rate_two_buckets_of_ten_through_compare_pairs():
    def rejects(combo) -> bool:
        pairs = [p for b, (i, j) in enumerate(combo) for p in _pairs(100 * (b + 1), 10, i, j)]
        return any(r["p_holm"] < ALPHA for r in compare_pairs(pairs, n_boot=1)["buckets"])

    rate = _rate(10, 2, rejects)
    assert 0.03 < rate <= ALPHA, rate  # at q = 1: 1 - (1 - 22/1024)^2 = 0.0425


def test_exact_false_positive_rate_three_buckets_of_fifteen():
    # Holm rejects something exactly when the smallest p times the number of buckets is below
    # alpha, so "any bucket significant" is the union of independent per-bucket events: each
    # bucket's p from the real paired_group, its corrected value from the real holm.
    n, m = 15, 3
    states = _states(n)
    hit = {
        s: holm([paired_group(_pairs(100, n, *s), n_boot=1).p_value] + [1.0] * (m - 1))[0] < ALPHA
        for s in states
    }
    worst = max(1 - (1 - sum(_weight(n, *s, q) for s in states if hit[s])) ** m for q in QS)
    assert 0.01 < worst <= ALPHA, worst
