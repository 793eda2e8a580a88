"""The ranking signature: outcome-blind percentiles, exact tests, the equivalence decision, the
"needle systematically excluded" class, Holm across layers, and collapse vs top-k by Wilson
intervals (issue 28 items 1 and 3, issue 24 item 5)."""

from __future__ import annotations

import math
import random

import pytest
from scipy.stats import kstest

from needlescope.analysis.stats import wilson_interval
from needlescope.investigate.decide.signature import (
    HOLD,
    NEAR_CHANCE,
    case_draw,
    cases_needed,
    collapse_runs,
    layer_ranking,
    percentile_stats,
    rank_percentile,
    signature,
    sum_uniform_cdf,
    topk_fix,
    tracks_topk,
)


def _random_rank(rng: random.Random, v: int, m: int) -> int:
    order = rng.sample(range(v), v)
    return next(i for i, e in enumerate(order) if e < m) + 1


def test_randomized_percentile_is_exactly_uniform_with_few_visible_entries():
    # v = 6, m = 5: the mid-p value takes two values (variance 0.035, not 1/12) and an exact KS
    # test of it rejects a random ranking; the randomized percentile is U(0, 1).
    rng = random.Random(0)
    ranks = [_random_rank(rng, 6, 5) for _ in range(3000)]
    mid = [rank_percentile(r, 6, 5) for r in ranks]
    rand = [rank_percentile(r, 6, 5, case_draw(f"c{i}", 1)) for i, r in enumerate(ranks)]
    var = lambda xs: sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / len(xs)  # noqa: E731
    assert abs(var(mid) - 0.035) < 0.005
    assert abs(var(rand) - 1 / 12) < 0.005 and abs(sum(rand) / len(rand) - 0.5) < 0.02
    assert kstest(mid[:40], "uniform").pvalue < 0.05
    assert kstest(rand, "uniform").pvalue > 0.01
    assert rank_percentile(1, 128, 5, 0.0) == 0.0 and rank_percentile(124, 128, 5, 1.0) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        rank_percentile(200, 128, 5)
    with pytest.raises(ValueError):
        rank_percentile(1, 128, 5, 1.5)
    assert 0 < case_draw("x", 1) < 1 and case_draw("x", 1) == case_draw("x", 1) != case_draw("x", 3)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 30, 401])
def test_sum_uniform_cdf_matches_its_closed_forms_and_simulation(n):
    if n == 1:
        assert sum_uniform_cdf(0.3, 1) == pytest.approx(0.3)
    if n == 2:
        assert sum_uniform_cdf(0.5, 2) == pytest.approx(0.125) and sum_uniform_cdf(1.5, 2) == pytest.approx(
            0.875
        )
    assert sum_uniform_cdf(n / 2, n) == pytest.approx(0.5)
    assert sum_uniform_cdf(0, n) == 0.0 and sum_uniform_cdf(n, n) == 1.0
    rng = random.Random(n)
    sums = [sum(rng.random() for _ in range(n)) for _ in range(4000)]
    for q in (0.05, 0.3):
        s = sorted(sums)[int(q * len(sums))]
        assert sum_uniform_cdf(s, n) == pytest.approx(q, abs=0.02)
    assert sum_uniform_cdf(n / 2 - 1, n) + sum_uniform_cdf(n / 2 + 1, n) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        sum_uniform_cdf(0.5, 0)


def _layers(ranks, visible=256, layer=1):
    return [{"layer": layer, "best_rank": r, "visible": visible, "needle_visible": 5} for r in ranks]


def _rec(i, first_ranks, *, correct=True, analysed_ranks=None, topk=64, visible=256):
    """One measured record; ``analysed_ranks``: the ranks at the first wrong answer token."""
    return {
        "case_id": f"c{i}",
        "correct": correct,
        "analysed_token": 0 if correct else 1,
        "analysed_source": "first answer token (answer correct)" if correct else "first wrong answer token",
        "index_topk": topk,
        "layers": _layers(analysed_ranks or first_ranks, visible),
        "first_token_layers": _layers(first_ranks, visible),
    }


