"""Write a random DeepSeek-V4-Flash-shaped checkpoint in the public release's layout and formats.

``write_flash_checkpoint(dir, layers=4, fmt="fp8")`` writes what a user who downloaded
DeepSeek-V4-Flash has on disk, with random weights and fewer layers: a ``config.json`` in the
release's own schema (``compress_ratios``, ``num_hash_layers``, ``quantization_config`` with
``fmt "e4m3"``, ``scale_fmt "ue8m0"``, ``weight_block_size [128, 128]``), safetensors shards
``model-0000K-of-0000N.safetensors`` with DeepSeek's tensor names (``embed.weight``,
``layers.{i}.attn.wq_a.weight`` + ``.scale``, ``layers.{i}.ffn.experts.{e}.w1.weight`` + ``.scale``,
...) and ``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``).
``fmt="bf16"`` is the same layout with every projection in bf16 and no ``.scale`` tensors (and no
``quantization_config``). docs/scale.md names the sources of the layout and what differs from
the release (routed experts in block fp8 unless ``experts="fp4"`` asks for the release's packed
fp4, no MTP block, the organism's
tokenizer and chat template so that prompts render offline).

``FLASH`` holds Flash's widths; ``layers=4`` gives the SWA, CSA, HCA, CSA schedule of the
issue (about 27B parameters: 256 routed experts x 3 x 4096 x 2048 per layer dominate).
``overrides`` shrinks any width for CPU tests; tensors are generated on ``device`` one at a
time, so a GPU writes the full-width checkpoint at disk speed.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from needlescope.dsa.blockfp4 import quantize_block_fp4
from needlescope.dsa.blockfp8 import quantize_block_fp8
from needlescope.dsa.checkpoint import shipped_dir
from needlescope.dsa.release import quantized

__all__ = ["FLASH", "TEST_WIDTHS", "flash_config", "release_tensors", "write_flash_checkpoint"]

# DeepSeek-V4-Flash's config.json values (docs/scale.md gives the sources).
FLASH: dict = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "hc_eps": 1e-06,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "head_dim": 512,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 512,
    "initializer_range": 0.02,
    "max_position_embeddings": 1048576,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts_per_tok": 6,
    "num_hash_layers": 3,
    "num_key_value_heads": 1,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "q_lora_rank": 1024,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "sliding_window": 128,
    "swiglu_limit": 10.0,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 129280,
}
FP8_QUANTIZATION = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}
# Flash's layout and formats at widths a CPU test can afford: 128-wide where the fp8 blocks
# should be whole, odd elsewhere so that partial blocks are exercised.
TEST_WIDTHS: dict = {
    "hidden_size": 128,
    "num_attention_heads": 2,
    "head_dim": 128,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 96,
    "o_groups": 2,
    "o_lora_rank": 80,
    "index_n_heads": 2,
    "index_head_dim": 64,
    "index_topk": 8,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "vocab_size": 3120,
    "sliding_window": 16,
}
# Flash's schedule is [0, 0, 4, 128, 4, 128, ...]; a short checkpoint keeps one of each kind.
SHORT_SCHEDULES = {1: [4], 2: [0, 4], 3: [0, 4, 128], 4: [0, 4, 128, 4]}


def flash_config(
    layers: int = 4, fmt: str = "fp8", overrides: dict | None = None, experts: str | None = None
) -> dict:
    """The release-schema config.json of a ``layers``-layer Flash-shaped checkpoint.

    ``experts``: the routed experts' format, ``"fp4"`` (the release's) or the checkpoint's ``fmt``
    (None); recorded as ``expert_dtype``."""
    if fmt not in ("fp8", "bf16"):
        raise ValueError(f"fmt must be 'fp8' or 'bf16', got {fmt!r}")
    if experts not in (None, fmt, "fp4"):
        raise ValueError(f"experts must be 'fp4' or the checkpoint's fmt {fmt!r}, got {experts!r}")
    if layers in SHORT_SCHEDULES:
        ratios = SHORT_SCHEDULES[layers]
    else:
        ratios = ([0, 0] + [4, 128] * layers)[:layers]
    cfg = {**FLASH, "num_hidden_layers": layers, "compress_ratios": ratios, "num_nextn_predict_layers": 0}
    if fmt == "fp8":
        cfg["quantization_config"] = dict(FP8_QUANTIZATION)
    cfg["expert_dtype"] = experts or fmt
    cfg.update(overrides or {})
    return cfg


def release_tensors(cfg: dict) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(release name, shape, kind) of every tensor, in file order. kind: ``linear`` (random
    weight, block fp8 in the fp8 format), ``ones`` / ``zeros`` / ``small`` (norms, biases, hyper-
    connection weights), ``tid2eid`` (the hash router's token -> experts table)."""
    H, V, m = cfg["hidden_size"], cfg["vocab_size"], cfg["hc_mult"]
    nh, hd, ql = cfg["num_attention_heads"], cfg["head_dim"], cfg["q_lora_rank"]
    g, r = cfg["o_groups"], cfg["o_lora_rank"]
    ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
    E, inter, k = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
    yield "embed.weight", (V, H), "small"
    for i, ratio in enumerate(cfg["compress_ratios"][: cfg["num_hidden_layers"]]):
        p = f"layers.{i}"
        yield from (
            (f"{p}.attn_norm.weight", (H,), "ones"),
            (f"{p}.attn.wq_a.weight", (ql, H), "linear"),
            (f"{p}.attn.q_norm.weight", (ql,), "ones"),
            (f"{p}.attn.wq_b.weight", (nh * hd, ql), "linear"),
            (f"{p}.attn.wkv.weight", (hd, H), "linear"),
            (f"{p}.attn.kv_norm.weight", (hd,), "ones"),
            (f"{p}.attn.wo_a.weight", (g * r, nh * hd // g), "linear"),
            (f"{p}.attn.wo_b.weight", (H, g * r), "linear"),
            (f"{p}.attn.attn_sink", (nh,), "zeros"),
        )
        if ratio:
            width = 2 * hd if ratio == 4 else hd
            yield from _compressor(f"{p}.attn.compressor", width, hd, ratio, H)
        if ratio == 4:
            yield f"{p}.attn.indexer.wq_b.weight", (ih * idim, ql), "linear"
            yield f"{p}.attn.indexer.weights_proj.weight", (ih, H), "small"
            yield from _compressor(f"{p}.attn.indexer.compressor", 2 * idim, idim, 4, H)
        for block in ("attn", "ffn"):
            yield f"{p}.hc_{block}_fn", ((2 + m) * m, m * H), "small"
            yield f"{p}.hc_{block}_base", ((2 + m) * m,), "zeros"
            yield f"{p}.hc_{block}_scale", (3,), "ones"
        yield f"{p}.ffn_norm.weight", (H,), "ones"
        yield f"{p}.ffn.gate.weight", (E, H), "small"
        if i < cfg["num_hash_layers"]:
            yield f"{p}.ffn.gate.tid2eid", (V, k), "tid2eid"
        else:
            yield f"{p}.ffn.gate.bias", (E,), "zeros"
        for who in ["shared_experts"] + [f"experts.{e}" for e in range(E)]:
            yield f"{p}.ffn.{who}.w1.weight", (inter, H), "linear"
            yield f"{p}.ffn.{who}.w2.weight", (H, inter), "linear"
            yield f"{p}.ffn.{who}.w3.weight", (inter, H), "linear"
    yield "norm.weight", (H,), "ones"
    yield "hc_head_fn", (m, m * H), "small"
    yield "hc_head_base", (m,), "zeros"
    yield "hc_head_scale", (1,), "ones"
    yield "head.weight", (V, H), "small"


def _compressor(prefix: str, width: int, out: int, ratio: int, H: int):
    yield f"{prefix}.wkv.weight", (width, H), "small"
    yield f"{prefix}.wgate.weight", (width, H), "small"
    yield f"{prefix}.ape", (ratio, width), "zeros"
    yield f"{prefix}.norm.weight", (out,), "ones"


def _make(name: str, shape, kind: str, cfg: dict, gen: torch.Generator, device: str) -> torch.Tensor:
    if kind == "ones":
        return torch.ones(shape, dtype=torch.float32, device=device)
    if kind == "zeros":
        return torch.zeros(shape, dtype=torch.float32, device=device)
    if kind == "tid2eid":
        E = cfg["n_routed_experts"]
        scores = torch.rand((shape[0], E), generator=gen, device=device)
        return scores.topk(shape[1], dim=-1).indices.to(torch.int32)  # distinct experts per token
    std = cfg["initializer_range"] if kind == "small" else shape[-1] ** -0.5
    w = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(std)
    return w if ".hc_" in name or name.startswith("hc_") else w.to(torch.bfloat16)  # mHC stays fp32


def write_flash_checkpoint(
    out: str | Path,
    *,
    layers: int = 4,
    fmt: str = "fp8",
    seed: int = 0,
    device: str = "cpu",
    overrides: dict | None = None,
    shard_bytes: int = 4 << 30,
    experts: str | None = None,
) -> dict:
    """Write the checkpoint to ``out`` (created; must be empty or absent); returns a summary
    ``{"path", "fmt", "experts", "layers", "tensors", "total_size", "shards", "parameters"}``.

    ``experts="fp4"``: routed experts packed e2m1 with a UE8M0 scale per 32 inputs, as the
    release ships them (``dsa.blockfp4``); None: in ``fmt`` like every other projection."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; the writer does not overwrite checkpoints")
    cfg = flash_config(layers, fmt, overrides, experts)
    gen = torch.Generator(device=device).manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    files: list[tuple[Path, list[str]]] = []
    size = params = shard_size = 0

    def flush() -> None:
        tmp = out / f".shard-{len(files) + 1}.safetensors"
        save_file(shard, str(tmp), metadata={"format": "pt"})
        files.append((tmp, list(shard)))
        shard.clear()

    for name, shape, kind in release_tensors(cfg):
        t = _make(name, shape, kind, cfg, gen, device)
        params += t.numel()
        pieces = {name: t}
        if cfg["expert_dtype"] == "fp4" and ".ffn.experts." in name:
            q, scale = quantize_block_fp4(t)
            pieces = {name: q, name.removesuffix(".weight") + ".scale": scale}
        elif fmt == "fp8" and quantized(name):
            q, scale = quantize_block_fp8(t)
            pieces = {name: q, name.removesuffix(".weight") + ".scale": scale}
        for n, v in pieces.items():
            v = v.contiguous().cpu()
            nbytes = v.numel() * v.element_size()
            if shard_size and shard_size + nbytes > shard_bytes:
                flush()
                shard_size = 0
            shard[n] = v
            shard_size += nbytes
            size += nbytes
    flush()
    weight_map = {}
    for i, (tmp, names) in enumerate(files, 1):
        file = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        tmp.rename(out / file)
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": size}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in shipped_dir().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return {
        "path": str(out),
        "fmt": fmt,
        "experts": cfg["expert_dtype"],
        "layers": layers,
        "tensors": len(weight_map),
        "total_size": size,
        "shards": len(files),
        "parameters": params,
    }
