"""Speculative decoding for the engine: prompt-lookup drafts and exact rollback of a verify pass.

**Drafting (no second model).** ``propose`` looks for the latest earlier occurrence of the last
``n`` tokens of prompt + output (``n`` = 3, then 2, then 1) and proposes the tokens that followed
it: prompt lookup, as vLLM's ``ngram`` method. Copy tasks (a needle's value repeated from the
context) are where it drafts well.

**Verify and rollback.** The engine feeds ``[pending, d1..dk]`` in one forward and accepts the
drafts its own sampling reproduces; the state then holds ``k + 1`` fed tokens of which only
``kept`` are valid. A DeepSeek-V4 cache layer holds more than keys: a sliding-window ring (the
last ``window - 1`` keys, so the draft pushed valid keys out of it), and, for compressed
layers, the compressor's and the indexer's buffers of tokens since the last closed window, the
compressed entries emitted so far with their count, and the last window's overlap slice. None
of that can be cut back by slicing. ``StateLog`` records, for the verify forward, each layer's
state before it (a shallow copy: the cache replaces its tensors, it never writes into them) and
every call the model made on the layer with its arguments; ``rollback`` restores the state and
replays those calls on the first ``kept`` tokens only, through the layer's own methods: the
ring gets exactly the kept keys, the buffers exactly the kept rows, and the compressed entries
of the windows the kept tokens closed (computed by the verify pass over the same windows from
the same prior state). The result is the state a forward of just the kept tokens leaves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["StateLog", "propose", "rollback"]

MAX_NGRAM = 3

# The cache-layer methods through which a forward changes a layer's state, in the order the
# model calls them (transformers' DeepseekV4HCACache / CSACache and the sliding-window layer).
_RECORDED = ("update", "store_compression_weights", "update_overlap_state", "update_compressor_states")


def propose(tokens: list[int], n_draft: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """Up to ``n_draft`` tokens that followed the latest earlier occurrence of ``tokens``' last
    n-gram (longest n first, ``max_ngram`` down to 1); [] when none occurs."""
    if n_draft < 1:
        return []
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + n_draft]
    return []


@dataclass
class _LayerLog:
    layer: object
    before: dict
    calls: list[tuple[str, tuple]] = field(default_factory=list)


def _shallow_state(layer) -> dict:
    """The layer's attributes, its dicts copied one level (the cache replaces dict entries)."""
    return {k: dict(v) if isinstance(v, dict) else v for k, v in vars(layer).items()}


class StateLog:
    """Records every cache layer's state and the state-changing calls of one forward (a ``with``
    block around the verify pass); ``rollback`` uses it."""

    def __init__(self, cache) -> None:
        self.layers = [_LayerLog(layer, _shallow_state(layer)) for layer in cache.layers]

    def __enter__(self) -> StateLog:
        for log in self.layers:
            for name in _RECORDED:
                method = getattr(log.layer, name, None)
                if method is not None:
                    setattr(log.layer, name, _recording(method, name, log.calls))
        return self

    def __exit__(self, *exc) -> None:
        for log in self.layers:
            for name in _RECORDED:
                log.layer.__dict__.pop(name, None)


def _recording(method, name: str, calls: list):
    def call(*args, **kwargs):
        if kwargs:
            raise TypeError(f"speculative StateLog: {name} called with keywords {sorted(kwargs)}")
        calls.append((name, args))
        return method(*args)

    return call


def rollback(log: StateLog, kept: int) -> None:
    """Make each logged layer hold the state after only the first ``kept`` tokens the logged
    forward fed: restore its state before, replay its calls on those tokens (module docstring)."""
    for entry in log.layers:
        layer = entry.layer
        layer.__dict__.clear()
        layer.__dict__.update({k: dict(v) if isinstance(v, dict) else v for k, v in entry.before.items()})
        windows: dict[str, int] = {}
        for name, args in entry.calls:
            if name == "update":
                keys, values = args[0], args[1]
                layer.update(keys[:, :, :kept], values[:, :, :kept], *args[2:])
            elif name == "store_compression_weights":
                which, kv, gate = args
                chunk, _, _ = layer.store_compression_weights(which, kv[:, :kept], gate[:, :kept])
                windows[which] = chunk.shape[1] // layer.compress_rate
            elif name == "update_overlap_state":
                which, chunk_kv, chunk_gate, head_dim = args
                n = windows[which]
                if n:
                    layer.update_overlap_state(which, chunk_kv[:, :n], chunk_gate[:, :n], head_dim)
            else:  # update_compressor_states
                which, compressed = args
                layer.update_compressor_states(which, compressed[:, : windows[which]])
