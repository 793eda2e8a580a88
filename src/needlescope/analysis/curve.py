"""Recall cells over (length, depth), effective context length and the cliff. Pure functions."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

from needlescope.analysis.stats import wilson_interval


@dataclass(frozen=True)
class Cell:
    length: int
    depth: float
    n: int  # scored (non-error) requests
    correct: int
    errors: int  # failed requests, kept apart: an error is never a miss
    recall: float
    ci_low: float
    ci_high: float

    def to_dict(self) -> dict:
        return asdict(self)


def cells_from_results(rows: Iterable[dict]) -> list[Cell]:
    """Aggregate result rows (keys length, depth, status, correct) into cells sorted by length, depth."""
    acc: dict[tuple[int, float], list[int]] = {}
    for r in rows:
        slot = acc.setdefault((int(r["length"]), float(r["depth"])), [0, 0, 0])
        if r["status"] == "ok":
            slot[0] += 1
            slot[1] += int(bool(r["correct"]))
        else:
            slot[2] += 1
    cells = []
    for (length, depth), (n, correct, errors) in sorted(acc.items()):
        lo, hi = wilson_interval(correct, n)
        cells.append(Cell(length, depth, n, correct, errors, correct / n if n else 0.0, lo, hi))
    return cells


def recall_by_length(cells: Iterable[Cell]) -> dict[int, float | None]:
    """Recall pooled over depths per length; None where no request was scored."""
    pooled: dict[int, list[int]] = {}
    for c in cells:
        slot = pooled.setdefault(c.length, [0, 0])
        slot[0] += c.correct
        slot[1] += c.n
    return {L: (k / n if n else None) for L, (k, n) in sorted(pooled.items())}


def effective_length(cells: Iterable[Cell], threshold: float) -> int | None:
    """Largest tested length whose pooled recall, and that of every shorter length, is >= threshold (RULER).

    A length with no scored request breaks the chain: it was not measured, so it cannot pass.
    """
    best = None
    for length, recall in recall_by_length(cells).items():
        if recall is None or recall < threshold:
            break
        best = length
    return best


def cliff(cells: Iterable[Cell]) -> dict | None:
    """The adjacent pair of tested lengths with the largest drop in pooled recall, or None without a drop."""
    curve = [(L, r) for L, r in recall_by_length(cells).items() if r is not None]
    drops = [(a[1] - b[1], a[0], b[0]) for a, b in zip(curve, curve[1:])]
    if not drops:
        return None
    drop, lo, hi = max(drops)
    return {"from": lo, "to": hi, "drop": round(drop, 6)} if drop > 0 else None
