"""Write a tensor dump in SGLang's dumper layout from one of our own models, sharded as TP would.

``write_sglang_dump(model, ids, out, mapping=..., tp=2, passes=[...])`` runs ``model`` (the
"engine": patch it first to plant a fault) once over ``ids``, records every module call, and
writes, for every ``[[tensor]]`` of the mapping and every layer it applies to, one file per
(pass, name, layer, rank), as SGLang's current dumper names them::

    DIR/dump_test/step=P___rank=R___dump_index=N___name=NAME___recompute_status=disabled___layer_id=L.pt

holding ``torch.save({"value": tensor, "meta": {...}})``. ``passes`` splits the tokens into
forward passes (a chunked prefill, then one-token decode steps); each pass also gets the core
fields ``input_ids`` and ``positions``. Shards follow the rule and, for ``nn.Linear`` modules,
the way tensor parallelism splits the weight: a column-parallel rank computes
``x @ W[rows_r].T`` (its slice of the output features), a row-parallel rank ``x[..., cols_r] @
W[:, cols_r].T`` (a partial sum over its slice of the input features). Floating values are cast
to ``dtype`` (bf16, as an engine's activations are); top-k entry ids are written as int32.
``rank_order`` relabels the ranks (a permutation of ``range(tp)``) to fake a wrong merge.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from needlescope.dsa.dump_mapping import DumpMapping, TensorRule
from needlescope.dsa.emulate import emulate
from needlescope.dsa.module_replay import Call, Recorder
from needlescope.setting import Setting

__all__ = ["write_sglang_dump"]


def _layer_ids(model: torch.nn.Module) -> list[int]:
    return list(range(int(model.config.num_hidden_layers)))


def _shards(model, call: Call, rule: TensorRule, t: torch.Tensor, x: torch.Tensor | None, tp: int):
    """Per-rank tensors of one pass; ``t`` the whole rows, ``x`` the module input rows (Linear only)."""
    if rule.shard == "replicated":
        return [t] * tp
    module = model.get_submodule(call.name)
    # Exactly nn.Linear: a subclass (the grouped o_a projection) computes something else.
    linear = type(module) is torch.nn.Linear and x is not None and rule.take == "output"
    if rule.shard == "sum":
        if not linear:
            raise ValueError(f"{call.name}: a 'sum' shard is written only for nn.Linear outputs")
        cols = torch.arange(module.in_features).chunk(tp)
        return [F.linear(x[..., c], module.weight[:, c]) for c in cols]
    dim = int(rule.shard.split(":", 1)[1])
    if linear and dim in (-1, t.dim() - 1):
        rows = torch.arange(module.out_features).chunk(tp)
        return [F.linear(x, module.weight[r]) for r in rows]
    if dim == -1:  # an engine's column-parallel output is [tokens, features], split by feature
        return list(t.reshape(t.shape[0], -1).chunk(tp, dim=-1))
    return list(t.chunk(tp, dim=dim))


def _save(d: Path, tags: dict, value: torch.Tensor, index: int, tp: int) -> None:
    stem = "___".join(f"{k}={v}" for k, v in tags.items())
    meta = {**tags, "world_rank": tags["rank"], "world_size": tp, "dump_index": index}
    torch.save({"value": value.contiguous().clone(), "meta": meta}, d / f"{stem}.pt")


def _rule_calls(mapping: DumpMapping, by_key: dict[str, Call], layers: list[int]):
    """(engine name, layer tag, rule, call) for every rule and layer the model has."""
    for rule in mapping.rules:
        for layer in layers if "{layer}" in rule.reference else [None]:
            call = by_key.get(rule.reference_name(layer))
            if call is not None:
                name = rule.engine.replace("{layer}", str(layer))
                yield name, layer, rule, call


def write_sglang_dump(
    model: torch.nn.Module,
    ids: Sequence[int],
    out: str | Path,
    *,
    mapping: DumpMapping,
    tp: int = 2,
    passes: Sequence[int] | None = None,
    index_topk: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    rank_order: Sequence[int] | None = None,
) -> Path:
    """Write the dump (module docstring); returns the experiment directory."""
    T = len(ids)
    lengths = list(passes) if passes is not None else [T]
    if sum(lengths) != T:
        raise ValueError(f"passes {lengths} do not add up to {T} tokens")
    order = list(rank_order) if rank_order is not None else list(range(tp))
    d = Path(out) / "dump_test"
    d.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), emulate(model, Setting(index_topk=index_topk)), Recorder(model) as rec:
        model(input_ids=torch.tensor([list(ids)]), use_cache=False)
    by_key = {c.key: c for c in rec.rows}
    index = 0
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    with torch.no_grad():
        for step, (a, n) in enumerate(zip(starts, lengths), start=1):
            sl = slice(a, a + n)
            per_rank: list[list[tuple[dict, torch.Tensor]]] = [[] for _ in range(tp)]
            for field, value in (("input_ids", torch.tensor(ids[sl])), ("positions", torch.arange(a, a + n))):
                for r in range(tp):
                    per_rank[r].append(({"name": field}, value))
            for name, layer, rule, call in _rule_calls(mapping, by_key, _layer_ids(model)):
                src = call.out if rule.take == "output" else call.inputs[0]
                rows = src[0] if src.shape[0] == 1 and src.dim() >= 2 and src.shape[1] == T else src
                x = call.inputs[0] if call.inputs else None
                x = x[0] if x is not None and x.shape[0] == 1 and x.dim() >= 2 else x
                keep = slice(a + n - 1, a + n) if rule.rows == "last" else sl
                shards = _shards(model, call, rule, rows[keep], None if x is None else x[keep], tp)
                for r, s in enumerate(shards):
                    value = s.to(torch.int32) if rule.kind == "topk" else s.to(dtype)
                    extra = {} if layer is None else {"layer_id": layer}
                    per_rank[r].append(({"name": name, "recompute_status": "disabled", **extra}, value))
            for r in range(tp):
                for tags, value in per_rank[r]:
                    index += 1
                    head = {"step": step, "rank": order[r], "dump_index": index}
                    _save(d, {**head, **tags}, value, index, tp)
    return d
