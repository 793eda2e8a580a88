"""``compare_dump.json``: its schema, strict JSON text, and ``compare_dump.md``.

Schema (``COMPARE_DUMP_SCHEMA``)::

    {"dump_dir": str, "mapping": str, "files": int, "passes": [int], "ranks": [int],
     "prompt_tokens": int, "index_topk": int | null,
     "tensors": [{"engine_name": str, "reference": str, "layer": int | null,
                  "kind": "tensor" | "topk", "take": "output" | "input", "shard": str,
                  "ranks": [int], "passes": int, "rows": int, "in_err": float,
                  "precision": str | null, "rel_err": float | null, "budget": float | null,
                  "calibrated": bool, "verdict": "within budget" | "beyond budget" | "incomparable",
                  "reason": str | null}, ...],                     # reference forward order
     "layers": [{"layer": int | null, "tensors": int, "beyond": int, "incomparable": int,
                 "max_rel_err": float, "first_beyond": str | null}],
     "first_beyond": {"engine_name": str, "reference": str, "layer": int | null} | null,
     "summary": str,
     "indexer": [{"layer": int | null, "engine_name": str, "topk_overlap": float,
                  "positions_changed": int, "positions": int, "query_pos": int,
                  "needle_entries": [int], "needle_kept_engine": bool | null,
                  "needle_kept_reference": bool | null}],
     "needle_token_span": [int, int] | null,
     "unknown_names": [str], "ignored_names": [str], "names_without_layer": [str],
     "missing_reference": [str], "margin": float, "draws": int, "growth": float | null,
     "allow": {str: str}}

For a top-k row ``rel_err`` is the set difference of the selections (``1 - topk_overlap``).
Non-finite numbers are written as the strings ``"inf"`` / ``"nan"``.
"""

from __future__ import annotations

from needlescope.dsa.diff_md import diff_to_json
from needlescope.schema import check_schema, record

__all__ = ["COMPARE_DUMP_SCHEMA", "NO_BEYOND", "validate_compare_dump", "compare_dump_to_json",
           "render_compare_dump_md"]  # fmt: skip

NO_BEYOND = "every compared tensor is within its precision budget"
_NUM = {"type": ["number", "string"]}
_OPT_NUM = {"type": ["number", "string", "null"]}
_INT = {"type": "integer"}
_OPT_INT = {"type": ["integer", "null"]}
_STR = {"type": "string"}
_OPT_STR = {"type": ["string", "null"]}
_BOOL = {"type": "boolean"}
_OPT_BOOL = {"type": ["boolean", "null"]}
_INTS = {"type": "array", "items": _INT}
_STRS = {"type": "array", "items": _STR}

_TENSOR = record(
    {
        "engine_name": _STR, "reference": _STR, "layer": _OPT_INT, "kind": _STR, "take": _STR,
        "shard": _STR, "ranks": _INTS, "passes": _INT, "rows": _INT, "in_err": _NUM,
        "precision": _OPT_STR, "rel_err": _OPT_NUM, "budget": _OPT_NUM, "calibrated": _BOOL,
        "verdict": _STR, "reason": _OPT_STR,
    }
)  # fmt: skip
_LAYER = record(
    {"layer": _OPT_INT, "tensors": _INT, "beyond": _INT, "incomparable": _INT, "max_rel_err": _NUM,
     "first_beyond": _OPT_STR}
)  # fmt: skip
_INDEXER = record(
    {
        "layer": _OPT_INT, "engine_name": _STR, "topk_overlap": _NUM, "positions_changed": _INT,
        "positions": _INT, "query_pos": _INT, "needle_entries": _INTS, "needle_kept_engine": _OPT_BOOL,
        "needle_kept_reference": _OPT_BOOL,
    }
)  # fmt: skip
COMPARE_DUMP_SCHEMA: dict = record(
    {
        "dump_dir": _STR, "mapping": _STR, "files": _INT, "passes": _INTS, "ranks": _INTS,
        "prompt_tokens": _INT, "index_topk": _OPT_INT,
        "tensors": {"type": "array", "items": _TENSOR},
        "layers": {"type": "array", "items": _LAYER},
        "first_beyond": {"type": ["object", "null"]},
        "summary": _STR,
        "indexer": {"type": "array", "items": _INDEXER},
        "needle_token_span": {"type": ["array", "null"], "items": _INT},
        "unknown_names": _STRS, "ignored_names": _STRS, "names_without_layer": _STRS,
        "missing_reference": _STRS, "margin": _NUM, "draws": _INT, "growth": _OPT_NUM,
        "allow": {"type": "object"},
    }
)  # fmt: skip


