"""Planted (no undo): the attention's de-rotated output (its rotary application with ``-sin``)
is stored in bf16 before the grouped output projection reads it."""

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
            calls = []

            def rope(x, cos, sin, unsqueeze_dim=1):
                out = good(x, cos, sin, unsqueeze_dim)
                if sys._getframe(1).f_code is own:  # the attention's own calls: q, kv, then its output
                    calls.append(1)
                    if len(calls) == 3:
                        out = out.to(torch.bfloat16).to(out.dtype)
                return out

            m.apply_rotary_pos_emb = rope
            try:
                return inner(*args, **kwargs)
            finally:
                m.apply_rotary_pos_emb = good

        attn.forward = forward
