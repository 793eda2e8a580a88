"""Write a tensor dump in SGLang's dumper layout from one of our own models, sharded as TP would.

``write_sglang_dump(model, ids, out, mapping=..., tp=2, passes=[...])`` runs ``model`` (the
"engine": patch it first to plant a fault) once over ``ids``, records every module call, and
writes, for every ``[[tensor]]`` of the mapping and every layer it applies to, one file per
(pass, name, layer, rank), as SGLang's current dumper names them::

    DIR/dump_test/step=P___rank=R___dump_index=N___name=NAME___recompute_status=disabled___layer_id=L.pt

holding ``torch.save({"value": tensor, "meta": {...}})`` (the tags, ``world_rank``,
``world_size`` and ``sglang_parallel_info``, as SGLang's ``_Dumper._dump_single`` writes them;
``dump_index`` counts per rank). ``passes`` splits the tokens into forward passes (a chunked
prefill, then one-token decode steps); each pass also gets the core fields ``input_ids`` and
``positions``, once without a layer (the ``ForwardBatch``'s) and once per decoder layer with its
``layer_id`` (SGLang's hooks dump them again for every module taking them as keywords). Shards follow the rule and, for ``nn.Linear`` modules,
the way tensor parallelism splits the weight: a column-parallel rank computes
``x @ W[rows_r].T`` (its slice of the output features), a row-parallel rank ``x[..., cols_r] @
W[:, cols_r].T`` (a partial sum over its slice of the input features). Floating values are cast
to ``dtype`` (bf16, as an engine's activations are); top-k entry ids are written as int32.
``rank_order`` relabels the ranks (a permutation of ``range(tp)``) to fake a wrong merge.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from needlescope.dsa.compare_dump_steps import reference_stages
from needlescope.dsa.dump_mapping import DumpMapping, TensorRule

__all__ = ["write_sglang_dump"]


def _shards(model, name: str, rule: TensorRule, t: torch.Tensor, x: torch.Tensor | None, tp: int):
    """Per-rank tensors of one pass; ``t`` the whole rows, ``x`` the module input rows (Linear only)."""
    if rule.shard == "replicated":
        return [t] * tp
    module = model.get_submodule(name)
    # Exactly nn.Linear: a subclass (the grouped o_a projection) computes something else.
    linear = type(module) is torch.nn.Linear and x is not None and rule.take == "output"
    if rule.shard == "sum":
        if not linear:
            raise ValueError(f"{name}: a 'sum' shard is written only for nn.Linear outputs")
        cols = torch.arange(module.in_features).chunk(tp)
        return [F.linear(x[..., c.to(x.device)], module.weight[:, c.to(x.device)]) for c in cols]
    dim = int(rule.shard.split(":", 1)[1])
    if linear and dim in (-1, t.dim() - 1):
        rows = torch.arange(module.out_features).chunk(tp)
        return [F.linear(x, module.weight[r.to(x.device)]) for r in rows]
    if dim == -1:  # an engine's column-parallel output is [tokens, features], split by feature
        return list(t.reshape(t.shape[0], -1).chunk(tp, dim=-1))
    return list(t.chunk(tp, dim=dim))


@dataclass(frozen=True)
class _Item:
    """One value every rank dumps once per pass: a token field or a mapped module's tensor."""

    name: str
    layer: int | None
    rule: TensorRule | None = None  # None: a token field
    reference: str | None = None


def _items(model: torch.nn.Module, mapping: DumpMapping) -> list[_Item]:
    """What each rank dumps per pass, in dump_index order: the ForwardBatch's token fields, their
    copies each decoder layer's hooks dump (SGLang passes ``positions`` and ``input_ids`` to every
    layer as keywords), then every mapped tensor of every layer the model has."""
    layers = list(range(int(model.config.num_hidden_layers)))
    items = [_Item(mapping.input_ids, None), _Item(mapping.positions, None)]
    items += [_Item(f, i) for i in layers for f in (mapping.positions, mapping.input_ids)]
    names = {n for n, _ in model.named_modules()}
    for rule in mapping.rules:
        for layer in layers if "{layer}" in rule.reference else [None]:
            ref = rule.reference_name(layer)
            if ref in names:
                items.append(_Item(rule.engine.replace("{layer}", str(layer)), layer, rule, ref))
    return items


