"""Render issue 37's planted-set rows (``investigate_planted_37.py``'s OUT/rows.jsonl) as the
docs/investigate.md tables, one per (device, lengths), and a line of what each table shows.

    python bench/investigate_planted_37.py --render OUT/rows.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from planted_bugs import FAMILY  # noqa: E402

HEADER = (
    "| planted bug (undo?) | planted class | route | completes | recall ref / cand | first class | "
    "`where` | root cause | root-cause line (start) | s |\n|---|---|---|---|---|---|---|---|---|---|"
)


def _where(w: dict | None) -> str:
    if not w:
        return "-"
    if w.get("family"):
        return f"{w['family']} (`{w['module']}`, {w.get('localized_path')})"
    if w.get("first_departing_layer") is not None:
        return f"CSA layer {w['first_departing_layer']} ({w.get('path')}), {w.get('cause')}"
    return "-"


def _recall(r: dict) -> str:
    """Recall per length, reference / candidate: ``1.00, 1.00 / 1.00, 0.33``."""

    def fmt(by_length) -> str:
        if not isinstance(by_length, dict):
            return "-"
        return ", ".join(f"{by_length[k]:.2f}" for k in sorted(by_length, key=int))

    return f"{fmt(r.get('recall_reference'))} / {fmt(r.get('recall_candidate'))}"


def _ok(r: dict) -> bool:
    """The row holds what the issue asks: completes, no wrong root cause, the planted class first,
    ``where`` the bug's family (in-process) or a CSA layer (live; for a bug outside the selection,
    the cause put upstream or downstream of it), and a benign bug says "nothing to explain" (live)
    or exonerated / diverges_no_effect (in-process)."""
    if not r.get("completes"):
        return False
    first, where = (r.get("classes") or [None])[0], r.get("where") or {}
    if r["planted"] == "none":
        if r["route"] == "live":
            return first == "none" and r.get("root_cause") is None
        return all(v in ("exonerated", "diverges_no_effect") for k, v in r["suspects"].items() if "p1" in k)
    if r.get("root_cause") not in (None,) + tuple(k for k in r.get("suspects", {}) if "p1" in k):
        return False
    if r["route"] == "inprocess":
        placed = where.get("family") == FAMILY[r["bug"]]
    elif r["planted"] == "outside_selection":
        placed = where.get("cause") == "upstream or downstream of the selection"
    else:
        placed = where.get("first_departing_layer") is not None
    return first == r["planted"] and placed


def _line(r: dict) -> str:
    bug = f"`{r['bug']}` ({'undo' if r['undo'] else 'no undo'})"
    if not r.get("completes"):
        return f"| {bug} | {r['planted']} | {r['route']} | **no**: {r.get('error', '')[-80:]!r} | | | | | | {r['seconds']} |"
    first = (r.get("classes") or ["-"])[0]
    mark = f"**{first}**" if _ok(r) else f"{first} (expected {r['planted']})"
    line = r.get("root_line", "").split("**Root cause:**")[-1].strip().replace("|", "/")[:110]
    return (
        f"| {bug} | {r['planted']} | {r['route']} | yes | {_recall(r)} | {mark} | {_where(r.get('where'))} | "
        f"{r.get('root_cause') or '-'} | {line} | {r['seconds']} |"
    )


def render(rows_path: Path) -> str:
    rows: dict[str, dict] = {}
    for text in Path(rows_path).read_text().splitlines():
        row = json.loads(text)
        rows[row["key"]] = row  # the last row of a key wins (a resumed run)
    tables: dict[tuple, list[dict]] = {}
    for r in rows.values():
        tables.setdefault((r["device"], r["key"].split(":")[1]), []).append(r)
    out = []
    for (device, lengths), rs in sorted(tables.items()):
        rs.sort(key=lambda r: (r["bug"], r["route"]))
        good = sum(_ok(r) for r in rs)
        out += [f"**{device}, lengths {lengths}**: {good} of {len(rs)} runs as the issue asks.", "", HEADER]
        out += [_line(r) for r in rs] + [""]
    return "\n".join(out)
