"""Logprob-oracle comparison math: two greedy generations of one prompt, token by token. Pure.

A *step* is one generated position as a server reports it with ``logprobs: k``: the chosen token
(its text), its logprob, and ``top``, the k best tokens' texts and logprobs at that position.

Positions are compared only while both sides had the same prefix: up to and including the first
divergence (where both saw the same text but chose differently). Past it, each side conditions on
its own tokens, so nothing there is comparable.

Per compared position:

- top-1 agreement: the two sides' best tokens (by their own ``top``) are the same;
- top-k overlap: ``|top_ref ∩ top_cand| / min(|top_ref|, |top_cand|)``;
- ``|Δ logprob|`` on every shared token of the two top-k sets;
- KL on the common support: both distributions restricted to the shared tokens and renormalised,
  ``KL(ref || cand) = Σ p log(p / q)`` (0 when they share fewer than two tokens, since one
  renormalised token carries no shape);
- the reference's margin, best minus second-best logprob: below ``flip_margin`` nats a flip of the
  greedy choice is expected from numerical noise alone, so a divergence there is *expected*.

A logprob of ``-inf``, or at or below ``NO_PROB`` (vLLM writes -inf as -9999.0, since JSON has no
infinity), is probability 0: two such logprobs agree (``|Δ|`` 0, and they add nothing to KL); one
against a finite logprob differs without bound (``inf``). A missing logprob (``null``, read as NaN)
is left out rather than compared.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .margins import token_score
from .stats import mean_present

__all__ = [
    "Step",
    "PromptComparison",
    "compare_steps",
    "first_difference",
    "margin",
    "summarize",
    "FLIP_MARGIN",
    "ATOL",
    "NO_PROB",
]

FLIP_MARGIN = 0.1
"""Nats: a reference margin below this makes a greedy flip an expected outcome of noise."""
ATOL = 1e-4
"""Nats: the largest ``|Δ logprob|`` still called identical (batching and kernel order move ~1e-6)."""
NO_PROB = -9999.0
"""A logprob at or below this is probability 0: vLLM's JSON stand-in for ``-inf``."""


@dataclass(frozen=True)
class Step:
    """One generated position: the chosen token, its logprob, and the top-k alternatives."""

    token: str
    logprob: float
    top: Mapping[str, float]

    def best(self) -> str:
        """The top-1 token of ``top`` (the chosen one when ``top`` is empty or ties)."""
        if not self.top:
            return self.token
        hi = max(self.top.values())
        return self.token if self.top.get(self.token) == hi else max(self.top, key=self.top.__getitem__)


@dataclass(frozen=True)
class PromptComparison:
    compared: int
    """Positions compared (through the first divergence)."""
    first_divergence: int | None
    top1_agreement: float | None
    topk_overlap: float | None
    mean_abs_dlogprob: float | None
    max_abs_dlogprob: float | None
    shared_tokens: int
    mean_kl: float | None
    max_kl: float | None
    low_margin_positions: list[int]
    ref_margins: list[float | None]
    divergence_margin: float | None
    """The reference's margin at the first divergence (None without a divergence)."""
    verdict: str
    """``identical``, ``close`` (same tokens, some ``|Δ|`` above atol), ``flip_at_low_margin``
    (diverged where the reference's margin was below ``flip_margin``), or ``diverged``."""

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def margin(step: Step) -> float | None:
    """The chosen token's margin over its best rival in ``step.top`` (``analysis.margins``, the
    probe's graded signal; for a greedy step, best minus second best); None without a rival."""
    return token_score(step.token, step.logprob, step.top).margin


