"""A probe run's analysis: the recall curve, the depth profile, the failed requests and the length
disagreements, decided once here; ``report.probe`` only renders it (headline, report.md, heatmap).

A case **misses its length** when the prompt the tokenizer built has another length than the one
asked for (``counted_length != length``: the closest count reached, ``cases.assemble``); it is
left out of recall, the effective length, the cliff and the graded signal (``reached_length``).
The **server miscounts** a case when its ``usage.prompt_tokens`` differs from our count. Both are
judged only by ``misses_length`` and ``server_miscounts``: the notes, the cells, the graded rows
and the summary's counts all read them.
"""

from __future__ import annotations

from dataclasses import asdict

from .curve import Cell, cliff, effective_length
from .depth import depth_profile

__all__ = [
    "CELL_KEYS",
    "analyze_probe",
    "error_reasons",
    "length_notes",
    "misses_length",
    "reached_length",
    "server_miscounts",
]

CELL_KEYS = ("length", "depth", "n", "correct", "errors", "recall", "ci_low", "ci_high")
"""The keys of each of the summary's cells (``summary.json`` ``cells``)."""


def misses_length(row: dict) -> bool:
    """Whether the case's prompt has another length than asked for (module docstring)."""
    return row.get("counted_length") is not None and row["counted_length"] != row["length"]


def reached_length(row: dict) -> bool:
    """Whether the case measures the length it was asked for: the rows the analysis counts."""
    return not misses_length(row)


def server_miscounts(row: dict) -> bool:
    """Whether the server's ``usage.prompt_tokens`` disagrees with our count of the prompt."""
    return row.get("prompt_tokens") is not None and row["prompt_tokens"] != row.get("counted_length")


def length_notes(rows: list[dict]) -> list[str]:
    """One note per length disagreement, in row order (report.md's Notes name each case)."""
    notes = []
    for r in rows:
        if misses_length(r):
            notes.append(
                f"{r['case_id']}: length {r['length']} is unreachable with this tokenizer (closest "
                f"{r['counted_length']} tokens); the case is left out of recall, effective length and cliff"
            )
        if server_miscounts(r):
            notes.append(
                f"{r['case_id']}: counted {r['counted_length']} tokens but the server reported "
                f"usage.prompt_tokens={r['prompt_tokens']}"
            )
    return notes


def error_reasons(results: list[dict]) -> list[dict]:
    """Failed requests by kind, most first: ``{"kind", "count", "example"}``, the example the
    first such request's error (300 characters at most; keys are scrubbed before results)."""
    by_kind: dict[str, dict] = {}
    for r in results:
        if r.get("status") != "error":
            continue
        kind = r.get("error_kind") or "error"
        entry = by_kind.setdefault(
            kind, {"kind": kind, "count": 0, "example": str(r.get("error") or "")[:300]}
        )
        entry["count"] += 1
    return sorted(by_kind.values(), key=lambda e: (-e["count"], e["kind"]))


def analyze_probe(
    *,
    cells: list[Cell],
    results: list[dict],
    kind: str,
    model: str,
    threshold: float,
    provenance: dict,
    value_digits: int,
    value_digits_source: str,
    failures: dict | None = None,
    endpoints: dict | None = None,
    graded: dict | None = None,
    difficulty: dict | None = None,
) -> dict:
    """``summary.json`` without its ``headline`` (``report.probe`` writes it from these fields):
    ``cells`` sorted by (length, depth), the effective length at ``threshold``, the cliff, the
    depth profile, the failed requests and the length disagreements of ``results``."""
    cells = sorted(cells, key=lambda c: (c.length, c.depth))
    unreachable = {r["case_id"] for r in results if misses_length(r)}
    server = {r["case_id"] for r in results if server_miscounts(r)}
    return {
        "effective_length": effective_length(cells, threshold),
        "threshold": float(threshold),
        "kind": kind,
        "model": model,
        "cells": [{k: asdict(c)[k] for k in CELL_KEYS} for c in cells],
        "cliff": cliff(cells),
        "depth_profile": depth_profile(cells),
        "provenance": dict(provenance),
        "errors_total": sum(c.errors for c in cells),
        "error_reasons": error_reasons(results),
        "cells_without_data": sum(1 for c in cells if c.recall is None),
        "length_mismatches": len(unreachable | server),
        "unreachable_lengths": len(unreachable),
        "server_length_mismatches": len(server),
        "value_digits": int(value_digits),
        "value_digits_source": value_digits_source,
        **({"failures": failures} if failures is not None else {}),
        **({"endpoints": endpoints} if endpoints is not None else {}),
        **({"graded": graded} if graded is not None else {}),
        **({"difficulty": difficulty} if difficulty is not None else {}),
    }
