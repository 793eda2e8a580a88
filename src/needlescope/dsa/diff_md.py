"""``diff.json`` text, its schema and ``diff.md``: the written forms of ``needlescope.dsa.diff.localize``'s result.

``diff.json`` schema (``DIFF_SCHEMA``)::

    {"modules": [{"module": str, "kind": "module" | "indexer_selection" | "hc_streams_in"
                  | "hc_streams_out", "type": str, "rel_err": float, "in_err": float,
                  "expected_rel_err": float, "calibrated": bool, "own_err": float | null,
                  "own_budget": float | null, "precision": "bf16" | "fp16" | null,
                  "verdict": str, "exceeds": bool, "inner_divergent": str | null}, ...],
     "first_divergent_module": str | null, "summary": str,
     "layers": [{"layer": int, "index_topk": int, "k_reference": int | null,
                 "k_candidate": int | null, "topk_overlap": float, "selection_error": float,
                 "positions_changed": int, "positions": int, "needle_entries": [int],
                 "needle_rank_reference": int | null, "needle_rank_candidate": int | null,
                 "needle_selected_reference": bool | null, "needle_selected_candidate": bool | null,
                 "rank_consistent": bool}],
     "numerics": {...}, "reference_numerics": {...}, "patch": str | null,
     "prompt_tokens": int, "needle_token_span": [int, int] | null, "query_pos": int,
     "growth": float | null, "margin": float, "draws": int, "allow": {str: str},
     "unmatched": {"reference_only": [str], "candidate_only": [str]},
     "rope": [{"module": str, "expected": str, "finding": str,
               "queries": {"table": str | null, "rel_err": float},
               "keys": {"table": str | null, "rel_err": float} | null}]}

``rope``: the indexer calls whose queries or keys a RoPE table other than the indexer's own
rotates (``needlescope.dsa.diff_rope``); ``summary`` then names the first one.

Non-finite numbers are written as JSON strings ``"inf"`` / ``"nan"`` by ``diff_to_json``.
"""

from __future__ import annotations

import json

from needlescope.paths import json_safe
from needlescope.schema import check_schema

__all__ = ["DIFF_SCHEMA", "diff_to_json", "render_diff_md", "trivial_selection_note", "validate_diff"]

_NUM = {"type": ["number", "string"]}
DIFF_SCHEMA: dict = {
    "type": "object",
    "required": [
        "modules",
        "first_divergent_module",
        "summary",
        "layers",
        "numerics",
        "patch",
        "prompt_tokens",
    ],
    "properties": {
        "modules": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [
                    "module",
                    "rel_err",
                    "expected_rel_err",
                    "own_err",
                    "own_budget",
                    "verdict",
                    "exceeds",
                ],
                "properties": {
                    "module": {"type": "string"},
                    "kind": {"type": "string"},
                    "type": {"type": "string"},
                    "rel_err": _NUM,
                    "in_err": _NUM,
                    "expected_rel_err": _NUM,
                    "own_err": {"type": ["number", "string", "null"]},
                    "own_budget": {"type": ["number", "string", "null"]},
                    "precision": {"type": ["string", "null"]},
                    "verdict": {"type": "string"},
                    "exceeds": {"type": "boolean"},
                },
            },
        },
        "first_divergent_module": {"type": ["string", "null"]},
        "summary": {"type": "string"},
        "layers": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [
                    "layer",
                    "topk_overlap",
                    "selection_error",
                    "positions_changed",
                    "needle_rank_reference",
                    "needle_rank_candidate",
                    "rank_consistent",
                ],
                "properties": {
                    "layer": {"type": "integer"},
                    "topk_overlap": {"type": "number"},
                    "selection_error": {"type": "number"},
                    "positions_changed": {"type": "integer"},
                    "needle_rank_reference": {"type": ["integer", "null"]},
                    "needle_rank_candidate": {"type": ["integer", "null"]},
                    "rank_consistent": {"type": "boolean"},
                },
            },
        },
        "numerics": {"type": "object"},
        "patch": {"type": ["string", "null"]},
        "prompt_tokens": {"type": "integer"},
        "rope": {
            "type": "array",
            "items": {"type": "object", "required": ["module", "expected", "finding", "queries", "keys"]},
        },
    },
}
"""JSON-Schema-style description of ``diff.json``."""


def validate_diff(obj: dict) -> None:
    """Raise ValueError unless ``obj`` (as ``localize`` returns it) follows DIFF_SCHEMA."""
    check_schema(obj, DIFF_SCHEMA, "diff")


def diff_to_json(obj: dict) -> str:
    """``diff.json`` text: strict JSON, non-finite floats written as strings."""
    return json.dumps(json_safe(obj), indent=2, allow_nan=False)


def _fmt(x) -> str:
    if isinstance(x, str):
        return x
    if x is None:
        return "-"
    if isinstance(x, float):
        return "0" if x == 0 else f"{x:.3g}"
    return str(x)


