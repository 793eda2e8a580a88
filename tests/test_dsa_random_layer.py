"""The random full-size indexer layer (at small sizes here) and ``indexer sweep --model random-layer``.

The layer is transformers' real ``DeepseekV4Indexer`` with seeded weights; the planted needle's
key must come out of the layer's own compressor pointing where it was aimed, its rank must fall
as the needle fades, and the sweep must give the same ranks through the Triton kernel (Triton's
interpreter on CPU) as through the reference.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from needlescope.dsa.random_layer import (  # noqa: E402
    RandomLayerConfig,
    make_context,
    random_indexer,
    score_needle,
)
from needlescope.dsa.sweep import SweepConfig, run_random_layer_sweep, validate_sweep  # noqa: E402
from needlescope.errors import BadInput  # noqa: E402

SMALL = dict(hidden=384, q_lora_rank=96, heads=8)


def test_weights_have_the_layer_dtypes_and_are_seeded():
    cfg = RandomLayerConfig(**SMALL)
    a, b, c = random_indexer(cfg, seed=1), random_indexer(cfg, seed=1), random_indexer(cfg, seed=2)
    assert (
        a.kv_proj.weight.dtype
        == a.q_b_proj.weight.dtype
        == a.scorer.weights_proj.weight.dtype
        == torch.bfloat16
    )
    assert a.position_bias.dtype == a.kv_norm.weight.dtype == torch.float32
    assert a.q_b_proj.weight.shape == (8 * 128, 96) and a.kv_proj.weight.shape == (256, 384)
    assert torch.equal(a.kv_proj.weight, b.kv_proj.weight)
    assert not torch.equal(a.kv_proj.weight, c.kv_proj.weight)


def test_planted_key_points_where_it_was_aimed_and_fades_with_strength():
    ranks = []
    for strength in (1.0, 0.25, 0.0):
        cfg = RandomLayerConfig(**SMALL, strength=strength)
        layer = random_indexer(cfg)
        ctx = make_context(layer, cfg, 2048, 30.0, seed=3)
        with torch.no_grad():
            stats, selected = score_needle(layer, ctx, 16)
        assert ctx.needle_entry == round(0.3 * (ctx.visible - 1)) and ctx.keys.shape == (512, 128)
        if strength == 1.0:  # the strongest key the layer can hold beats every random entry
            assert stats.best_rank == 1 and selected
        ranks.append(stats.best_rank)
    assert ranks[0] < ranks[1] < ranks[2], ranks


def test_keys_and_query_are_transformers_own():
    """transformers' forward of the same module over the same tokens selects what score_needle selects."""
    cfg = RandomLayerConfig(**SMALL, strength=0.3)
    layer = random_indexer(cfg)
    ctx = make_context(layer, cfg, 256, 50.0, seed=4)
    k = 8
    q_res = torch.randn(ctx.tokens, cfg.q_lora_rank, generator=torch.Generator().manual_seed(5))
    q_res[-1] = ctx.q_lora
    layer.index_topk = k
    with torch.no_grad():
        theirs = layer(
            ctx.hidden[None], q_res.to(torch.bfloat16)[None], torch.arange(ctx.tokens)[None], None, 0
        )
        scores = layer.scorer(ctx.q[None, None], ctx.keys[None], ctx.x_last[None, None])[0, 0]
        stats, selected = score_needle(layer, ctx, k)
    ours = scores.float().topk(k).indices
    assert set(theirs[0, -1].tolist()) == set(ours.tolist())
    assert selected == (ctx.needle_entry in set(theirs[0, -1].tolist()))


def test_bad_random_layers_are_refused():
    with pytest.raises(BadInput, match="needle strength"):
        RandomLayerConfig(strength=1.5)
    with pytest.raises(BadInput, match="dim must be 64 or 128"):
        RandomLayerConfig(dim=96)
    cfg = RandomLayerConfig(**SMALL)
    with pytest.raises(BadInput, match="at least 8 tokens"):
        make_context(random_indexer(cfg), cfg, 5, 50.0, seed=0)
    with pytest.raises(BadInput, match="no answers"):
        run_random_layer_sweep(SweepConfig(index_topk=(4,), lengths=(64,)), cfg)


def test_sweep_on_a_random_layer_scores_through_the_kernel_like_the_reference():
    from needlescope.kernels.scoring import kernel_backend

    cfg = SweepConfig(
        index_topk=(8,),
        lengths=(512,),
        index_k=("fp8_e4m3",),
        index_q=("fp8_e4m3",),
        generate=False,
        trials=2,
    )
    layer_cfg = RandomLayerConfig(**SMALL, strength=0.3)
    with kernel_backend("reference", "cpu"):
        ref = run_random_layer_sweep(cfg, layer_cfg)
    with kernel_backend("triton", "cpu"):  # Triton's interpreter (tests/conftest.py)
        kern = run_random_layer_sweep(cfg, layer_cfg)
    validate_sweep(kern)
    assert len(kern["runs"]) == len(ref["runs"]) == 2
    for a, b in zip(kern["runs"], ref["runs"]):  # fp32 sums in another order: margins agree to rounding
        la, lb = a.pop("layers")[0], b.pop("layers")[0]
        assert a == b and la.pop("margin_frac") == pytest.approx(lb.pop("margin_frac"), abs=1e-3) and la == lb
    assert kern["judged_by"] == "selection_rate" and kern["kind"] == "planted key"
    # settings differ only in numerics: the same contexts under fp32 give the same needle entries
    with kernel_backend("reference", "cpu"):
        fp32 = run_random_layer_sweep(
            SweepConfig(index_topk=(8,), lengths=(512,), generate=False, trials=2), layer_cfg
        )
    assert [r["needle_entry"] for r in fp32["runs"]] == [r["needle_entry"] for r in ref["runs"]]


def test_cli_sweep_random_layer(tmp_path, run_cli):
    out = tmp_path / "sweep"
    code, stdout, err = run_cli("indexer", "sweep", "--model", "random-layer", "--lengths", "64,256",
        "--index-topk", "4", "--index-k", "fp32,fp8_e4m3", "--needle-strength", "1", "--kernel", "reference",
        "--out", str(out),
    )  # fmt: skip
    assert code == 0, err
    obj = json.loads((out / "sweep.json").read_text())
    validate_sweep(obj)
    assert obj["model"].startswith("random-layer") and obj["generate"] is False
    assert {r["layers"][0]["best_rank"] for r in obj["runs"]} == {1}  # strength 1: the strongest key
    code, _, err = run_cli("indexer", "sweep", "--model", "random-layer", "--index-topk", "4", "--generate",
        "--out", str(tmp_path / "x"))  # fmt: skip
    assert code == 2 and "no answers" in err and len(err.strip().splitlines()) == 1
