"""The logprob oracle's comparison math (pure): divergence, margins, overlap, KL, verdicts."""

from __future__ import annotations

import math

from needlescope.analysis.oracle import Step, compare_steps, margin, summarize


def _step(token: str, top: dict[str, float]) -> Step:
    return Step(token, top[token], top)


def test_identical_generations_compare_perfectly():
    steps = [_step("a", {"a": -0.1, "b": -2.5}), _step("c", {"c": -0.3, "d": -1.4})]
    r = compare_steps(steps, list(steps))
    assert (r.first_divergence, r.verdict, r.top1_agreement, r.topk_overlap) == (None, "identical", 1.0, 1.0)
    assert r.mean_abs_dlogprob == 0.0 and r.max_kl == 0.0 and r.compared == 2


def test_kl_on_the_common_support_is_renormalised():
    ref = [_step("a", {"a": math.log(0.6), "b": math.log(0.2), "x": math.log(0.2)})]
    cand = [_step("a", {"a": math.log(0.5), "b": math.log(0.5)})]
    r = compare_steps(ref, cand)
    p, q = (0.75, 0.25), (0.5, 0.5)  # ref restricted to {a, b}: 0.6/0.8, 0.2/0.8
    want = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True))
    assert math.isclose(r.mean_kl, want, rel_tol=1e-12)
    assert r.topk_overlap == 1.0  # both of the candidate's two tokens are in the reference's three
    assert r.verdict == "close" and math.isclose(r.max_abs_dlogprob, abs(math.log(0.2) - math.log(0.5)))


def test_a_divergence_is_expected_only_where_the_reference_margin_is_low():
    ref = [_step("a", {"a": -0.1, "b": -3.0}), _step("c", {"c": -0.70, "d": -0.72}), _step("e", {"e": -0.1})]
    flipped = [ref[0], _step("d", {"c": -0.72, "d": -0.70}), _step("z", {"z": -0.1})]
    r = compare_steps(ref, flipped)
    assert r.first_divergence == 1 and r.compared == 2 and r.verdict == "flip_at_low_margin"
    assert r.low_margin_positions == [1] and math.isclose(r.divergence_margin, 0.02)
    assert r.top1_agreement == 0.5
    confident = [_step("b", {"a": -3.0, "b": -0.1})]  # parts at position 0, where the reference led by 2.9
    r = compare_steps(ref, confident)
    assert (r.first_divergence, r.verdict, math.isclose(r.divergence_margin, 2.9)) == (0, "diverged", True)
    assert margin(_step("e", {"e": -0.1})) is None


def test_summary_verdicts_order_divergence_first():
    same = compare_steps([_step("a", {"a": -0.1})], [_step("a", {"a": -0.1})])
    moved = compare_steps([_step("a", {"a": -0.1, "b": -2.0})], [_step("a", {"a": -0.2, "b": -2.0})])
    assert summarize([same, same], [True, True])["verdict"] == "identical"
    assert summarize([same, moved], [True, True])["verdict"] == "same_tokens"
    assert summarize([same, same], [True, False])["verdict"] == "divergent"
    s = summarize([same, moved], [True, None])
    assert (s["prompt_ids_equal"], s["prompt_ids_unchecked"], s["close"]) == (1, 1, 1)


def test_engine_state_effect_pairs_recall_and_margins_of_right_answers():
    from needlescope.analysis.engine_state import ArmRow, answer_margin, factor_effect

    steps = [("9", -0.1, {"9": -0.1, "8": -2.6}), ("8", -0.2, {"8": -0.2, "3": -1.0})]
    assert math.isclose(answer_margin(steps, True), 0.8) and answer_margin(steps, False) is None

    def row(i, correct, margin, toks):
        return ArmRow(f"c{i}", 512, 50.0, correct, margin, 0, tuple(toks))

    a = [row(0, True, 2.0, "98"), row(1, True, 1.0, "12"), row(2, None, None, ""), row(3, True, 3.0, "55")]
    b = [row(0, True, 1.5, "98"), row(1, False, None, "13"), row(2, True, 1.0, "77"), row(3, True, 2.0, "55")]
    e = factor_effect(a, b)
    assert (e["pairs"], e["errors"], e["recall_a"], e["recall_b"], e["a_only"]) == (3, 1, 1.0, 2 / 3, 1)
    assert e["margin"]["n"] == 2 and math.isclose(e["margin"]["delta_mean"], -0.75)
    assert (e["answers_differ"], e["first_differing_tokens"]) == (1, [1])
