"""Write the outputs of a probe run: summary.json, report.md, heatmap.png and results.jsonl."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from ..analysis.curve import Cell, cliff, effective_length, pooled_recall
from ..schema import check_schema
from .breakdown import ENDPOINTS_SCHEMA, FAILURES_SCHEMA, endpoint_lines, failure_lines

__all__ = ["SUMMARY_SCHEMA", "validate_summary", "write_probe_outputs"]

_CELL_KEYS = ("length", "depth", "n", "correct", "errors", "recall", "ci_low", "ci_high")

SUMMARY_SCHEMA: dict = {
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
                "required": list(_CELL_KEYS),
                "properties": {
                    "length": {"type": "integer"},
                    "depth": {"type": "number"},
                    "n": {"type": "integer"},
                    "correct": {"type": "integer"},
                    "errors": {"type": "integer"},
                    "recall": {"type": ["number", "null"]},
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
        "cells_without_data": {"type": "integer"},
        "length_mismatches": {"type": "integer"},
        "unreachable_lengths": {"type": "integer"},
        "server_length_mismatches": {"type": "integer"},
        "value_digits": {"type": "integer"},
        "value_digits_source": {"type": "string"},
        "failures": FAILURES_SCHEMA,
        "endpoints": ENDPOINTS_SCHEMA,
    },
}


def validate_summary(obj: dict) -> None:
    """Raise ValueError if ``obj`` does not follow SUMMARY_SCHEMA (a minimal JSON Schema checker)."""
    check_schema(obj, SUMMARY_SCHEMA, "summary")


def _heatmap(path: Path, cells: list[Cell]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lengths = sorted({c.length for c in cells})
    depths = sorted({c.depth for c in cells})
    grid = np.full((max(1, len(lengths)), max(1, len(depths))), np.nan)
    fig, ax = plt.subplots(figsize=(1.2 * max(3, len(depths)) + 2, 0.7 * max(3, len(lengths)) + 1.5))
    for c in cells:
        i, j = lengths.index(c.length), depths.index(c.depth)
        if c.n:
            grid[i, j] = c.recall
        label = f"{c.recall:.2f}\nn={c.n}" if c.recall is not None else "no data"
        if c.errors:
            label += f"\nerr={c.errors}"
        ax.text(j, i, label, ha="center", va="center", fontsize=7)
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto", origin="lower")
    ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_xlabel("needle depth (%)")
    ax.set_ylabel("length (tokens)")
    fig.colorbar(im, ax=ax, label="recall")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _markdown(summary: dict, cells: list[Cell], notes: list[str]) -> str:
    lines = [f"# needlescope probe: {summary['model']} ({summary['kind']})", ""]
    eff = summary["effective_length"]
    lines.append(
        f"**Effective length** (pooled recall >= {summary['threshold']:g} at it and every shorter length): "
        + (f"{eff} tokens" if eff is not None else "none (the shortest tested length already fails)")
    )
    c = summary["cliff"]
    lines.append(
        "**Cliff:** " + (f"{c['from']} -> {c['to']} tokens, recall drops by {c['drop']:.2f}" if c else "none")
    )
    lines.append(
        f"**Errors:** {summary['errors_total']} request(s) failed; they are excluded from recall, not counted as misses."
    )
    lines.append(
        f"**Needle values:** {summary['value_digits']} digits, from {summary['value_digits_source']}."
    )
    if summary["cells_without_data"]:
        lines += [
            "",
            f"> **WARNING: {summary['cells_without_data']} cell(s) have no scored case** (every request failed "
            "or missed its length): their recall is null, drawn as 'no data', and they are left out of the "
            "effective length and the cliff.",
        ]
    if summary["length_mismatches"]:
        lines += [
            "",
            f"> **WARNING: {summary['length_mismatches']} case(s) have a length disagreement**: "
            f"{summary['unreachable_lengths']} did not reach their target length (left out of the analysis), "
            f"{summary['server_length_mismatches']} were counted differently by the server "
            "(usage.prompt_tokens). Each is named under Notes.",
        ]
    lines += [
        "",
        "| length | depth | recall | 95% CI | n | correct | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for cell in cells:
        recall = "no data" if cell.recall is None else f"{cell.recall:.3f}"
        lines.append(
            f"| {cell.length} | {cell.depth:g} | {recall} | [{cell.ci_low:.3f}, {cell.ci_high:.3f}] "
            f"| {cell.n} | {cell.correct} | {cell.errors} |"
        )
    lines += ["", "| length | pooled recall | n |", "|---|---|---|"]
    for length, (k, n) in pooled_recall(cells).items():
        lines.append(f"| {length} | {f'{k / n:.3f}' if n else 'no data'} | {n} |")
    if "failures" in summary:
        lines += [""] + failure_lines(summary["failures"])
    if "endpoints" in summary:
        lines += [""] + endpoint_lines(summary["endpoints"])
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    lines += [
        "",
        "## Provenance",
        "",
        "```json",
        json.dumps(summary["provenance"], indent=2, sort_keys=True),
        "```",
        "",
    ]
    return "\n".join(lines)


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
    value_digits: int,
    value_digits_source: str,
    failures: dict | None = None,
    endpoints: dict | None = None,
) -> dict:
    """Write the four probe outputs into ``out_dir`` and return the summary dict."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cells = sorted(cells, key=lambda c: (c.length, c.depth))
    unreachable = {
        r["case_id"]
        for r in results
        if r.get("counted_length") is not None and r["counted_length"] != r["length"]
    }
    server = {
        r["case_id"]
        for r in results
        if r.get("prompt_tokens") is not None and r["prompt_tokens"] != r.get("counted_length")
    }
    summary = {
        "effective_length": effective_length(cells, threshold),
        "threshold": float(threshold),
        "kind": kind,
        "model": model,
        "cells": [{k: asdict(c)[k] for k in _CELL_KEYS} for c in cells],
        "cliff": cliff(cells),
        "provenance": dict(provenance),
        "errors_total": sum(c.errors for c in cells),
        "cells_without_data": sum(1 for c in cells if c.recall is None),
        "length_mismatches": len(unreachable | server),
        "unreachable_lengths": len(unreachable),
        "server_length_mismatches": len(server),
        "value_digits": int(value_digits),
        "value_digits_source": value_digits_source,
        **({"failures": failures} if failures is not None else {}),
        **({"endpoints": endpoints} if endpoints is not None else {}),
    }
    validate_summary(summary)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / "report.md").write_text(_markdown(summary, cells, notes))
    with (out_dir / "results.jsonl").open("w") as f:
        for r in results:
            f.write(json.dumps(r, default=str) + "\n")
    _heatmap(out_dir / "heatmap.png", cells)
    return summary
