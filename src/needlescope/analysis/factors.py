"""Which serving factor moves recall: paired exact tests over factor arms, Holm across them, the
power to detect a stated loss, and the echo probe's corruption bounds. Pure, stdlib only.

An experiment sends the same cases in a baseline arm and in arms that each change one serving
factor (one level of it) or two (an interaction cell). Every arm is compared with the baseline
on the same cases: exact McNemar on the discordant pairs (``lost``: right in the baseline, wrong in
the arm; ``gained``: the reverse), two-sided. The p-values of all the arms are Holm-adjusted
together (one family: every main level and every cell).

The decision (``decide``):

* a **factor** is named when one of its single-factor arms is significant (Holm p < alpha); with
  several, the one whose arm lost the most pairs first (the others are listed);
* an **interaction** ``A × B`` is named when its cell is significant and no single-factor arm of
  A or of B is: each factor alone is clean, together they lose;
* ``repeat`` (the baseline's own condition sent again) is named like a factor: a significant
  repeat is a server that answers the same request differently (state across requests that no
  other factor names, or nondeterminism);
* otherwise **no factor**, with the power each arm had to detect ``min_loss``.

**Output identity** (``identity_counts``, ``decide_identity``): greedy decoding is token-identical
across serving features on a correct engine, so an arm whose greedy output departs from the
baseline's output (on the same case) more often than the ``repeat`` arm's does (the same
condition sent again: the engine's own nondeterminism, and the nonce's effect) is a serving bug
even where recall holds. Paired on the cases: ``only_arm`` (the arm departs, repeat does not),
``only_repeat`` (the reverse), one-sided exact binomial p (the arm departs more), Holm across the
arms. It is decided like recall (a factor, an interaction, or none) and reported apart from it:
an output that departs is never a recall loss.

Power (``analysis.significance.mcnemar_power``): a loss of ``d`` shows as Binomial(n, d) lost pairs
and no gained ones; the test is run at alpha / m, the strictest Holm step of m arms, so the power
printed is a lower bound for the arm that ranks first.
"""

from __future__ import annotations

from collections.abc import Sequence

from .significance import holm, mcnemar_pairs_needed, mcnemar_power
from .stats import binomial_tail, mcnemar_exact

__all__ = [
    "clopper_pearson_upper",
    "decide",
    "decide_identity",
    "departures",
    "echo_summary",
    "identity_counts",
    "paired_counts",
]


def clopper_pearson_upper(k: int, n: int, conf: float = 0.95) -> float:
    """One-sided Clopper-Pearson upper bound of a rate seen k times in n: the p with
    P(X <= k | n, p) = 1 - conf; 1.0 when k == n or n == 0 (bisection, 60 steps: < 1e-15)."""
    if n == 0 or k >= n:
        return 1.0
    lo, hi = k / n, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        cdf = 1.0 - binomial_tail(k + 1, n, mid)  # P(X <= k)
        lo, hi = (mid, hi) if cdf > 1 - conf else (lo, mid)
    return hi


def paired_counts(base: Sequence[bool | None], arm: Sequence[bool | None]) -> dict:
    """Paired recall of ``arm`` against ``base`` (aligned per case; None: the request failed, the
    pair is left out and counted in ``errors``)."""
    if len(base) != len(arm):
        raise ValueError(f"arms must be aligned per case: {len(base)} vs {len(arm)}")
    both = [(a, b) for a, b in zip(base, arm, strict=True) if a is not None and b is not None]
    lost = sum(a and not b for a, b in both)
    gained = sum(b and not a for a, b in both)
    n = len(both)
    return {
        "pairs": n,
        "errors": len(base) - n,
        "recall_base": sum(a for a, _ in both) / n if n else None,
        "recall_arm": sum(b for _, b in both) / n if n else None,
        "delta": (gained - lost) / n if n else None,
        "lost": lost,
        "gained": gained,
        "p": mcnemar_exact(lost, gained),
    }


def departures(base: Sequence[str | None], arm: Sequence[str | None]) -> list[bool | None]:
    """Per case, whether ``arm``'s output differs from ``base``'s (None: either is missing)."""
    if len(base) != len(arm):
        raise ValueError(f"arms must be aligned per case: {len(base)} vs {len(arm)}")
    return [None if a is None or b is None else a != b for a, b in zip(base, arm, strict=True)]


def identity_counts(arm: Sequence[bool | None], repeat: Sequence[bool | None]) -> dict:
    """An arm's departures from the baseline's output against the repeat arm's, paired per case
    (``departures``' lists; a case missing in either is left out). ``p``: one-sided exact
    binomial, P(X >= only_arm) for X ~ Binomial(only_arm + only_repeat, 1/2); 1 without a
    discordant pair."""
    both = [(a, r) for a, r in zip(arm, repeat, strict=True) if a is not None and r is not None]
    only_arm = sum(a and not r for a, r in both)
    only_repeat = sum(r and not a for a, r in both)
    n = only_arm + only_repeat
    return {
        "pairs": len(both),
        "errors": len(arm) - len(both),
        "departs": sum(a for a, _ in both),
        "departs_repeat": sum(r for _, r in both),
        "only_arm": only_arm,
        "only_repeat": only_repeat,
        "p": binomial_tail(only_arm, n, 0.5) if n else 1.0,
    }