def render_diff_md(obj: dict, *, top: int = 15) -> str:
    """Markdown summary: verdict, per-layer indexer table, judged modules, largest errors."""
    num = obj["numerics"]
    budget = (
        f"growth factor {obj['growth']}"
        if obj.get("growth") is not None
        else (f"calibrated budgets (margin {obj.get('margin')}, {obj.get('draws')} draws)")
    )
    allow = ", ".join(f"`{k}={v}`" for k, v in (obj.get("allow") or {}).items()) or "none"
    lines = [
        "# Differential localization",
        "",
        f"Candidate numerics: keys `{num['index_k']}`, queries `{num['index_q']}`, scores `{num['score_dtype']}`, "
        f"index_topk `{num['index_topk'] if num['index_topk'] is not None else 'checkpoint'}`; "
        f"patch: `{obj['patch'] or 'none'}`. Prompt: {obj['prompt_tokens']} tokens; {budget}; allowed: {allow}.",
        "",
    ]
    first = obj["first_divergent_module"]
    if first is None:
        lines.append(f"**{obj['summary'][0].upper()}{obj['summary'][1:]}.**")
    else:
        m = next(m for m in obj["modules"] if m["module"] == first)
        lines.append(
            f"**First divergent module: `{first}`** ({m['type']}): its own code moves its output by "
            f"{_fmt(m['own_err'])} against a budget of {_fmt(m['own_budget'])} (output error {_fmt(m['rel_err'])}, "
            f"input error {_fmt(m['in_err'])})."
        )
    lines += [
        "",
        "## Indexer per CSA layer",
        "",
        "| layer | k (ref / cand) | top-k overlap | positions changed | needle rank (ref) | needle rank (cand) "
        "| selected (ref / cand) | rank consistent |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in obj["layers"]:
        lines.append(
            f"| {r['layer']} | {_fmt(r['k_reference'])} / {_fmt(r['k_candidate'])} | {_fmt(r['topk_overlap'])} "
            f"| {r['positions_changed']}/{r['positions']} | {_fmt(r['needle_rank_reference'])} "
            f"| {_fmt(r['needle_rank_candidate'])} | {_fmt(r['needle_selected_reference'])} / "
            f"{_fmt(r['needle_selected_candidate'])} | {'yes' if r['rank_consistent'] else '**no**'} |"
        )
    trivial = trivial_selection_note(obj)
    if trivial:
        lines += ["", f"**{trivial}**"]
    judged = [m for m in obj["modules"] if m["verdict"] not in ("ok", "probe")]
    lines += ["", f"## Modules not simply ok ({len(judged)} of {len(obj['modules'])}, first {top})", ""]
    lines += _module_table(judged[:top])
    worst = sorted(
        (m for m in obj["modules"] if isinstance(m["rel_err"], float)), key=lambda m: -m["rel_err"]
    )[:top]
    lines += ["", f"## Largest relative errors (top {top})", ""]
    lines += _module_table(worst)
    um = obj.get("unmatched", {})
    if um.get("reference_only") or um.get("candidate_only"):
        lines += [
            "",
            f"Unmatched module calls: reference only {um.get('reference_only')}, "
            f"candidate only {um.get('candidate_only')}.",
        ]
    return "\n".join(lines) + "\n"


COMPRESS_RATIO = 4
"""Tokens per compressed entry of a CSA layer (the organism's and DeepSeek-V4's)."""


def trivial_selection_note(obj: dict) -> str | None:
    """A sentence naming the layers whose top-k holds every compressed entry of the prompt (both
    sides select everything: an overlap of 1 there says nothing about selection); None if none."""
    entries = obj["prompt_tokens"] // COMPRESS_RATIO
    layers = [
        r["layer"]
        for r in obj["layers"]
        if min(k for k in (r["k_reference"], r["k_candidate"], r["index_topk"]) if k is not None) >= entries
    ]
    if not layers:
        return None
    return (
        f"The comparison of selection is trivial in layer{'s' if len(layers) > 1 else ''} "
        f"{', '.join(map(str, layers))}: the top-k holds all {entries} entries of the {obj['prompt_tokens']}-token "
        f"prompt on both sides, so every entry is selected and the overlap is 1 whatever the numerics; pass "
        f"--index-topk below {entries} to compare selection"
    )


def _module_table(rows: list[dict]) -> list[str]:
    if not rows:
        return ["(none)"]
    out = [
        "| module | type | rel_err | input err | expected | own err | own budget | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in rows:
        out.append(
            f"| `{m['module']}` | {m['type']} | {_fmt(m['rel_err'])} | {_fmt(m['in_err'])} "
            f"| {_fmt(m['expected_rel_err'])} | {_fmt(m['own_err'])} | {_fmt(m['own_budget'])} | {m['verdict']} |"
        )
    return out
