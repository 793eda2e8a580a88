"""The probe's four outputs and the schema of ``summary.json`` that other tools rely on."""

from __future__ import annotations

import json
from pathlib import Path

from needlescope.analysis import Cell, cliff, effective_length, recall_by_length

CELL_KEYS = ("length", "depth", "n", "correct", "errors", "recall", "ci_low", "ci_high")

SUMMARY_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "needlescope probe summary.json",
    "type": "object",
    "required": ["effective_length", "threshold", "kind", "model", "cells", "cliff", "provenance"],
    "properties": {
        "effective_length": {"type": ["integer", "null"]},
        "threshold": {"type": "number"},
        "kind": {"type": "string"},
        "model": {"type": "string"},
        "cells": {
            "type": "array",
            "items": {
                "type": "object",
                "required": list(CELL_KEYS),
                "properties": {
                    "length": {"type": "integer"},
                    "depth": {"type": "number"},
                    "n": {"type": "integer"},
                    "correct": {"type": "integer"},
                    "errors": {"type": "integer"},
                    "recall": {"type": "number"},
                    "ci_low": {"type": "number"},
                    "ci_high": {"type": "number"},
                },
            },
        },
        "cliff": {
            "type": ["object", "null"],
            "required": ["from", "to", "drop"],
            "properties": {
                "from": {"type": "integer"},
                "to": {"type": "integer"},
                "drop": {"type": "number"},
            },
        },
        "provenance": {"type": "object"},
        "errors_total": {"type": "integer"},
        "length_mismatches": {"type": "array", "items": {"type": "string"}},
    },
}

_PY_TYPES = {"integer": int, "number": (int, float), "string": str, "object": dict, "array": list}


def _check(value, schema: dict, where: str) -> None:
    types = schema.get("type")
    if types is not None:
        allowed = [types] if isinstance(types, str) else types
        ok = any(value is None if t == "null" else isinstance(value, _PY_TYPES[t]) for t in allowed)
        if not ok or (isinstance(value, bool) and "integer" in allowed):
            raise ValueError(f"{where}: expected {types}, got {type(value).__name__}")
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                raise ValueError(f"{where}: missing key {key!r}")
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                _check(value[key], sub, f"{where}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _check(item, schema["items"], f"{where}[{i}]")


def validate_summary(obj: dict) -> None:
    """Raise ValueError naming the first place where ``obj`` breaks SUMMARY_SCHEMA."""
    _check(obj, SUMMARY_SCHEMA, "summary")


def write_probe_outputs(
    out_dir: Path,
    *,
    cells: list[Cell],
    results: list[dict],
    kind: str,
    model: str,
    threshold: float,
    provenance: dict,
    notes: list[str],
) -> dict:
    """Write summary.json, report.md, heatmap.png and results.jsonl into ``out_dir``; return the summary."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {
        "effective_length": effective_length(cells, threshold),
        "threshold": threshold,
        "kind": kind,
        "model": model,
        "cells": [c.to_dict() for c in cells],
        "cliff": cliff(cells),
        "provenance": provenance,
        "errors_total": sum(c.errors for c in cells),
        "length_mismatches": notes,
    }
    validate_summary(summary)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    with (out_dir / "results.jsonl").open("w") as fh:
        for row in results:
            fh.write(json.dumps(row) + "\n")
    (out_dir / "report.md").write_text(render_report(summary, cells))
    write_heatmap(out_dir / "heatmap.png", cells, title=f"{model} · {kind}")
    return summary


def render_report(summary: dict, cells: list[Cell]) -> str:
    depths = sorted({c.depth for c in cells})
    lengths = sorted({c.length for c in cells})
    grid = {(c.length, c.depth): c for c in cells}
    pooled = recall_by_length(cells)
    eff = summary["effective_length"]
    lines = [
        f"# Recall probe: {summary['model']} ({summary['kind']})",
        "",
        f"- Effective length: **{eff if eff is not None else 'none'}** tokens "
        f"(largest length whose recall, and every shorter one's, is >= {summary['threshold']})",
    ]
    c = summary["cliff"]
    lines.append(
        f"- Cliff: {c['from']} -> {c['to']} tokens, recall drops {c['drop']:.2f}" if c else "- Cliff: none"
    )
    lines.append(
        f"- Errors: {summary['errors_total']} failed requests, counted apart and never scored as misses"
    )
    lines += ["", "Recall per cell (correct/n, errors in brackets):", ""]
    lines.append("| length \\ depth | " + " | ".join(f"{d:g}%" for d in depths) + " | pooled |")
    lines.append("|---" * (len(depths) + 2) + "|")
    for L in lengths:
        row = []
        for d in depths:
            cell = grid.get((L, d))
            if cell is None:
                row.append("-")
                continue
            text = f"{cell.recall:.2f} ({cell.correct}/{cell.n})"
            row.append(text + (f" [{cell.errors} err]" if cell.errors else ""))
        p = pooled[L]
        tail = f" | {p:.2f} |" if p is not None else " | - |"
        lines.append(f"| {L} | " + " | ".join(row) + tail)
    if summary["length_mismatches"]:
        lines += ["", f"## WARNING: {len(summary['length_mismatches'])} token-length disagreements", ""]
        lines += [f"- {n}" for n in summary["length_mismatches"][:50]]
        if len(summary["length_mismatches"]) > 50:
            lines.append(f"- ... and {len(summary['length_mismatches']) - 50} more (see results.jsonl)")
    lines += [
        "",
        "## Provenance",
        "",
        "```json",
        json.dumps(summary["provenance"], indent=2)[:4000],
        "```",
        "",
    ]
    lines += ["![heatmap](heatmap.png)", ""]
    return "\n".join(lines)


def write_heatmap(path: Path, cells: list[Cell], *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    depths = sorted({c.depth for c in cells})
    lengths = sorted({c.length for c in cells})
    grid = np.full((len(lengths), len(depths)), np.nan)
    fig, ax = plt.subplots(figsize=(1.1 * len(depths) + 2.5, 0.7 * len(lengths) + 1.8))
    for c in cells:
        i, j = lengths.index(c.length), depths.index(c.depth)
        if c.n:
            grid[i, j] = c.recall
        label = f"{c.recall:.2f}\nn={c.n}" if c.n else "no data"
        if c.errors:
            label += f"\n{c.errors} err"
        ax.text(j, i, label, ha="center", va="center", fontsize=7)
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto", origin="lower")
    ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_yticks(range(len(lengths)), [str(L) for L in lengths])
    ax.set_xlabel("needle depth (%)")
    ax.set_ylabel("prompt length (tokens)")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="recall")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