def validate_compare_dump(obj: dict) -> None:
    """ValueError unless ``obj`` (as ``compare_dump`` returns it) follows COMPARE_DUMP_SCHEMA."""
    check_schema(obj, COMPARE_DUMP_SCHEMA, "compare_dump")


def compare_dump_to_json(obj: dict) -> str:
    """``compare_dump.json`` text: strict JSON (the same writer as ``diff.json``)."""
    return diff_to_json(obj)


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return "0" if x == 0 else f"{x:.3g}"
    return str(x)


def _names(title: str, names: list[str]) -> list[str]:
    if not names:
        return []
    return ["", f"**{title}** ({len(names)}):", ""] + [f"- `{n}`" for n in names]


def render_compare_dump_md(obj: dict) -> str:
    """``compare_dump.md``: the verdict, per layer, the tensors, the indexer, and every name not compared."""
    first = obj["first_beyond"]
    head = (
        f"**First tensor beyond its precision budget: `{first['engine_name']}`** "
        f"(reference `{first['reference']}`, layer {_fmt(first['layer'])})."
        if first
        else f"**{obj['summary'][0].upper()}{obj['summary'][1:]}.**"
    )
    lines = [
        "# Engine dump against the reference",
        "",
        head,
        "",
        f"Dump `{obj['dump_dir']}`: {obj['files']} files, passes {obj['passes']}, ranks {obj['ranks']}, "
        f"{obj['prompt_tokens']} tokens; mapping `{obj['mapping']}`; margin {obj['margin']}.",
        "",
        "## Per layer",
        "",
        "| layer | tensors | beyond budget | incomparable | max rel_err | first beyond |",
        "|---|---|---|---|---|---|",
    ]
    for d in obj["layers"]:
        lines.append(
            f"| {_fmt(d['layer'])} | {d['tensors']} | {d['beyond']} | {d['incomparable']} | "
            f"{_fmt(d['max_rel_err'])} | {'`' + d['first_beyond'] + '`' if d['first_beyond'] else '-'} |"
        )
    lines += ["", "## Tensors (reference forward order)", "",
              "| engine name | reference | shard | ranks | rows | precision | rel_err | in_err | budget | verdict |",
              "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for t in obj["tensors"]:
        verdict = t["verdict"] + (" (calibrated)" if t["calibrated"] else "")
        if t["reason"]:
            verdict += f": {t['reason']}"
        lines.append(
            f"| `{t['engine_name']}` | `{t['reference']}` | {t['shard']} | {len(t['ranks'])} | {t['rows']} | "
            f"{_fmt(t['precision'])} | {_fmt(t['rel_err'])} | {_fmt(t['in_err'])} | {_fmt(t['budget'])} | "
            f"{verdict} |"
        )
    if obj["indexer"]:
        lines += ["", "## Indexer top-k against the reference's selection", "",
                  "| layer | top-k overlap | positions changed | query | needle entries | kept (engine / reference) |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for r in obj["indexer"]:
            lines.append(
                f"| {_fmt(r['layer'])} | {_fmt(r['topk_overlap'])} | {r['positions_changed']}/{r['positions']} | "
                f"{r['query_pos']} | {r['needle_entries'] or '-'} | "
                f"{_fmt(r['needle_kept_engine'])} / {_fmt(r['needle_kept_reference'])} |"
            )
    lines += _names("Dumped names the mapping does not know (not compared)", obj["unknown_names"])
    lines += _names("Mapped names whose file gives no layer (not compared)", obj["names_without_layer"])
    lines += _names("Reference modules the checkpoint lacks (not compared)", obj["missing_reference"])
    lines += _names("Names the mapping ignores on purpose", obj["ignored_names"])
    return "\n".join(lines) + "\n"
