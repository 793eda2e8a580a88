"""Layer-major streaming: run a DeepSeek-V4 checkpoint larger than the device, one decoder layer at a time.

``load_streamed(path, device=...)`` builds the model on the meta device and loads only what every
pass needs (embedding, final norm, hyper-connection head, lm head, buffers) onto ``device``; the
decoder layers stay in their safetensors shards. ``streamed_forward`` runs one pass over the
tokens layer-major: layer i is read from disk (by a reader thread that fetches layer i+1 while
layer i computes), dequantized on the device (block fp8, packed fp4 experts), run over every
token in chunks through the KV cache, freed (its parameters go back to the meta device), and the
hidden streams of every token [B, S, hc_mult, H] are carried to layer i+1. Each layer is read
once per pass, never once per chunk; a decode step is one pass.

Why this equals the token-major run: a decoder layer's output at a token depends only on its
inputs at that token and earlier tokens of the same layer, through the layer's own cache entry
(sliding window, CSA/HCA compressor buffers and overlap, indexer keys), which ``DynamicCache``
keeps per layer. Running layer i over chunks 1..n and then layer i+1 over chunks 1..n hands each
layer the same inputs and cache states as running chunk 1 through all layers, then chunk 2.
The attention mask of a chunk is built from layer 0's cache before that chunk (as the model's
forward builds it from its first sliding layer) and reused by every later layer. The module
instances persist, so forward hooks (``IndexerCapture``, ``Recorder``) and ``emulate``'s scorer
swaps see every call as in the in-memory run.

Memory on the device: the resident units, one layer's dequantized weights, the hidden streams
of all tokens (``S x hc_mult x H`` in the model dtype: 4 GiB at 128K on Flash's widths), the
per-chunk masks and rotary tables, and one chunk's activations. ``model.needlescope_stream``
(``streamer_of``) holds the reader and the per-layer times of every pass (``LayerStream.passes``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from needlescope.dsa.loading import (
    TensorReader,
    checkpoint_tensors,
    fill,
    load_placed,
    model_tensors,
    planned,
    read_group,
    set_tensor,
    stored_names,
)
from needlescope.dsa.placement import human_bytes, plan_placement, unit_bytes
from needlescope.dsa.release import expert_slot, hf_name
from needlescope.errors import BadInput

__all__ = [
    "LayerMajor",
    "LayerStream",
    "is_streamed",
    "layers_of",
    "load_streamed",
    "load_weights",
    "streamed_forward",
    "streamer_of",
]

_STREAM_ATTR = "needlescope_stream"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _target(name: str, intermediate: int) -> str | None:
    slot = expert_slot(name, intermediate)
    return slot.param if slot is not None else hf_name(name)


def _held(model: torch.nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer ``name`` the model holds now."""
    module_path, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_path)
    return module._parameters[leaf] if leaf in module._parameters else module._buffers[leaf]


def _layer_of(target: str) -> int | None:
    m = _LAYER.match(target)
    return int(m.group(1)) if m else None


