"""Decode SGLang's indexer top-k capture and report whether the needle's entries were selected.

SGLang started with ``--enable-return-indexer-topk`` answers a native ``/generate`` request
carrying ``"return_indexer_topk": true`` with ``meta_info["indexer_topk"]``: base64 of
little-endian int32, shaped ``(tokens - 1, indexer_layers, index_topk)``, ``-1`` as padding,
values request-local compressed-entry indices (entry i pools tokens [4i, 4i+3]). Row i is
the query at position i, the i-th token fed to the model: the prompt's tokens, then every
generated token but the last (which is never fed back), hence ``tokens - 1`` rows with
``tokens = prompt_tokens + completion_tokens``.

The answer positions are the rows that produce answer tokens: ``prompt_tokens - 1`` (the
last prompt token, which produces the first generated token) up to the last row.

This module itself uses numpy only (the ``needlescope.dsa`` package imports torch).

``capture.json`` schema (``CAPTURE_SCHEMA``; keys beyond these may be added)::

    {"url": str, "prompt_tokens": int, "completion_tokens": int, "text": str,
     "index_topk": int, "num_layers": int, "layer_ids": [int], "compress_ratio": int,
     "needle_token_span": [int, int], "needle_entries": [int],
     "answer_positions": [int],
     "layers": [{"layer": int, "capture_layer": int,
                 "positions": [{"query_pos": int, "visible_entries": int,
                                "needle_entries_visible": [int], "selected_needle_entries": [int],
                                "selected": bool, "valid_entries": int}],
                 "selected_rate": float | null,       # over positions with a visible needle entry
                 "selected_at_first_answer": bool | null}],
     "tokenizer": str}
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence

import numpy as np

from needlescope.dsa.reference import visible_entries
from needlescope.errors import BadInput, ProtocolViolation
from needlescope.schema import check_schema

__all__ = [
    "validate_capture",
    "CAPTURE_SCHEMA",
    "decode_indexer_topk",
    "decode_capture",
    "infer_shape",
    "default_answer_positions",
    "capture_report",
    "render_capture_md",
]

CAPTURE_SCHEMA: dict = {
    "type": "object",
    "required": ["prompt_tokens", "index_topk", "num_layers", "needle_entries", "answer_positions", "layers"],
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "index_topk": {"type": "integer"},
        "num_layers": {"type": "integer"},
        "needle_entries": {"type": "array", "items": {"type": "integer"}},
        "answer_positions": {"type": "array", "items": {"type": "integer"}},
        "layers": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["layer", "positions"],
                "properties": {"layer": {"type": "integer"}, "positions": {"type": "array"}},
            },
        },
    },
}


def _raw_int32(b64: str) -> np.ndarray:
    if not isinstance(b64, str):
        raise ProtocolViolation(f"indexer_topk must be a base64 string, got {type(b64).__name__}")
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ProtocolViolation(f"indexer_topk is not valid base64: {exc}") from exc
    if len(raw) % 4:
        raise ProtocolViolation(f"indexer_topk holds {len(raw)} bytes, not a whole number of int32 values")
    return np.frombuffer(raw, dtype="<i4")


def infer_shape(n_values: int, rows: int, num_layers: int | None, index_topk: int | None) -> tuple[int, int]:
    """(num_layers, index_topk) for ``n_values`` int32s over ``rows`` rows, given at least one of them."""
    if rows < 1:
        raise ProtocolViolation(f"the capture needs at least one row (tokens - 1 >= 1), got {rows}")
    if n_values % rows:
        raise ProtocolViolation(f"indexer_topk holds {n_values} values, not divisible by tokens-1 = {rows}")
    per_row = n_values // rows
    if num_layers is None and index_topk is None:
        raise BadInput(
            "cannot shape the capture: the server info names neither index_topk nor num_indexer_layers; "
            "pass --index-topk or --num-layers"
        )
    if num_layers is None:
        if per_row % index_topk:
            raise ProtocolViolation(f"{per_row} values per row are not divisible by index_topk={index_topk}")
        num_layers = per_row // index_topk
    if index_topk is None:
        if per_row % num_layers:
            raise ProtocolViolation(f"{per_row} values per row are not divisible by num_layers={num_layers}")
        index_topk = per_row // num_layers
    if num_layers * index_topk != per_row:
        raise ProtocolViolation(
            f"indexer_topk has {per_row} values per row, but num_layers x index_topk = "
            f"{num_layers} x {index_topk} = {num_layers * index_topk}"
        )
    return num_layers, index_topk


def decode_indexer_topk(b64: str, num_layers: int, index_topk: int) -> np.ndarray:
    """int32 array [tokens-1, num_layers, index_topk] from SGLang's base64 payload.

    ProtocolViolation when the payload is not base64, not whole int32s, or its length is not
    a multiple of ``num_layers * index_topk``; ValueError for non-positive shape arguments.
    """
    if num_layers < 1 or index_topk < 1:
        raise ValueError(f"num_layers and index_topk must be >= 1, got {num_layers}, {index_topk}")
    flat = _raw_int32(b64)
    per_row = num_layers * index_topk
    if flat.size % per_row:
        raise ProtocolViolation(
            f"indexer_topk holds {flat.size} int32 values, not a multiple of num_layers x index_topk = "
            f"{num_layers} x {index_topk} = {per_row}; check --num-layers / --index-topk"
        )
    return flat.reshape(-1, num_layers, index_topk).astype(np.int32, copy=True)


def decode_capture(
    b64: str, rows: int, *, num_layers: int | None = None, index_topk: int | None = None
) -> np.ndarray:
    """int32 [rows, layers, k] from the payload of a request with ``rows`` = tokens-1 fed tokens.

    Whichever of ``num_layers`` / ``index_topk`` is None is inferred from the payload length
    (BadInput when both are); a length that does not fit is a ProtocolViolation.
    """
    flat = _raw_int32(b64)
    n, k = infer_shape(flat.size, rows, num_layers, index_topk)
    return flat.reshape(rows, n, k).astype(np.int32, copy=True)


def default_answer_positions(prompt_tokens: int, rows: int) -> list[int]:
    """Rows producing answer tokens: prompt_tokens-1 .. rows-1."""
    return list(range(max(prompt_tokens - 1, 0), rows))


def capture_report(
    topk: np.ndarray,
    prompt_len: int,
    needle_entries: Sequence[int],
    answer_positions: Sequence[int],
    layer_ids: Sequence[int],
    *,
    ratio: int = 4,
) -> list[dict]:
    """Per capture layer: at each answer position, which visible needle entries were selected.

    topk: [N, layers, k] request-local entry indices (-1 = none), row i = query position i;
    prompt_len: prompt tokens (validated: N >= prompt_len); needle_entries: entries covering
    the needle; answer_positions: rows to inspect (each in 0..N-1); layer_ids: the model
    layer id of each capture layer (length = layers). An entry is visible to row t when
    entry < (t+1)//ratio; an index >= that is reported as a protocol violation.
    """
    topk = np.asarray(topk)
    if topk.ndim != 3:
        raise ValueError(f"topk must be [N, layers, k], got shape {topk.shape}")
    N, n_layers, _ = topk.shape
    if len(layer_ids) != n_layers:
        raise ValueError(f"{len(layer_ids)} layer ids for {n_layers} capture layers")
    if N < prompt_len:
        raise ProtocolViolation(f"the capture has {N} rows but the prompt has {prompt_len} tokens")
    bad = [p for p in answer_positions if not 0 <= p < N]
    if bad:
        raise ValueError(f"answer positions {bad[:5]} are outside the capture's rows 0..{N - 1}")
    needle = sorted(set(int(e) for e in needle_entries))
    out = []
    for j, layer in enumerate(layer_ids):
        rows = []
        for t in answer_positions:
            row = topk[t, j]
            valid = row[row >= 0]
            visible = visible_entries(t, ratio)
            # SGLang clamps each row's length to >= 1 (FlashMLA), so a row with no visible entry
            # may still carry entry 0; anything beyond that is not a request-local index.
            if valid.size and int(valid.max()) >= max(visible, 1):
                raise ProtocolViolation(
                    f"capture layer {j} row {t} selects entry {int(valid.max())}, but only {visible} entries "
                    "are visible there; the indices are not request-local compressed entries"
                )
            vis_needle = [e for e in needle if e < visible]
            chosen = sorted(set(int(v) for v in valid) & set(vis_needle))
            rows.append(
                {
                    "query_pos": int(t),
                    "visible_entries": int(visible),
                    "needle_entries_visible": vis_needle,
                    "selected_needle_entries": chosen,
                    "selected": bool(chosen),
                    "valid_entries": int(valid.size),
                }
            )
        scored = [r for r in rows if r["needle_entries_visible"]]
        out.append(
            {
                "layer": int(layer),
                "capture_layer": j,
                "positions": rows,
                "selected_rate": (sum(r["selected"] for r in scored) / len(scored)) if scored else None,
                "selected_at_first_answer": (
                    rows[0]["selected"] if rows and rows[0]["needle_entries_visible"] else None
                ),
            }
        )
    return out


def render_capture_md(obj: dict) -> str:
    """Markdown summary of ``capture.json``."""
    lines = [
        "# Live indexer capture",
        "",
        f"Server `{obj.get('url', '?')}`: {obj['prompt_tokens']} prompt + {obj.get('completion_tokens', '?')} "
        f"generated tokens, {obj['num_layers']} indexer layers, index_topk {obj['index_topk']}. "
        f"Needle tokens {obj.get('needle_token_span')} -> entries {obj['needle_entries']}.",
        "",
        f"Answer text: `{obj.get('text', '')!s}`",
        "",
        "| layer | selected at first answer position | selected rate over answer positions |",
        "|---|---|---|",
    ]
    for r in obj["layers"]:
        first = r["selected_at_first_answer"]
        rate = r["selected_rate"]
        lines.append(
            f"| {r['layer']} | {'-' if first is None else ('yes' if first else 'no')} "
            f"| {'-' if rate is None else f'{rate:.2f}'} |"
        )
    return "\n".join(lines) + "\n"


def validate_capture(obj: dict) -> None:
    """Raise ValueError unless ``obj`` follows CAPTURE_SCHEMA."""
    check_schema(obj, CAPTURE_SCHEMA, "capture")
