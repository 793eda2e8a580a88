"""Packed fp4 (e2m1) weights with one power-of-two scale per 32 inputs: the release's routed experts.

DeepSeek-V4-Flash ships each routed expert matrix ``W`` [out, in] as ``weight`` (``int8``,
[out, in / 2]: two e2m1 codes per byte, the even column in the low nibble, the OCP MX
packing that torch's ``float4_e2m1fn_x2`` also uses) and ``scale`` (``float8_e8m0fnu``,
[out, in / 32]), so ``W[i, j] ~= e2m1(code[i, j]) * scale[i, j // 32]``. An e2m1 code is a sign
bit (bit 3) and a magnitude index (bits 0-2) into {0, 0.5, 1, 1.5, 2, 3, 4, 6}.

``quantize_block_fp4`` picks each group's scale as the smallest power of two with
``amax / scale <= 6`` and rounds to the nearest grid value (``dsa.quant``'s e2m1 rounding);
``dequantize_block_fp4`` is its exact inverse on the grid values.
"""

from __future__ import annotations

import torch

from needlescope.dsa.quant import FP4_GRID, FP4_MAX

__all__ = ["FP4_GROUP", "quantize_block_fp4", "dequantize_block_fp4", "is_packed_fp4"]

FP4_GROUP = 32


def is_packed_fp4(q: torch.Tensor) -> bool:
    """Whether a stored weight is packed e2m1 (one byte per two values) rather than fp8."""
    return q.dtype in (torch.int8, torch.uint8)


def quantize_block_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed [out, in/2] int8, scale [out, in/32] float8_e8m0fnu) of ``weight`` [out, in], in % 32 == 0.

    An all-zero group gets scale 2**-126 (any power of two reproduces zeros).
    """
    if weight.dim() != 2 or weight.shape[1] % FP4_GROUP:
        raise ValueError(
            f"fp4 packs 2-D weights with a multiple of 32 inputs, got shape {tuple(weight.shape)}"
        )
    out, inp = weight.shape
    w = weight.float().view(out, inp // FP4_GROUP, FP4_GROUP)
    amax = w.abs().amax(dim=-1, keepdim=True).clamp_min(2.0**-120)  # [out, in/32, 1]
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP4_MAX)))
    y = (w / scale).reshape(out, inp)
    grid = torch.tensor(FP4_GRID, dtype=torch.float32, device=y.device)
    mids = (grid[1:] + grid[:-1]) / 2
    mag = torch.bucketize(y.abs().clamp_max(FP4_MAX), mids, right=False)  # [out, in] 0..7
    codes = (mag | ((y < 0) & (mag > 0)).to(mag.dtype) << 3).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), scale.view(out, inp // FP4_GROUP).to(torch.float8_e8m0fnu)


def dequantize_block_fp4(
    packed: torch.Tensor, scale: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``e2m1(code) * scale`` as ``dtype`` [out, in]: packed [out, in/2] int8/uint8, scale
    [out, in/32] (float8_e8m0fnu or float32). ValueError on a shape mismatch."""
    if packed.dim() != 2 or scale.dim() != 2:
        raise ValueError(
            f"fp4 needs a 2-D weight and scale, got {tuple(packed.shape)} and {tuple(scale.shape)}"
        )
    out, half = packed.shape
    inp = 2 * half
    if tuple(scale.shape) != (out, inp // FP4_GROUP) or inp % FP4_GROUP:
        raise ValueError(
            f"a packed fp4 weight of shape {tuple(packed.shape)} ({out} x {inp} values) needs a scale of "
            f"shape {(out, inp // FP4_GROUP)}, got {tuple(scale.shape)}"
        )
    b = packed.view(torch.uint8).to(torch.int32)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(out, inp)  # even column = low nibble
    grid = torch.tensor(FP4_GRID, dtype=torch.float32, device=packed.device)
    values = grid[codes & 7] * (1.0 - 2.0 * (codes >> 3).float())
    groups = values.view(out, inp // FP4_GROUP, FP4_GROUP) * scale.float().unsqueeze(-1)
    return groups.reshape(out, inp).to(dtype)
