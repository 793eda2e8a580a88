"""The reference's module calls for a dump comparison, stage by stage: in one pass, or layer-major
in chunks and streamed.

``reference_stages(model, ids, wanted=..., chunk=...)`` records the calls of the modules named in
``wanted`` (``module_replay.Recorder``, the indexers at the dump's ``index_topk``) and yields them
in ``Stage``s, each a group of modules in forward order:

* **one pass** (``chunk`` None, weights in memory): one forward over all ids, as before; a single
  stage holds every call (``dsa.compare_dump``'s default path, unchanged);
* **layer-major** (a ``chunk``, or a model loaded by ``dsa.streaming``, which reads each decoder
  layer once): ``streaming.LayerMajor`` runs the embedding over all ids (stage ``embed``), then
  each decoder layer over every chunk through the KV cache (stage ``layer i``, yielded while the
  layer's weights are on the device, so a judge may replay its modules), then the head (stage
  ``head``: the hyper-connection head and final norm over every position, the lm head only at
  ``logits_at``). Calls outside ``wanted`` are dropped after each chunk, so memory holds one
  layer's wanted calls, not every module's output over the prompt.

A module called once per forward is called once per chunk here; ``StageCall`` joins those calls
by the absolute positions of their rows, so a tensor's rows, its calibration and its top-k are
read the same way whichever path ran. Streamed equals in-memory layer-major call for call (the
same computation); layer-major equals one pass within float32 reduction order (float64 in the
tests), as the chunked rank dump and localizer do.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from needlescope.dsa.emulate import emulate
from needlescope.dsa.module_replay import Call, Recorder, calibrate, first_tensor
from needlescope.dsa.passes import new_cache
from needlescope.dsa.streaming import LayerMajor, is_streamed, layers_of
from needlescope.setting import Setting

__all__ = ["Incomparable", "Stage", "StageCall", "reference_stages", "token_rows"]


class Incomparable(Exception):
    """The dumped rows do not line up with the reference module's."""


def token_rows(t: torch.Tensor, n: int, where: str) -> torch.Tensor:
    """t with its token dim first: [1, n, ...] -> [n, ...]; [n, ...] as is."""
    if t.dim() >= 2 and t.shape[0] == 1 and t.shape[1] == n:
        return t[0]
    if t.dim() >= 1 and t.shape[0] == n:
        return t
    raise Incomparable(f"{where}: shape {tuple(t.shape)} has no token dimension of {n}")


def _padded(rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Rows of one module's calls made one width: a top-k (integer) padded with -1, scores with -inf.

    A chunk's indexer sees only the entries emitted so far, so its top-k and score rows are
    narrower than a later chunk's (or the one pass's); the padding stands for entries not visible.
    """
    width = max(r.shape[-1] for r in rows)
    if all(r.shape[-1] == width for r in rows) or any(r.dim() < 2 for r in rows):
        return rows
    pad = -1 if not rows[0].is_floating_point() else -math.inf
    return [torch.nn.functional.pad(r, (0, width - r.shape[-1]), value=pad) for r in rows]


@dataclass
class StageCall:
    """One reference module's calls in a stage (one per chunk, in order) and the absolute
    positions of each call's rows (``positions[c]``: [S_c] long)."""

    name: str
    calls: list[Call] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)

    @property
    def first(self) -> Call:
        return self.calls[0]

    def rows(self, take: str, at: torch.Tensor) -> torch.Tensor:
        """[N, ...] rows of the module's output (``take="output"``) or first floating input
        (``"input"``) at the absolute positions ``at`` [N]; Incomparable if a row is missing."""
        parts = []
        for call, pos in zip(self.calls, self.positions):
            src = call.out if take == "output" else (call.inputs[0] if call.inputs else None)
            if src is None:
                raise Incomparable(f"{self.name} has no {take}")
            parts.append(token_rows(src, len(pos), self.name))
        parts = _padded(parts)
        rows = parts[0] if len(parts) == 1 else torch.cat(parts)
        have = torch.cat(self.positions) if len(self.positions) > 1 else self.positions[0]
        top = int(max(int(have.max()), int(at.max()) if len(at) else 0)) + 1
        lookup = torch.full((top,), -1, dtype=torch.long)
        lookup[have] = torch.arange(len(have))
        idx = lookup[at.long()]
        if bool((idx < 0).any()):
            missing = at[idx < 0][:5].tolist()
            raise Incomparable(f"{self.name}: the reference computed no row at position(s) {missing}")
        return rows.index_select(0, idx.to(rows.device))

    def moved(self, model: torch.nn.Module, sizes: list[float], draws: int) -> float:
        """How far the module's output moves under input noise (``module_replay.calibrate``) over
        all its calls: the relative error over every row, each call weighted by its output's norm."""
        if len(self.calls) == 1:
            return calibrate(model, self.first, sizes, draws=draws)
        num = den = 0.0
        for call in self.calls:
            m = calibrate(model, call, sizes, draws=draws)
            out = first_tensor(call.output)
            w = float(out.double().norm()) ** 2 if out is not None else 1.0
            num, den = num + m * m * w, den + w
        return math.sqrt(num / den) if den > 0 else 0.0


