"""Planted (no undo): the attention reads its rotary tables (cos, sin) in bf16."""

import torch


def apply(model):
    for name, attn in model.named_modules():
        if not name.endswith(".self_attn"):
            continue
        inner = attn.forward

        def forward(hidden_states, position_embeddings, *args, inner=inner, **kwargs):
            tables = {
                k: tuple(t.to(torch.bfloat16).to(t.dtype) for t in v) for k, v in position_embeddings.items()
            }
            return inner(hidden_states, tables, *args, **kwargs)

        attn.forward = forward
