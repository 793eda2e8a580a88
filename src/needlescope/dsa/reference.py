"""Exact reference math of the DeepSeek-V4 lightning indexer (CSA layers, ratio 4).

Pure functions over tensors; no modules, no I/O. Mirrors transformers'
``DeepseekV4Indexer`` (models/deepseek_v4/modeling_deepseek_v4.py, v5.23) so that
parity holds bit-for-bit up to fp32 rounding.

Places where transformers deviates from DeepSeek's reference inference code and SGLang's
indexer (the deployments whose numerics ``needlescope.dsa.emulate`` imitates):

* No Hadamard rotation and no FP4/FP8 simulation of q or k in transformers. Ref and
  SGLang rotate + quantise; transformers keeps both in the model dtype. A rotation
  preserves dot products, so this only matters once you quantise
  (see ``needlescope.dsa.quant``).
* Indexer RoPE width is ``config.head_dim * partial_rotary_factor`` (the *main*
  attention rope width, 64 for Flash), applied to the trailing dims of the
  ``index_head_dim`` vector, interleaved pairs, theta = ``compress_rope_theta``
  (YaRN with ``attention_factor`` forced to 1.0).
* Gated pooling: ``sum(kv * softmax(gate).to(kv.dtype))`` then RMSNorm; the softmax is
  fp32 but the products/sum run in the kv dtype (bf16 in a bf16 model).
* Causality uses a -inf mask on entries ``i >= (t+1)//4`` and then ``topk`` with
  ``k = min(index_topk, L)``; masked picks become -1. SGLang's
  "rows with len <= k emit 0..len-1" shortcut is not in transformers: it
  emits the visible entries in score order. As sets they are identical.
* Head weights use ``hidden_states`` (the attn-normed x), not q_lora, with
  ``c = index_head_dim**-0.5 * index_n_heads**-0.5``; ``index_head_dim**-0.5`` is
  applied after the ReLU, ``index_n_heads**-0.5`` to the weights (same product).
"""

from __future__ import annotations

import torch

__all__ = [
    "NO_ENTRY",
    "visible_entries",
    "visibility_mask",
    "rope_cos_sin",
    "apply_rope_interleaved",
    "compress_index_keys",
    "lightning_scores",
    "indexer_scores",
    "topk_indices",
]

NO_ENTRY = -1
"""Sentinel index in ``topk_indices`` output: "no entry" (fewer than k visible)."""


def visible_entries(t, ratio: int = 4):
    """Number of compressed entries visible to the query at position ``t``: (t+1)//ratio.

    The one statement of the visibility rule: entry ``s`` (covering tokens ``ratio*s ..
    ratio*s + ratio - 1``) is complete, hence scoreable, once the query has seen its last token.
    ``t`` is an int or an integer tensor of positions (then the result is a tensor of that shape).
    """
    return (t + 1) // ratio


def visibility_mask(T: int, L: int, ratio: int = 4) -> torch.Tensor:
    """Bool [T, L]: entry i is visible to query t iff i < (t+1)//ratio."""
    vis = visible_entries(torch.arange(T), ratio)  # [T]
    return torch.arange(L).view(1, L) < vis.view(T, 1)  # [T, L]


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
    """cos, sin of shape [..., rd/2] (fp32) for integer ``positions`` [...] and ``inv_freq`` [rd/2].

    Same as ``DeepseekV4RotaryEmbedding.forward`` before its cast to the model dtype.
    """
    freqs = positions[..., None].float() * inv_freq.float()  # [..., rd/2]
    return freqs.cos() * attention_scaling, freqs.sin() * attention_scaling


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair RoPE on the trailing ``2*cos.shape[-1]`` dims of ``x``.

    x: [..., D]; cos/sin: broadcastable to [..., rd/2]. Rotation runs in fp32, the
    result is cast back to ``x.dtype`` (as transformers does). For bit parity pass
    cos/sin already cast to ``x.dtype``: transformers' rotary returns them in the model
    dtype (``compress_index_keys`` does this cast itself).
    """
    cos2 = cos.repeat_interleave(2, dim=-1).float()  # [..., rd]
    sin2 = sin.repeat_interleave(2, dim=-1).float()
    rd = cos2.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:]
    r1, r2 = rope[..., 0::2], rope[..., 1::2]
    rot_half = torch.stack((-r2, r1), dim=-1).flatten(-2)
    rotated = (rope.float() * cos2 + rot_half.float() * sin2).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def compress_index_keys(
    x: torch.Tensor,
    wkv: torch.Tensor,
    wgate: torch.Tensor,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    ratio: int = 4,
    overlap: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Indexer compressor: x [T, hidden] -> compressed index keys [L, D], L = T//ratio.

    wkv, wgate: [(2 if overlap else 1)*D, hidden] (nn.Linear layout); ape: [ratio, 2D or D];
    norm_weight: [D]; cos/sin: [L, rd/2] for positions ratio*i (see ``rope_cos_sin``).
    Trailing tokens of an unfinished block are dropped. With ``overlap``, entry i pools
    8 candidates per channel: block i-1's tokens over channels [:D] and block i's over
    [D:]; block 0's previous half has gate -inf (weight 0).
    """
    T = x.shape[0]
    L = T // ratio
    D = norm_weight.shape[0]
    usable = L * ratio
    kv = (x @ wkv.t().to(x.dtype))[:usable]  # [L*r, C]
    gate = (x @ wgate.t().to(x.dtype))[:usable]
    if L == 0:
        return kv.new_zeros((0, D))
    kv = kv.view(L, ratio, -1)  # [L, r, C]
    gate = gate.view(L, ratio, -1) + ape  # [L, r, C]
    if overlap:
        new_kv = kv.new_zeros((L, 2 * ratio, D))  # [L, 2r, D]
        new_gate = gate.new_full((L, 2 * ratio, D), float("-inf"))
        new_kv[:, ratio:] = kv[..., D:]
        new_gate[:, ratio:] = gate[..., D:]
        new_kv[1:, :ratio] = kv[:-1, :, :D]
        new_gate[1:, :ratio] = gate[:-1, :, :D]
    else:
        new_kv, new_gate = kv, gate
    pooled = (new_kv * new_gate.softmax(dim=1, dtype=torch.float32).to(new_kv.dtype)).sum(dim=1)  # [L, D]
    # RMSNorm exactly as DeepseekV4RMSNorm: fp32 math, fp32 weight, one cast at the end.
    p32 = pooled.float()
    p32 = p32 * torch.rsqrt(p32.pow(2).mean(-1, keepdim=True) + eps)
    normed = (norm_weight * p32).to(pooled.dtype)  # [L, D]
    return apply_rope_interleaved(normed, cos.to(normed.dtype), sin.to(normed.dtype))


