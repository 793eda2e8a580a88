"""Recall per (length, depth) cell, RULER-style effective length, and the steepest cliff."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .stats import wilson_interval

__all__ = ["Cell", "cells_from_results", "pooled_recall", "effective_length", "cliff"]


@dataclass(frozen=True)
class Cell:
    """Scored outcome of one (length, depth); errors are counted apart and never as misses."""

    length: int
    depth: float
    n: int
    correct: int
    errors: int
    recall: float
    ci_low: float
    ci_high: float


def cells_from_results(rows: Iterable[dict]) -> list[Cell]:
    """Aggregate result rows into cells sorted by (length, depth)."""
    acc: dict[tuple[int, float], list[int]] = {}
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
        out.append(Cell(length, depth, n, k, e, k / n if n else 0.0, lo, hi))
    return out


def pooled_recall(cells: Iterable[Cell]) -> dict[int, tuple[int, int]]:
    """length -> (correct, n) pooled over depths."""
    pooled: dict[int, list[int]] = {}
    for c in cells:
        p = pooled.setdefault(c.length, [0, 0])
        p[0] += c.correct
        p[1] += c.n
    return {k: (v[0], v[1]) for k, v in sorted(pooled.items())}


def _rates(cells: Iterable[Cell]) -> list[tuple[int, float]]:
    return [(length, k / n if n else 0.0) for length, (k, n) in pooled_recall(cells).items()]


def effective_length(cells: Iterable[Cell], threshold: float) -> int | None:
    """Largest tested length whose pooled recall, and that of every shorter length, is >= threshold."""
    best = None
    for length, rate in _rates(cells):
        if rate < threshold:
            break
        best = length
    return best


def cliff(cells: Iterable[Cell]) -> dict | None:
    """The adjacent pair of tested lengths with the largest pooled-recall drop, or None."""
    rates = _rates(cells)
    best = None
    for (a, ra), (b, rb) in zip(rates, rates[1:], strict=False):
        drop = ra - rb
        if drop > 0 and (best is None or drop > best["drop"]):
            best = {"from": a, "to": b, "drop": drop}
    return best