def _gaussian_rank(rng: random.Random, delta: float, v: int = 256, m: int = 5) -> int:
    best = max(rng.gauss(delta, 1) for _ in range(m))
    return 1 + sum(rng.gauss(0, 1) > best for _ in range(v - m))


def test_population_is_outcome_blind():
    # An informative ranking (needle scores N(0.75, 1) against N(0, 1)): the failing cases are
    # the ones whose needle ranked low, at their first wrong token worse still. Only the first
    # answer token of every case beyond top-k counts; where a case failed does not.
    rng = random.Random(3)
    recs = []
    for i in range(60):
        r = _gaussian_rank(rng, 0.75)
        fails = r > 64
        recs.append(
            _rec(i, [r], correct=not fails, analysed_ranks=[rng.randint(100, 250)] if fails else None)
        )
    (row,) = layer_ranking(recs)
    assert row["n"] == 60 and row["ranking"] == "informative", row
    assert row["mean_percentile"] < 0.3 and row["p_better_holm"] < 0.001
    # Cases whose query sees no more than index_topk entries are left out (the ranking decides nothing).
    small = [_rec(i, [3], visible=64) for i in range(10)]
    assert layer_ranking(small) == []
    # Older records without first-token layers count only when analysed at the first token.
    old = [{k: v for k, v in r.items() if k != "first_token_layers"} for r in recs]
    assert layer_ranking(old)[0]["n"] == sum(r["correct"] for r in recs)


def test_uninformative_needs_the_data_to_bound_it_near_chance():
    rng = random.Random(5)
    few = [_rec(i, [_random_rank(rng, 256, 5)]) for i in range(4)]
    assert layer_ranking(few)[0]["ranking"] == "undecided"  # not rejecting is not enough
    many = [_rec(i, [_random_rank(rng, 256, 5)]) for i in range(80)]
    row = layer_ranking(many)[0]
    assert row["ranking"] == "uninformative" and row["uninformative"]
    assert row["mean_lower"] >= 0.5 - NEAR_CHANCE and row["p_near_chance_holm"] < 0.05
    # A weakly informative ranking (mean percentile about 0.22) is never called uninformative.
    weak = [_rec(i, [_gaussian_rank(rng, 0.75)]) for i in range(40)]
    assert layer_ranking(weak)[0]["ranking"] == "informative"
    assert cases_needed(1) < cases_needed(2)


def test_needle_systematically_excluded():
    # The needle ranks last (masked, flagged invalid or dropped): percentiles near 1.
    recs = [_rec(i, [252]) for i in range(5)]
    (row,) = layer_ranking(recs)
    assert row["ranking"] == "excluded" and row["p_worse_holm"] < 0.05 and row["median_percentile"] > 0.95
    sig = signature(recs, [])
    assert sig["excluded"] is True and sig["ranking"] == "excluded" and not sig["uninformative_ranking"]
    # Slightly worse than chance is not "excluded".
    rng = random.Random(8)
    meh = [_rec(i, [max(1, min(252, _random_rank(rng, 256, 5) + 15))]) for i in range(30)]
    assert layer_ranking(meh)[0]["ranking"] != "excluded"


def _rank_for(u: float, case_id: str, layer: int) -> int:
    draw = case_draw(case_id, layer)
    return min(range(1, 253), key=lambda r: abs(rank_percentile(r, 256, 5, draw) - u))