def decide_identity(tests: Sequence[dict], *, alpha: float = 0.05, min_share: float = 0.1) -> dict:
    """``decide`` over ``identity_counts`` tests (each with ``arm`` and ``factors``): which factor
    makes greedy output depart from the baseline's more than the repeat level does. Significant
    needs Holm p < alpha and more departures only in the arm than only in repeat; ``power`` is
    the power to see ``min_share`` of the cases depart (a lower bound, as for recall)."""
    renamed = [{**t, "lost": t["only_arm"], "gained": t["only_repeat"]} for t in tests]
    decision = decide(renamed, alpha=alpha, min_loss=min_share)
    decision["tests"] = [
        {k: v for k, v in t.items() if k not in ("lost", "gained")} for t in decision["tests"]
    ]
    decision["min_share"] = decision.pop("min_loss")
    return decision


def _power(n: int, min_loss: float, alpha: float) -> dict:
    return {
        "power": mcnemar_power(n, min_loss, alpha),
        "pairs_needed": mcnemar_pairs_needed(min_loss, alpha),
    }


def decide(tests: Sequence[dict], *, alpha: float = 0.05, min_loss: float = 0.1) -> dict:
    """The named factor of an experiment (module docstring).

    ``tests``: one per non-baseline arm, ``paired_counts``' dict plus ``arm`` (its name) and
    ``factors`` (the one or two factors it changes). Returns ``tests`` with ``p_holm``,
    ``significant``, ``power`` and ``pairs_needed`` added, and the verdict: ``named`` (the factor,
    ``"A × B"``, or None), ``kind`` (``factor`` | ``interaction`` | ``none``), ``arm`` (the arm
    that shows it), ``also`` (other significant factors) and ``min_power``."""
    m = len(tests)
    adjusted = holm([t["p"] for t in tests]) if m else []
    out = []
    for t, p_holm in zip(tests, adjusted, strict=True):
        sig = p_holm < alpha and t["lost"] != t["gained"]
        out.append({**t, "p_holm": p_holm, "significant": sig, **_power(t["pairs"], min_loss, alpha / m)})
    mains = sorted(
        (t for t in out if len(t["factors"]) == 1 and t["significant"]),
        key=lambda t: -abs(t["lost"] - t["gained"]),
    )
    moved = {t["factors"][0] for t in mains}
    cells = sorted(
        (t for t in out if len(t["factors"]) == 2 and t["significant"] and not moved & set(t["factors"])),
        key=lambda t: -abs(t["lost"] - t["gained"]),
    )
    powers = [t["power"] for t in out]
    verdict: dict = {"named": None, "kind": "none", "arm": None, "also": []}
    if mains:
        named = mains[0]["factors"][0]
        verdict = {"named": named, "kind": "factor", "arm": mains[0]["arm"], "also": sorted(moved - {named})}
    elif cells:
        names = [" × ".join(t["factors"]) for t in cells]
        verdict = {"named": names[0], "kind": "interaction", "arm": cells[0]["arm"], "also": names[1:]}
    return {
        "tests": out,
        **verdict,
        "alpha": alpha,
        "min_loss": min_loss,
        "min_power": min(powers) if powers else None,
    }


def echo_summary(
    by_level: dict[str, Sequence[bool | None]], baseline: str, *, alpha: float = 0.05
) -> list[dict]:
    """Per level (a draft depth), the echo probe's corruption: the share of copy tasks not copied
    exactly, its one-sided 95% Clopper-Pearson upper bound, and the exact McNemar p against the
    ``baseline`` level on the same tasks (Holm across the levels). ``by_level`` maps a level to
    its tasks' exact-copy outcomes, aligned per task (None: the request failed)."""
    levels = [lv for lv in by_level if lv != baseline]
    rows, ps = [], []
    for lv in [baseline, *levels]:
        outcomes = [x for x in by_level[lv] if x is not None]
        k, n = sum(not x for x in outcomes), len(outcomes)
        row = {
            "level": lv,
            "tasks": n,
            "errors": len(by_level[lv]) - n,
            "corrupted": k,
            "rate": k / n if n else None,
            "upper95": clopper_pearson_upper(k, n),
            "p": None,
            "p_holm": None,
        }
        if lv != baseline:
            counts = paired_counts(by_level[baseline], by_level[lv])
            row["p"] = counts["p"]
            ps.append(counts["p"])
        rows.append(row)
    for row, p_holm in zip(rows[1:], holm(ps), strict=True):
        row["p_holm"] = p_holm
        row["significant"] = p_holm < alpha and (row["rate"] or 0) > (rows[0]["rate"] or 0)
    rows[0]["significant"] = False
    return rows
