"""Block-scaled fp8 weights, as DeepSeek ships them: e4m3 values with one scale per 128 x 128 block.

A weight ``W`` [out, in] is stored as ``q`` (``float8_e4m3fn``, same shape) and ``scale``
[ceil(out/128), ceil(in/128)] with ``W[i, j] ~= q[i, j] * scale[i // 128, j // 128]``. DeepSeek-V4's
release writes the scale as ``float8_e8m0fnu`` (``"scale_fmt": "ue8m0"``: a power of two), its V3
release as float32 (``weight_scale_inv``); both dequantize the same way. Edge blocks are partial
when a dimension is not a multiple of the block.

``quantize_block_fp8`` picks each block's scale as amax / 448 (e4m3's largest finite value),
rounded up to a power of two for ue8m0 so that no value saturates; ``dequantize_block_fp8`` is
its inverse up to e4m3 rounding (relative error <= 2^-4 per element).
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "E4M3_MAX", "SCALE_DTYPES", "quantize_block_fp8", "dequantize_block_fp8", "scale_shape"]

BLOCK = 128
E4M3_MAX = 448.0
SCALE_DTYPES = {"ue8m0": torch.float8_e8m0fnu, "fp32": torch.float32}
"""Scale formats: the name in a checkpoint's ``quantization_config.scale_fmt`` -> torch dtype."""


def scale_shape(shape: tuple[int, int], block: int = BLOCK) -> tuple[int, int]:
    """The scale tensor's shape for a weight of ``shape`` [out, in]."""
    return (-(-shape[0] // block), -(-shape[1] // block))


def _expand(scale: torch.Tensor, shape: tuple[int, int], block: int) -> torch.Tensor:
    """scale [bo, bi] -> [out, in], each block's scale repeated over its elements."""
    return scale.repeat_interleave(block, 0)[: shape[0]].repeat_interleave(block, 1)[:, : shape[1]]


def quantize_block_fp8(
    weight: torch.Tensor, *, scale_fmt: str = "ue8m0", block: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [out, in] float8_e4m3fn, scale [ceil(out/block), ceil(in/block)]) of ``weight`` [out, in].

    ``scale_fmt``: ``"ue8m0"`` (power-of-two scales stored as float8_e8m0fnu, DeepSeek-V4) or
    ``"fp32"``. An all-zero block gets scale 1.
    """
    if weight.dim() != 2:
        raise ValueError(f"block fp8 quantizes 2-D weights, got shape {tuple(weight.shape)}")
    if scale_fmt not in SCALE_DTYPES:
        raise ValueError(f"unknown scale format {scale_fmt!r}; known: {', '.join(SCALE_DTYPES)}")
    out, inp = weight.shape
    bo, bi = scale_shape((out, inp), block)
    w = weight.float()
    padded = w.new_zeros((bo * block, bi * block))
    padded[:out, :inp] = w
    amax = padded.view(bo, block, bi, block).abs().amax(dim=(1, 3))  # [bo, bi]
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    if scale_fmt == "ue8m0":
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (w / _expand(scale, (out, inp), block)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale.to(SCALE_DTYPES[scale_fmt])


def dequantize_block_fp8(
    q: torch.Tensor, scale: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16, block: int = BLOCK
) -> torch.Tensor:
    """``q * scale`` per block, as ``dtype``: q [out, in] (any fp8 or float dtype), scale
    [ceil(out/block), ceil(in/block)] (float8_e8m0fnu or float32). ValueError on a shape mismatch."""
    if q.dim() != 2 or scale.dim() != 2:
        raise ValueError(
            f"block fp8 needs a 2-D weight and scale, got {tuple(q.shape)} and {tuple(scale.shape)}"
        )
    want = scale_shape(tuple(q.shape), block)
    if tuple(scale.shape) != want:
        raise ValueError(
            f"a weight of shape {tuple(q.shape)} needs a scale of shape {want} ({block} x {block} blocks), "
            f"got {tuple(scale.shape)}"
        )
    return (q.float() * _expand(scale.float(), tuple(q.shape), block)).to(dtype)
