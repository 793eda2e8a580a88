"""A random full-size lightning-indexer layer with a planted needle: sweeps at real sizes, no checkpoint.

``random_indexer(cfg, device)`` builds transformers' ``DeepseekV4Indexer`` from
``DeepseekV4Config`` (DeepSeek-V4-Flash defaults: hidden 4096, q_lora_rank 1024, 64 index
heads x 128 dims, compress ratio 4, index_topk 512) and fills it with seeded random weights,
generated here and never downloaded: projections bf16 (``kv_proj``/``gate_proj`` [2*128, 4096],
``q_b_proj`` [64*128, 1024], ``weights_proj`` [64, 4096]) with std 1/sqrt(fan_in), so
projections of unit-RMS inputs are unit-RMS; the gate position bias (ape, [4, 256]) and the
key RMSNorm weight fp32, as the checkpoint keeps them. Because it is the real module,
``needlescope.dsa.emulate`` (numerics, patches, the kernel backend) applies to it unchanged.

``make_context(layer, tokens, depth, strength, seed)`` draws one context: hidden states x
[T, hidden] bf16 ~ N(0, 1) (the attention-normed input), the query's q_lora [q_lora_rank]
bf16 ~ N(0, 1) at the last position ``T - 1``, and plants the needle in the compressed entry
``n`` nearest ``depth`` percent. Keys are the layer's own compressor over x
(``reference.compress_index_keys``: gated pooling, RMSNorm, RoPE at 4i), the query is
``q_b_proj(q_lora)`` with RoPE at ``T - 1``, and the head weights are ``weights_proj(x[T-1])``.

The needle: the key direction the query scores highest is about
``u = normalize(sum_h ReLU(w_h) q_h)``; the needle's target direction is
``strength * u + sqrt(1 - strength**2) * r`` (r a random unit vector orthogonal to u), so
``strength`` 1 plants the strongest key the layer can hold at its RMS-normalised length and
smaller values fade it into the distractors. The four tokens of block n get hidden states
(least squares through ``kv_proj``/``gate_proj``) whose current-block kv half is that direction,
rotated back by RoPE at 4n, and whose gate half is ``NEEDLE_GATE`` (so the softmax pooling
takes them and not block n-1). The needle's rank is then measured, not assumed: ``score_needle``
runs the layer's scorer (the emulated numerics and, inside ``emulate.scores_backend``, the
Triton kernel) over every visible entry and ranks entry n.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from needlescope.dsa.rankdump import RankStats, needle_rank_stats, selected_in
from needlescope.dsa.reference import (
    apply_rope_interleaved,
    compress_index_keys,
    topk_indices,
    visible_entries,
)
from needlescope.errors import BadInput

__all__ = [
    "RANDOM_LAYER",
    "NEEDLE_GATE",
    "RandomLayerConfig",
    "Context",
    "random_indexer",
    "make_context",
    "score_needle",
]

RANDOM_LAYER = "random-layer"
"""The ``--model`` value of ``needlescope indexer sweep`` that runs this layer instead of a checkpoint."""

NEEDLE_GATE = 20.0
"""Gate logit of the needle block's own tokens: softmax weight ~1 against unit-scale gates of block n-1."""


@dataclass(frozen=True)
class RandomLayerConfig:
    """Dimensions of the random layer (defaults: DeepSeek-V4-Flash) and the needle's strength."""

    hidden: int = 4096
    q_lora_rank: int = 1024
    heads: int = 64
    dim: int = 128
    ratio: int = 4
    strength: float = 1.0
    """1: the strongest needle key the layer can hold; 0: a random key (see the module docstring)."""

    def __post_init__(self) -> None:
        for name in ("hidden", "q_lora_rank", "heads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise BadInput(f"random layer {name} must be a positive integer, got {v!r}")
        if self.dim not in (64, 128):
            raise BadInput(f"random layer dim must be 64 or 128, got {self.dim!r}")
        if self.hidden < 2 * self.dim:
            raise BadInput(f"random layer hidden must be >= 2*dim = {2 * self.dim} to plant a needle")
        if self.ratio != 4:
            raise BadInput(f"the lightning indexer runs on ratio-4 (CSA) entries, got ratio {self.ratio}")
        if not 0.0 <= self.strength <= 1.0:
            raise BadInput(f"needle strength must be in [0, 1], got {self.strength}")


def _config(cfg: RandomLayerConfig):
    from transformers import DeepseekV4Config

    from needlescope.dsa.checkpoint import quiet_transformers

    with quiet_transformers():
        return DeepseekV4Config(
            hidden_size=cfg.hidden,
            q_lora_rank=cfg.q_lora_rank,
            index_n_heads=cfg.heads,
            index_head_dim=cfg.dim,
        )


def random_indexer(
    cfg: RandomLayerConfig, device: str | torch.device = "cpu", seed: int = 0
) -> torch.nn.Module:
    """transformers' ``DeepseekV4Indexer`` at ``cfg``'s size with seeded random weights (module docstring)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Indexer

    config = _config(cfg)
    if config.compress_rates["compressed_sparse_attention"] != cfg.ratio:
        raise BadInput(f"transformers' DeepSeek-V4 config has CSA ratio {config.compress_rates}")
    layer = DeepseekV4Indexer(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(layer.named_parameters()):
            if name.endswith("position_bias"):
                p.copy_(torch.randn(p.shape, generator=gen))  # fp32 [ratio, 2D]
            elif p.dim() == 1:  # RMSNorm weight, fp32
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:  # nn.Linear [out, in]
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5)
    for mod in layer.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.to(torch.bfloat16)
    return layer.to(device).eval()


@dataclass
class Context:
    """One sampled context of ``tokens`` tokens for the random layer, needle planted."""

    hidden: torch.Tensor  # [T, hidden] bf16 hidden states, needle tokens included
    q_lora: torch.Tensor  # [q_lora_rank] bf16, the last position's
    keys: torch.Tensor  # [L, D] compressed index keys (bf16), L = tokens // ratio
    q: torch.Tensor  # [H, D] the last position's index query (bf16, RoPE applied)
    needle_entry: int
    tokens: int

    @property
    def x_last(self) -> torch.Tensor:
        """[hidden]: the last position's hidden state (weights_proj's input)."""
        return self.hidden[-1]

    @property
    def visible(self) -> int:
        return int(visible_entries(self.tokens - 1, 4))


def _rope(
    layer: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, rd/2] in x's dtype at ``positions`` [n] (the layer's compress rotary)."""
    cos, sin = layer.rotary_emb(x, position_ids=positions.view(1, -1), layer_type=layer.rope_layer_type)
    return cos[0], sin[0]


