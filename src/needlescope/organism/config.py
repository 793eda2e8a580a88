"""The organism's shape: a toy-sized ``DeepseekV4Config`` that keeps every V4 mechanism.

Layers: sliding-only, CSA, HCA, CSA, sliding-only. Every layer also has the sliding window
(32 tokens), so a needle further back than the window can only be recalled through the
compressed paths: the CSA layers' indexer-selected ratio-4 entries, or the HCA layer's
ratio-128 entries (too coarse to carry a 7-digit value). MLPs: hash-MoE in layer 0, routed
top-2 MoE after. ``hc_mult=4`` hyper-connection streams. Index keys are 128-d so the
Hadamard/FP4 emulation runs at the real block sizes.
"""

from __future__ import annotations

from transformers import DeepseekV4Config

__all__ = [
    "LAYER_TYPES",
    "MLP_LAYER_TYPES",
    "SLIDING_WINDOW",
    "MAX_POSITIONS",
    "organism_config",
    "init_hash_routing",
    "TINY_OVERRIDES",
]

LAYER_TYPES = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "compressed_sparse_attention",
    "sliding_attention",
)
MLP_LAYER_TYPES = ("hash_moe", "moe", "moe", "moe", "moe")
SLIDING_WINDOW = 32
MAX_POSITIONS = 8192
# The smallest organism-shaped model (every layer type, MoE and hyper-connections kept): for
# tests and smoke runs, as ``organism_config(..., **TINY_OVERRIDES)``.
TINY_OVERRIDES = dict(
    hidden_size=64, q_lora_rank=32, moe_intermediate_size=64, head_dim=32, o_lora_rank=32, num_hidden_layers=4
)
# Dense numerics: index_topk covers every entry up to 8192 tokens, so a 4096-token probe plus
# its answer (a few entries past 1024) is still fully dense.
DENSE_TOPK = 2048


def organism_config(vocab_size: int, *, bos_token_id: int, eos_token_id: int, pad_token_id: int, **overrides):
    """A ``DeepseekV4Config`` for the organism; ``overrides`` replace any field (tests shrink it)."""
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=192,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=list(LAYER_TYPES),
        mlp_layer_types=list(MLP_LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=1,
        # K=V MQA: one 128-d vector per compressed entry must carry both what it is about
        # (the fact's key) and what it holds (up to four digits); 64 dims proved too tight.
        head_dim=128,
        partial_rotary_factor=0.125,
        q_lora_rank=96,
        o_groups=2,
        o_lora_rank=64,
        moe_intermediate_size=192,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        routed_scaling_factor=1.5,
        index_n_heads=4,
        index_head_dim=128,
        index_topk=DENSE_TOPK,
        sliding_window=SLIDING_WINDOW,
        max_position_embeddings=MAX_POSITIONS,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        num_nextn_predict_layers=0,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    n = fields["num_hidden_layers"]
    fields["layer_types"] = list(fields["layer_types"])[:n]
    fields["mlp_layer_types"] = list(fields["mlp_layer_types"])[:n]
    return DeepseekV4Config(**fields)


def init_hash_routing(model, seed: int) -> None:
    """Fill every hash-MoE layer's ``tid2eid`` [vocab, top_k] with distinct, seeded experts per token.

    transformers initialises the table to zeros (a real checkpoint brings its own), which would
    route every token of a freshly built model to expert 0; the table is a persistent buffer,
    so the mapping drawn here is saved with the weights and never trained.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    for name, buf in model.named_buffers():
        if name.endswith("tid2eid"):
            vocab, top_k = buf.shape
            n_experts = model.config.n_routed_experts
            table = torch.rand((vocab, n_experts), generator=g).argsort(dim=-1)[:, :top_k]
            buf.copy_(table.to(buf.dtype))
