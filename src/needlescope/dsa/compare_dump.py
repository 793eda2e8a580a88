"""Compare an engine's tensor dump with the reference model, tensor by tensor, layer by layer.

``compare_dump(model, dump_dir, mapping, ...)`` reads the dump (``engine_dump``, ``dump_tokens``),
runs the reference over the same token ids with ``module_replay.Recorder`` on the mapped modules (and the
indexers at the dump's ``index_topk``): in one pass, or layer-major in chunks and streamed
(``compare_dump_steps``: each decoder layer read once, judged while it is on the device), merges each dumped tensor's TP shards, takes the reference
module's rows at the positions each pass stood for, and judges every tensor in the reference's
forward order (the order its module returns; a ``take = "input"`` tensor just before the
module's first callee returns).

**The budget of one tensor**, with the localizer's measures (``module_replay.rel_err``,
``module_replay.calibrate``, ``diff.unit_roundoff``, ``diff.swappable_fraction``):

* ``rel_err``: ``||engine - reference|| / ||reference||`` over all the tensor's rows;
* ``precision`` p (``u_p`` its unit roundoff): declared in the mapping or by ``allow``, else the
  dumped dtype (bf16 / fp16), else bf16 or fp16 when every value of a float32 dump round-trips
  through it, else fp32;
* ``in_err``: the error arriving at it, the largest ``rel_err`` of the tensors before it;
* ``budget = margin x (u_p + moved)``, where ``moved`` is how far the reference module's
  output moves when each of its floating inputs gets Gaussian noise of relative size
  ``in_err + u_p`` (``module_replay.calibrate``, ``draws`` seeded draws). Calibration runs only where
  ``rel_err`` exceeds the uncalibrated ``margin x (u_p + in_err + u_p)``; a fixed ``growth``
  replaces it (``margin x u_p + growth x (in_err + u_p)``). A tensor with no floating input
  (the embedding) or taken as a module's input gets the uncalibrated budget.
* an indexer top-k (``kind = "topk"``): ``rel_err`` is the set difference ``selection_error``
  (``module_replay``); its budget is the fraction of the reference's selections that score noise of
  ``margin x (u_p + in_err)`` of each row's largest visible score could swap
  (``diff.swappable_fraction``), at least 0.

``verdict`` is ``"within budget"``, ``"beyond budget"`` or ``"incomparable"`` (its rows do not
match the reference module's after merging: a wrong shard rule or mapping; or a ``sum`` /
``concat`` tensor lacks a rank's shard, or its shards do not join); ``first_beyond`` is
the first tensor beyond its budget. The indexer section compares each dumped top-k with the
reference's selection (overlap, positions changed) and, with a needle, whether its entries
were kept at the query position on both sides. The schema is in ``compare_dump_md``.
"""

from __future__ import annotations

import fnmatch
import math

import torch

from needlescope.dsa.compare_dump_md import NO_BEYOND
from needlescope.dsa.compare_dump_steps import Incomparable, Stage, StageCall, reference_stages
from needlescope.dsa.diff import DEFAULT_DRAWS, DEFAULT_MARGIN, swappable_fraction, unit_roundoff
from needlescope.dsa.dump_mapping import DumpMapping
from needlescope.dsa.dump_tokens import DumpEntry, group_dump, token_layout
from needlescope.dsa.emulate import csa_indexers
from needlescope.dsa.engine_dump import (
    check_tensor_parallel,
    find_dump_dir,
    load_value,
    merge_shards,
    scan_dump,
)
from needlescope.dsa.module_replay import rel_err, roundtrips, selection_error
from needlescope.dsa.prompt import covering_entries
from needlescope.dsa.rankdump import selected_in
from needlescope.dsa.reference import visible_entries
from needlescope.errors import BadInput
from needlescope.progress import Progress, no_progress
from needlescope.setting import check_chunk

__all__ = ["compare_dump", "PRECISION_U"]

