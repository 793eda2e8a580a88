"""Recall by needle depth pooled over lengths, and the depth patterns a length curve hides.

Three questions, each an exact test over the probe's cells:

- **lost in the middle**: are the middle depths (every tested depth strictly between the
  shallowest and the deepest) worse than the two ends? Two-sided Fisher exact test of the pooled
  2x2 table, called when p < ``alpha`` and the middle's recall is the lower.
- **which depths are worse**: each depth against the rest (Fisher, Holm-corrected over depths),
  and the same for each length over depths;
- **depth, not length**: some depth is worse than the rest while no length is, so failures follow
  where the needle sits and an effective length does not describe the target.

Pure functions over :class:`~needlescope.analysis.curve.Cell`.
"""

from __future__ import annotations

from collections.abc import Iterable

from .curve import Cell
from .significance import fisher_exact, groups_vs_rest
from .stats import wilson_interval

__all__ = ["DEPTH_ALPHA", "depth_profile"]

DEPTH_ALPHA = 0.01
"""Significance level of the depth tests: they name a pattern in the probe's headline, so a
false alarm costs an engineer's afternoon; 0.01 keeps it rare."""


def _pooled(cells: list[Cell], key) -> dict:
    acc: dict = {}
    for c in cells:
        a = acc.setdefault(key(c), [0, 0])
        a[0] += c.correct
        a[1] += c.n
    return dict(sorted(acc.items()))


def _outcomes(cells: list[Cell], key) -> list[tuple[str, bool]]:
    return [(key(c), ok) for c in cells for ok in [True] * c.correct + [False] * (c.n - c.correct)]


def _worse(cells: list[Cell], key, alpha: float) -> list[dict]:
    """Each group (depth or length) against the rest: Fisher, Holm-corrected; worse ones flagged."""
    tests = groups_vs_rest(_outcomes(cells, key))
    return [
        {
            "group": t.group,
            "n": t.n,
            "correct": t.correct,
            "recall": t.recall,
            "rest_recall": t.rest_recall,
            "p_value": t.p_value,
            "p_holm": t.p_holm,
            "worse": t.worse(alpha),
        }
        for t in tests
    ]


def _middle_hole(by_depth: dict[float, list[int]], alpha: float) -> dict | None:
    depths = [d for d, (_k, n) in by_depth.items() if n]
    if len(depths) < 3:
        return None
    ends = (depths[0], depths[-1])
    middle = depths[1:-1]
    mk = sum(by_depth[d][0] for d in middle)
    mn = sum(by_depth[d][1] for d in middle)
    ek = sum(by_depth[d][0] for d in ends)
    en = sum(by_depth[d][1] for d in ends)
    p = fisher_exact(mk, mn - mk, ek, en - ek)
    return {
        "middle_depths": middle,
        "end_depths": list(ends),
        "middle_n": mn,
        "middle_correct": mk,
        "middle_recall": mk / mn,
        "end_n": en,
        "end_correct": ek,
        "end_recall": ek / en,
        "p_value": p,
        "found": p < alpha and mk / mn < ek / en,
    }


def depth_profile(cells: Iterable[Cell], alpha: float = DEPTH_ALPHA) -> dict:
    """The depth profile of a probe's cells (``summary.json``'s ``depth_profile``).

    Returns ``depths`` (per depth, pooled over lengths: n, correct, recall, 95% Wilson interval),
    ``middle_hole`` (the middle-vs-ends test; None with fewer than three depths with data),
    ``depth_tests`` and ``length_tests`` (each group against the rest), ``pattern`` and ``alpha``.

    ``pattern`` is ``depth_not_length`` when some depth is worse than the rest and no length is,
    else ``lost_in_the_middle`` when the middle-vs-ends test finds a hole, else None. When both
    hold (a middle band that fails at every length), ``depth_not_length`` is the pattern: it is the
    one that decides the headline (the length curve is not stated), and the hole is still reported
    by ``middle_hole["found"]`` and its own headline line.
    """
    cells = [c for c in cells if c.n]
    by_depth = _pooled(cells, lambda c: c.depth)
    depths = []
    for d, (k, n) in by_depth.items():
        lo, hi = wilson_interval(k, n)
        depths.append({"depth": d, "n": n, "correct": k, "recall": k / n, "ci_low": lo, "ci_high": hi})
    hole = _middle_hole(by_depth, alpha)
    depth_tests = _worse(cells, lambda c: f"{c.depth:g}", alpha)
    length_tests = _worse(cells, lambda c: str(c.length), alpha)
    pattern = None
    if hole is not None and hole["found"]:
        pattern = "lost_in_the_middle"
    if any(t["worse"] for t in depth_tests) and not any(t["worse"] for t in length_tests):
        pattern = "depth_not_length"  # over lost_in_the_middle, on purpose (see the docstring)
    for t in length_tests:  # groups_vs_rest sorts names as text; lengths read best in numeric order
        t["group"] = int(t["group"])
    length_tests.sort(key=lambda t: t["group"])
    for t in depth_tests:
        t["group"] = float(t["group"])
    depth_tests.sort(key=lambda t: t["group"])
    return {
        "alpha": alpha,
        "depths": depths,
        "middle_hole": hole,
        "depth_tests": depth_tests,
        "length_tests": length_tests,
        "pattern": pattern,
    }
