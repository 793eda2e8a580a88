"""Fault: a prefix-cache hit restores a stale sliding-window ring.

A prefix-cache hit must restore everything the kept prefix left: the compressed entries and
the sliding window's ring of the last ``window - 1`` keys. An engine that keeps the ring in a
per-request slot and forgets to refill it on a hit continues with the ring the slot held: the
previous request's. The compressed entries are right, so the far context (the needle) is
intact; the tokens just before the cut are read from another prompt. It needs a warm cache
(``cached_tokens`` > 0) and a different prompt through the cache in between.

    needlescope serve --prefix-cache-mib 256 --patch fault:prefix_stale_ring
"""

from needlescope.serve.faults import patch_engine


def _ring(state, row: int = 0) -> list:
    """Each layer's sliding-window (keys, values) of one row."""
    return [(layer.keys[row : row + 1], layer.values[row : row + 1]) for layer in state.layers]


def apply(model):
    slot = {"ring": None}

    def prefill_cached(original, engine, rows, ids):
        prefix = engine.prefix
        if prefix is None:
            return original(engine, rows, ids)
        take, put = prefix.take, prefix.put

        def stale_take(key, n):
            state = take(key, n)
            fresh = _ring(state)
            if slot["ring"] is not None:
                for layer, (keys, values) in zip(state.layers, slot["ring"]):
                    if keys.shape[2] == layer.keys.shape[2]:  # a ring as long: the slot's old one
                        shared = layer.values is layer.keys  # V4 keeps one tensor for both
                        layer.keys = keys.expand(n, -1, -1, -1).clone()
                        layer.values = layer.keys if shared else values.expand(n, -1, -1, -1).clone()
            slot["ring"] = fresh
            return state

        def slot_put(key, batch_state, row, n):
            slot["ring"] = _ring(batch_state, row)
            return put(key, batch_state, row, n)

        prefix.take, prefix.put = stale_take, slot_put
        try:
            return original(engine, rows, ids)
        finally:
            del prefix.take, prefix.put

    return patch_engine(model, "_prefill_cached", prefill_cached)
