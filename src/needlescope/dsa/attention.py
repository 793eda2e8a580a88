"""Eager attention that reads, per block of queries, only the keys the mask lets it read.

transformers' DeepSeek-V4 eager attention multiplies every query by every key and then adds the
mask: a one-pass prefill of T tokens builds ``[B, H, T, T + T/4]`` fp32 scores (and as many
again for the masked copy, the sinks and the softmax) although each query reads its sliding
window (the organism: 32 tokens) and its compressed entries. ``blocked_attention`` computes the
same attention block by block of ``BLOCK`` queries (``DEVICE_BLOCK`` on a GPU): for each block
it gathers the key columns that any of the block's rows may read (mask above the dtype's
minimum: transformers masks with ``finfo.min``, the compressor's block bias with ``-inf``) and
runs the eager math on those alone. A column left out would have had softmax weight exactly 0 (``exp(min - max)`` underflows),
so the result is the eager one up to the order of the sums (tests/test_dsa_attention.py). The
sink joins the softmax's denominator only (eager concatenates it as one more column and drops it
after), and the rows are normalised after the product with the values, in place where it can.

Peak memory of the scores is ``BLOCK x (BLOCK + window + compressed entries)`` per head instead of
``T x (T + T/4)``, and the work drops with it: for the sliding part, ``BLOCK + window`` keys per
query instead of T. A call of at most ``BLOCK`` queries (a chunk of a chunked prefill, a decode
step) and a call without a mask tensor run the eager function itself, as does training.

``use_blocked_attention(model)`` switches a loaded model to it (``dsa.checkpoint.load_bundle``
does, for every transformers-layout checkpoint); the mask the model builds is the eager one.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as modeling
from transformers.models.deepseek_v4.modeling_deepseek_v4 import eager_attention_forward

__all__ = ["BLOCK", "DEVICE_BLOCK", "NAME", "blocked_attention", "use_blocked_attention"]

NAME = "needlescope_blocked"
BLOCK = 64
"""Queries per block on the CPU: the scores of one block are ``BLOCK x keys read`` per head; small,
so that a block's sliding part (``BLOCK + window`` keys) stays near the window's work."""
DEVICE_BLOCK = 1024
"""Queries per block on an accelerator, where a small block costs launches and a sync each: a
measurement chunk (512 tokens) runs the eager function in one piece there."""


def blocked_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention output [B, S, H, D] (transposed as eager's) of ``query`` [B, H, S, D] over
    ``key``/``value`` [B, 1, K, D] (V4's single shared KV head) with the additive
    ``attention_mask`` [B, 1, S, K] and the module's per-head ``sinks``; no probabilities."""
    S = query.shape[2]
    eager = _eager_in_force()
    block = BLOCK if query.device.type == "cpu" else DEVICE_BLOCK
    if attention_mask is None or module.training or S <= block or eager is not eager_attention_forward:
        return eager(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    B, H, _, D = query.shape
    floor = torch.finfo(attention_mask.dtype).min
    out = query.new_empty(B, H, S, value.shape[-1])
    sinks = module.sinks.reshape(1, -1, 1, 1).to(query.dtype)  # [1, H, 1, 1]
    for lo in range(0, S, block):
        hi = min(lo + block, S)
        mask = attention_mask[:, :, lo:hi]  # [B, 1, s, K]
        cols = (mask.amax(dim=(0, 1, 2)) > floor).nonzero().flatten()  # keys any row may read
        k, v = key[:, 0, cols], value[:, 0, cols]  # [B, k, D]: the one KV head every query head reads
        s = hi - lo
        # the heads' rows stacked, [B, H * s, D]: one product per block instead of one per head
        q = query[:, :, lo:hi].reshape(B, H * s, D)
        scores = torch.matmul(q, k.transpose(1, 2)).view(B, H, s, -1).mul_(scaling).add_(mask[..., cols])
        # softmax over [scores, sink] without concatenating: the sink only adds to the denominator
        top = torch.maximum(scores.amax(dim=-1, keepdim=True), sinks)  # [B, H, s, 1]
        weights = scores.sub_(top).exp_()
        denom = weights.sum(dim=-1, keepdim=True) + (sinks - top).exp()
        mixed = torch.matmul(weights.to(v.dtype).view(B, H * s, -1), v).view(B, H, s, -1)
        out[:, :, lo:hi] = mixed / denom.to(v.dtype)
    return out.transpose(1, 2).contiguous(), None


def _eager_in_force():
    """The eager function a forward would call now: a patch that replaced transformers'
    (``modeling_deepseek_v4.eager_attention_forward``, or an ``"eager"`` registry entry) keeps
    its effect, every block included, so a planted bug in the attention is never bypassed."""
    registered = ALL_ATTENTION_FUNCTIONS._global_mapping.get("eager")
    return registered if registered is not None else modeling.eager_attention_forward


AttentionInterface.register(NAME, blocked_attention)
AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["eager"])


def use_blocked_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Switch ``model`` (a transformers DeepSeek-V4 model using eager attention) to
    ``blocked_attention``; returns it. Any other model is returned unchanged."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "deepseek_v4" or config._attn_implementation != "eager":
        return model
    model.set_attn_implementation(NAME)
    return model