def test_layers_are_holm_corrected():
    us = [0.1, 0.9, 0.2, 0.8, 0.3, 0.7, 0.45, 0.55, 0.35, 0.65, 0.5, 0.6]
    assert 0.017 < percentile_stats(us)["p_near_chance"] < 0.05  # near chance, for one layer alone

    def recs(layers):
        return [
            {
                "case_id": f"c{i}",
                "correct": True,
                "analysed_token": 0,
                "index_topk": 64,
                "layers": [],
                "first_token_layers": [_layers([_rank_for(u, f"c{i}", la)], layer=la)[0] for la in layers],
            }
            for i, u in enumerate(us)
        ]

    (one,) = layer_ranking(recs([1]))
    assert one["ranking"] == "uninformative" and one["p_near_chance_holm"] == one["p_near_chance"]
    rows = layer_ranking(recs([1, 2, 3]))
    low = min(rows, key=lambda r: r["p_near_chance"])
    assert low["p_near_chance_holm"] == pytest.approx(3 * low["p_near_chance"])
    assert all(r["ranking"] == "undecided" for r in rows)  # none survives the correction


def _run(k, by_length: dict[int, tuple[int, int]], ratio=4, prefix="c"):
    cases = []
    for length, (correct, n) in by_length.items():
        cases += [
            {"case_id": f"{prefix}{length}-{i}", "length": length, "correct": i < correct} for i in range(n)
        ]
    return {"index_topk": k, "compress_ratio": ratio, "cases": cases}


def test_collapse_holds_and_collapsed_are_decided_by_wilson_intervals():
    (few,) = collapse_runs([_run(64, {256: (6, 6), 512: (2, 6)})])
    states = {x["length"]: x["state"] for x in few["lengths"]}
    assert states == {256: "unclear", 512: "collapsed"}  # 6/6 cannot show recall above 0.85
    assert few["consistent"] is None and few["last_holding"] is None and few["first_collapsed"] == 512
    (many,) = collapse_runs([_run(64, {256: (30, 30), 512: (5, 30)})])
    assert [x["state"] for x in many["lengths"]] == ["holds", "collapsed"] and many["consistent"] is True
    assert many["lengths"][0]["ci"][0] > HOLD


def test_collapse_tracks_topk_only_when_a_larger_topk_moves_it():
    small = _run(64, {256: (30, 30), 512: (4, 30), 1024: (0, 30)})
    large = _run(128, {256: (30, 30), 512: (30, 30), 1024: (3, 30)})
    runs = collapse_runs([large, small])
    got = tracks_topk(runs)
    assert got["tracks"] is True and got["moved_by"] == [128]
    sig_cases = [_rec(i, [_random_rank(random.Random(i), 256, 5)]) for i in range(80)]
    fired = signature(sig_cases, [small, large])
    assert fired["uninformative_ranking"] is True and fired["topk_fix"]["restores"] is True
    # The same recall without a tested length between the capacities (256 < L <= 512): no decision.
    gap = [_run(64, {256: (30, 30), 1024: (0, 30)}), _run(128, {256: (30, 30), 1024: (3, 30)})]
    assert tracks_topk(collapse_runs(gap))["tracks"] is None
    # Only lengths beyond every capacity (the old rule called this consistent): no decision.
    beyond = [_run(16, {256: (2, 30), 512: (0, 30)}), _run(32, {256: (3, 30), 512: (1, 30)})]
    assert tracks_topk(collapse_runs(beyond))["tracks"] is False  # the larger top-k collapses too
    assert signature(sig_cases, beyond)["uninformative_ranking"] is False


def test_collapse_that_never_holds_or_falls_before_capacity_is_not_tracking():
    # Issue 24: recall 0.33 at every length and every top-k (candidates dropped past a buffer).
    flat = [_run(k, {256: (10, 30), 512: (10, 30), 1024: (10, 30)}, prefix=f"k{k}") for k in (64, 128, 2048)]
    flat = [
        {**r, "cases": [{**c, "case_id": c["case_id"][len(f"k{r['index_topk']}") :]} for c in r["cases"]]}
        for r in flat
    ]
    runs = collapse_runs(flat)
    got = tracks_topk(runs)
    assert got["tracks"] is False and "never holds" in got["reason"]
    assert topk_fix(runs)["restores"] is False
    # A collapse before capacity: recall already collapsed at 256 tokens with capacity 512.
    early = collapse_runs(
        [_run(64, {128: (30, 30), 256: (3, 30)}), _run(128, {128: (30, 30), 256: (2, 30), 512: (0, 30)})]
    )
    assert early[1]["consistent"] is False
    assert tracks_topk(early)["tracks"] is False and "within its capacity" in tracks_topk(early)["reason"]
    # A single run: nothing to compare.
    one = collapse_runs([_run(64, {256: (30, 30), 512: (3, 30)})])
    assert one[0]["consistent"] is True and tracks_topk(one) == {
        "tracks": None,
        "reason": "fewer than two runs with different index_topk",
        "moved_by": [],
    }


