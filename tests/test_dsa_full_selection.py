"""``dsa.full_selection``: the indexer without scores when it selects everything, against the stock forward."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from transformers import DynamicCache  # noqa: E402

from needlescope.dsa import full_selection  # noqa: E402
from needlescope.dsa.checkpoint import load_bundle  # noqa: E402
from needlescope.dsa.emulate import csa_indexers, wrap_scorers  # noqa: E402

LENGTH, CHUNK, STEPS = 160, 64, 2


@pytest.fixture(scope="module")
def organism():
    return load_bundle("organism")[0]


def _set_topk(model, k: int) -> None:
    for _, indexer in csa_indexers(model):
        indexer.index_topk = k


def _stock(model) -> None:
    for _, indexer in csa_indexers(model):
        indexer.__dict__.pop("forward", None)


def _run(model, ids):
    """Logits of a chunked prefill through a cache, greedy decode steps, and one pass without a cache;
    and the cache's indexer keys."""
    cache, out = DynamicCache(config=model.config), []
    B, T = ids.shape
    with torch.no_grad():
        for lo in range(0, T, CHUNK):
            pos = torch.arange(lo, min(T, lo + CHUNK)).expand(B, -1)
            out.append(
                model(input_ids=ids[:, lo : lo + CHUNK], position_ids=pos, past_key_values=cache).logits
            )
        nxt = out[-1][:, -1:].argmax(-1)
        for step in range(STEPS):
            logits = model(
                input_ids=nxt, position_ids=torch.full((B, 1), T + step), past_key_values=cache
            ).logits
            out.append(logits)
            nxt = logits.argmax(-1)
        out.append(model(input_ids=ids).logits)
    keys = [cache.layers[i].compressed_kv["indexer"] for i, _ in csa_indexers(model)]
    return out, keys


@pytest.mark.parametrize(
    "topk", [2048, 20]
)  # every entry at every step; a selection from the second chunk on
def test_logits_and_cache_equal_the_stock_forward(organism, topk):
    ids = torch.randint(10, 3000, (2, LENGTH), generator=torch.Generator().manual_seed(0))
    _set_topk(organism, topk)
    try:
        _stock(organism)
        want, want_keys = _run(organism, ids)
        full_selection.use_full_selection(organism)
        calls = []
        original = full_selection._compress
        full_selection._compress = lambda *a: calls.append(1) or original(*a)
        try:
            got, got_keys = _run(organism, ids)
        finally:
            full_selection._compress = original
    finally:
        _set_topk(organism, organism.config.index_topk)
        full_selection.use_full_selection(organism)
    assert calls, "the scoreless path never ran"
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(got_keys, want_keys, strict=True):
        assert torch.equal(a, b)


def test_an_observed_or_patched_indexer_keeps_the_stock_forward(organism):
    """A hook on the indexer sees the score-ordered selection, and a wrapped scorer (a fault) runs."""
    ids = torch.randint(10, 3000, (1, 64), generator=torch.Generator().manual_seed(1))
    _, indexer = csa_indexers(organism)[0]
    seen, scored = [], []
    handle = indexer.register_forward_hook(lambda m, a, out: seen.append(out))
    try:
        with torch.no_grad():
            organism(input_ids=ids)
    finally:
        handle.remove()
    order = seen[0][0, -1]
    assert not torch.equal(
        order[order >= 0], torch.arange(int((order >= 0).sum()))
    )  # ranked, not in entry order

    undo = wrap_scorers(organism, lambda inner: lambda *a: scored.append(1) or inner(*a))
    try:
        assert not full_selection.selects_everything(indexer)
        with torch.no_grad():
            organism(input_ids=ids)
    finally:
        undo()
    assert len(scored) == len(csa_indexers(organism))
    assert full_selection.selects_everything(indexer)