# Every fp8 form an engine may dump (NVIDIA's e4m3fn and e5m2, AMD's fnuz pair), named as such and
# never cast-tested; each one's budget is its unit roundoff, as for the wider types.
_DUMPED_ONLY = {
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
    torch.float8_e4m3fnuz: "fp8_e4m3fnuz",
    torch.float8_e5m2fnuz: "fp8_e5m2fnuz",
}
PRECISION_U = {
    "fp32": unit_roundoff(torch.float32),
    "bf16": unit_roundoff(torch.bfloat16),
    "fp16": unit_roundoff(torch.float16),
    **{name: float(torch.finfo(dtype).eps) / 2 for dtype, name in _DUMPED_ONLY.items()},
}
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _precision(entry: DumpEntry, engine: torch.Tensor, allow: dict[str, str]) -> str:
    declared = entry.rule.precision or next(
        (p for pat, p in allow.items() if fnmatch.fnmatchcase(entry.name, pat)), None
    )
    if declared is not None:
        return declared
    if engine.dtype in _DTYPE_NAMES or engine.dtype in _DUMPED_ONLY:
        return {**_DTYPE_NAMES, **_DUMPED_ONLY}[engine.dtype]
    for name, dtype in ((n, d) for d, n in _DTYPE_NAMES.items()):
        if roundtrips(engine, dtype):
            return name
    return "fp32"


def _shards(entry: DumpEntry, p: int, most: int, what: str) -> list[tuple[int, torch.Tensor]]:
    """(rank, tensor) of each file of pass ``p``, read without copying; BadInput when one holds
    more than ``most`` values (``what`` says whose size that is), before any is merged: merging
    copies, and a file of a few hundred bytes may hold a zero-stride tensor of gigabytes."""
    shards = []
    for f in entry.files[p]:
        t = load_value(f.path)[0]  # unreadable: BadInput
        if t.numel() > most:
            raise BadInput(
                f"dump file {f.path.name!r}: {entry.name} has shape {list(t.shape)} ({t.numel()} values), more than "
                f"{what} ({most} values): a dump of another model or mapping, or a corrupt file; nothing was merged"
            )
        shards.append((f.rank, t))
    return shards


def _rows(entry: DumpEntry, ref_call: StageCall, positions: dict[int, torch.Tensor], ranks: list[int]):
    """(engine rows [N, ...], reference rows [N, ...], query positions [N]) over the entry's passes;
    the engine's rows on the reference's device. ``ranks``: every rank of the dump. Each shard's
    size is checked against the reference's rows before the shards are merged (``_shards``)."""
    where = {}
    for p in sorted(entry.files):
        pos = positions.get(p)
        if pos is None:
            raise Incomparable(f"pass {p} has no positions")
        where[p] = pos[-1:] if entry.rule.rows == "last" else pos
    at = torch.cat(list(where.values()))
    ref = ref_call.rows(entry.rule.take, at)
    width = ref[0].numel() if len(ref) else 0
    engine = []
    for p in sorted(entry.files):
        have = {f.rank for f in entry.files[p]}
        if entry.rule.shard != "replicated" and have != set(ranks):
            # A partial sum or slice short of a rank merges into a wrong tensor, which would be
            # judged as the engine's error; the dump is incomplete instead.
            lost = sorted(set(ranks) - have)
            raise Incomparable(f"pass {p}: rank(s) {lost} dumped no shard of this {entry.rule.shard} tensor")
        want = len(where[p])
        whole = f"the reference's {entry.reference} at these {want} rows"
        shards = _shards(entry, p, want * max(width, 1), whole)
        try:
            t = merge_shards(shards, entry.rule.shard)
        except BadInput as exc:
            raise Incomparable(f"pass {p}: {exc}") from None
        if t.dim() > 2 and t.shape[0] == 1 and t.shape[1] == want:
            t = t[0]  # a batch of one ([1, tokens, ...]): a transformers model's layout, not SGLang's
        if t.dim() == 0 or t.shape[0] != want:
            raise Incomparable(f"pass {p}: {t.shape[0] if t.dim() else 0} rows, expected {want}")
        engine.append(t)
    for e in engine:
        if e[0].numel() != width:
            raise Incomparable(
                f"{e[0].numel()} values per row after merging ({entry.rule.shard}), the reference has {width}"
            )
    rows = torch.cat([e.reshape(e.shape[0], -1) for e in engine])
    return rows.to(ref.device), ref, at