def first_difference(a: Sequence, b: Sequence) -> int | None:
    """Index of the first element where ``a`` and ``b`` differ, or where one ends; None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _lp(x: float) -> float:
    """``x`` with every spelling of probability 0 (``-inf``, vLLM's -9999.0) as ``-inf``."""
    return -math.inf if x <= NO_PROB else x


def _abs_delta(a: float, b: float) -> float | None:
    """``|a - b|`` of two logprobs: 0 when both are probability 0 (``-inf - -inf`` is NaN, which
    made a server compared with itself read as 'close' or 'identical' by set order), None when
    either is missing (NaN)."""
    a, b = _lp(a), _lp(b)
    if math.isnan(a) or math.isnan(b):
        return None
    return 0.0 if a == b else abs(a - b)


def _kl_common(p: Mapping[str, float], q: Mapping[str, float], shared: set[str]) -> float | None:
    """KL(p || q) of two logprob maps restricted to ``shared`` and renormalised there. Tokens of
    probability 0 on both sides carry nothing and are left out; p > 0 where q = 0 is ``inf``.
    Summed in token order, so the same maps always give the same float. None when no token is
    left (a side that sent no alternatives): unmeasured, never a KL of 0 that reads as agreement
    (one shared token gives 0, as the common-support KL is: both renormalise to 1)."""
    pairs = [(_lp(p[t]), _lp(q[t])) for t in sorted(shared)]
    pairs = [(a, b) for a, b in pairs if not (math.isnan(a) or math.isnan(b) or a == b == -math.inf)]
    if not pairs or all(a == -math.inf for a, _b in pairs):
        return None
    if any(b == -math.inf and a > -math.inf for a, b in pairs):
        return math.inf
    zp = _logsumexp([a for a, _b in pairs])
    zq = _logsumexp([b for _a, b in pairs])
    terms = [math.exp(a - zp) * ((a - zp) - (b - zq)) for a, b in pairs if a > -math.inf]
    return max(0.0, math.fsum(terms))


def _logsumexp(xs: Sequence[float]) -> float:
    hi = max(xs)
    return hi + math.log(sum(math.exp(x - hi) for x in xs))


def compare_steps(
    ref: Sequence[Step], cand: Sequence[Step], *, flip_margin: float = FLIP_MARGIN, atol: float = ATOL
) -> PromptComparison:
    """Compare two greedy generations of the same prompt (``ref`` is the reference)."""
    div = first_difference([s.token for s in ref], [s.token for s in cand])
    n = min(len(ref), len(cand)) if div is None else min(div + 1, len(ref), len(cand))
    agree = 0.0
    overlaps: list[float] = []  # only where both sides sent alternatives: else unknown, not 0
    deltas: list[float] = []
    kls: list[float] = []
    margins: list[float | None] = []
    for r, c in zip(ref[:n], cand[:n], strict=True):
        agree += r.best() == c.best()
        shared = set(r.top) & set(c.top)
        if r.top and c.top:
            overlaps.append(len(shared) / min(len(r.top), len(c.top)))
        pairs = [(r.top[t], c.top[t]) for t in sorted(shared)]
        if r.token == c.token and r.token not in shared:
            pairs.append((r.logprob, c.logprob))
        deltas += [d for d in (_abs_delta(a, b) for a, b in pairs) if d is not None]
        kl = _kl_common(r.top, c.top, shared)
        if kl is not None:
            kls.append(kl)
        margins.append(margin(r))
    low = [i for i, m in enumerate(margins) if m is not None and m < flip_margin]
    div_margin = margins[div] if div is not None and div < len(margins) else None
    if div is not None:
        verdict = "flip_at_low_margin" if div_margin is not None and div_margin < flip_margin else "diverged"
    else:
        verdict = "identical" if not deltas or max(deltas) <= atol else "close"
    return PromptComparison(
        compared=n,
        first_divergence=div,
        top1_agreement=agree / n if n else None,
        topk_overlap=sum(overlaps) / len(overlaps) if overlaps else None,
        mean_abs_dlogprob=sum(deltas) / len(deltas) if deltas else None,
        max_abs_dlogprob=max(deltas) if deltas else None,
        shared_tokens=len(deltas),
        mean_kl=sum(kls) / len(kls) if kls else None,
        max_kl=max(kls) if kls else None,
        low_margin_positions=low,
        ref_margins=margins,
        divergence_margin=div_margin,
        verdict=verdict,
    )


def summarize(rows: Sequence[PromptComparison], prompt_ids_equal: Sequence[bool | None]) -> dict:
    """Totals over prompts and the overall verdict, the first that applies:

    ``divergent``: a prompt's ids differ, or a generation diverged where the reference was confident;
    ``flips_at_low_margin``: generations part only where the reference's margin was below the flip margin;
    ``same_tokens``: every generation equal, some ``|Δ logprob|`` above atol;
    ``identical``: every generation equal within atol.
    """
    verdicts = [r.verdict for r in rows]
    ids_differ = sum(1 for e in prompt_ids_equal if e is False)
    diverged = verdicts.count("diverged")
    flips = verdicts.count("flip_at_low_margin")
    if ids_differ or diverged:
        overall = "divergent"
    elif flips:
        overall = "flips_at_low_margin"
    elif verdicts.count("close"):
        overall = "same_tokens"
    else:
        overall = "identical"
    maxes = [r.max_abs_dlogprob for r in rows if r.max_abs_dlogprob is not None]
    kls = [r.max_kl for r in rows if r.max_kl is not None]
    return {
        "prompts": len(rows),
        "prompt_ids_equal": sum(1 for e in prompt_ids_equal if e is True),
        "prompt_ids_unchecked": sum(1 for e in prompt_ids_equal if e is None),
        "identical": verdicts.count("identical"),
        "close": verdicts.count("close"),
        "flips_at_low_margin": flips,
        "diverged": diverged,
        "positions_compared": sum(r.compared for r in rows),
        "top1_agreement": mean_present([r.top1_agreement for r in rows]),
        "topk_overlap": mean_present([r.topk_overlap for r in rows]),
        "mean_abs_dlogprob": mean_present([r.mean_abs_dlogprob for r in rows]),
        "max_abs_dlogprob": max(maxes) if maxes else None,
        "mean_kl": mean_present([r.mean_kl for r in rows]),
        "max_kl": max(kls) if kls else None,
        "low_margin_positions": sum(len(r.low_margin_positions) for r in rows),
        "verdict": overall,
    }
