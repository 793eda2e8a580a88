"""``topk_audit.json`` and ``topk_audit.md``: the result of ``needlescope indexer topk-audit``.

``topk_audit.json`` schema (``TOPK_AUDIT_SCHEMA``; definitions of every count in
``needlescope.dsa.topk_audit``)::

    {"capture": str, "format": "safetensors" | "safetensors+sglang" | "safetensors+vllm" | "needlescope-serve",
     "k": int, "bin_bits": int, "tie_rule": str,
     "rows": int,                      # audited (row, layer) pairs
     "rows_inexact": int, "exact": bool,
     "recall_mean": float | null, "recall_min": float | null,   # null when rows == 0
     "overlap_mean": float | null, "overlap_min": float | null,
     "wrongly_kept_total": int, "wrongly_dropped_total": int,
     "worst": [ROW],                   # up to --worst inexact rows, lowest recall first
     "per_row": [ROW]}                 # every audited row, in capture order
    ROW = {"row": int,                 # index along the capture's first axis
           "layer": int | null, "position": int | null,
           "candidates": int, "k_eff": int, "selected_valid": int,
           "wrongly_kept": int, "wrongly_dropped": int, "invalid_selected": int,
           "recall": float, "overlap": float,
           "kth_value": float | null,   # null: no candidate, or +inf
           "ties_at_cutoff": int, "tie_slots": int, "cutoff_bin_count": int, "exact": bool}
"""

from __future__ import annotations

import math

import numpy as np

from needlescope.dsa.topk_audit import AUDIT_COLUMNS, TIE_RULE
from needlescope.dsa.topk_audit_input import AuditInput
from needlescope.schema import check_schema, record

__all__ = ["TOPK_AUDIT_SCHEMA", "audit_report", "render_audit_md", "validate_audit"]

_INT = {"type": "integer"}
_ROW = record(
    {
        "row": _INT,
        "layer": {"type": ["integer", "null"]},
        "position": {"type": ["integer", "null"]},
        **{name: _INT for name in AUDIT_COLUMNS},
        "recall": {"type": "number"},
        "overlap": {"type": "number"},
        "kth_value": {"type": ["number", "null"]},
        "exact": {"type": "boolean"},
    }
)
TOPK_AUDIT_SCHEMA = record(
    {
        "capture": {"type": "string"},
        "format": {"type": "string"},
        "k": _INT,
        "bin_bits": _INT,
        "tie_rule": {"type": "string"},
        "rows": _INT,
        "rows_inexact": _INT,
        "exact": {"type": "boolean"},
        "recall_mean": {"type": ["number", "null"]},
        "recall_min": {"type": ["number", "null"]},
        "overlap_mean": {"type": ["number", "null"]},
        "overlap_min": {"type": ["number", "null"]},
        "wrongly_kept_total": _INT,
        "wrongly_dropped_total": _INT,
        "worst": {"type": "array", "items": _ROW},
        "per_row": {"type": "array", "items": _ROW},
    }
)


def _row_records(data: AuditInput, columns: dict[str, np.ndarray]) -> list[dict]:
    out = []
    for i in range(data.selected.shape[0]):
        rec: dict = {
            "row": int(data.row[i]),
            "layer": None if data.layer is None else int(data.layer[i]),
            "position": None if data.position is None else int(data.position[i]),
        }
        for name in AUDIT_COLUMNS:
            v = columns[name][i]
            if name == "exact":
                rec[name] = bool(v)
            elif name in ("recall", "overlap", "kth_value"):
                rec[name] = float(v) if math.isfinite(v) else None
            else:
                rec[name] = int(v)
        out.append(rec)
    return out


def audit_report(
    data: AuditInput, columns: dict[str, np.ndarray], *, capture: str, bin_bits: int, worst: int
) -> dict:
    """The ``topk_audit.json`` object of ``columns`` (``audit_rows`` over ``data``)."""
    rows = _row_records(data, columns)
    bad = sorted(
        (r for r in rows if not r["exact"]), key=lambda r: (r["recall"], -r["wrongly_dropped"], r["row"])
    )
    recall, overlap = columns["recall"], columns["overlap"]
    return {
        "capture": capture,
        "format": data.format,
        "k": int(data.selected.shape[1]),
        "bin_bits": int(bin_bits),
        "tie_rule": TIE_RULE,
        "rows": len(rows),
        "rows_inexact": len(bad),
        "exact": not bad,
        "recall_mean": float(recall.mean()) if len(rows) else None,
        "recall_min": float(recall.min()) if len(rows) else None,
        "overlap_mean": float(overlap.mean()) if len(rows) else None,
        "overlap_min": float(overlap.min()) if len(rows) else None,
        "wrongly_kept_total": int(columns["wrongly_kept"].sum()),
        "wrongly_dropped_total": int(columns["wrongly_dropped"].sum()),
        "worst": bad[:worst],
        "per_row": rows,
    }


def _where(r: dict) -> str:
    parts = [f"row {r['row']}"]
    if r["layer"] is not None:
        parts.append(f"layer {r['layer']}")
    if r["position"] is not None:
        parts.append(f"pos {r['position']}")
    return ", ".join(parts)


def render_audit_md(obj: dict) -> str:
    """Markdown summary of ``topk_audit.json``: the verdict and the worst rows."""
    verdict = "every row exact" if obj["exact"] else f"{obj['rows_inexact']} of {obj['rows']} rows inexact"
    recall, overlap = (
        "-" if obj[f"{m}_min"] is None else f"mean {obj[f'{m}_mean']:.4f}, min {obj[f'{m}_min']:.4f}"
        for m in ("recall", "overlap")
    )
    lines = [
        "# Top-k audit",
        "",
        f"Capture `{obj['capture']}` ({obj['format']}), k = {obj['k']}: **{verdict}**.",
        f"Selected-value recall {recall}; overlap {overlap}; {obj['wrongly_kept_total']} entries wrongly kept, "
        f"{obj['wrongly_dropped_total']} wrongly dropped.",
        "",
        f"Reference: {obj['tie_rule']}. Cut-off bin: top {obj['bin_bits']} bits of the float32 key.",
        "",
    ]
    if obj["worst"]:
        lines += [
            "| row | recall | overlap | kept wrong | dropped | candidates | ties at cut-off | cut-off bin |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in obj["worst"]:
            lines.append(
                f"| {_where(r)} | {r['recall']:.4f} | {r['overlap']:.4f} | {r['wrongly_kept']} | {r['wrongly_dropped']} "
                f"| {r['candidates']} | {r['ties_at_cutoff']} | {r['cutoff_bin_count']} |"
            )
        shown = len(obj["worst"])
        if shown < obj["rows_inexact"]:
            lines += ["", f"{obj['rows_inexact'] - shown} more inexact rows in topk_audit.json."]
    return "\n".join(lines) + "\n"


def validate_audit(obj: dict) -> None:
    """ValueError unless ``obj`` follows ``TOPK_AUDIT_SCHEMA``."""
    check_schema(obj, TOPK_AUDIT_SCHEMA, "topk_audit")
