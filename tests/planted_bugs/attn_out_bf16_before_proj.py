"""Planted (benign, with undo): the attention output is rounded to bf16 before the output
projection reads it (a kernel that stores the attention output in bf16). Each output projection
(``o_a_proj``) rounds its input inside its forward, where no hook sees it. Issue 54 item 10: the
localizer named the output projection first divergent, then the same module in every other layer."""

import torch


def apply(model):
    projections = [mod.o_a_proj for name, mod in model.named_modules() if name.endswith(".self_attn")]
    for proj in projections:

        def forward(x, inner=proj.forward):
            return inner(x.to(torch.bfloat16).to(x.dtype))

        proj.forward = forward

    def undo():
        for proj in projections:
            proj.__dict__.pop("forward", None)

    return undo
