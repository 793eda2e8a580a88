"""Which RoPE table rotated the indexer's queries and keys: a query/key table mismatch, named.

The lightning indexer rotates its queries and its compressed keys with the same table (its
``rope_layer_type``, ``compress_rope_theta``) so that ``q . k`` depends on relative position
only. A kernel that rotates one side with another table (the main attention's theta, another
position table) leaves a position-dependent skew that scrambles the ranking (ik_llama.cpp PR
#2099, mlx-lm PR #1431). The localizer can flag the module where the rotation changed, but a
module name does not say *what* changed; this does.

``rope_tables(reference, calls)`` reads one candidate indexer call and the calls made inside it
(recorded by ``module_replay.Recorder``): the queries before rotation (``q_b_proj``'s output)
and after (the scorer's first argument), the new keys before rotation (``kv_norm``'s output)
and after (the last entries of the scorer's second argument). For each side it finds the table
of the model (``rotary_emb.layer_types``) that reproduces the candidate's rotation at the
reference's positions (queries at the indexer's ``position_ids``, key entry ``j`` at ``j x
ratio``), computed by the *reference's* rotary code. Returns None when both sides use the
reference's table; else ``{"module", "layer", "queries", "keys", "expected", "finding"}`` with,
per side, ``{"table": NAME | None, "rel_err": float}`` (None: no table of the model reproduces
it within ``MATCH``: another theta or another position table) and ``finding`` the sentence
(``"query/key RoPE-table mismatch: ..."`` when the two sides differ).
"""

from __future__ import annotations

import sys

import torch

from needlescope.dsa.module_replay import INDEXER, Call, rel_err

__all__ = ["MATCH", "rope_tables"]

MATCH = 1e-3
"""Relative error at or below which a table reproduces a side's rotation (fp32 rotation of the
same vectors agrees to ~1e-7; another theta moves it by O(1))."""


def _rotate(reference: torch.nn.Module, indexer: str, x: torch.Tensor, positions, table: str) -> torch.Tensor:
    """x [B, S, H, D] rotated at positions [B, S] with the reference rotary's ``table``."""
    module = reference.get_submodule(indexer)
    rotary = module.rotary_emb
    cos, sin = type(rotary).forward(rotary, x, positions.to(x.device), layer_type=table)
    apply = sys.modules[type(module).__module__].apply_rotary_pos_emb
    return apply(x.transpose(1, 2), cos, sin).transpose(1, 2)


def _side(reference, indexer: str, raw: torch.Tensor, rotated: torch.Tensor, positions, tables) -> dict:
    """{"table", "rel_err"}: the table reproducing ``raw`` -> ``rotated`` best (None above MATCH)."""
    errs = {
        t: rel_err(_rotate(reference, indexer, raw.float(), positions, t), rotated.float()) for t in tables
    }
    best = min(errs, key=errs.get)
    return {"table": best if errs[best] <= MATCH else None, "rel_err": errs[best]}


def _sides(call: Call, callees: list[Call]):
    """(raw queries, rotated queries, raw new keys, rotated new keys, key entry offset) or None."""
    by_name = {c.name.rsplit(".", 1)[-1]: c for c in callees}
    q_proj, scorer, norm = by_name.get("q_b_proj"), by_name.get("scorer"), by_name.get("kv_norm")
    if q_proj is None or scorer is None or len(scorer.args) < 2:
        return None
    q_rot, k_all = scorer.args[0], scorer.args[1]
    if q_proj.out is None or q_rot.dim() != 4 or q_rot.shape[1] != q_proj.out.shape[1]:
        return None
    q_raw = q_proj.out.reshape(q_rot.shape)
    if norm is None or norm.out is None or norm.out.shape[1] == 0 or k_all.dim() != 3:
        return q_raw, q_rot, None, None, 0
    n = norm.out.shape[1]
    return q_raw, q_rot, norm.out.unsqueeze(2), k_all[:, -n:].unsqueeze(2), k_all.shape[1] - n


def rope_tables(reference: torch.nn.Module, call: Call, callees: list[Call]) -> dict | None:
    """The RoPE finding of one candidate indexer ``call`` (module docstring), or None."""
    if call.type != INDEXER:
        return None
    module = reference.get_submodule(call.name)
    sides = _sides(call, callees)
    positions = call.args[2] if len(call.args) > 2 else call.kwargs.get("position_ids")
    if sides is None or positions is None:
        return None
    q_raw, q_rot, k_raw, k_rot, offset = sides
    tables, expected = list(module.rotary_emb.layer_types), module.rope_layer_type
    with torch.no_grad():
        queries = _side(reference, call.name, q_raw, q_rot, positions.long(), tables)
        keys = None
        if k_raw is not None:
            entries = torch.arange(offset, offset + k_raw.shape[1], device=k_raw.device)
            key_pos = (entries * module.compress_rate).unsqueeze(0).expand(k_raw.shape[0], -1)
            keys = _side(reference, call.name, k_raw, k_rot, key_pos, tables)
    used = [queries] + ([keys] if keys is not None else [])
    if all(s["table"] == expected for s in used):
        return None
    return {
        "module": call.key,
        "queries": queries,
        "keys": keys,
        "expected": expected,
        "finding": _finding(queries, keys, expected),
    }


def _name(side: dict) -> str:
    t = side["table"]
    return (
        f"the {t!r} table"
        if t is not None
        else f"no table of the model (best rel. error {side['rel_err']:.2g})"
    )


def _finding(queries: dict, keys: dict | None, expected: str) -> str:
    if keys is not None and queries["table"] != keys["table"]:
        return (
            f"query/key RoPE-table mismatch: the indexer's queries are rotated with {_name(queries)}, "
            f"its keys with {_name(keys)} (both should use {expected!r})"
        )
    side = "queries and keys are" if keys is not None else "queries are"
    return f"the indexer's {side} rotated with {_name(queries)} instead of {expected!r}"
