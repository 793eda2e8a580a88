"""Non-finite indexer scores made rankable and counted (the rank dump and the investigation).

An indexer that leaves ``-inf`` (a legitimate mask: it ranks last), NaN or ``+inf`` in its score
rows must not crash an analysis: ``rank_scores`` places -inf and NaN below every finite score and
+inf above, ``nonfinite_in`` counts them so the report can show them as findings.
"""

from __future__ import annotations

import torch

__all__ = ["nonfinite_in", "rank_scores"]


def rank_scores(row: torch.Tensor) -> torch.Tensor:
    """``row`` [v] with its non-finite scores made rankable: -inf and NaN just below the lowest
    finite score (they rank last, ties counted pessimistically), +inf just above the highest."""
    finite = torch.isfinite(row)
    if bool(finite.all()):
        return row
    lo = float(row[finite].min()) - 1.0 if bool(finite.any()) else 0.0
    hi = float(row[finite].max()) + 1.0 if bool(finite.any()) else 1.0
    out = torch.where(torch.isnan(row) | (row == float("-inf")), torch.full_like(row, lo), row)
    return torch.where(out == float("inf"), torch.full_like(out, hi), out)


def nonfinite_in(row: torch.Tensor) -> dict | None:
    """Counts of -inf, NaN and +inf scores in ``row`` [v]; None when every score is finite."""
    counts = {
        "neg_inf": int((row == float("-inf")).sum()),
        "nan": int(torch.isnan(row).sum()),
        "pos_inf": int((row == float("inf")).sum()),
    }
    return counts if any(counts.values()) else None