class _Writer:
    """Writes each item's per-pass, per-rank files as SGLang's dumper names and fills them."""

    def __init__(self, d: Path, items: list[_Item], starts: list[int], lengths: list[int], tp: int, order):
        self.d, self.items, self.starts, self.lengths, self.tp, self.order = (
            d,
            items,
            starts,
            lengths,
            tp,
            order,
        )
        self.index = {item: j for j, item in enumerate(items)}

    def save(self, item: _Item, p: int, r: int, value: torch.Tensor) -> None:
        rank = self.order[r]
        tags = {"step": p + 1, "rank": rank, "dump_index": p * len(self.items) + self.index[item] + 1,
                "name": item.name, "recompute_status": "disabled"}  # fmt: skip
        if item.layer is not None:
            tags["layer_id"] = item.layer
        stem = "___".join(f"{k}={v}" for k, v in tags.items())
        info = {"tp_rank": rank, "tp_size": self.tp, "pp_rank": 0, "pp_size": 1}
        meta = {**tags, "world_rank": rank, "world_size": self.tp, "sglang_parallel_info": info}
        torch.save({"value": value.detach().contiguous().cpu().clone(), "meta": meta}, self.d / f"{stem}.pt")

    def tokens(self, ids: Sequence[int]) -> None:
        for item in (i for i in self.items if i.rule is None):
            for p, (a, n) in enumerate(zip(self.starts, self.lengths)):
                value = (
                    torch.tensor(ids[a : a + n])
                    if item.name != self.items[1].name
                    else torch.arange(a, a + n)
                )
                for r in range(self.tp):
                    self.save(item, p, r, value)

    def tensor(self, model, item: _Item, ref_call, dtype: torch.dtype) -> None:
        rule = item.rule
        keeps = [
            torch.arange(a + n - 1, a + n) if rule.rows == "last" else torch.arange(a, a + n)
            for a, n in zip(self.starts, self.lengths)
        ]
        at = torch.cat(keeps)
        rows = ref_call.rows(rule.take, at)
        x = ref_call.rows("input", at) if ref_call.first.inputs and rule.shard != "replicated" else None
        lo = 0
        for p, keep in enumerate(keeps):
            part = slice(lo, lo + len(keep))
            lo += len(keep)
            shards = _shards(model, item.reference, rule, rows[part], None if x is None else x[part], self.tp)
            for r, s in enumerate(shards):
                self.save(item, p, r, s.to(torch.int32) if rule.kind == "topk" else s.to(dtype))


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
    chunk: int | None = None,
) -> Path:
    """Write the dump (module docstring); returns the experiment directory.

    ``chunk``: run the engine layer-major in chunks of that many tokens through its KV cache
    (``dsa.compare_dump_steps``; a streamed model always runs layer-major, reading each layer
    once and writing its files while it is on the device); None: one pass.
    """
    T = len(ids)
    lengths = list(passes) if passes is not None else [T]
    if sum(lengths) != T:
        raise ValueError(f"passes {lengths} do not add up to {T} tokens")
    d = Path(out) / "dump_test"
    d.mkdir(parents=True, exist_ok=True)
    items = _items(model, mapping)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    writer = _Writer(
        d, items, starts, lengths, tp, list(rank_order) if rank_order is not None else list(range(tp))
    )
    writer.tokens(list(ids))
    by_ref: dict[str, list[_Item]] = {}
    for item in items:
        if item.reference is not None:
            by_ref.setdefault(item.reference, []).append(item)
    lasts = [a + n - 1 for a, n in zip(starts, lengths)]
    logits_at = (
        []
        if "lm_head" not in by_ref
        else (lasts if all(i.rule.rows == "last" for i in by_ref["lm_head"]) else range(T))
    )
    for stage in reference_stages(
        model, ids, wanted=set(by_ref), index_topk=index_topk, chunk=chunk, logits_at=logits_at
    ):
        for ref, ref_call in stage.calls.items():
            for item in by_ref[ref]:
                writer.tensor(model, item, ref_call, dtype)
    return d