class _Judge:
    """Budgets for one comparison (module docstring)."""

    def __init__(self, model, margin: float, draws: int, growth: float | None, allow: dict[str, str]):
        self.model, self.margin, self.draws, self.growth, self.allow = model, margin, draws, growth, allow

    def tensor(self, entry, ref_call: StageCall, engine, ref, in_err) -> dict:
        prec = _precision(entry, engine, self.allow)
        u = PRECISION_U[prec]
        err = rel_err(engine.float(), ref.reshape(ref.shape[0], -1).float())
        n_in = len(ref_call.first.inputs)
        floating_in = entry.rule.take == "output" and n_in > 0
        arriving = in_err + u if floating_in else 0.0
        calibrated = False
        if self.growth is not None:
            budget = self.margin * u + self.growth * arriving
        else:
            budget = self.margin * (u + arriving)
            if err > budget and floating_in:
                moved = ref_call.moved(self.model, [arriving] * n_in, self.draws)
                budget, calibrated = self.margin * (u + moved), True
        return {"precision": prec, "rel_err": err, "budget": budget, "calibrated": calibrated}

    def topk(self, entry, engine, ref, at, scorer: StageCall | None, in_err) -> dict:
        prec = entry.rule.precision or "fp32"
        u = PRECISION_U[prec]
        err = selection_error(engine.long(), ref.reshape(ref.shape[0], -1).long())[0]
        budget = 0.0
        if scorer is not None and scorer.first.out is not None:
            scores = scorer.rows("output", at).float().cpu()  # [N, L]
            vis = visible_entries(at.cpu().long()).clamp_max(scores.shape[-1])
            ar = torch.arange(scores.shape[-1]).view(1, -1)
            scale = scores.masked_fill(ar >= vis.view(-1, 1), 0.0).abs().amax(-1)
            k = int((ref >= 0).sum(-1).max()) if ref.numel() else 1
            budget = swappable_fraction(scores, vis, max(k, 1), self.margin * (u + in_err) * scale)
        return {"precision": prec, "rel_err": err, "budget": budget, "calibrated": False}


def _needle_row(engine, ref, at, entries: list[int], query_pos: int) -> dict:
    hits = (at == query_pos).nonzero()
    ne = [e for e in entries if e < visible_entries(query_pos)]
    if len(hits) == 0 or not ne:
        return {"query_pos": query_pos, "needle_entries": ne, "needle_kept_engine": None,
                "needle_kept_reference": None}  # fmt: skip
    i = int(hits[-1])
    return {
        "query_pos": query_pos,
        "needle_entries": ne,
        "needle_kept_engine": selected_in(engine[i], ne),
        "needle_kept_reference": selected_in(ref[i], ne),
    }


def _index_topk(grouped, K: int | None, positions: dict[int, torch.Tensor], tokens: int) -> int | None:
    """The dump's top-k width (its widest top-k row), or ``K`` when given. A row selects among at
    most ``tokens`` entries, so a shard of more than rows x ``tokens`` values is refused unmerged."""
    if K is not None:
        return K
    widths = []
    for e in (e for e in grouped.entries if e.rule.kind == "topk"):
        p = next(iter(e.files))
        rows = 1 if e.rule.rows == "last" else len(positions.get(p, ()))
        shards = _shards(e, p, max(rows, 1) * tokens, f"{rows} rows of at most {tokens} entries")
        try:
            t = merge_shards(shards, e.rule.shard)
        except BadInput:  # shards that do not merge: the tensor is judged incomparable later
            continue
        if t.dim():
            widths.append(int(t.shape[-1]))
    return max(widths, default=None)