def _needle_direction(
    q: torch.Tensor, w: torch.Tensor, strength: float, gen: torch.Generator
) -> torch.Tensor:
    """Unit [D]: strength * u + sqrt(1 - strength^2) * r, u = normalize(sum_h ReLU(w_h) q_h), r ⟂ u."""
    u = (w.float().clamp_min(0).unsqueeze(-1) * q.float()).sum(0)  # [D]
    u = u / u.norm().clamp_min(1e-12)
    r = torch.randn(u.shape, generator=gen, device=u.device)
    r = r - (r @ u) * u
    r = r / r.norm().clamp_min(1e-12)
    return strength * u + math.sqrt(max(0.0, 1.0 - strength * strength)) * r


def make_context(
    layer: torch.nn.Module, cfg: RandomLayerConfig, tokens: int, depth: float, seed: int
) -> Context:
    """Sample one context of ``tokens`` tokens with the needle at ``depth`` percent (module docstring)."""
    ratio = cfg.ratio
    L = visible_entries(tokens - 1, ratio)
    if L < 2:
        raise BadInput(
            f"a context of {tokens} tokens has {L} complete entries; give at least {2 * ratio} tokens"
        )
    if not 0.0 <= depth <= 100.0:
        raise BadInput(f"needle depth must be in 0..100 percent, got {depth}")
    dev = layer.kv_proj.weight.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(tokens, cfg.hidden, generator=gen, device=dev).to(torch.bfloat16)  # [T, hidden]
    q_lora = torch.randn(1, cfg.q_lora_rank, generator=gen, device=dev).to(torch.bfloat16)
    last = torch.tensor([tokens - 1], device=dev)
    q = layer.q_b_proj(q_lora).view(cfg.heads, cfg.dim)  # [H, D]
    q = apply_rope_interleaved(q, *_rope(layer, q, last))
    w = layer.scorer.weights_proj(x[-1]).float()  # [H]
    n = min(L - 1, int(round(depth / 100.0 * (L - 1))))
    # Plant: rotate the target back by RoPE at 4n, then solve for 4 tokens whose current-block kv
    # half is that (the RMSNorm removes the scale) and whose gate half is NEEDLE_GATE - ape.
    D = cfg.dim
    target = _needle_direction(q, w, cfg.strength, gen) * math.sqrt(D)  # [D]
    cos, sin = _rope(layer, target.view(1, D), torch.tensor([ratio * n], device=dev))
    pre_rope = apply_rope_interleaved(target.view(1, D), cos.float(), -sin.float())[0]  # [D]
    pre_norm = pre_rope / layer.kv_norm.weight.float()
    A = torch.cat([layer.kv_proj.weight[D:], layer.gate_proj.weight[D:]]).float()  # [2D, hidden]
    ape = layer.position_bias[:, D:].float()  # [ratio, D]
    rhs = torch.cat([pre_norm.expand(ratio, D), NEEDLE_GATE - ape], dim=1)  # [ratio, 2D]
    x_needle = torch.linalg.lstsq(A, rhs.t()).solution.t()  # [ratio, hidden] minimum-norm
    x[ratio * n : ratio * (n + 1)] = x_needle.to(x.dtype)
    cos_k, sin_k = _rope(layer, x, torch.arange(L, device=dev) * ratio)
    keys = compress_index_keys(
        x[: L * ratio],
        layer.kv_proj.weight,
        layer.gate_proj.weight,
        layer.position_bias,
        layer.kv_norm.weight,
        cos_k,
        sin_k,
        ratio=ratio,
        eps=layer.kv_norm.variance_epsilon,
    )  # [L, D]
    return Context(hidden=x, q_lora=q_lora[0], keys=keys, q=q, needle_entry=n, tokens=tokens)


def score_needle(layer: torch.nn.Module, ctx: Context, k: int) -> tuple[RankStats, bool]:
    """(rank statistics of the needle entry, whether the top-k selects it) for one context.

    Scores come from ``layer.scorer`` (inside ``emulate``: the setting's numerics, and the kernel
    under a scores backend); selection is ``reference.topk_indices`` over the visible entries.
    """
    L, D = ctx.keys.shape
    scores = layer.scorer(ctx.q.view(1, 1, -1, D), ctx.keys.view(1, L, D), ctx.x_last.view(1, 1, -1))
    row = scores.reshape(L).float().cpu()  # [L]
    stats = needle_rank_stats(row, ctx.visible, [ctx.needle_entry], k)
    sel = topk_indices(row.view(1, L), k, torch.tensor([ctx.visible]))[0]
    return stats, selected_in(sel, [ctx.needle_entry])
