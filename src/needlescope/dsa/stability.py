"""Selection stability: how much the indexer's top-k sets move between two numerics (or models).

Both sides run one prefill of the same prompt (same token ids), so every prompt position is a
query row on both sides; generation is not used because two numerics may generate different
tokens. Per CSA layer, over the rows with at least one visible entry:

* ``mean_recall`` / ``min_recall``: recall of the reference set, |R ∩ C| / |R|, per row;
* ``mean_recall_competitive``: the same over rows with more visible entries than the reference
  k (the only rows where a choice is made; null when there are none);
* ``changed_positions`` / ``changed_fraction``: rows whose selected *set* differs;
* ``needle_flips``: rows where a needle entry (visible at that row) entered or left the set,
  each ``{"query_pos", "entered": [entries only the candidate selects], "left": [entries only
  the reference selects]}``.

``stability.json`` schema (``STABILITY_SCHEMA``)::

    {"reference": {"index_k": str, "index_q": str, "score_dtype": str, "index_topk": int,
                   "patch": str | null, "model": str},
     "candidate": {same keys},
     "prompt_tokens": int, "needle_token_span": [int, int], "needle_entries": [int],
     "layers": [{"layer": int, "rows": int, "competitive_rows": int, "mean_recall": float,
                 "min_recall": float, "mean_recall_competitive": float | null,
                 "changed_positions": int, "changed_fraction": float,
                 "needle_flips": [{"query_pos": int, "entered": [int], "left": [int]}]}],
     "summary": {"mean_recall": float, "changed_positions": int, "rows": int, "needle_flips": int}}
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from needlescope.dsa.emulate import IndexerCapture, csa_indexers, emulate
from needlescope.dsa.passes import prefill
from needlescope.dsa.prompt import covering_entries, render_prompt, resolve_needle_span
from needlescope.dsa.reference import visible_entries
from needlescope.errors import BadInput
from needlescope.schema import check_schema
from needlescope.setting import REFERENCE, Setting

__all__ = [
    "STABILITY_SCHEMA",
    "selection_mask",
    "reference_recall",
    "changed_rows",
    "needle_flips",
    "compare_topk",
    "selection_stability",
    "validate_stability",
]

_SIDE = {
    "type": "object",
    "required": ["index_k", "index_q", "score_dtype", "index_topk"],
    "properties": {
        "index_k": {"type": "string"},
        "index_q": {"type": "string"},
        "score_dtype": {"type": "string"},
        "index_topk": {"type": "integer"},
        "patch": {"type": ["string", "null"]},
        "model": {"type": "string"},
    },
}

STABILITY_SCHEMA: dict = {
    "type": "object",
    "required": ["reference", "candidate", "prompt_tokens", "needle_token_span", "needle_entries", "layers"],
    "properties": {
        "reference": _SIDE,
        "candidate": _SIDE,
        "prompt_tokens": {"type": "integer"},
        "needle_token_span": {"type": "array", "items": {"type": "integer"}},
        "needle_entries": {"type": "array", "items": {"type": "integer"}},
        "layers": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [
                    "layer",
                    "rows",
                    "competitive_rows",
                    "mean_recall",
                    "min_recall",
                    "mean_recall_competitive",
                    "changed_positions",
                    "changed_fraction",
                    "needle_flips",
                ],
                "properties": {
                    "layer": {"type": "integer"},
                    "rows": {"type": "integer"},
                    "competitive_rows": {"type": "integer"},
                    "mean_recall": {"type": "number"},
                    "min_recall": {"type": "number"},
                    "mean_recall_competitive": {"type": ["number", "null"]},
                    "changed_positions": {"type": "integer"},
                    "changed_fraction": {"type": "number"},
                    "needle_flips": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["query_pos", "entered", "left"],
                            "properties": {
                                "query_pos": {"type": "integer"},
                                "entered": {"type": "array", "items": {"type": "integer"}},
                                "left": {"type": "array", "items": {"type": "integer"}},
                            },
                        },
                    },
                },
            },
        },
        "summary": {"type": "object"},
    },
}
"""JSON-Schema-style description of ``stability.json`` (checked by ``validate_stability``)."""


def selection_mask(topk: torch.Tensor, n_entries: int) -> torch.Tensor:
    """Bool [N, n_entries]: entry e is in row n's set. topk: [N, k] entry ids, -1 padded.

    Ids >= n_entries raise ValueError (the caller's entry count is wrong).
    """
    N = topk.shape[0]
    t = topk.long()
    if t.numel() and int(t.max()) >= n_entries:
        raise ValueError(f"top-k holds entry {int(t.max())} but only {n_entries} entries exist")
    cols = torch.where(t >= 0, t, torch.full_like(t, n_entries))  # -1 -> spill column
    mask = torch.zeros((N, n_entries + 1), dtype=torch.bool)
    mask.scatter_(1, cols, True)
    return mask[:, :n_entries]


def _masks(ref: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if ref.shape[0] != other.shape[0]:
        raise ValueError(f"row counts differ: reference {ref.shape[0]} vs candidate {other.shape[0]}")
    n = 1 + max(int(ref.max()) if ref.numel() else -1, int(other.max()) if other.numel() else -1, 0)
    return selection_mask(ref, n), selection_mask(other, n)


def reference_recall(ref: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Float [N]: |R_n ∩ C_n| / |R_n| for ref [N, k] and other [N, k2] (-1 padded); 1.0 where R_n is empty."""
    r, c = _masks(ref, other)
    size = r.sum(dim=1)  # [N]
    inter = (r & c).sum(dim=1)  # [N]
    return torch.where(size > 0, inter.float() / size.clamp_min(1).float(), torch.ones(size.shape))


def changed_rows(ref: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Bool [N]: row n's selected set differs between ref [N, k] and other [N, k2] (order ignored)."""
    r, c = _masks(ref, other)
    return (r != c).any(dim=1)


def needle_flips(
    ref: torch.Tensor,
    other: torch.Tensor,
    needle_entries: Sequence[int],
    positions: Sequence[int],
    visible: Sequence[int] | None = None,
) -> list[dict]:
    """Rows where a needle entry entered or left the set.

    ref [N, k], other [N, k2]: -1 padded sets; positions [N]: each row's query position;
    visible [N] (optional): entries visible per row, needle entries >= it are ignored.
    Returns ``[{"query_pos", "entered": [...], "left": [...]}]`` in row order.
    """
    if len(positions) != ref.shape[0]:
        raise ValueError(f"{len(positions)} positions for {ref.shape[0]} rows")
    r, c = _masks(ref, other)
    n = r.shape[1]
    out = []
    for i, t in enumerate(positions):
        lim = n if visible is None else min(n, int(visible[i]))
        entered = [int(e) for e in needle_entries if e < lim and bool(c[i, e]) and not bool(r[i, e])]
        left = [int(e) for e in needle_entries if e < lim and bool(r[i, e]) and not bool(c[i, e])]
        if entered or left:
            out.append({"query_pos": int(t), "entered": entered, "left": left})
    return out


def compare_topk(
    layer: int,
    positions: torch.Tensor,
    ref: torch.Tensor,
    other: torch.Tensor,
    *,
    ref_k: int,
    needle_entries: Sequence[int],
    ratio: int = 4,
) -> dict:
    """One layer's stability record from captured rows: positions [N], ref [N, k], other [N, k2].

    Rows with no visible entry ((t+1)//ratio == 0) are dropped before any statistic.
    """
    vis = visible_entries(positions.long(), ratio)  # [N]
    keep = vis > 0
    positions, ref, other, vis = positions[keep], ref[keep], other[keep], vis[keep]
    rec = reference_recall(ref, other)  # [N]
    changed = changed_rows(ref, other)
    comp = vis > ref_k
    N = int(keep.sum())
    return {
        "layer": layer,
        "rows": N,
        "competitive_rows": int(comp.sum()),
        "mean_recall": float(rec.mean()) if N else 1.0,
        "min_recall": float(rec.min()) if N else 1.0,
        "mean_recall_competitive": float(rec[comp].mean()) if bool(comp.any()) else None,
        "changed_positions": int(changed.sum()),
        "changed_fraction": float(changed.float().mean()) if N else 0.0,
        "needle_flips": needle_flips(ref, other, needle_entries, positions.tolist(), vis.tolist()),
    }


def _prefill_topk(model, ids: torch.Tensor, setting: Setting, chunk: int | None) -> tuple[dict, int, int]:
    capture = IndexerCapture(keep_scores=False)
    with torch.no_grad(), emulate(model, setting, capture=capture) as layers:
        indexer = csa_indexers(model)[0][1]
        k, ratio = int(indexer.index_topk), int(indexer.compress_rate)
        prefill(model, ids, chunk=chunk)
    return {layer: capture.rows(layer, width=k) for layer in layers}, k, ratio


def selection_stability(
    model,
    tokenizer,
    messages: list[dict],
    *,
    needle: str | None = None,
    needle_span: tuple[int, int] | None = None,
    reference: Setting = REFERENCE,
    candidate: Setting,
    candidate_model=None,
    reference_label: str = "",
    candidate_label: str = "",
    chunk: int | None = None,
) -> dict:
    """Compare the top-k sets of the ``reference`` and ``candidate`` settings on one prompt.

    ``chunk``: prefill in chunks of this many tokens through the KV cache (``dsa.passes``).

    ``candidate_model`` (default: ``model``) compares two models with the same tokenizer and
    CSA layers. Returns a dict following ``STABILITY_SCHEMA``.
    """
    prompt = render_prompt(tokenizer, messages)
    P = len(prompt.input_ids)
    span = resolve_needle_span(prompt, needle, needle_span)
    ids = torch.tensor([prompt.input_ids])
    ref_rows, ref_k, ratio = _prefill_topk(model, ids, reference, chunk)
    cand_rows, cand_k, _ = _prefill_topk(
        candidate_model if candidate_model is not None else model, ids, candidate, chunk
    )
    if sorted(ref_rows) != sorted(cand_rows):
        raise BadInput(f"the two models have different CSA layers: {sorted(ref_rows)} vs {sorted(cand_rows)}")
    entries = covering_entries(span, ratio=ratio, overlap=True)
    layers = []
    for layer in sorted(ref_rows):
        pos, r = ref_rows[layer]
        pos_c, c = cand_rows[layer]
        if not torch.equal(pos, pos_c):
            raise RuntimeError(f"layer {layer}: the two runs captured different query positions")
        layers.append(compare_topk(layer, pos, r, c, ref_k=ref_k, needle_entries=entries, ratio=ratio))

    def side(n: Setting, k: int, label: str) -> dict:
        return {
            "index_k": n.index_k,
            "index_q": n.index_q,
            "score_dtype": n.score_dtype,
            "index_topk": k,
            "patch": None if n.patch is None else n.patch.spec,
            "model": label,
        }

    rows = sum(lay["rows"] for lay in layers)
    return {
        "reference": side(reference, ref_k, reference_label),
        "candidate": side(candidate, cand_k, candidate_label),
        "prompt_tokens": P,
        "needle_token_span": [span[0], span[1]],
        "needle_entries": entries,
        "layers": layers,
        "summary": {
            "mean_recall": (sum(lay["mean_recall"] * lay["rows"] for lay in layers) / rows) if rows else 1.0,
            "changed_positions": sum(lay["changed_positions"] for lay in layers),
            "rows": rows,
            "needle_flips": sum(len(lay["needle_flips"]) for lay in layers),
        },
    }


def validate_stability(obj: dict) -> None:
    """Raise ValueError unless ``obj`` follows STABILITY_SCHEMA and its invariants."""
    check_schema(obj, STABILITY_SCHEMA, "stability")
    for layer in obj["layers"]:
        if not 0.0 <= layer["min_recall"] <= layer["mean_recall"] <= 1.0 + 1e-9:
            raise ValueError(f"stability: layer {layer['layer']}: recall out of order or range")
        if not 0 <= layer["changed_positions"] <= layer["rows"]:
            raise ValueError(f"stability: layer {layer['layer']}: changed_positions exceeds rows")