class _Walk:
    """The judged tensors so far, in the reference's forward order, and the error arriving."""

    def __init__(self, judge: _Judge, positions, ranks: list[int], needle_entries: list[int], query_pos: int):
        self.judge, self.positions, self.ranks = judge, positions, ranks
        self.needle_entries, self.query_pos = needle_entries, query_pos
        self.tensors: list[dict] = []
        self.indexer: list[dict] = []
        self.in_err = 0.0

    def stage(self, stage: Stage, entries: list[DumpEntry]) -> None:
        """Judge the ``entries`` whose reference module ran in ``stage``, in forward order."""
        order = stage.order
        entries = sorted(
            entries, key=lambda e: order[e.reference + (">in" if e.rule.take == "input" else "")]
        )
        for entry in entries:
            self.entry(entry, stage)

    def entry(self, entry: DumpEntry, stage: Stage) -> None:
        ref_call = stage.calls[entry.reference]
        row = {"engine_name": entry.name, "reference": entry.reference, "layer": entry.layer,
               "kind": entry.rule.kind, "take": entry.rule.take, "shard": entry.rule.shard,
               "ranks": entry.ranks, "passes": len(entry.files), "in_err": self.in_err}  # fmt: skip
        try:
            engine, ref, at = _rows(entry, ref_call, self.positions, self.ranks)
        except Incomparable as exc:
            row.update(rows=0, precision=None, rel_err=None, budget=None, calibrated=False)
            row.update(verdict="incomparable", reason=str(exc))
            self.tensors.append(row)
            return
        if entry.rule.kind == "topk":
            engine, ref = engine.cpu(), ref.cpu()
            scorer = stage.calls.get(entry.reference + ".scorer")
            row.update(self.judge.topk(entry, engine, ref.reshape(ref.shape[0], -1), at, scorer, self.in_err))
            self.indexer.append({"layer": entry.layer, "engine_name": entry.name,
                                 "topk_overlap": 1.0 - row["rel_err"],
                                 "positions_changed": selection_error(engine.long(), ref.long())[1],
                                 "positions": int(engine.shape[0]),
                                 **_needle_row(engine, ref, at, self.needle_entries, self.query_pos)})  # fmt: skip
        else:
            row.update(self.judge.tensor(entry, ref_call, engine, ref, self.in_err))
            if math.isfinite(row["rel_err"]):
                self.in_err = max(self.in_err, row["rel_err"])
        beyond = not row["rel_err"] <= row["budget"]
        row.update(rows=int(engine.shape[0]), verdict="beyond budget" if beyond else "within budget")
        row["reason"] = None
        self.tensors.append(row)


def _judge_stages(model, grouped, ids, K, chunk, walk: _Walk, progress) -> list[str]:
    """Run the reference stage by stage and judge each stage's entries; returns the reference
    names the model never ran (``missing_reference``)."""
    by_ref: dict[str, list[DumpEntry]] = {}
    for e in grouped.entries:
        by_ref.setdefault(e.reference, []).append(e)
    wanted = set(by_ref) | {
        r + ".scorer" for r, es in by_ref.items() if any(e.rule.kind == "topk" for e in es)
    }
    logits_at = sorted({p for e in by_ref.get("lm_head", []) for p in _positions_of(e, walk.positions)})
    seen: set[str] = set()
    stages = len(model.model.layers) + 2  # embedding, layers, head (one pass: a single stage)
    stream = reference_stages(model, ids, wanted=wanted, index_topk=K, chunk=chunk, logits_at=logits_at)
    for k, stage in enumerate(stream):
        progress("reference stages", k, stages, stage.name)
        todo = [e for ref, es in by_ref.items() if ref in stage.calls and ref not in seen for e in es]
        seen |= {e.reference for e in todo}
        walk.stage(stage, todo)
    progress("reference stages", stages, stages, "")
    return sorted(set(by_ref) - seen)


def _positions_of(entry: DumpEntry, positions: dict[int, torch.Tensor]) -> list[int]:
    """The absolute positions of the rows the entry's passes hold."""
    out: list[int] = []
    for p in entry.files:
        pos = positions.get(p)
        if pos is not None and len(pos):
            out += pos[-1:].tolist() if entry.rule.rows == "last" else pos.tolist()
    return out


def _token_bounds(model) -> dict:
    """``token_layout``'s bounds from the reference's config: its context and vocabulary size."""
    return {
        "context": getattr(model.config, "max_position_embeddings", None),
        "vocab": model.config.vocab_size,
    }