@dataclass
class Stage:
    """A group of modules in forward order: ``calls`` by module name, ``order`` of each module's
    output (``name``) and input (``name>in``) in the stage's forward order."""

    name: str
    calls: dict[str, StageCall]
    order: dict[str, float]


def _order(rows: list[Call]) -> dict[str, float]:
    """Forward order of each module's first output (and, as 'name>in', of its input): a module
    returns after its callees, so its input comes just before its first callee returns."""
    order: dict[str, float] = {}
    first_inner: dict[str, int] = {}
    for i, c in enumerate(rows):
        order.setdefault(c.name, float(i))
        parts = c.name.split(".")
        for j in range(1, len(parts) + 1):
            first_inner.setdefault(".".join(parts[:j]), i)
    for name, i in first_inner.items():
        order[name + ">in"] = i - 0.5
    return order


class _Collector:
    """Moves a recorder's rows into the stage being built: the first call of each wanted module."""

    def __init__(self, rec: Recorder, wanted: set[str]):
        self.rec, self.wanted = rec, wanted
        self.calls: dict[str, StageCall] = {}
        self.order: dict[str, float] | None = None

    def take(self, positions_of) -> None:
        rows = self.rec.rows
        if self.order is None:
            self.order = _order(rows)
        seen: set[str] = set()
        for c in rows:
            if c.name in self.wanted and c.name not in seen:
                seen.add(c.name)
                sc = self.calls.setdefault(c.name, StageCall(c.name))
                sc.calls.append(c)
                sc.positions.append(positions_of(c.name))
        rows.clear()

    def stage(self, name: str) -> Stage:
        stage = Stage(name, self.calls, self.order or {})
        self.calls, self.order = {}, None
        return stage


def _one_pass(model, ids: torch.Tensor, rec: Recorder, col: _Collector) -> Iterator[Stage]:
    model(input_ids=ids, use_cache=False)
    every = torch.arange(ids.shape[1])
    col.take(lambda _name: every)
    with rec.paused():
        yield col.stage("forward")


def _head(model, run: LayerMajor, col: _Collector, logits_at: Sequence[int]) -> None:
    """The hyper-connection head and final norm over every position; the lm head at ``logits_at``."""
    inner = model.model
    T = run.hidden.shape[1]
    normed = inner.norm(inner.hc_head(run.hidden))  # [B, T, H]
    at = torch.tensor(sorted(set(int(p) for p in logits_at)), dtype=torch.long)
    if len(at):
        model.lm_head(normed[:, at.to(normed.device)])
    every = torch.arange(T)
    col.take(lambda name: at if name == "lm_head" else every)


def _layer_major(model, ids, chunk, rec, col, logits_at) -> Iterator[Stage]:
    run = LayerMajor(model, ids, 0, new_cache(model) if chunk is not None else None, chunk)
    col.take(lambda _name: torch.arange(ids.shape[1]))
    with rec.paused():
        yield col.stage("embed")
    for i in layers_of(model):
        for c, (lo, hi) in enumerate(run.spans):
            run.run(i, c)
            span = torch.arange(lo, hi)
            col.take(lambda _name, span=span: span)
        with rec.paused():
            yield col.stage(f"layer {i}")
    _head(model, run, col, logits_at)
    with rec.paused():
        yield col.stage("head")


def reference_stages(
    model: torch.nn.Module,
    ids: Sequence[int],
    *,
    wanted: set[str],
    index_topk: int | None,
    chunk: int | None = None,
    logits_at: Sequence[int] = (),
) -> Iterator[Stage]:
    """The reference's calls of the ``wanted`` modules over ``ids``, stage by stage (module docstring).

    ``chunk``: tokens per layer call (None: one pass; a streamed model then runs each layer over
    all ids at once); ``logits_at``: positions where the layer-major head runs the lm head (the
    one pass computes every position). The model's recorder is paused while a stage is yielded,
    so the caller may replay the stage's modules (their weights are on the device).
    """
    device = model.model.embed_tokens.weight.device
    x = torch.tensor([list(ids)], device=device)
    with torch.no_grad(), emulate(model, Setting(index_topk=index_topk)), Recorder(model) as rec:
        col = _Collector(rec, wanted)
        if chunk is None and not is_streamed(model):
            yield from _one_pass(model, x, rec, col)
        else:
            yield from _layer_major(model, x, chunk, rec, col, logits_at)
