"""Recall per (length, depth) cell, RULER-style effective length, and the steepest cliff."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .stats import wilson_interval

__all__ = ["Cell", "cells_from_results", "pooled_recall", "effective_length", "cliff"]


@dataclass(frozen=True)
class Cell:
    """Scored outcome of one (length, depth); errors are counted apart and never as misses.

    ``recall`` is None when no case of the cell was scored (all failed, or none ran): no data, not 0.
    """

    length: int
    depth: float
    n: int
    correct: int
    errors: int
    recall: float | None
    ci_low: float
    ci_high: float


def cells_from_results(rows: Iterable[dict], grid: Iterable[tuple[int, float]] = ()) -> list[Cell]:
    """Aggregate result rows into cells sorted by (length, depth).

    Every (length, depth) of ``grid`` gets a cell even if no row falls in it (then with no data).
    """
    acc: dict[tuple[int, float], list[int]] = {(int(n), float(d)): [0, 0, 0] for n, d in grid}
    for r in rows:
        key = (int(r["length"]), float(r["depth"]))
        a = acc.setdefault(key, [0, 0, 0])
        if r.get("status") != "ok":
            a[2] += 1
            continue
        a[0] += 1
        a[1] += 1 if r.get("correct") else 0
    out = []
    for (length, depth), (n, k, e) in sorted(acc.items()):
        lo, hi = wilson_interval(k, n)
        out.append(Cell(length, depth, n, k, e, k / n if n else None, lo, hi))
    return out


def pooled_recall(cells: Iterable[Cell]) -> dict[int, tuple[int, int]]:
    """length -> (correct, n) pooled over depths (n is 0 where no case of that length was scored)."""
    pooled: dict[int, list[int]] = {}
    for c in cells:
        p = pooled.setdefault(c.length, [0, 0])
        p[0] += c.correct
        p[1] += c.n
    return {k: (v[0], v[1]) for k, v in sorted(pooled.items())}


def _rates(cells: Iterable[Cell]) -> list[tuple[int, float]]:
    # A length with no scored case is no evidence either way: it neither holds nor breaks a curve.
    return [(length, k / n) for length, (k, n) in pooled_recall(cells).items() if n]


def effective_length(cells: Iterable[Cell], threshold: float) -> int | None:
    """Largest tested length whose pooled recall, and that of every shorter length, is >= threshold.

    Lengths without a scored case are skipped (neither extend nor end the run of passing lengths).
    """
    best = None
    for length, rate in _rates(cells):
        if rate < threshold:
            break
        best = length
    return best


def cliff(cells: Iterable[Cell]) -> dict | None:
    """The adjacent pair of lengths with data with the largest pooled-recall drop, or None."""
    rates = _rates(cells)
    best = None
    for (a, ra), (b, rb) in zip(rates, rates[1:], strict=False):
        drop = ra - rb
        if drop > 0 and (best is None or drop > best["drop"]):
            best = {"from": a, "to": b, "drop": drop}
    return best
