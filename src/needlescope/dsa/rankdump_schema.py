"""``rankdump.json``'s schema (``RANKDUMP_SCHEMA``; the keys are documented in ``dsa.rankdump``)."""

from __future__ import annotations

__all__ = ["RANKDUMP_SCHEMA"]

_POSITION_SCHEMA = {
    "type": "object",
    "required": [
        "query_pos",
        "visible_entries",
        "needle_entries",
        "best_rank",
        "needle_score",
        "cutoff_score",
        "margin",
        "selected",
    ],
    "properties": {
        "query_pos": {"type": "integer"},
        "visible_entries": {"type": "integer"},
        "needle_entries": {"type": "array", "items": {"type": "integer"}},
        "best_rank": {"type": "integer"},
        "ties": {"type": "integer"},
        "needle_score": {"type": "number"},
        "cutoff_score": {"type": "number"},
        "margin": {"type": "number"},
        "margin_frac": {"type": "number"},
        "selected": {"type": "boolean"},
        "nonfinite": {
            "type": "object",
            "required": ["neg_inf", "nan", "pos_inf"],
            "properties": {k: {"type": "integer"} for k in ("neg_inf", "nan", "pos_inf")},
        },
    },
}

_DUMP_SCHEMA: dict = {
    "type": "object",
    "required": ["index_topk", "numerics", "prompt_tokens", "needle_token_span", "layers"],
    "properties": {
        "index_topk": {"type": "integer"},
        "numerics": {
            "type": "object",
            "required": ["index_k", "index_q", "score_dtype"],
            "properties": {
                "index_k": {"type": "string"},
                "index_q": {"type": "string"},
                "score_dtype": {"type": "string"},
                "hadamard": {"type": "boolean"},
            },
        },
        "prompt_tokens": {"type": "integer"},
        "needle_token_span": {"type": "array", "items": {"type": "integer"}},
        "compress_ratio": {"type": "integer"},
        "query_positions_source": {"type": "string"},
        "generated_tokens": {"type": "array", "items": {"type": "integer"}},
        "generated_text": {"type": "string"},
        "answer_correct": {"type": ["boolean", "null"]},
        "patch": {"type": ["string", "null"]},
        "label": {"type": "string"},
        "layers": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["layer", "positions"],
                "properties": {
                    "layer": {"type": "integer"},
                    "needle_not_visible": {"type": "array", "items": {"type": "integer"}},
                    "positions": {"type": "array", "items": _POSITION_SCHEMA},
                },
            },
        },
    },
}

RANKDUMP_SCHEMA: dict = {
    **_DUMP_SCHEMA,
    "properties": {**_DUMP_SCHEMA["properties"], "prompts": {"type": "array", "items": _DUMP_SCHEMA}},
}
"""JSON-Schema-style description of ``rankdump.json`` (checked by ``validate_rankdump``)."""
