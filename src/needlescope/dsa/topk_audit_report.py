"""``topk_audit.json`` and ``topk_audit.md``: the result of ``needlescope indexer topk-audit``.

``topk_audit.json`` schema (``TOPK_AUDIT_SCHEMA``; definitions of every count in
``needlescope.dsa.topk_audit``)::

    {"capture": str, "format": "safetensors" | "safetensors+sglang" | "safetensors+vllm" | "needlescope-serve",
     "k": int, "bin_bits": int, "tie_rule": str,
     "rows": int,                      # audited (row, layer) pairs
     "rows_inexact": int,              # a wrong selection, NaN logits in use, or k = 0 (ROW.problem)
     "rows_empty": int,                # no candidate and nothing selected: nothing to audit, not exact
     "exact": bool,                    # no row inexact and at least one row audited (not empty)
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
           "ties_at_cutoff": int, "tie_slots": int, "cutoff_bin_count": int, "nan_logits": int,
           "exact": bool,
           "problem": str | null}      # why a row is never exact whatever it selected: "no candidates
                                       # ...", "empty selection (k = 0)", "N NaN logits ..."; null: none
"""

from __future__ import annotations

import math

import numpy as np

from needlescope.dsa.topk_audit import AUDIT_COLUMNS, TIE_RULE
from needlescope.dsa.topk_audit_input import AuditInput
from needlescope.schema import check_schema, record

__all__ = ["TOPK_AUDIT_SCHEMA", "audit_report", "render_audit_md", "validate_audit", "verdict_line"]

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
        "problem": {"type": ["string", "null"]},
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
        "rows_empty": _INT,
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


def _problem(rec: dict, k: int) -> str | None:
    """Why a row cannot be exact whatever it selected (``topk_audit``'s docstring), or None."""
    parts = []
    if k == 0:
        parts.append("empty selection (k = 0): nothing was selected to audit")
    if rec["candidates"] == 0:
        parts.append("no candidates: every column in use is -inf or NaN (or the row's length is 0)")
    if rec["nan_logits"]:
        parts.append(f"{rec['nan_logits']} NaN logits among the columns in use")
    return "; ".join(parts) or None


def _empty(rec: dict, k: int) -> bool:
    """A row with nothing to audit: no candidate, and nothing (nothing valid or not) selected."""
    return rec["candidates"] == 0 and rec["wrongly_kept"] == 0 and rec["nan_logits"] == 0 and k > 0


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
        rec["problem"] = _problem(rec, data.selected.shape[1])
        out.append(rec)
    return out


def audit_report(
    data: AuditInput, columns: dict[str, np.ndarray], *, capture: str, bin_bits: int, worst: int
) -> dict:
    """The ``topk_audit.json`` object of ``columns`` (``audit_rows`` over ``data``)."""
    rows = _row_records(data, columns)
    k = int(data.selected.shape[1])
    empty = sum(_empty(r, k) for r in rows)
    bad = sorted(
        (r for r in rows if not r["exact"] and not _empty(r, k)),
        key=lambda r: (r["problem"] is None, r["recall"], -r["wrongly_dropped"], r["row"]),
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
        "rows_empty": empty,
        "exact": not bad and empty < len(rows),
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


def verdict_line(obj: dict) -> str:
    """The verdict in words: every audited row exact, how many inexact, or nothing to audit."""
    empty = obj["rows_empty"]
    if empty == obj["rows"]:
        return (
            f"nothing to audit: none of the {obj['rows']} rows has a candidate (every column in use is -inf "
            "or NaN, or its length is 0)"
        )
    said = (
        f"every audited row exact ({obj['rows'] - empty} rows)"
        if obj["exact"]
        else (f"{obj['rows_inexact']} of {obj['rows']} rows inexact")
    )
    return said + (f"; {empty} rows had no candidate (nothing to audit, not called exact)" if empty else "")


def render_audit_md(obj: dict) -> str:
    """Markdown summary of ``topk_audit.json``: the verdict and the worst rows."""
    verdict = verdict_line(obj)
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
            "| row | recall | overlap | kept wrong | dropped | candidates | ties at cut-off | cut-off bin | problem |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in obj["worst"]:
            lines.append(
                f"| {_where(r)} | {r['recall']:.4f} | {r['overlap']:.4f} | {r['wrongly_kept']} | {r['wrongly_dropped']} "
                f"| {r['candidates']} | {r['ties_at_cutoff']} | {r['cutoff_bin_count']} | {r['problem'] or '-'} |"
            )
        shown = len(obj["worst"])
        if shown < obj["rows_inexact"]:
            lines += ["", f"{obj['rows_inexact'] - shown} more inexact rows in topk_audit.json."]
    return "\n".join(lines) + "\n"


def validate_audit(obj: dict) -> None:
    """ValueError unless ``obj`` follows ``TOPK_AUDIT_SCHEMA``."""
    check_schema(obj, TOPK_AUDIT_SCHEMA, "topk_audit")