class LayerStream:
    """The decoder layers of a model kept in their shards, materialized one at a time on ``device``.

    ``layer_names[i]``: the stored checkpoint tensors of layer i. ``passes``: one list per pass of
    per-layer records ``{"layer", "bytes", "read_s", "wait_s", "place_s", "compute_s"}`` (read_s:
    the reader thread's safetensors reads, memory-mapped, so pages it did not touch are read
    while placing; wait_s: how long the pass waited for the thread; place_s: copy to the device
    and dequantize; compute_s: the layer over all chunks).
    """

    def __init__(self, model: torch.nn.Module, path: Path, device: str, dtype: torch.dtype, prefetch: bool):
        self.model, self.path, self.device, self.dtype, self.prefetch = model, path, device, dtype, prefetch
        self.files = checkpoint_tensors(path)
        self.reader = TensorReader(self.files)
        self.targets = model_tensors(model)
        n_layers = len(model.model.layers)
        intermediate = int(model.config.moe_intermediate_size)
        self.layer_names: list[list[str]] = [[] for _ in range(n_layers)]
        self.resident_names: list[str] = []
        self._layer_targets: list[set[str]] = [set() for _ in range(n_layers)]
        for name in stored_names(self.files):
            target = _target(name, intermediate)
            layer = None if target is None else _layer_of(target)
            if layer is None or layer >= n_layers:  # a layer the model lacks: _fill refuses it
                self.resident_names.append(name)
            else:
                self.layer_names[layer].append(name)
                self._layer_targets[layer].add(target)
        self.passes: list[list[dict]] = []

    def _fill(self, raw: dict[str, torch.Tensor], names: list[str], filled: set[str]) -> None:
        unexpected = fill(self.model, raw, names, lambda _t: self.device, self.dtype, self.targets, filled)
        if unexpected:
            raise BadInput(
                f"{self.path}: {len(unexpected)} checkpoint tensors the model does not have, e.g. {unexpected[:3]}"
            )

    def load_resident(self) -> None:
        """Load every non-layer tensor onto the device and move the model's real buffers there."""
        filled: set[str] = set()
        self._fill(read_group(self.reader.get, self.files, self.resident_names), self.resident_names, filled)
        layer_targets = set().union(*self._layer_targets)
        missing = sorted(set(self.targets) - filled - layer_targets)
        if missing:
            raise BadInput(
                f"{self.path}: the checkpoint lacks {len(missing)} model tensors, e.g. {missing[:3]}"
            )
        for module in self.model.modules():
            for key, buf in list(module._buffers.items()):
                if buf is not None and buf.device.type != "meta":
                    module._buffers[key] = buf.to(self.device)

    def _read(self, i: int) -> tuple[dict[str, torch.Tensor], float]:
        t0 = time.perf_counter()
        raw = read_group(self.reader.get, self.files, self.layer_names[i])
        return raw, time.perf_counter() - t0

    def _place(self, i: int, raw: dict[str, torch.Tensor]) -> None:
        filled: set[str] = set()
        self._fill(raw, self.layer_names[i], filled)
        missing = sorted(self._layer_targets[i] - filled)
        if missing:
            raise BadInput(
                f"{self.path}: the checkpoint lacks {len(missing)} tensors of layer {i}, e.g. {missing[:3]}"
            )
        if str(self.device).startswith("cuda"):
            torch.cuda.synchronize(self.device)

    def lend(self, i: int, other: torch.nn.Module) -> None:
        """Give ``other`` (a second skeleton of the same checkpoint) layer i's loaded tensors."""
        for target in self._layer_targets[i]:
            set_tensor(other, target, _held(self.model, target))

    def take_back(self, i: int, other: torch.nn.Module) -> None:
        """Put ``other``'s layer i back on the meta device."""
        for target in self._layer_targets[i]:
            held = _held(other, target)
            set_tensor(other, target, torch.empty(held.shape, dtype=held.dtype, device="meta"))

    def _free(self, i: int) -> None:
        """Layer i's tensors back to the meta device, keeping each one's shape and dtype (so that a
        ``model.double()`` after loading holds for the next pass too)."""
        for target in self._layer_targets[i]:
            held = _held(self.model, target)
            meta = torch.empty(held.shape, dtype=held.dtype, device="meta")
            self.targets[target] = set_tensor(self.model, target, meta)

    def layers(self) -> Iterator[int]:
        """One pass: yields each layer index with its weights on the device, freeing it afterwards."""
        n = len(self.layer_names)
        records: list[dict] = []
        self.passes.append(records)
        pool = ThreadPoolExecutor(max_workers=1) if self.prefetch else None
        pending = pool.submit(self._read, 0) if pool else None
        try:
            for i in range(n):
                t0 = time.perf_counter()
                raw, read_s = pending.result() if pending else self._read(i)
                waited = time.perf_counter() - t0
                if pool and i + 1 < n:
                    pending = pool.submit(self._read, i + 1)
                t1 = time.perf_counter()
                self._place(i, raw)
                nbytes = sum(t.numel() * t.element_size() for t in raw.values())
                del raw
                t2 = time.perf_counter()
                try:
                    yield i
                    if str(self.device).startswith("cuda"):
                        torch.cuda.synchronize(self.device)
                finally:
                    self._free(i)
                records.append(
                    {
                        "layer": i,
                        "bytes": nbytes,
                        "read_s": read_s,
                        "wait_s": waited,
                        "place_s": t2 - t1,
                        "compute_s": time.perf_counter() - t2,
                    }
                )
        finally:
            if pool:
                pool.shutdown(wait=True, cancel_futures=True)


