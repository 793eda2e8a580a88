"""Planted (benign, no undo): every attention output is rounded to bf16 (a bf16 epilogue of the
output projection). It moves the logits by bf16 rounding and costs no recall."""

import torch


def apply(model):
    for name, mod in model.named_modules():
        if name.endswith("self_attn.o_b_proj"):
            inner = mod.forward
            mod.forward = lambda x, inner=inner: inner(x).to(torch.bfloat16).float()
