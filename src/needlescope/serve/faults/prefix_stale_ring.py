"""Fault: a prefix-cache hit restores a stale sliding-window ring.

A prefix-cache hit must restore everything the kept prefix left: the compressed entries and
the sliding window's ring of the last ``window - 1`` keys. An engine that keeps the ring in a
per-request slot and forgets to refill it on a hit continues with the ring the slot holds: the
one the slot's previous occupant left after its last prefill forward (the tail of the previous
prompt, its question and the assistant marker, at that prompt's positions). The compressed
entries are right, so the far context (the needle) is intact; the ``window - 1`` tokens just
before the cut are read from another prompt, by every token prefilled after the cut (the
question) and by the first decode steps. It needs a warm cache (``cached_tokens`` > 0) and a
different prompt through the slot in between.

(A first version restored the previous request's ring *at its own cut*: on same-template
prompts of one length that ring holds the same question text at the same positions, so it
changed logprobs but never a greedy token on the organism: 0 of 10 warm continuations departed,
docs/faults.md. The slot's ring as its last prefill left it is the state a real per-slot ring
holds when the next request arrives.)

    needlescope serve --prefix-cache-mib 256 --patch fault:prefix_stale_ring
"""

from needlescope.serve.faults import patch_engine


def _ring(state, row: int = 0) -> list:
    """Each layer's sliding-window (keys, values) of one row (copies: the cache moves on)."""
    return [
        (layer.keys[row : row + 1].clone(), layer.values[row : row + 1].clone()) for layer in state.layers
    ]


def apply(model):
    slot = {"ring": None}

    def forward(original, engine, ids, start, cache, keep=1):
        out = original(engine, ids, start, cache, keep)
        if ids.shape[1] > 1 and engine.prefix is not None:  # a prefill forward: the slot's ring now
            slot["ring"] = _ring(cache, ids.shape[0] - 1)
        return out

    def prefill_cached(original, engine, rows, ids):
        prefix = engine.prefix
        if prefix is None:
            return original(engine, rows, ids)
        take = prefix.take

        def stale_take(key, n):
            state = take(key, n)
            if slot["ring"] is not None:
                for layer, (keys, values) in zip(state.layers, slot["ring"]):
                    if keys.shape[2] == layer.keys.shape[2]:  # a ring as long: the slot's old one
                        shared = layer.values is layer.keys  # V4 keeps one tensor for both
                        layer.keys = keys.expand(n, -1, -1, -1).clone()
                        layer.values = layer.keys if shared else values.expand(n, -1, -1, -1).clone()
            return state

        prefix.take = stale_take
        try:
            return original(engine, rows, ids)
        finally:
            del prefix.take

    undo_forward = patch_engine(model, "_forward", forward)
    undo_prefill = patch_engine(model, "_prefill_cached", prefill_cached)

    def undo():
        undo_prefill()
        undo_forward()

    return undo
