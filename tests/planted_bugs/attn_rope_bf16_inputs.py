"""Planted (no undo): every rotary application of the attention (queries, keys, the output's
de-rotation) reads its input in bf16 (a fused RoPE kernel with a bf16 load)."""

import sys

import torch
import transformers.models.deepseek_v4.modeling_deepseek_v4 as m


def apply(model):
    own = m.DeepseekV4Attention.forward.__code__
    for name, attn in model.named_modules():
        if not name.endswith(".self_attn"):
            continue
        inner = attn.forward

        def forward(*args, inner=inner, **kwargs):
            good = m.apply_rotary_pos_emb

            def rope(x, cos, sin, unsqueeze_dim=1):
                if sys._getframe(1).f_code is own:  # not the compressor's or the indexer's
                    x = x.to(torch.bfloat16).to(x.dtype)
                return good(x, cos, sin, unsqueeze_dim)

            m.apply_rotary_pos_emb = rope
            try:
                return inner(*args, **kwargs)
            finally:
                m.apply_rotary_pos_emb = good

        attn.forward = forward
