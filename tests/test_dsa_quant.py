"""Fake-quant formats, the quantizer registry and top-k properties of needlescope.dsa."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from needlescope.dsa import quant as Q  # noqa: E402
from needlescope.dsa import reference as R  # noqa: E402
from needlescope.errors import BadInput  # noqa: E402

FAST = settings(max_examples=40, deadline=None)


def _rand(seed: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_fp8_equals_cast_through_e4m3fn():
    x = _rand(0, 5, 128, scale=3.0)
    s = x.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448
    expect = (x / s).to(torch.float8_e4m3fn).float() * s
    assert torch.equal(Q.get_quantizer("fp8_e4m3")(x), expect)


def test_fp8_block128_scales_per_block():
    x = _rand(1, 3, 256)
    x[:, 128:] *= 1000.0
    out = Q.quantize_fp8_e4m3_block128(x)
    torch.testing.assert_close(out[:, :128], Q.quantize_fp8_e4m3(x[:, :128]), rtol=0, atol=0)
    torch.testing.assert_close(out[:, 128:], Q.quantize_fp8_e4m3(x[:, 128:]), rtol=0, atol=0)
    with pytest.raises(BadInput):
        Q.quantize_fp8_e4m3_block128(torch.ones(2, 100))


def test_casts_round_trip_dtype():
    x = _rand(2, 4, 64)
    for name in ("fp32", "bf16", "fp16"):
        y = Q.get_quantizer(name)(x)
        assert y.dtype == x.dtype and y.shape == x.shape
    assert torch.equal(Q.get_quantizer("bf16")(x), x.to(torch.bfloat16).float())


def test_unknown_quantizer_suggests():
    with pytest.raises(BadInput, match=r"Did you mean 'fp8_e4m3'.*Available: fp32"):
        Q.get_quantizer("fp8_e4m")
    with pytest.raises(BadInput, match="Available"):
        Q.get_quantizer("zzz")


@pytest.mark.parametrize("name", list(Q.QUANTIZERS))
def test_all_zero_rows_no_nan(name):
    x = torch.zeros(3, 128)
    y = Q.get_quantizer(name)(x)
    assert torch.equal(y, x)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e4m3_block128", "fp4_e2m1"])
def test_huge_outliers_finite_and_scaled(name):
    x = _rand(3, 4, 128)
    x[:, 7] = 1e30
    y = Q.get_quantizer(name)(x)
    assert torch.isfinite(y).all()
    # the scale follows the outlier: it maps to the format's top code
    rtol = 0.2 if name == "fp4_e2m1" else 1e-6
    assert torch.allclose(y[:, 7], x[:, 7], rtol=rtol)


def test_fp8_scale_values():
    x = torch.zeros(2, 8)
    x[0, 3] = -896.0
    s = Q.fp8_scale(x)
    assert s[0, 0].item() == 2.0 and s[1, 0].item() == pytest.approx(1e-4 / 448)


@FAST
@given(st.integers(0, 10_000), st.floats(1e-3, 1e6))
def test_fp4_values_on_grid_times_power_of_two(seed, mag):
    x = _rand(seed, 2, 64, scale=mag)
    y = Q.quantize_fp4_e2m1(x).view(2, 2, 32)
    amax = x.view(2, 2, 32).abs().amax(-1, keepdim=True).clamp_min(1e-4)
    s = torch.exp2(torch.ceil(torch.log2(amax / 6)))
    assert torch.equal(torch.log2(s), torch.log2(s).round())  # power of two
    codes = (y / s).abs()
    grid = torch.tensor(Q.FP4_GRID)
    assert torch.isin(codes, grid).all()
    # nearest grid point: error at most half the local step (<= 1 at the top)
    assert ((y - x.view(2, 2, 32)).abs() <= s * 1.0 + 1e-6 * mag).all()


def test_hadamard_orthonormal_involution():
    x = _rand(4, 3, 128)
    h = Q.hadamard_128(x)
    torch.testing.assert_close(Q.hadamard_128(h), x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h @ h.t(), x @ x.t(), rtol=1e-4, atol=1e-4)
    e = torch.zeros(128)
    e[0] = 1
    torch.testing.assert_close(Q.hadamard_128(e), torch.full((128,), 128**-0.5))


def test_query_fp8_per_head_folds_scale():
    q, k, w = _rand(5, 6, 4, 128), _rand(6, 3, 128), _rand(7, 6, 4)
    q_hat, w_f = Q.quantize_query_fp8_per_head(q, w)
    assert q_hat.abs().max() <= 448
    deq = Q.quantize_fp8_e4m3(q)
    a = R.indexer_scores(q_hat, k, w_f, scale=0.1, ratio=1)
    b = R.indexer_scores(deq, k, w, scale=0.1, ratio=1)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@FAST
@given(st.integers(0, 10_000), st.integers(1, 40), st.integers(1, 12), st.integers(0, 12), st.integers(1, 5))
def test_topk_monotone_in_k_distinct(seed, T, L, k, dk):
    scores = torch.randperm(T * L, generator=torch.Generator().manual_seed(seed)).float().view(T, L)
    vis = torch.randint(0, L + 1, (T,), generator=torch.Generator().manual_seed(seed + 1))
    small, big = R.topk_indices(scores, k, vis), R.topk_indices(scores, k + dk, vis)
    assert small.shape == (T, k) and big.shape == (T, k + dk)
    for t in range(T):
        a = {i for i in small[t].tolist() if i != R.NO_ENTRY}
        b = {i for i in big[t].tolist() if i != R.NO_ENTRY}
        assert a <= b
        assert len(a) == min(k, int(vis[t])) and len(b) == min(k + dk, int(vis[t]))


@FAST
@given(st.integers(0, 10_000), st.integers(1, 40), st.integers(1, 12), st.integers(0, 12))
def test_topk_monotone_in_k_with_ties(seed, T, L, k):
    scores = _rand(seed, T, L).round(decimals=1)  # force ties
    vis = torch.randint(0, L + 1, (T,), generator=torch.Generator().manual_seed(seed))
    small = R.topk_indices(scores, k, vis)
    big = R.topk_indices(scores, k + 3, vis)
    for t in range(T):
        a = {i for i in small[t].tolist() if i >= 0}
        b = {i for i in big[t].tolist() if i >= 0}
        assert len(a) == min(k, int(vis[t]))
        assert all(i < int(vis[t]) for i in b)
        # ties may swap members; compare by score threshold instead of identity
        if a - b:
            assert max(scores[t, list(a - b)]) <= min(scores[t, list(b)])


@FAST
@given(st.integers(0, 10_000), st.integers(1, 50))
def test_scores_visibility_rule(seed, T):
    L = max(T // 4, 1)
    s = R.indexer_scores(_rand(seed, T, 2, 8), _rand(seed + 1, L, 8), _rand(seed + 2, T, 2), scale=1.0)
    assert torch.equal(torch.isfinite(s), R.visibility_mask(T, L))
    assert not torch.isnan(s).any()
