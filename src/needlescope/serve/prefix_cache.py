"""A bounded prefix cache for the engine: model state after a token prefix, reused by later prompts.

**What is stored.** A copy of the per-layer cache (``transformers.DynamicCache``) of one request
right after its prompt's first ``b`` tokens were prefilled, keyed by those ``b`` token ids. For
DeepSeek-V4 that copy holds each layer's sliding-window keys and, for compressed layers, every
compressed entry emitted so far, the compressor's buffer of tokens since the last closed window
and (CSA) the last window's overlap slice, so a later prompt that starts with the same ``b`` tokens
continues from it exactly as if it had prefilled them itself.

**Where prefixes are cut (the boundary rule).** ``b`` is the largest multiple of ``block`` that
is smaller than the prompt (one token at least is always prefilled, for the logits). For V4,
``block`` is the least common multiple of the compress rates (4 and 128 for the organism: 128),
so a stored state holds whole windows only (every compressor buffer is empty, the overlap slice
is the last closed window's), as a paged engine caches whole pages. transformers' V4 cache keeps
partial windows in its buffers, so other cut points would resume too, but this one keeps the
stored state minimal and is the one measured (docs/serve.md). For other models ``block`` is 16.

**Bounded.** Entries are evicted least recently used first once their bytes exceed
``capacity_bytes``; an entry larger than the whole capacity is not stored.

Only the engine's worker thread calls it, so it needs no lock.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from dataclasses import dataclass

import torch

__all__ = ["PrefixCache", "cache_block"]


def cache_block(model_config) -> int:
    """The boundary multiple for ``model_config``: lcm of V4's compress rates, else 16."""
    rates = getattr(model_config, "compress_rates", None)
    if isinstance(rates, dict) and rates:
        return math.lcm(*(int(r) for r in rates.values()))
    return 16


def _nbytes(obj, seen: set[int]) -> int:
    """Bytes of the tensors reachable from ``obj`` through attributes, dicts and lists (each once)."""
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, dict):
        return sum(_nbytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v, seen) for v in obj)
    if hasattr(obj, "__dict__"):
        return sum(_nbytes(v, seen) for v in vars(obj).values())
    return 0


def _compact(obj, memo: dict[int, object]) -> None:
    """Replace every tensor reachable from ``obj`` through attributes, dicts and lists by a compact
    clone (one clone per tensor, so aliases stay aliases). Cache layers keep views (the sliding
    window is the tail of a longer tensor), and a view pins its whole base storage, which would
    make a kept entry as large as the prompt."""
    if id(obj) in memo:
        return
    memo[id(obj)] = obj
    if isinstance(obj, list):
        slots = list(enumerate(obj))
    elif isinstance(obj, dict):
        slots = list(obj.items())
    elif hasattr(obj, "__dict__"):
        slots = list(vars(obj).items())
    else:
        return
    for key, value in slots:
        if isinstance(value, torch.Tensor):
            if id(value) not in memo:
                memo[id(value)] = value.clone()
            if isinstance(obj, (list, dict)):
                obj[key] = memo[id(value)]
            else:
                setattr(obj, key, memo[id(value)])
        else:
            _compact(value, memo)


@dataclass
class _Entry:
    state: object
    nbytes: int


class PrefixCache:
    """LRU map from a token prefix (a multiple of ``block`` long) to the model state after it."""

    def __init__(self, capacity_bytes: int, block: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.block = block
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def cut(self, prompt_len: int) -> int:
        """The boundary at which a prompt of ``prompt_len`` tokens is snapshotted (0: none)."""
        return ((prompt_len - 1) // self.block) * self.block

    def match(self, ids: list[int]) -> tuple[int, ...] | None:
        """The longest stored prefix of ``ids`` that leaves at least one token to prefill."""
        for b in range(self.cut(len(ids)), 0, -self.block):
            key = tuple(ids[:b])
            if key in self._entries:
                return key
        return None

    def take(self, key: tuple[int, ...], rows: int) -> object:
        """A private copy of ``key``'s state for a batch of ``rows`` identical prefixes."""
        self._entries.move_to_end(key)
        self.hits += rows
        state = copy.deepcopy(self._entries[key].state)
        if rows > 1:
            state.reorder_cache(torch.zeros(rows, dtype=torch.long))
        return state

    def put(self, key: tuple[int, ...], batch_state: object, row: int, rows: int) -> None:
        """Store row ``row`` of ``batch_state`` (a batch of ``rows``) under ``key`` (copied)."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        state = copy.deepcopy(batch_state)
        if rows > 1:
            state.reorder_cache(torch.tensor([row], dtype=torch.long))
        _compact(state, {})
        size = _nbytes(state, set())
        if size > self.capacity_bytes:
            return
        self._entries[key] = _Entry(state, size)
        self.bytes += size
        while self.bytes > self.capacity_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.nbytes
            self.evictions += 1

    def info(self) -> dict:
        return {
            "block": self.block,
            "capacity_bytes": self.capacity_bytes,
            "bytes": self.bytes,
            "entries": len(self._entries),
            "hit_rows": self.hits,
            "miss_rows": self.misses,
            "evictions": self.evictions,
        }