def test_topk_fix_is_paired_and_directional():
    base = {"index_topk": 64, "cases": {f"c{i}": i < 10 for i in range(20)}}
    better = {"index_topk": 128, "cases": {f"c{i}": True for i in range(20)}}
    worse = {"index_topk": 256, "cases": {f"c{i}": i < 2 for i in range(20)}}
    got = topk_fix([base, better, worse])
    assert [r["restores"] for r in got["runs"]] == [True, False]
    assert (got["runs"][0]["b"], got["runs"][0]["c"]) == (10, 0) and got["runs"][1]["c"] == 8
    assert topk_fix([base, worse])["restores"] is False  # c > b, significant: it hurts
    assert math.isclose(got["runs"][0]["p"], 2 / 2**10)


def test_percentile_stats_values_against_scipy():
    from scipy.stats import t as student_t
    from scipy.stats import ttest_1samp

    empty = percentile_stats([])
    assert empty == {
        "n": 0,
        "mean_percentile": None,
        "mean_lower": None,
        "mean_upper": None,
        "median_percentile": None,
        "p_better": 1.0,
        "p_worse": 1.0,
        "p_near_chance": 1.0,
    }
    one = percentile_stats([0.3])
    assert (
        one["mean_percentile"] == 0.3 and one["mean_lower"] is None and one["p_better"] == pytest.approx(0.3)
    )
    two = percentile_stats([0.2, 0.4])
    assert two["mean_lower"] is not None and two["median_percentile"] == pytest.approx(0.3)
    us = [0.1, 0.5, 0.9, 0.3, 0.45]
    got = percentile_stats(us)
    n, mean = len(us), sum(us) / len(us)
    se = (sum((u - mean) ** 2 for u in us) / (n - 1)) ** 0.5 / n**0.5
    q = student_t.ppf(0.95, n - 1)
    assert got["mean_lower"] == pytest.approx(mean - q * se) and got["mean_upper"] == pytest.approx(
        mean + q * se
    )
    ref = ttest_1samp(us, 0.5 - NEAR_CHANCE, alternative="greater").pvalue
    assert got["p_near_chance"] == pytest.approx(ref)
    assert got["p_better"] + got["p_worse"] == pytest.approx(1.0)
    assert percentile_stats([0.99, 0.98])["mean_upper"] == 1.0  # capped
    assert percentile_stats([0.01, 0.02])["mean_lower"] == 0.0


def test_cases_needed_values():
    assert cases_needed() == cases_needed(1) == cases_needed(0) == 24
    assert cases_needed(2) == 31


def test_sum_uniform_cdf_exact_at_the_switch_and_normal_beyond():
    from fractions import Fraction
    from statistics import NormalDist

    def exact(s, n):
        x = Fraction(s)
        return float(
            sum((-1) ** k * math.comb(n, k) * (x - k) ** n for k in range(math.floor(s) + 1))
            / math.factorial(n)
        )

    assert sum_uniform_cdf(190.0, 400) == pytest.approx(exact(190.0, 400), rel=1e-12)
    assert sum_uniform_cdf(190.0, 401) == NormalDist(200.5, math.sqrt(401 / 12)).cdf(190.0)
    assert sum_uniform_cdf(3.7, 5) == pytest.approx(1 - exact(5 - 3.7, 5), rel=1e-12)
    with pytest.raises(ValueError, match="n must be >= 1; got 0"):
        sum_uniform_cdf(0.5, 0)


