"""Planning and reading a collapse bisection over prompt lengths (pure; the runner sends the cases).

The search: a coarse grid over [lo, hi]; the first grid length whose pooled recall is below the
threshold, with the grid length before it passing, brackets the boundary; binary search narrows
the bracket to ``resolution`` tokens; then fine offsets around the boundary and around the nearest
multiples of each kernel boundary (page size, window, compression ratio, ratio x index_topk).
Small moduli (at most ``RESIDUE_MAX_MOD``) also get a residue-class sweep: runs of consecutive
lengths whose recall, split by length mod m, is tested for independence (chi-square) and class by
class against the rest (Fisher exact, Holm-corrected).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from .significance import chi2_independence, groups_vs_rest

__all__ = [
    "RESIDUE_MAX_MOD",
    "cases_for_ci_width",
    "coarse_grid",
    "bracket",
    "midpoint",
    "fine_lengths",
    "residue_lengths",
    "residue_test",
    "boundaries_from_server_info",
    "full_grid_points",
]

RESIDUE_MAX_MOD = 16
Tally = Mapping[int, tuple[int, int]]
"""length -> (correct, n) pooled over depths and trials."""


def cases_for_ci_width(width: float, threshold: float, z: float = 1.959964) -> int:
    """Scored cases per length so a recall near ``threshold`` has a 95% interval about ``width`` wide.

    Normal approximation n = (2 z)^2 p (1 - p) / width^2, at least 1.
    """
    if not 0 < width < 1:
        raise ValueError(f"width must lie in (0, 1); got {width}")
    p = min(max(threshold, 0.05), 0.95)
    return max(1, math.ceil((2 * z) ** 2 * p * (1 - p) / width**2))


def coarse_grid(lo: int, hi: int, points: int) -> list[int]:
    """``points`` lengths spread evenly over [lo, hi], both ends included, no duplicates."""
    if points < 2 or hi <= lo:
        return sorted({lo, hi})
    return sorted({round(lo + i * (hi - lo) / (points - 1)) for i in range(points)})


def _passes(tally: Tally, length: int, threshold: float) -> bool:
    k, n = tally[length]
    return n > 0 and k / n >= threshold


def bracket(tally: Tally, threshold: float) -> tuple[int, int] | None:
    """(last passing, first failing) adjacent tested lengths, scanning up from the shortest.

    None when the shortest tested length already fails or no tested length fails.
    """
    lengths = sorted(length for length, (_k, n) in tally.items() if n > 0)
    for prev, cur in zip(lengths, lengths[1:]):
        if not _passes(tally, prev, threshold):
            return None
        if not _passes(tally, cur, threshold):
            return prev, cur
    return None


def midpoint(last_pass: int, first_fail: int, resolution: int) -> int | None:
    """The next length to test inside the bracket, or None once it is ``resolution`` wide or less."""
    if first_fail - last_pass <= resolution:
        return None
    return (last_pass + first_fail) // 2


def fine_lengths(first_fail: int, boundaries: Iterable[int], lo: int, hi: int) -> list[int]:
    """Offsets around the boundary (+-1) and around the multiple of each boundary nearest to it."""
    out = {first_fail - 1, first_fail + 1}
    for m in boundaries:
        if m < 2:
            continue
        near = max(m, round(first_fail / m) * m)
        out.update((near - 1, near, near + 1))
    return sorted(x for x in out if lo <= x <= hi)


def residue_lengths(modulus: int, lo: int, hi: int, bases: int) -> list[int]:
    """``bases`` runs of ``modulus`` consecutive lengths spread over [lo, hi]; every class mod m
    appears once per run."""
    top = max(lo, hi - modulus + 1)
    starts = coarse_grid(lo, top, bases) if bases > 1 else [lo]
    return sorted({s + i for s in starts for i in range(modulus) if s + i <= hi})


def residue_test(tally: Tally, modulus: int, alpha: float = 0.05) -> dict:
    """Recall by length mod ``modulus``: chi-square of independence and each class against the rest.

    ``flagged`` lists the classes worse than the rest with a Holm-corrected Fisher p below alpha.
    """
    table = [[0, 0] for _ in range(modulus)]
    outcomes: list[tuple[str, bool]] = []
    for length, (k, n) in tally.items():
        r = length % modulus
        table[r][0] += k
        table[r][1] += n - k
        outcomes += [(str(r), True)] * k + [(str(r), False)] * (n - k)
    stat, df, p = chi2_independence(table)
    classes = []
    flagged = []
    for g in groups_vs_rest(outcomes):
        classes.append(
            {"residue": int(g.group), "n": g.n, "correct": g.correct, "recall": g.recall, "p_holm": g.p_holm}
        )
        if g.p_holm < alpha and g.recall is not None and g.rest_recall is not None:
            if g.recall < g.rest_recall:
                flagged.append(int(g.group))
    classes.sort(key=lambda c: c["residue"])
    return {
        "modulus": modulus,
        "statistic": stat,
        "df": df,
        "p_value": p,
        "classes": classes,
        "flagged": sorted(flagged),
    }


def _ints(value: object) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _ints(v)]
    if isinstance(value, list):
        return [x for v in value for x in _ints(v)]
    return []


_BOUNDARY_KEYS = ("page_size", "sliding_window", "window", "window_size", "sliding_window_size")
_RATIO_KEYS = ("compress_ratio", "compress_ratios", "compress_rates", "compression_ratio")


def boundaries_from_server_info(info: Mapping) -> list[int]:
    """Kernel-relevant lengths a server reports: page size, window, compression ratios, and each
    ratio x ``index_topk``. Looks at the top level and at ``args`` / ``config`` / ``server_args``."""
    scopes = [info] + [info[k] for k in ("args", "config", "server_args") if isinstance(info.get(k), dict)]
    found: set[int] = set()
    ratios: set[int] = set()
    topk: set[int] = set()
    for s in scopes:
        for k in _BOUNDARY_KEYS:
            found.update(_ints(s.get(k)))
        for k in _RATIO_KEYS:
            ratios.update(_ints(s.get(k)))
        topk.update(_ints(s.get("index_topk")))
    found |= ratios
    found |= {r * t for r in ratios for t in topk}
    return sorted(x for x in found if x >= 2)


def full_grid_points(lo: int, hi: int, resolution: int) -> int:
    """Lengths a plain grid over [lo, hi] at step ``resolution`` tests."""
    return (hi - lo) // resolution + 1


def pooled(rows: Iterable[tuple[int, bool]]) -> dict[int, tuple[int, int]]:
    """(length, correct) per scored case -> length -> (correct, n)."""
    acc: dict[int, list[int]] = {}
    for length, correct in rows:
        a = acc.setdefault(length, [0, 0])
        a[0] += int(bool(correct))
        a[1] += 1
    return {k: (v[0], v[1]) for k, v in sorted(acc.items())}


def tally_slice(tally: Tally, lengths: Sequence[int]) -> dict[int, tuple[int, int]]:
    return {x: tally[x] for x in lengths if x in tally}
