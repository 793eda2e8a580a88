"""Recall per (length, depth) cell, RULER-style effective length, and the steepest cliff."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .stats import wilson_interval

__all__ = [
    "Cell",
    "cells_from_results",
    "pool_by_length",
    "pooled_recall",
    "longest_passing",
    "effective_length",
    "cliff",
]


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


def pool_by_length(counts: Iterable[tuple[int, int, int]]) -> dict[int, tuple[int, int]]:
    """(length, correct, n) triples -> length -> (correct, n) summed, by ascending length.

    The one pooling over depths: of ``Cell`` objects (``pooled_recall``) and of ``summary.json``
    cells (``report.diagnosis.recall_by_length``) and of an investigation's case records
    (``investigate.decide.causal.recall_by_length``).
    """
    pooled: dict[int, list[int]] = {}
    for length, correct, n in counts:
        p = pooled.setdefault(length, [0, 0])
        p[0] += correct
        p[1] += n
    return {k: (v[0], v[1]) for k, v in sorted(pooled.items())}


def pooled_recall(cells: Iterable[Cell]) -> dict[int, tuple[int, int]]:
    """length -> (correct, n) pooled over depths (n is 0 where no case of that length was scored)."""
    return pool_by_length((c.length, c.correct, c.n) for c in cells)


def longest_passing(rates: Iterable[tuple[int, float | None]], threshold: float) -> int | None:
    """Largest length L whose rate, and that of every shorter length, is >= ``threshold``.

    ``rates`` are (length, rate) pairs; a None rate (no data) neither extends nor ends the run.
    The one definition behind the probe's effective length and the sweep's ``restored_to``.
    """
    best = None
    for length, rate in sorted(rates):
        if rate is None:
            continue
        if rate < threshold:
            break
        best = length
    return best


def _rates(cells: Iterable[Cell]) -> list[tuple[int, float]]:
    # A length with no scored case is no evidence either way: it neither holds nor breaks a curve.
    return [(length, k / n) for length, (k, n) in pooled_recall(cells).items() if n]


def effective_length(cells: Iterable[Cell], threshold: float) -> int | None:
    """Largest tested length whose pooled recall, and that of every shorter length, is >= threshold.

    Lengths without a scored case are skipped (neither extend nor end the run of passing lengths).
    """
    return longest_passing(_rates(cells), threshold)


def cliff(cells: Iterable[Cell]) -> dict | None:
    """The adjacent pair of lengths with data with the largest pooled-recall drop, or None."""
    rates = _rates(cells)
    best = None
    for (a, ra), (b, rb) in zip(rates, rates[1:], strict=False):
        drop = ra - rb
        if drop > 0 and (best is None or drop > best["drop"]):
            best = {"from": a, "to": b, "drop": drop}
    return best
