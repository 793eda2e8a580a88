"""Planted faults for the localizer tests: patch-file bodies, each with the module it must be pinned on.

Not shipped as built-in faults (``needlescope.dsa.faults``): they exist to check that
``indexer diff`` names the right module and exonerates benign changes. Each body is the text
of a ``--patch`` file; ``expect`` is the module ``first_divergent_module`` must name (None:
nothing may diverge), ``reduced`` the modules that must read "reduced precision, within its
rounding".
"""

from __future__ import annotations

from dataclasses import dataclass

# Layer 1 is the organism's first CSA layer; its indexer is the one these faults break.
INDEXER = "model.layers.1.self_attn.compressor.indexer"


def _under_mode(mode: str, body: str) -> str:
    """A patch body: ``body`` defines the torch function mode ``mode``; the indexer's forward runs under it."""
    return (
        body
        + f'''

def apply(model):
    idx = model.get_submodule("{INDEXER}")
    inner = idx.forward

    def forward(*args, **kwargs):
        with {mode}():
            return inner(*args, **kwargs)

    idx.forward = forward
    return lambda: idx.__dict__.pop("forward", None)
'''
    )


# The indexer's own code, between its inputs and its scorer: ropes the compressed keys (and
# queries) the wrong way round. No sub-module changes; the scorer is handed other keys.
PLAIN_CODE = f'''
import transformers.models.deepseek_v4.modeling_deepseek_v4 as m


def apply(model):
    idx = model.get_submodule("{INDEXER}")
    good_rope, inner = m.apply_rotary_pos_emb, idx.forward

    def bad_rope(x, cos, sin, unsqueeze_dim=1):
        return good_rope(x, cos, -sin, unsqueeze_dim)

    def forward(*args, **kwargs):
        m.apply_rotary_pos_emb = bad_rope
        try:
            return inner(*args, **kwargs)
        finally:
            m.apply_rotary_pos_emb = good_rope

    idx.forward = forward
    return lambda: idx.__dict__.pop("forward", None)
'''

# After the scorer, before the top-k: a "recency buffer" that boosts the last 16 visible
# entries of each row by the row's score spread, in the indexer's own code.
POST_SCORER = _under_mode(
    "Boost",
    """
import torch
from torch.overrides import TorchFunctionMode


class Boost(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.topk:
            s = args[0]
            finite = torch.isfinite(s)
            vis = finite.sum(-1, keepdim=True)
            pos = torch.arange(s.shape[-1]).view(1, 1, -1)
            span = torch.where(finite, s, 0).amax(-1, keepdim=True) - torch.where(finite, s, 0).amin(-1, keepdim=True)
            s = torch.where(finite & (pos >= vis - 16), s + span, s)
            args = (s, *args[1:])
        return func(*args, **kwargs)

""",
)

# After the top-k: the step that marks picks beyond the visible entries as -1 is off by one and
# also discards the newest visible entry. Drops one entry per row at any index_topk.
POST_TOPK_VALIDITY = _under_mode(
    "OffByOne",
    """
import torch
from torch.overrides import TorchFunctionMode


class OffByOne(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.__ge__, torch.Tensor.ge):
            self.seen += 1
            if self.seen == 2:  # the validity check, after the future mask's comparison
                return func(args[0], args[1] - 1)
        return func(*args, **(kwargs or {}))

""",
)

# Visibility off by one: each query also sees the entry that is still being compressed (a
# future entry). Adds one entry to every selection that has room; drops none where k covers all.
VISIBILITY = _under_mode(
    "Leak",
    """
import torch
from torch.overrides import TorchFunctionMode


class Leak(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.__floordiv__:
            return out + 1
        return out

""",
)

# Benign: every hyper-connection's input streams and every attention output rounded to bf16.
BF16_ROUNDING = """
import torch


def _round(x):
    return x.to(torch.bfloat16).to(x.dtype)


def apply(model):
    handles = []
    for name, mod in model.named_modules():
        if name.endswith(".attn_hc") or name.endswith(".ffn_hc"):
            handles.append(mod.register_forward_pre_hook(lambda m, args: (_round(args[0]), *args[1:])))
        if name.endswith(".self_attn"):
            handles.append(mod.register_forward_hook(lambda m, a, out: (_round(out[0]), *out[1:])))

    def undo():
        for h in handles:
            h.remove()

    return undo
"""

# Not idempotent, no undo: multiplies every router's routed scale by 1.5 in place.
ROUTED_SCALE = """
def apply(model):
    for name, mod in model.named_modules():
        if hasattr(mod, "routed_scaling_factor"):
            mod.routed_scaling_factor = mod.routed_scaling_factor * 1.5
"""


_SAME = object()


@dataclass(frozen=True)
class Planted:
    name: str
    body: str
    expect: str | None
    reduced: tuple[str, ...] = ()
    # When index_topk covers every entry, a fault that only reorders scores before the top-k
    # changes no selection: it is harmless there, and nothing may be flagged.
    expect_full_k: object = _SAME

    def expected(self, full_k: bool) -> str | None:
        return self.expect if not full_k or self.expect_full_k is _SAME else self.expect_full_k


PLANTED = (
    Planted("plain_code_in_indexer", PLAIN_CODE, INDEXER),
    Planted("post_scorer", POST_SCORER, INDEXER, expect_full_k=None),
    Planted("post_topk_validity", POST_TOPK_VALIDITY, INDEXER),
    Planted("visibility_leak", VISIBILITY, INDEXER),
    Planted(
        "bf16_hc_inputs_and_attention_output",
        BF16_ROUNDING,
        None,
        # Layer 0's streams are the embeddings, already bf16 values in the shipped weights, so
        # rounding them changes nothing; layer 1 is the first whose inputs really get rounded.
        ("model.layers.1.attn_hc", "model.layers.1.ffn_hc", "model.layers.1.self_attn"),
    ),
    Planted("routed_scale_no_undo", ROUTED_SCALE, "model.layers.0.mlp.gate"),
)
