"""The logprob oracle's rules at their edges (pure): the best token, where two generations part,
what is compared, the inclusive thresholds and every summary field, worked out by hand."""

from __future__ import annotations

import math

import pytest

from needlescope.analysis.oracle import Step, compare_steps, first_difference, summarize


def _step(token: str, top: dict[str, float]) -> Step:
    return Step(token, top[token], top)


def _kl(p: list[float], q: list[float]) -> float:
    zp, zq = sum(math.exp(x) for x in p), sum(math.exp(x) for x in q)
    return sum(math.exp(a) / zp * math.log((math.exp(a) / zp) / (math.exp(b) / zq)) for a, b in zip(p, q))


def test_best_token():
    assert Step("a", -0.1, {}).best() == "a"  # no alternatives: the chosen one
    assert Step("a", -1.0, {"a": -1.0, "b": -0.5}).best() == "b"
    assert Step("b", -0.5, {"a": -0.5, "b": -0.5}).best() == "b"  # a tie keeps the chosen one
    assert Step("z", -3.0, {"x": -0.2, "y": -0.9}).best() == "x"


def test_first_difference():
    assert first_difference([1, 2], [1, 2, 3]) == first_difference([1, 2, 3], [1, 2]) == 2
    assert first_difference([1, 2], [1, 3]) == 1 and first_difference([], [1]) == 0
    assert first_difference([1], [1]) is None


def test_nothing_to_compare():
    r = compare_steps([], [])
    assert (r.compared, r.first_divergence, r.verdict) == (0, None, "identical")
    assert (r.top1_agreement, r.topk_overlap, r.mean_abs_dlogprob, r.max_abs_dlogprob) == (None,) * 4
    assert (r.mean_kl, r.max_kl, r.shared_tokens, r.ref_margins) == (None, None, 0, [])


def test_one_generation_ends_first():
    a, b = _step("a", {"a": -0.1, "b": -2.0}), _step("b", {"b": -0.2, "a": -3.0})
    short = compare_steps([a], [a, b])  # the reference ends: compared through its last token
    assert (short.compared, short.first_divergence, short.divergence_margin, short.verdict) == (
        1,
        1,
        None,
        "diverged",
    )
    assert compare_steps([a, b, b], [a]).compared == 1


def test_shared_tokens_deltas_and_means():
    ref = [_step("a", {"a": -0.1, "b": -2.0}), _step("c", {"c": -0.5, "d": -1.0})]
    cand = [_step("a", {"a": -0.6, "b": -2.0}), _step("c", {"c": -0.5, "d": -1.25})]
    r = compare_steps(ref, cand)
    # |dlogprob| over the shared tokens a, b, c, d: 0.5, 0, 0, 0.25
    assert (
        r.shared_tokens == 4 and r.max_abs_dlogprob == 0.5 and r.mean_abs_dlogprob == pytest.approx(0.75 / 4)
    )
    kls = [_kl([-0.1, -2.0], [-0.6, -2.0]), _kl([-0.5, -1.0], [-0.5, -1.25])]
    assert r.mean_kl == pytest.approx(sum(kls) / 2) and r.max_kl == pytest.approx(max(kls))
    assert r.ref_margins == pytest.approx([1.9, 0.5]) and r.to_dict()["verdict"] == "close"


def test_a_chosen_token_outside_the_top_lists_is_compared_by_its_own_logprob():
    r = compare_steps([Step("a", -0.3, {})], [_step("a", {"a": -0.05})])
    # The reference sent no alternatives: overlap and KL are unknown (None), not 0 (which read as
    # "nothing in common" beside a verdict of identical) nor a KL of 0 (which reads as agreement).
    assert (r.topk_overlap, r.top1_agreement, r.shared_tokens, r.max_abs_dlogprob) == (None, 1.0, 1, 0.25)
    assert r.verdict == "close" and r.mean_kl is None and r.max_kl is None


def test_thresholds_are_strict_for_margins_and_inclusive_for_atol():
    ref = [_step("a", {"a": -0.25, "b": -0.75})]  # margin exactly 0.5
    flipped = [_step("b", {"a": -0.75, "b": -0.25})]
    r = compare_steps(ref, flipped, flip_margin=0.5)
    assert r.low_margin_positions == [] and r.verdict == "diverged"
    assert compare_steps(ref, flipped, flip_margin=0.51).verdict == "flip_at_low_margin"
    moved = [_step("a", {"a": -0.5, "b": -0.75})]  # |dlogprob| exactly 0.25
    assert compare_steps(ref, moved, atol=0.25).verdict == "identical"
    assert compare_steps(ref, moved, atol=0.24).verdict == "close"


def test_summary_fields():
    same = compare_steps([_step("a", {"a": -0.1})], [_step("a", {"a": -0.1})])
    moved = compare_steps([_step("a", {"a": -0.1, "b": -2.0})], [_step("a", {"a": -0.2, "b": -2.0})])
    kl = _kl([-0.1, -2.0], [-0.2, -2.0])
    s = summarize([same, moved], [True, None])
    assert s == {
        "prompts": 2, "prompt_ids_equal": 1, "prompt_ids_unchecked": 1, "identical": 1, "close": 1,
        "flips_at_low_margin": 0, "diverged": 0, "positions_compared": 2, "top1_agreement": 1.0,
        "topk_overlap": 1.0, "mean_abs_dlogprob": pytest.approx(0.05 / 2), "max_abs_dlogprob": pytest.approx(0.1),
        "mean_kl": pytest.approx(kl / 2), "max_kl": pytest.approx(kl), "low_margin_positions": 0,
        "verdict": "same_tokens",
    }  # fmt: skip
    counted = summarize([same, same, same], [True, True, None])
    assert (counted["prompt_ids_equal"], counted["prompt_ids_unchecked"]) == (2, 1)
    ref = [_step("c", {"c": -0.70, "d": -0.72})]
    flip = compare_steps(ref, [_step("d", {"c": -0.72, "d": -0.70})])
    div = compare_steps([_step("a", {"a": -0.1, "b": -3.0})], [_step("b", {"a": -3.0, "b": -0.1})])
    f = summarize([flip, same], [True, True])
    assert (f["verdict"], f["flips_at_low_margin"], f["low_margin_positions"]) == (
        "flips_at_low_margin",
        1,
        1,
    )
    d = summarize([flip, div], [True, True])
    assert (d["verdict"], d["diverged"], d["identical"]) == ("divergent", 1, 0)
    e = summarize([], [])
    assert (e["verdict"], e["max_abs_dlogprob"], e["max_kl"], e["prompts"]) == ("identical", None, None, 0)
