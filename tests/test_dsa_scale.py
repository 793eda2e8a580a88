"""Deployment-scale loading on the CPU: block-fp8 dequantization, the release layout, the
Flash-shaped checkpoint writer, placement across two "devices" and refusal before loading."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from safetensors import safe_open  # noqa: E402

from needlescope.dsa.blockfp8 import dequantize_block_fp8, quantize_block_fp8, scale_shape  # noqa: E402
from needlescope.dsa.checkpoint import load_bundle  # noqa: E402
from needlescope.dsa.loading import placement_of  # noqa: E402
from needlescope.dsa.passes import prefill  # noqa: E402
from needlescope.dsa.placement import GiB, parse_max_memory, plan_placement, unit_bytes  # noqa: E402
from needlescope.dsa.release import expert_slot, hf_name  # noqa: E402
from needlescope.errors import BadInput  # noqa: E402
from needlescope.testing.flash import TEST_WIDTHS, flash_config, write_flash_checkpoint  # noqa: E402

TINY = TEST_WIDTHS


# ---------------------------------------------------------------- block fp8


def _reference_dequant(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Element by element, in float64: q[i, j] * scale[i // block, j // block]."""
    out = torch.empty(q.shape, dtype=torch.float64)
    qf, sf = q.double(), scale.double()
    for i in range(q.shape[0]):
        for bj in range(scale.shape[1]):
            cols = slice(bj * block, min((bj + 1) * block, q.shape[1]))
            out[i, cols] = qf[i, cols] * sf[i // block, bj]
    return out


@pytest.mark.parametrize("shape", [(128, 256), (200, 300), (7, 129)])
@pytest.mark.parametrize("scale_fmt", ["ue8m0", "fp32"])
def test_block_fp8_round_trip_against_a_float_reference(shape, scale_fmt):
    gen = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=gen) * torch.logspace(-3, 1, shape[1])  # blocks of very different ranges
    q, scale = quantize_block_fp8(w, scale_fmt=scale_fmt)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert tuple(scale.shape) == scale_shape(shape) == (-(-shape[0] // 128), -(-shape[1] // 128))
    if scale_fmt == "ue8m0":
        assert scale.dtype == torch.float8_e8m0fnu
        assert torch.equal(torch.exp2(torch.log2(scale.float()).round()), scale.float())  # powers of two
    deq = dequantize_block_fp8(q, scale, dtype=torch.float32)
    assert torch.equal(deq, _reference_dequant(q, scale).float())  # one correctly rounded product
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 above the subnormal range, whose spacing is 2^-9.
    per_elem_scale = _reference_dequant(torch.ones_like(q, dtype=torch.float32), scale)
    bound = w.double().abs() * 2**-4 + per_elem_scale * 2**-9
    assert bool(((deq.double() - w.double()).abs() <= bound).all())
    assert float(q.float().abs().max()) <= 448.0


def test_block_fp8_bad_shapes_are_refused():
    q, scale = quantize_block_fp8(torch.randn(130, 260))
    with pytest.raises(ValueError, match=r"needs a scale of shape \(2, 3\)"):
        dequantize_block_fp8(q, scale[:, :2])
    with pytest.raises(ValueError, match="2-D"):
        quantize_block_fp8(torch.randn(4, 4, 4))
    zero_q, zero_scale = quantize_block_fp8(torch.zeros(3, 3))
    assert torch.equal(dequantize_block_fp8(zero_q, zero_scale, dtype=torch.float32), torch.zeros(3, 3))


# ---------------------------------------------------------------- release names


def test_release_names_map_to_transformers_paths():
    assert hf_name("embed.weight") == "model.embed_tokens.weight"
    assert hf_name("head.weight") == "lm_head.weight"
    assert hf_name("layers.2.attn.wq_b.weight") == "model.layers.2.self_attn.q_b_proj.weight"
    assert (
        hf_name("layers.2.attn.indexer.wq_b.weight")
        == "model.layers.2.self_attn.compressor.indexer.q_b_proj.weight"
    )
    assert (
        hf_name("layers.2.attn.indexer.compressor.ape")
        == "model.layers.2.self_attn.compressor.indexer.position_bias"
    )
    assert (
        hf_name("layers.3.attn.compressor.norm.weight")
        == "model.layers.3.self_attn.compressor.kv_norm.weight"
    )
    assert hf_name("layers.0.hc_ffn_fn") == "model.layers.0.ffn_hc.fn"
    assert hf_name("layers.5.ffn.gate.bias") == "model.layers.5.mlp.gate.e_score_correction_bias"
    assert hf_name("mtp.0.enorm.weight") is None and hf_name("layers.1.ffn.experts.7.w2.weight") is None
    # transformers paths (and the model.-prefixed mix save_pretrained writes) come back unchanged / mapped
    for name in ("model.layers.1.self_attn.compressor.indexer.q_b_proj.weight", "model.norm.weight"):
        assert hf_name(name) == name
    assert hf_name("model.layers.1.attn.wkv.weight") == "model.layers.1.self_attn.kv_proj.weight"
    slot = expert_slot("layers.1.ffn.experts.3.w3.weight", 200)
    assert (slot.param, slot.expert, slot.rows) == (
        "model.layers.1.mlp.experts.gate_up_proj",
        3,
        slice(200, 400),
    )
    assert expert_slot("layers.1.ffn.experts.3.w2.weight", 200).rows is None


# ---------------------------------------------------------------- writer and loader


@pytest.fixture(scope="module")
def flash_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("flash")
    return {
        fmt: (root / fmt, write_flash_checkpoint(root / fmt, fmt=fmt, overrides=TINY, shard_bytes=1 << 20))
        for fmt in ("fp8", "bf16")
    }


def test_the_writer_follows_the_release_layout(flash_dirs):
    path, summary = flash_dirs["fp8"]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["compress_ratios"] == [0, 4, 128, 4] and cfg["num_hash_layers"] == 3
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    assert cfg["quantization_config"]["scale_fmt"] == "ue8m0"
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(path.glob("model-*-of-*.safetensors"))
    assert summary["shards"] == len(files) > 1 and {p.name for p in files} == set(
        index["weight_map"].values()
    )
    seen, size = {}, 0
    for f in files:
        with safe_open(f, framework="pt") as h:
            for k in h.keys():
                t = h.get_tensor(k)
                seen[k] = t.dtype
                size += t.numel() * t.element_size()
                assert index["weight_map"][k] == f.name
    assert set(seen) == set(index["weight_map"]) and index["metadata"]["total_size"] == size
    assert seen["layers.1.attn.wq_a.weight"] == torch.float8_e4m3fn
    assert seen["layers.1.attn.wq_a.scale"] == torch.float8_e8m0fnu
    assert seen["layers.1.ffn.experts.3.w2.scale"] == torch.float8_e8m0fnu
    assert seen["layers.1.attn.indexer.compressor.wkv.weight"] == torch.bfloat16  # shipped unquantized
    assert "layers.0.ffn.gate.tid2eid" in seen and "layers.3.ffn.gate.bias" in seen
    bf16 = json.loads((flash_dirs["bf16"][0] / "config.json").read_text())
    assert "quantization_config" not in bf16 and not any(
        k.endswith(".scale")
        for k in json.loads((flash_dirs["bf16"][0] / "model.safetensors.index.json").read_text())[
            "weight_map"
        ]
    )
    with pytest.raises(FileExistsError):
        write_flash_checkpoint(path, overrides=TINY)


def test_fp8_checkpoint_loads_dequantized_and_equals_transformers_own_loader(flash_dirs):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    path, _ = flash_dirs["fp8"]
    ours, tok, _ = load_bundle(path)
    assert placement_of(ours) is not None and ours.model.embed_tokens.weight.dtype == torch.bfloat16
    with safe_open(next(iter(sorted(path.glob("*.safetensors")))), framework="pt") as h:
        name = next(k for k in h.keys() if k.endswith("attn.wq_a.weight"))
        want = dequantize_block_fp8(h.get_tensor(name), h.get_tensor(name.replace(".weight", ".scale")))
    assert torch.equal(ours.get_parameter(hf_name(name)), want)
    theirs = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", quantization_config=FineGrainedFP8Config(dequantize=True)
    )
    a, b = ours.state_dict(), theirs.state_dict()
    assert set(a) == set(b)
    assert all(torch.equal(a[k], b[k].to(a[k].dtype)) for k in a)


def test_bf16_checkpoint_equals_transformers_and_runs_chunked(flash_dirs):
    from transformers import AutoModelForCausalLM

    path, _ = flash_dirs["bf16"]
    ours, _, _ = load_bundle(path)
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager")
    a, b = ours.state_dict(), theirs.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    ids = torch.randint(3, 3000, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = prefill(ours, ids, chunk=64, logits_at=[299]).logits
    assert got.shape == (1, 1, 3120) and bool(torch.isfinite(got).all())


# ---------------------------------------------------------------- placement


def test_organism_split_over_two_devices_gives_the_same_logits():
    one, _, _ = load_bundle("organism")
    sizes = unit_bytes(one)
    total = sum(n for _, n in sizes)
    two, _, _ = load_bundle("organism", device="cpu,cpu", max_memory=str(int(total * 0.6)))
    report = placement_of(two).report()
    used = [d["weight_bytes"] for d in report["devices"]]
    assert len(used) == 2 and all(u > 0 for u in used) and sum(used) == total == report["total_weight_bytes"]
    assert (
        report["devices"][0]["units"][0] == "model.embed_tokens"
        and "lm_head" in report["devices"][1]["units"]
    )
    assert all(u <= int(total * 0.6) for u in used)
    ids = torch.randint(3, 3000, (1, 400), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a = prefill(one, ids, chunk=100, logits_at=[399, 17]).logits
        b = prefill(two, ids, chunk=100, logits_at=[399, 17]).logits
    assert torch.equal(a, b)


def test_a_checkpoint_that_does_not_fit_is_refused_before_loading(monkeypatch):
    import needlescope.dsa.loading as loading

    def no_reading(*a, **k):
        raise AssertionError("a tensor was read before the placement was checked")

    monkeypatch.setattr(loading, "load_placed", no_reading)
    with pytest.raises(BadInput, match=r"need 20\.91 MiB .* budgets are cpu: 6\.00 MiB, cpu: 6\.00 MiB"):
        load_bundle("organism", device="cpu,cpu", max_memory="6MiB")


def test_placement_math_and_memory_sizes():
    p = plan_placement([("a", 5), ("b", 5), ("c", 5)], ["d0", "d1"], [10, None])
    assert p.units == {"a": 0, "b": 0, "c": 1} and p.bytes_per_device() == [10, 5]
    with pytest.raises(BadInput, match="'b'"):
        plan_placement([("a", 5), ("b", 7)], ["d0", "d1"], [6, 6])
    assert parse_max_memory("70GiB", 2) == [70 * GiB, 70 * GiB]
    assert parse_max_memory("1.5GB,512MiB", 2) == [1_500_000_000, 512 << 20]
    assert parse_max_memory(None, 3) == [None, None, None]
    for bad in ("lots", "1GiB,2GiB,3GiB"):
        with pytest.raises(BadInput):
            parse_max_memory(bad, 2)
    assert flash_config(4)["compress_ratios"] == [0, 4, 128, 4]