def test_rank_percentile_validation_and_exact_values():
    assert rank_percentile(1, 10, 1, 0.0) == 0.0 and rank_percentile(10, 10, 1, 1.0) == pytest.approx(1.0)
    assert rank_percentile(1, 5, 5, 0.5) == pytest.approx(0.5)  # every entry covers the needle
    assert rank_percentile(2, 10, 1, 0.5) == pytest.approx(0.15)  # P(J < 1) = 0.1, P(J = 1) = 0.1
    with pytest.raises(ValueError, match="inconsistent rank: best_rank 125, visible 128, needle entries 5"):
        rank_percentile(125, 128, 5)
    with pytest.raises(ValueError, match="inconsistent rank"):
        rank_percentile(1, 4, 5)
    with pytest.raises(ValueError, match="inconsistent rank"):
        rank_percentile(1, 4, 0)
    with pytest.raises(ValueError, match=r"draw must lie in \[0, 1\]; got -0.1"):
        rank_percentile(1, 128, 5, -0.1)


def test_layer_percentiles_skip_small_layers_and_use_the_case_draw():
    from needlescope.investigate.decide.signature import layer_percentiles

    rec = {
        "case_id": "c7",
        "correct": False,
        "analysed_token": 2,
        "index_topk": 64,
        "layers": [],
        "first_token_layers": [
            {"layer": 1, "best_rank": 3, "visible": 64, "needle_visible": 5},
            {"layer": 3, "best_rank": 9, "visible": 128, "needle_visible": 5},
        ],
    }
    got = layer_percentiles([rec])
    assert list(got) == [3]
    assert got[3] == [rank_percentile(9, 128, 5, case_draw("c7", 3))]
    assert case_draw("c7", 3) != case_draw("c7", 1) and case_draw("c7", 3) != case_draw("c8", 3)
    assert layer_percentiles([{**rec, "first_token_layers": None, "analysed_token": 2}]) == {}


def test_signature_structure_and_classes():
    rng = random.Random(11)
    informative = [_rec(i, [_gaussian_rank(rng, 2.0)]) for i in range(30)]
    runs = [
        _run(64, {256: (30, 30), 512: (3, 30)}, prefix="a"),
        _run(128, {256: (30, 30), 512: (30, 30)}, prefix="a"),
    ]
    sig = signature(informative, runs)
    assert set(sig) == {
        "uninformative_ranking",
        "excluded",
        "ranking",
        "collapse",
        "topk_fix",
        "layers",
        "collapse_vs_topk",
    }
    assert sig["ranking"] == "informative" and not sig["uninformative_ranking"] and not sig["excluded"]
    assert set(sig["collapse"]) == {"tracks", "reason", "moved_by"} and sig["collapse"]["tracks"] is True
    assert sig["topk_fix"]["restores"] is True
    (fix,) = sig["topk_fix"]["runs"]
    assert set(fix) == {"index_topk", "n", "b", "c", "p", "restores"} and (fix["index_topk"], fix["n"]) == (
        128,
        60,
    )
    (layer,) = sig["layers"]
    assert set(layer) == {
        "layer",
        "population",
        "n",
        "mean_percentile",
        "mean_lower",
        "mean_upper",
        "median_percentile",
        "p_better",
        "p_worse",
        "p_near_chance",
        "p_better_holm",
        "p_worse_holm",
        "p_near_chance_holm",
        "ranking",
        "uninformative",
        "cases_needed",
    }
    assert layer["layer"] == 1 and layer["population"].startswith("every case with more visible entries")
    assert layer["cases_needed"] == 24
    row = sig["collapse_vs_topk"][0]
    assert set(row) == {
        "index_topk",
        "capacity_tokens",
        "recall",
        "lengths",
        "last_holding",
        "first_collapsed",
        "consistent",
    }
    assert row["recall"] == {"256": 1.0, "512": 0.1}
    assert row["lengths"][1] == {
        "length": 512,
        "correct": 3,
        "n": 30,
        "ci": list(wilson_interval(3, 30)),
        "state": "collapsed",
    }
    (held,) = collapse_runs([_run(128, {256: (30, 30), 512: (30, 30)})])
    assert held["first_collapsed"] is None and held["last_holding"] == 512
    empty = signature([], [])
    assert empty["ranking"] == "undecided" and empty["collapse"]["tracks"] is None
    assert empty["collapse"]["reason"] == "fewer than two runs with different index_topk"
    assert empty["topk_fix"] == {"restores": False, "runs": []}
    # One case ranked last: too few to call anything.
    assert layer_ranking([_rec(0, [252])])[0]["ranking"] == "undecided"


