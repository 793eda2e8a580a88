"""Engine state as a factor: paired effects of one change (cache, concurrency, repetition) on recall
and on the answer's margin. Pure.

Each case is sent in both arms of a factor, so outcomes pair up. Recall uses ``analysis.paired``
(exact McNemar on the discordant pairs, bootstrap interval of the difference). Margins are scored
as the probe's graded signal (``analysis.margins``): an answer's margin is its smallest token
margin, the token's logprob minus its best rival's. Here the tokens are the greedy answer's own,
so for a right answer they are the gold answer's path and the margin is the gold margin; a wrong
answer has no gold path in the generation and gets no margin (recall already counts it). Paired
margin differences get the Wilcoxon signed-rank test (``margins.paired_differences``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .margins import answer_score, paired_differences, token_score
from .oracle import first_difference
from .paired import Pair, paired_group
from .stats import mean_present

__all__ = ["ArmRow", "answer_difference", "answer_margin", "factor_effect"]


@dataclass(frozen=True)
class ArmRow:
    """One case's outcome in one arm (``correct`` None: the request failed, not a miss)."""

    case_id: str
    length: int
    depth: float
    correct: bool | None
    margin: float | None
    cached_tokens: int | None
    tokens: tuple[str, ...]
    text: str | None = None
    """The answer's text (None in rows stored before it was kept: ``tokens`` are compared then)."""


def answer_difference(x: ArmRow, y: ArmRow) -> int | None:
    """The first token at which two answers differ; None when they are the same answer.

    Answers of equal text are the same answer whatever their token lists say: a row's tokens are
    the server's when it returned logprobs and the text's words when it did not, so a router whose
    replicas differ in that (or a server that drops logprobs now and then) would otherwise show
    ``["9", "8", "8"]`` against ``["988"]`` as a difference at token 0."""
    if x.text is not None and x.text == y.text:
        return None
    return first_difference(x.tokens, y.tokens)


def answer_margin(steps: Sequence[tuple[str, float, Mapping[str, float]]], correct: bool) -> float | None:
    """The smallest token margin of a right answer's ``(token, logprob, top)`` steps; None for a
    wrong answer, when the server returned no rivals, or when the margin is not a finite number
    (a token sent without its logprob, ``"logprob": null``, is read as NaN: unknown, not a margin)."""
    if not correct or not steps:
        return None
    margin = answer_score([token_score(tok, lp, top) for tok, lp, top in steps])["min_margin"]
    return margin if margin is not None and math.isfinite(margin) else None


def factor_effect(arm_a: Sequence[ArmRow], arm_b: Sequence[ArmRow], *, seed: int = 0) -> dict:
    """Paired recall and margin statistics of arm B against arm A, plus how often the two
    answers differ and where (cases failed on either side are left out and counted)."""
    by_id = {r.case_id: r for r in arm_a}
    both = [(by_id[r.case_id], r) for r in arm_b if r.case_id in by_id]
    ok = [(x, y) for x, y in both if x.correct is not None and y.correct is not None]
    g = paired_group(
        [Pair(x.case_id, x.length, x.depth, bool(x.correct), bool(y.correct)) for x, y in ok], seed=seed
    )
    margins = [(x.margin, y.margin) for x, y in ok if x.margin is not None and y.margin is not None]
    diffs = [answer_difference(x, y) for x, y in ok]
    scored = bool(ok)  # no pair scored: no recall, rather than a recall of 0.00 on neither side
    return {
        "pairs": len(ok),
        "errors": len(both) - len(ok),
        "recall_a": g.recall_a if scored else None,
        "recall_b": g.recall_b if scored else None,
        "recall_delta": g.delta if scored else None,
        "recall_ci": [g.ci_low, g.ci_high] if scored else None,
        "mcnemar_p": g.p_value if scored else None,
        "a_only": g.a_only,
        "b_only": g.b_only,
        "margin": paired_differences([m[0] for m in margins], [m[1] for m in margins]),
        "answers_differ": sum(d is not None for d in diffs),
        "first_differing_tokens": sorted(d for d in diffs if d is not None),
        "cached_tokens_a": mean_present([x.cached_tokens for x, _ in ok]),
        "cached_tokens_b": mean_present([y.cached_tokens for _, y in ok]),
    }
