"""Tiny random checkpoints for tests and bench: organism-shaped DeepSeek-V4, saved as safetensors."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DeepseekV4ForCausalLM

from needlescope.dsa.checkpoint import quiet_transformers
from needlescope.organism.config import init_hash_routing, organism_config
from needlescope.organism.tokenizer import build_tokenizer

__all__ = ["TINY_SERVE", "save_random"]

# The smallest organism-shaped model the serving tests run: fast on CPU, a 512-token context.
TINY_SERVE = dict(
    hidden_size=64,
    q_lora_rank=32,
    o_lora_rank=32,
    moe_intermediate_size=64,
    index_topk=8,
    max_position_embeddings=512,
)


def save_random(out: str | Path, *, seed: int = 0, **config_overrides) -> Path:
    """Save a randomly initialised organism-shaped checkpoint to ``out``; returns ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = organism_config(
        len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **config_overrides,
    )
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(config)
    init_hash_routing(model, seed)
    with quiet_transformers():
        model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
