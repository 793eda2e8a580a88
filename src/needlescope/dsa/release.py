"""DeepSeek-V4's release checkpoint layout: tensor names, block-fp8 weights, and their transformers names.

The public DeepSeek-V4-Flash release (huggingface.co/deepseek-ai/DeepSeek-V4-Flash) is not in
transformers' layout: its ``config.json`` carries ``compress_ratios`` (0 / 4 / 128 per layer),
``num_hash_layers`` and a ``quantization_config`` (``quant_method "fp8"``, ``fmt "e4m3"``,
``scale_fmt "ue8m0"``, ``weight_block_size [128, 128]``), and ``model.safetensors.index.json``
maps DeepSeek's own names (``layers.{i}.attn.wq_a.weight`` with its ``.scale``,
``layers.{i}.ffn.experts.{e}.w1.weight`` per expert, ``embed.weight``, ``head.weight``, ...) to
shards. docs/scale.md lists the sources and what our writer reproduces.

``hf_name`` maps a release name to the transformers module path: the same renames transformers
5.23 applies in its ``conversion_mapping`` for ``deepseek_v4`` (so a checkpoint either library
loads means the same model). Routed experts are per-expert matrices in the release and one
stacked parameter per layer in transformers (``gate_up_proj`` [E, 2I, H] = w1 over w3,
``down_proj`` [E, H, I] = w2); ``expert_slot`` says where each expert matrix goes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "SCALE_SUFFIX",
    "ExpertSlot",
    "QUANTIZED_PROJECTIONS",
    "expert_slot",
    "hf_name",
    "is_release_layout",
    "quantized",
]

SCALE_SUFFIX = ".scale"
"""A block-fp8 weight ``X.weight`` has its scales in ``X.scale`` (float8_e8m0fnu in the release)."""

# Release projections stored as block fp8 with a scale; everything else (norms, compressor and
# indexer wkv/wgate/weights_proj, hyper-connections, router, embeddings, head) is bf16/fp32.
QUANTIZED_PROJECTIONS = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b")

# Ordered (pattern, replacement) pairs, applied in turn: transformers 5.23 conversion_mapping["deepseek_v4"].
_RENAMES: tuple[tuple[str, str], ...] = (
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight$", "embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^hc_head_fn$", "hc_head.hc_fn"),
    (r"^hc_head_base$", "hc_head.hc_base"),
    (r"^hc_head_scale$", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn$", ".attn_hc.fn"),
    (r"\.hc_attn_base$", ".attn_hc.base"),
    (r"\.hc_attn_scale$", ".attn_hc.scale"),
    (r"\.hc_ffn_fn$", ".ffn_hc.fn"),
    (r"\.hc_ffn_base$", ".ffn_hc.base"),
    (r"\.hc_ffn_scale$", ".ffn_hc.scale"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
)
_COMPILED = tuple((re.compile(p), r) for p, r in _RENAMES)
_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")
_TOP_LEVEL = ("lm_head.",)


def is_release_layout(names) -> bool:
    """Whether tensor ``names`` are in DeepSeek's release layout (``embed.weight``, ``layers.N.attn...``)."""
    return any(n == "embed.weight" or n.startswith("layers.") for n in names)


def quantized(name: str) -> bool:
    """Whether the release stores ``name`` (a ``.weight``) as block fp8 with a ``.scale`` beside it."""
    return name.endswith(".weight") and (
        any(f".{p}.weight" in name for p in QUANTIZED_PROJECTIONS)
        or ".ffn.shared_experts." in name
        or ".ffn.experts." in name
    )


def hf_name(name: str) -> str | None:
    """The transformers parameter/buffer path of checkpoint tensor ``name``; None for tensors
    transformers does not load (the MTP block ``mtp.*``) and for routed experts (``expert_slot``).

    Idempotent on transformers paths, and accepts the ``model.``-prefixed mix that transformers
    5.23's ``save_pretrained`` writes (it reverses its renames inside the layers).
    """
    name = name.removeprefix("model.")
    if name.startswith("mtp.") or _EXPERT.match(name):
        return None
    out = name
    for pattern, repl in _COMPILED:
        out = pattern.sub(repl, out)
    return out if out.startswith(_TOP_LEVEL) else f"model.{out}"


@dataclass(frozen=True)
class ExpertSlot:
    """Where one release expert matrix lands: ``param[expert, rows]`` of a stacked parameter."""

    param: str  # transformers path of the stacked parameter
    expert: int
    rows: slice | None  # rows of gate_up_proj (w1 first half, w3 second half); None: the whole matrix


def expert_slot(name: str, intermediate: int) -> ExpertSlot | None:
    """The stacked-parameter slot of a routed-expert weight ``layers.L.ffn.experts.E.wK.weight``
    (None for any other name). ``intermediate``: the config's ``moe_intermediate_size``."""
    m = _EXPERT.match(name.removeprefix("model."))
    if m is None:
        return None
    layer, expert, w = int(m.group(1)), int(m.group(2)), m.group(3)
    prefix = f"model.layers.{layer}.mlp.experts."
    if w == "w2":
        return ExpertSlot(prefix + "down_proj", expert, None)
    rows = slice(0, intermediate) if w == "w1" else slice(intermediate, 2 * intermediate)
    return ExpertSlot(prefix + "gate_up_proj", expert, rows)
