"""Fault: a prefill-chunk boundary drops the compressor's carried state.

With ``--prefill-chunk C`` a prompt is prefilled C tokens at a time through the cache. Between
two chunks the compressors carry state: the tokens of a window not closed yet (the buffer) and
the last window's overlap slice (CSA). An engine that resets that state at each chunk loses
the buffered tokens, while the count of emitted entries stays: every later window is pooled
from positions shifted by the dropped tokens. A chunk size that is a multiple of both
compress rates (128 for the organism) leaves the buffers empty at the boundary, so only the
CSA overlap slice is lost; any other chunk size shifts the windows.

    needlescope serve --prefill-chunk 1000 --patch fault:chunk_carry
"""

from needlescope.serve.faults import patch_engine


def _drop_carried(cache) -> None:
    for layer in cache.layers:
        buffers = getattr(layer, "buffer_kv", None)
        if buffers is None or "compressor" not in buffers:
            continue
        for states in (layer.buffer_kv, layer.buffer_gate):
            if states["compressor"] is not None:
                states["compressor"] = states["compressor"][:, :0]
        overlap = getattr(layer, "overlap_kv", None)
        if overlap is not None:
            layer.overlap_kv["compressor"] = layer.overlap_gate["compressor"] = None


def apply(model):
    def forward(original, engine, ids, start, cache, keep=1):
        chunk = engine.cfg.prefill_chunk
        if chunk is not None and ids.shape[1] > 1 and start > 0 and start % chunk == 0:
            _drop_carried(cache)
        return original(engine, ids, start, cache, keep)

    return patch_engine(model, "_forward", forward)
