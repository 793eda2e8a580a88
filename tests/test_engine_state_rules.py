"""Engine state's paired factor effect (pure): every field of ``factor_effect`` by hand, and the
seed reaching the bootstrap interval."""

from __future__ import annotations

from needlescope.analysis.engine_state import ArmRow, factor_effect
from needlescope.analysis.paired import Pair, bootstrap_delta_ci


def _row(i, correct, cached):
    return ArmRow(f"c{i}", 512, 50.0, correct, None, cached, ("1",))


def test_factor_effect_fields():
    # A right on 0-5, B right on 0-2 and 6-7: B loses 3 cases and gains 2 (b_only 2, a_only 3)
    a = [_row(i, i < 6, 100) for i in range(8)]
    b = [_row(i, i < 3 or i >= 6, 300 if i else None) for i in range(8)]
    e = factor_effect(a, b, seed=7)
    assert (e["pairs"], e["errors"], e["recall_a"], e["recall_b"]) == (8, 0, 6 / 8, 5 / 8)
    assert (e["recall_delta"], e["a_only"], e["b_only"]) == (-1 / 8, 3, 2)
    assert e["mcnemar_p"] == 1.0  # 3 against 2 discordant: two-sided exact p = 1
    # the seed reaches the bootstrap: over 60 pairs its percentiles move with the seed
    wide_a = [_row(i, i % 3 != 0, 0) for i in range(60)]
    wide_b = [_row(i, i % 5 != 0, 0) for i in range(60)]
    pairs = [Pair(x.case_id, 512, 50.0, bool(x.correct), bool(y.correct)) for x, y in zip(wide_a, wide_b)]
    # (checked at 8 seeds: an unseeded bootstrap of these pairs often lands on one seed's
    # interval by chance, since neighbouring bootstrap means tie, but not on all 8)
    ci = {seed: list(bootstrap_delta_ci(pairs, seed=seed)) for seed in range(8)}
    assert len({tuple(v) for v in ci.values()}) > 1
    assert all(factor_effect(wide_a, wide_b, seed=s)["recall_ci"] == ci[s] for s in range(8))
    assert factor_effect(wide_a, wide_b)["recall_ci"] == ci[0]  # the default seed
    assert (e["cached_tokens_a"], e["cached_tokens_b"]) == (100, 300)  # B's missing count is left out
    assert e["answers_differ"] == 0 and e["margin"]["n"] == 0
