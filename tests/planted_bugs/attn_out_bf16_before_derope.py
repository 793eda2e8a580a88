"""Planted (no undo): the attention kernel stores its output in bf16; the attention then
de-rotates the rope slice of that rounded output (``apply_rotary_pos_emb`` with ``-sin``) in
fp32 and projects it. The rounding sits inside ``self_attn``'s own code, before its rotary
application, so neither the rounded tensor nor what the projection reads is a rounding of
anything a hook sees."""

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
                if sys._getframe(1).f_code is own:  # the attention's own calls: q, kv, then its output
                    calls.append(1)
                    if len(calls) == 3:
                        x = x.to(torch.bfloat16).to(x.dtype)
                return good(x, cos, sin, unsqueeze_dim)

            m.apply_rotary_pos_emb = rope
            try:
                return inner(*args, **kwargs)
            finally:
                m.apply_rotary_pos_emb = good

        attn.forward = forward
