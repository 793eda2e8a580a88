"""Parity of needlescope.dsa.reference with transformers' DeepseekV4Indexer."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
tv4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers import DeepseekV4Config  # noqa: E402

from needlescope.dsa import reference as R  # noqa: E402


def _tiny(index_head_dim: int, n_heads: int, topk: int, rope_dim: int, yarn: bool) -> DeepseekV4Config:
    head_dim = 64
    kw = {}
    if yarn:
        kw["rope_parameters"] = {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
        }
    return DeepseekV4Config(
        hidden_size=48,
        num_attention_heads=2,
        head_dim=head_dim,
        q_lora_rank=24,
        index_n_heads=n_heads,
        index_head_dim=index_head_dim,
        index_topk=topk,
        num_hidden_layers=2,
        partial_rotary_factor=rope_dim / head_dim,
        max_position_embeddings=256,
        **kw,
    )


def _build(cfg: DeepseekV4Config, seed: int):
    g = torch.Generator().manual_seed(seed)
    m = tv4.DeepseekV4Indexer(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m, g


def _reference(m, cfg, x, q_lora, pos):
    ratio = m.compress_rate
    T = x.shape[0]
    L = T // ratio
    inv = m.rotary_emb.compress_inv_freq
    scl = m.rotary_emb.compress_attention_scaling
    kcos, ksin = R.rope_cos_sin(torch.arange(L) * ratio, inv, scl)
    k = R.compress_index_keys(
        x,
        m.kv_proj.weight,
        m.gate_proj.weight,
        m.position_bias,
        m.kv_norm.weight,
        kcos,
        ksin,
        ratio=ratio,
        eps=cfg.rms_norm_eps,
    )  # [L, D]
    qcos, qsin = R.rope_cos_sin(pos, inv, scl)
    qcos, qsin = qcos.to(x.dtype), qsin.to(x.dtype)  # transformers casts cos/sin to the model dtype
    q = (q_lora @ m.q_b_proj.weight.t()).view(T, cfg.index_n_heads, cfg.index_head_dim)
    q = R.apply_rope_interleaved(q, qcos[:, None, :], qsin[:, None, :])  # [T, H, D]
    w = x @ m.scorer.weights_proj.weight.t()  # [T, H]
    s = R.indexer_scores(
        q, k, w, scale=cfg.index_head_dim**-0.5, weight_scale=cfg.index_n_heads**-0.5, ratio=ratio
    )
    return k, s


CONFIGS = [
    # (index_head_dim, heads, topk, rope_dim, yarn, T)
    (32, 4, 3, 8, False, 3),  # inside the first window: no entries at all
    (32, 4, 3, 8, False, 4),
    (32, 4, 3, 16, True, 23),  # not divisible by 4
    (64, 2, 5, 8, False, 37),
    (64, 8, 2, 16, True, 64),
    (32, 3, 16, 8, False, 30),  # topk larger than L
]


@pytest.mark.parametrize(("dim", "heads", "topk", "rd", "yarn", "T"), CONFIGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_parity_with_transformers(dim, heads, topk, rd, yarn, T, seed):
    cfg = _tiny(dim, heads, topk, rd, yarn)
    m, g = _build(cfg, seed)
    x = torch.randn(T, cfg.hidden_size, generator=g)
    q_lora = torch.randn(T, cfg.q_lora_rank, generator=g)
    pos = torch.arange(T)
    captured = {}
    m.scorer.register_forward_hook(lambda mod, a, out: captured.update(scores=out[0], k=a[1][0]))
    with torch.no_grad():
        hf_idx = m(x[None], q_lora[None], pos[None], None, 0)[0]  # [T, k']
        k, s = _reference(m, cfg, x, q_lora, pos)

    L = T // 4
    assert k.shape == (L, dim)
    torch.testing.assert_close(k, captured["k"], rtol=1e-5, atol=1e-5)
    vis = R.visibility_mask(T, L)
    assert torch.equal(torch.isfinite(s), vis)
    if L:
        torch.testing.assert_close(s[vis], captured["scores"][vis], rtol=1e-5, atol=1e-5)

    ours = R.topk_indices(s, topk, (pos + 1) // 4)
    assert ours.shape == (T, topk)
    for t in range(T):
        a = sorted(i for i in ours[t].tolist() if i != R.NO_ENTRY)
        b = sorted(i for i in hf_idx[t].tolist() if i != -1)
        assert a == b, (t, a, b)
        assert len(a) == min(topk, R.visible_entries(t))


def test_visibility_rule():
    m = R.visibility_mask(9, 3)
    for t in range(9):
        assert m[t].sum().item() == min(3, R.visible_entries(t))
    assert [R.visible_entries(t) for t in range(9)] == [0, 0, 0, 1, 1, 1, 1, 2, 2]


def test_topk_small_rows_are_ordered_then_padded():
    scores = torch.tensor([[3.0, 1.0, 2.0, 0.0], [3.0, 1.0, 2.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    out = R.topk_indices(scores, 3, torch.tensor([2, 0, 4]))
    assert out.tolist() == [[0, 1, -1], [-1, -1, -1], [3, 2, 1]]


def test_scores_bf16_accumulation_close():
    g = torch.Generator().manual_seed(0)
    q, k, w = (
        torch.randn(8, 4, 32, generator=g),
        torch.randn(2, 32, generator=g),
        torch.randn(8, 4, generator=g),
    )
    a = R.indexer_scores(q, k, w, scale=32**-0.5)
    b = R.indexer_scores(q, k, w, scale=32**-0.5, acc_dtype=torch.bfloat16)
    assert b.dtype == torch.bfloat16
    fin = torch.isfinite(a)
    torch.testing.assert_close(b.float()[fin], a[fin], rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("T", [3, 23, 40])
def test_parity_bf16_model(T):
    """A bf16 module: keys bit-identical, fp32 scores equal, same top-k sets."""
    cfg = _tiny(32, 4, 3, 16, True)
    m, g = _build(cfg, 7)
    m = m.to(torch.bfloat16)
    x = torch.randn(T, cfg.hidden_size, generator=g).bfloat16()
    q_lora = torch.randn(T, cfg.q_lora_rank, generator=g).bfloat16()
    pos = torch.arange(T)
    captured = {}
    m.scorer.register_forward_hook(lambda mod, a, out: captured.update(scores=out[0], k=a[1][0]))
    with torch.no_grad():
        hf_idx = m(x[None], q_lora[None], pos[None], None, 0)[0]
        k, s = _reference(m, cfg, x, q_lora, pos)
    assert k.dtype == torch.bfloat16 and torch.equal(k, captured["k"])
    vis = R.visibility_mask(T, T // 4)
    torch.testing.assert_close(s[vis], captured["scores"][vis], rtol=1e-5, atol=1e-5)
    ours = R.topk_indices(s, cfg.index_topk, (pos + 1) // 4)
    for t in range(T):
        assert sorted(i for i in ours[t].tolist() if i >= 0) == sorted(
            i for i in hf_idx[t].tolist() if i >= 0
        )
