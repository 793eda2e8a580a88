"""The serve prefix cache's bookkeeping on real transformers caches: the boundary rule, longest
match, private copies, compact storage and LRU eviction under the memory cap."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from needlescope.serve.prefix_cache import PrefixCache, cache_block


def _state(tokens: int, rows: int = 1, fill: float = 1.0) -> DynamicCache:
    """A one-layer cache holding ``tokens`` positions, kept as a view of a longer tensor (as a
    sliding-window layer keeps its tail)."""
    cache = DynamicCache()
    full = torch.full((rows, 1, 2 * tokens, 8), fill)
    cache.update(full[:, :, tokens:], full[:, :, tokens:], 0)
    return cache


def test_boundary_rule_follows_the_compress_rates():
    class V4:
        compress_rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}

    assert cache_block(V4()) == 128 and cache_block(object()) == 16
    pc = PrefixCache(2**20, 128)
    assert [pc.cut(n) for n in (1, 128, 129, 256, 1024, 1025)] == [0, 0, 128, 128, 896, 1024]


def test_match_take_put_and_lru_eviction():
    one = 2 * 16 * 8 * 4  # keys and values of 16 positions, float32, compact
    pc = PrefixCache(capacity_bytes=2 * one, block=16)
    ids = list(range(100))
    pc.put(tuple(ids[:16]), _state(16), 0, 1)
    assert pc.bytes == one  # the view's 32-position base storage was not kept
    pc.put(tuple(ids[:32]), _state(16, fill=2.0), 0, 1)
    assert pc.match(ids) == tuple(ids[:32]) and pc.match(ids[:32]) == tuple(ids[:16])
    assert pc.match([7, *ids]) is None
    got = pc.take(tuple(ids[:32]), rows=3)
    assert got.layers[0].keys.shape[0] == 3 and float(got.layers[0].keys[2, 0, 0, 0]) == 2.0
    got.layers[0].keys.zero_()  # a private copy: the kept state is untouched
    assert float(pc.take(tuple(ids[:32]), rows=1).layers[0].keys.sum()) > 0
    pc.take(tuple(ids[:16]), rows=1)  # now the 32-prefix is the least recently used
    pc.put(tuple(range(200, 248)), _state(16, fill=3.0), 0, 1)
    assert pc.match(ids) == tuple(ids[:16]) and pc.evictions == 1 and len(pc) == 2
    pc.put(tuple(range(300, 316)), _state(64), 0, 1)  # larger than the whole cap: not kept
    assert len(pc) == 2 and pc.bytes == 2 * one


def test_put_keeps_one_row_of_a_batch():
    pc = PrefixCache(2**20, 16)
    batch = _state(16, rows=3)
    batch.layers[0].keys[1] = 5.0
    pc.put(tuple(range(16)), batch, 1, 3)
    kept = pc.take(tuple(range(16)), rows=1)
    assert kept.layers[0].keys.shape[0] == 1 and float(kept.layers[0].keys.min()) == 5.0
    assert pc.info()["entries"] == 1 and pc.info()["hit_rows"] == 1


def _answers(engine, batches: list[list[list[int]]], params) -> list:
    """Run ``batches`` of prompts through ``engine`` one after another (a batch's requests wait
    together, so equal ones share one prefill); the Final of each request, in order."""
    import asyncio

    from needlescope.serve.requests import GenRequest

    async def run():
        engine.start()
        out = []
        for prompts in batches:
            reqs = [GenRequest(p, params) for p in prompts]
            for r in reqs:
                engine.submit(r)
            out += [await asyncio.wait_for(r.events.get(), timeout=120) for r in reqs]
        return out

    try:
        return asyncio.run(run())
    finally:
        engine.close()


def test_engine_answers_with_the_cache_equal_answers_without_it_batched_rows_included(tmp_path):
    """A V4 checkpoint in-process: a cold prompt, then three identical prompts continuing its
    kept prefix as one batch of three, then a longer prompt continuing it; greedy, token-exact,
    logprobs within 1e-4 of a server without the cache."""
    from needlescope.serve.config import ServeConfig
    from needlescope.serve.engine import Engine
    from needlescope.serve.sampling import SamplingParams
    from needlescope.testing.checkpoints import save_random

    ckpt = str(
        save_random(
            tmp_path, seed=3, hidden_size=64, q_lora_rank=32, o_lora_rank=32, moe_intermediate_size=64
        )
    )
    params = SamplingParams(max_new_tokens=6, temperature=0.0, logprobs=0)
    base = list(range(5, 5 + 150))
    batches = [[base], [base, base, base], [base + [7, 8, 9, 10]]]
    plain = _answers(Engine(ServeConfig(model=ckpt)), batches, params)
    cached_engine = Engine(ServeConfig(model=ckpt, prefix_cache_mib=8))
    cached = _answers(cached_engine, batches, params)
    assert [f.cached_tokens for f in plain] == [0] * 5
    assert [f.cached_tokens for f in cached] == [0, 128, 128, 128, 128]
    for a, b in zip(plain, cached, strict=True):
        assert a.output_ids == b.output_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.tokens, b.tokens, strict=True)) < 1e-4
    info = cached_engine.prefix.info()
    assert (info["hit_rows"], info["miss_rows"], info["entries"]) == (4, 1, 1)
    assert cached_engine.metrics.batch_size._sum.get() == 5  # the three identical ones shared a batch
    assert cached_engine.metrics.cached_tokens._value.get() == 4 * 128