def streamer_of(model: torch.nn.Module) -> LayerStream | None:
    """The ``LayerStream`` of a streamed model (None: its weights are all in memory)."""
    return getattr(model, _STREAM_ATTR, None)


def is_streamed(model: torch.nn.Module) -> bool:
    return streamer_of(model) is not None


def load_streamed(
    path: Path,
    model: torch.nn.Module,
    *,
    device: str,
    dtype: torch.dtype,
    budget: int | None,
    prefetch: bool = True,
) -> torch.nn.Module:
    """``model`` (built on the meta device for ``path``) with its resident units on ``device`` and its
    layers streamed (module docstring).

    ``budget``: weight bytes allowed on the device (None: unbounded); the resident units plus the
    largest layer must fit, else BadInput with the numbers before any tensor is read.
    """
    sizes = dict(unit_bytes(model))
    layer_bytes = [n for u, n in sizes.items() if u.startswith("model.layers.")]
    resident = sum(n for u, n in sizes.items() if not u.startswith("model.layers."))
    need = resident + max(layer_bytes)
    if budget is not None and need > budget:
        raise BadInput(
            f"streaming layer by layer needs {human_bytes(need)} on {device} (resident embedding and head "
            f"{human_bytes(resident)} plus the largest layer {human_bytes(max(layer_bytes))}) but the budget is "
            f"{human_bytes(budget)}; give a larger --max-memory"
        )
    stream = LayerStream(model, path, device, dtype, prefetch)
    stream.load_resident()
    setattr(model, _STREAM_ATTR, stream)
    return model.eval()


def load_weights(
    path: Path,
    *,
    devices: list[str],
    max_memory: str | None,
    reserve: int,
    dtype: torch.dtype | None,
    stream_layers: bool,
    stream_if_needed: bool,
) -> torch.nn.Module:
    """Place the checkpoint on ``devices``, or stream it on the first one.

    Streams when ``stream_layers``, or when ``stream_if_needed`` (``--device auto``) and the weights
    do not fit the budgets; otherwise a checkpoint that does not fit is refused as before.
    """
    model, budgets, dtype = planned(path, devices, max_memory, reserve, dtype)
    if not stream_layers:
        try:
            placement = plan_placement(unit_bytes(model), devices, budgets)
        except BadInput:
            if not stream_if_needed:
                raise
        else:
            return load_placed(path, placement, model, dtype)
    elif len(devices) != 1:
        raise BadInput(
            f"--stream-layers runs on one device, got {len(devices)} ({', '.join(devices)}); "
            "give --device cuda:0, cpu or auto"
        )
    return load_streamed(path, model, device=devices[0], dtype=dtype, budget=budgets[0])