def _per_layer(tensors: list[dict]) -> list[dict]:
    layers: dict = {}
    for t in tensors:
        d = layers.setdefault(t["layer"], {"layer": t["layer"], "tensors": 0, "beyond": 0,
                                            "incomparable": 0, "max_rel_err": 0.0, "first_beyond": None})  # fmt: skip
        d["tensors"] += 1
        if t["verdict"] == "incomparable":
            d["incomparable"] += 1
            continue
        if t["kind"] == "tensor":
            d["max_rel_err"] = max(d["max_rel_err"], t["rel_err"])
        if t["verdict"] == "beyond budget":
            d["beyond"] += 1
            d["first_beyond"] = d["first_beyond"] or t["engine_name"]
    return sorted(layers.values(), key=lambda d: (d["layer"] is not None, d["layer"] or 0))


def compare_dump(
    model: torch.nn.Module,
    dump_dir,
    mapping: DumpMapping,
    *,
    prompt_ids: list[int] | None = None,
    needle_span: tuple[int, int] | None = None,
    index_topk: int | None = None,
    margin: float = DEFAULT_MARGIN,
    draws: int = DEFAULT_DRAWS,
    growth: float | None = None,
    allow: dict[str, str] | None = None,
    chunk: int | None = None,
    progress: Progress = no_progress,
) -> dict:
    """Compare the dump in ``dump_dir`` with ``model`` (the reference); the ``compare_dump.json`` object.

    ``prompt_ids``: the token ids the engine ran on, required when the dump carries no
    ``input_ids`` (checked against them when it does). ``needle_span``: [start, end) token
    indices of the needle, for the indexer's needle columns. ``index_topk``: the engine's k
    (default: the width of the dump's top-k rows, else the checkpoint's). BadInput on a dump
    that cannot be read or does not describe one request. ``chunk``: run the reference
    layer-major in chunks of that many tokens through its KV cache (``compare_dump_steps``; a
    streamed model always runs layer-major, reading each layer once); None: one pass.
    """
    check_chunk(chunk)
    if not margin >= 1.0 or draws < 1 or (growth is not None and not growth >= 1.0):
        raise BadInput(f"margin and growth must be >= 1 and draws >= 1, got {margin}, {growth}, {draws}")
    d = find_dump_dir(dump_dir)
    files = scan_dump(d)
    check_tensor_parallel(files)
    grouped = group_dump(files, mapping)
    if not grouped.entries:
        raise BadInput(
            f"no dumped name in {str(d)!r} is in the mapping {mapping.source!r} "
            f"(names: {', '.join(grouped.unknown[:5]) or 'none'}); give a mapping that names them (--mapping)"
        )
    ids, positions = token_layout(grouped, prompt_ids, **_token_bounds(model))
    T = len(ids)
    K = _index_topk(grouped, index_topk, positions, T)
    indexers = csa_indexers(model)
    ratio = indexers[0][1].compress_rate if indexers else 4
    entries = covering_entries(needle_span, ratio) if needle_span is not None else []
    query_pos = len(prompt_ids) - 1 if prompt_ids is not None else T - 1
    judge = _Judge(model, margin, draws, growth, dict(allow or {}))
    walk = _Walk(judge, positions, grouped.ranks, entries, query_pos)
    missing = _judge_stages(model, grouped, ids, K, chunk, walk, progress)
    tensors, indexer = walk.tensors, walk.indexer
    first = next((t for t in tensors if t["verdict"] == "beyond budget"), None)
    incomparable = sum(t["verdict"] == "incomparable" for t in tensors)
    summary = NO_BEYOND if first is None else f"first tensor beyond its budget: {first['engine_name']}"
    if incomparable:
        summary += f"; {incomparable} tensor(s) could not be compared"
    return {
        "dump_dir": str(d),
        "mapping": mapping.source,
        "files": len(files),
        "passes": grouped.passes,
        "ranks": grouped.ranks,
        "prompt_tokens": T,
        "index_topk": K,
        "tensors": tensors,
        "layers": _per_layer(tensors),
        "first_beyond": None
        if first is None
        else {k: first[k] for k in ("engine_name", "reference", "layer")},
        "summary": summary,
        "indexer": indexer,
        "needle_token_span": None if needle_span is None else [int(needle_span[0]), int(needle_span[1])],
        "unknown_names": grouped.unknown,
        "ignored_names": grouped.ignored,
        "names_without_layer": grouped.no_layer,
        "missing_reference": missing,
        "margin": margin,
        "draws": draws,
        "growth": growth,
        "allow": dict(allow or {}),
    }
