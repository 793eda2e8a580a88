"""Fault: a prefill-chunk boundary drops the compressors' carried state.

With ``--prefill-chunk C`` a prompt is prefilled C tokens at a time through the cache. Between
two chunks every compressed layer carries its compressors' state: the compressed entries
emitted so far and their count, the tokens of a window not closed yet, and (CSA) the last
window's overlap slice, for the attention's compressor and for the indexer's. An engine that
sets that state up afresh for each chunk (as for a new sequence) leaves the later chunks, and
every decode step after them, with the entries of the last chunk only, numbered from 0: the
sliding window still sees the last ``window - 1`` tokens, but a needle before the last chunk
boundary is gone from the compressed context. Prompts no longer than C are untouched.

(Dropping only the open window's tokens and the overlap slice, keeping the entries, cost no
recall on the organism: 15/15 at 1K with 300-token chunks, fp32 and fp8 top-64; docs/faults.md.)

    needlescope serve --prefill-chunk 1000 --patch fault:chunk_carry
"""

from needlescope.serve.faults import patch_engine


def _drop_carried(cache) -> None:
    """Every compressor of every compressed layer back to its state before the first token."""
    for layer in cache.layers:
        if not hasattr(layer, "compressed_kv"):
            continue
        for name in layer.compressed_kv:
            layer.compressed_kv[name] = layer.buffer_kv[name] = layer.buffer_gate[name] = None
            layer.entry_count[name] = 0
            if hasattr(layer, "overlap_kv"):
                layer.overlap_kv[name] = layer.overlap_gate[name] = None


def apply(model):
    def forward(original, engine, ids, start, cache, keep=1):
        chunk = engine.cfg.prefill_chunk
        if chunk is not None and ids.shape[1] > 1 and start > 0 and start % chunk == 0:
            _drop_carried(cache)
        return original(engine, ids, start, cache, keep)

    return patch_engine(model, "_forward", forward)