class LayerMajor:
    """One layer-major pass of a model over ``ids`` [B, S] at positions start..start+S-1, step by step.

    ``run(i, c)`` runs decoder layer i over chunk c (``spans[c]``), reading and writing the hidden
    streams of every token [B, S, hc_mult, H]; ``logits(keep)`` applies the head at the absolute
    positions ``keep``. Layer i's weights must be on the device while ``run(i, ...)`` runs, and the
    chunks of layer 0 must run first, in order: each builds the chunk's mask from layer 0's cache
    before it (as the model's forward builds it from its first sliding layer); later layers reuse it.
    ``cache``: the ``DynamicCache`` the pass extends (None: one cacheless chunk, the one-pass forward).
    """

    def __init__(self, model: torch.nn.Module, ids: torch.Tensor, start: int, cache, chunk: int | None):
        inner = model.model
        self.model, self.cache, self.start = model, cache, start
        dev = inner.embed_tokens.weight.device
        self.ids = ids.to(dev)
        S = ids.shape[1]
        step = S if chunk is None or cache is None else chunk
        self.spans = [(lo, min(lo + step, S)) for lo in range(0, S, step)]
        self.position_ids = torch.arange(start, start + S, device=dev).unsqueeze(0).expand(ids.shape[0], -1)
        self.embeds = inner.embed_tokens(self.ids)  # [B, S, H]
        self.hidden = self.embeds.unsqueeze(2).expand(-1, -1, model.config.hc_mult, -1).contiguous()
        self._per_chunk: list = []

    def _chunk_inputs(self, lo: int, hi: int):
        from transformers.masking_utils import create_sliding_window_causal_mask

        part, pos = self.embeds[:, lo:hi], self.position_ids[:, lo:hi]
        mask = create_sliding_window_causal_mask(
            config=self.model.config, inputs_embeds=part, attention_mask=None,
            past_key_values=self.cache, position_ids=pos,
        )  # fmt: skip
        rotary = self.model.model.rotary_emb
        rope = {kind: rotary(part, position_ids=pos, layer_type=kind) for kind in ("main", "compress")}
        return mask, rope

    def run(self, i: int, c: int) -> None:
        lo, hi = self.spans[c]
        if c == len(self._per_chunk):
            self._per_chunk.append(self._chunk_inputs(lo, hi))
        mask, rope = self._per_chunk[c]
        # a copy: the layer's input must stay as it was (a recorder keeps it) when its output lands
        self.hidden[:, lo:hi] = self.model.model.layers[i](
            self.hidden[:, lo:hi].clone(),
            position_embeddings=rope,
            position_ids=self.position_ids[:, lo:hi],
            attention_mask=mask,
            input_ids=self.ids[:, lo:hi],
            past_key_values=self.cache,
        )

    def logits(self, keep: Sequence[int]) -> torch.Tensor:
        """[B, len(keep), V] fp32 at the absolute positions ``keep``."""
        inner = self.model.model
        local = torch.tensor([p - self.start for p in keep], dtype=torch.long, device=self.hidden.device)
        return self.model.lm_head(inner.norm(inner.hc_head(self.hidden[:, local]))).float()


def layers_of(model: torch.nn.Module, *lent_to: torch.nn.Module) -> Iterator[int]:
    """Each decoder layer index of ``model`` in order, with its weights on the device while it is
    yielded: a streamed model reads it (and lends the same tensors to the ``lent_to`` models, the
    same checkpoint loaded streamed, for the step); an in-memory one has them already."""
    stream = streamer_of(model)
    if stream is None:
        yield from range(len(model.model.layers))
        return
    for i in stream.layers():
        for other in lent_to:
            stream.lend(i, other)
        try:
            yield i
        finally:
            for other in lent_to:
                stream.take_back(i, other)


def streamed_forward(
    model: torch.nn.Module,
    ids: torch.Tensor,
    start: int,
    cache,
    keep: Sequence[int],
    chunk: int | None,
) -> torch.Tensor:
    """One layer-major pass over ``ids`` [B, S] at positions start..start+S-1: logits [B, len(keep), V] fp32.

    ``keep``: absolute positions whose logits are returned; ``cache``: the ``DynamicCache`` the
    pass continues and extends (None: a cacheless one-chunk pass, the one-pass forward);
    ``chunk``: tokens per layer call (None: all S at once). Call under ``torch.no_grad()``.
    """
    if streamer_of(model) is None:
        raise ValueError("streamed_forward needs a model loaded by load_streamed")
    run = LayerMajor(model, ids, start, cache, chunk)
    for i in layers_of(model):
        for c in range(len(run.spans)):
            run.run(i, c)
    return run.logits(keep)