def lightning_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    *,
    scale: float,
    weight_scale: float = 1.0,
    acc_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Unmasked I(t, s) = sum_h weight_scale * w[t,h] * scale * ReLU(q[t,h] . k[s]).

    q: [..., S, H, D]; k: [..., L, D]; w: [..., S, H]; returns [..., S, L] in ``acc_dtype``
    (bf16 rounds every dot product, weighted term and the head sum).
    """
    dots = torch.einsum("...thd,...sd->...ths", q.to(acc_dtype), k.to(acc_dtype))  # [..., S, H, L]
    dots = torch.relu(dots) * scale
    wt = w.to(acc_dtype) * weight_scale  # [..., S, H]
    return (dots * wt.unsqueeze(-1)).sum(dim=-2)  # [..., S, L]


def indexer_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    *,
    scale: float,
    weight_scale: float = 1.0,
    ratio: int = 4,
    positions: torch.Tensor | None = None,
    acc_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``lightning_scores`` for one sequence with future entries set to -inf.

    q: [T, H, D]; k: [L, D]; w: [T, H] raw head weights (weights_proj(x)); returns [T, L].
    transformers: ``scale = index_head_dim**-0.5``, ``weight_scale = index_n_heads**-0.5``.
    ``positions`` [T] gives each query's absolute position (default 0..T-1); entry s is
    masked iff s >= (positions+1)//ratio.
    """
    T, L = q.shape[0], k.shape[0]
    scores = lightning_scores(q, k, w, scale=scale, weight_scale=weight_scale, acc_dtype=acc_dtype)
    pos = torch.arange(T, device=q.device) if positions is None else positions.to(q.device)
    vis = visible_entries(pos, ratio)  # [T]
    future = torch.arange(L, device=q.device).view(1, L) >= vis.view(T, 1)  # [T, L]
    return scores.masked_fill(future, float("-inf"))


def topk_indices(scores: torch.Tensor, k: int, visible: torch.Tensor) -> torch.Tensor:
    """LongTensor [T, k] of selected entry indices, ``NO_ENTRY`` (-1) padded.

    scores: [T, L] (entries >= visible[t] are ignored whatever their value);
    visible: [T] number of visible entries per row. Rows with visible > k hold the
    top-k indices by score (descending, ties as torch.topk). Rows with visible <= k
    return 0..visible-1 in order, then -1 (the SGLang convention).
    """
    T, L = scores.shape
    visible = visible.to(device=scores.device, dtype=torch.long).clamp(0, L)  # [T]
    ar = torch.arange(L, device=scores.device).view(1, L)
    masked = scores.float().masked_fill(ar >= visible.view(T, 1), float("-inf"))  # [T, L]
    kk = min(k, L)
    out = torch.full((T, k), NO_ENTRY, dtype=torch.long, device=scores.device)  # [T, k]
    if kk > 0:
        sel = masked.topk(kk, dim=-1).indices  # [T, kk]
        out[:, :kk] = sel
    small = visible <= k  # [T]
    if bool(small.any()):
        seq = torch.arange(k, device=scores.device).view(1, k).expand(T, k)
        fill = torch.where(seq < visible.view(T, 1), seq, torch.full_like(seq, NO_ENTRY))
        out = torch.where(small.view(T, 1), fill, out)
    return out