def test_tracks_topk_decisions_in_detail():
    # The larger top-k collapses where the smaller did: within its own capacity, not tracking.
    same = [_run(64, {256: (30, 30), 384: (2, 30)}), _run(128, {256: (30, 30), 384: (3, 30)})]
    got = tracks_topk(collapse_runs(same))
    assert got == {
        "tracks": False,
        "reason": "not tracking: index_topk 128 collapses at 384 tokens, within its capacity of 512",
        "moved_by": [],
    }
    # The larger holds but the smaller is only unclear at the length between: cannot decide.
    unclear = [
        _run(64, {256: (30, 30), 512: (27, 30), 1024: (0, 30)}),
        _run(128, {256: (30, 30), 512: (30, 30), 1024: (3, 30)}),
    ]
    got = tracks_topk(collapse_runs(unclear))
    assert got == {
        "tracks": None,
        "reason": "cannot decide: at no tested length between consecutive capacities do the Wilson intervals "
        f"show one run holding above {HOLD} and the smaller one collapsed below it (more cases per length, or "
        "a length between the capacities, would decide)",
        "moved_by": [],
    }
    # The smallest run is undecided (nothing tested within its capacity) though a larger one moves: no decision.
    base_open = [_run(64, {512: (0, 30), 1024: (27, 30)}), _run(128, {512: (30, 30), 1024: (27, 30)})]
    assert tracks_topk(collapse_runs(base_open))["tracks"] is None
    # Two inconsistent runs: the reason names the first.
    bad = collapse_runs([_run(64, {100: (30, 30), 128: (3, 30)}), _run(128, {100: (30, 30), 128: (2, 30)})])
    assert (
        tracks_topk(bad)["reason"]
        == "not tracking: index_topk 64 collapses at 128 tokens, within its capacity of 256"
    )
    never = collapse_runs([_run(64, {512: (3, 30)}), _run(128, {512: (2, 30)})])
    assert tracks_topk(never)["reason"] == "not tracking: index_topk 64 never holds at any tested length"
    moved = tracks_topk(collapse_runs([_run(64, {256: (30, 30), 512: (3, 30)}), _run(128, {512: (30, 30)})]))
    assert moved["reason"] == (
        "recall holds up to index_topk 64's capacity and collapses past it; index_topk 128 holds where it collapsed"
    )
    # Case sets that differ: only shared cases are paired.
    base = {"index_topk": 64, "cases": {"a": False, "b": False}}
    other = {"index_topk": 128, "cases": {"a": True, "z": True}}
    assert topk_fix([base, other])["runs"][0]["n"] == 1


def test_last_holding_stops_at_the_first_collapse_and_the_overall_class():
    (run,) = collapse_runs([_run(64, {256: (30, 30), 512: (3, 30), 1024: (30, 30)})])
    assert run["last_holding"] == 256 and run["first_collapsed"] == 512
    rng = random.Random(12)
    near = signature([_rec(i, [_random_rank(rng, 256, 5)]) for i in range(80)], [])
    assert near["ranking"] == "uninformative"
    few = signature([_rec(i, [_random_rank(rng, 256, 5)]) for i in range(3)], [])
    assert few["ranking"] == "undecided"
