"""Fake quantisation (quantise then dequantise) of indexer queries and keys.

Every quantiser maps a tensor [..., D] to a tensor of the same shape and dtype whose
values are exactly representable in the target format (math in fp32). Formats:

* ``fp32`` / ``bf16`` / ``fp16``: a plain cast round-trip.
* ``fp8_e4m3``: SGLang index-key granularity, one fp32 scale per vector (last dim),
  ``scale = max(absmax, 1e-4) / 448``, values cast through ``torch.float8_e4m3fn``.
* ``fp8_e4m3_block128``: the same with one scale per 128-element block of the last dim.
* ``fp4_e2m1``: grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} (signed), one power-of-two (UE8M0)
  scale per 32 elements, ``scale = 2**ceil(log2(max(absmax, 1e-4) / 6))``,
  round-to-nearest (ties to the smaller magnitude). The input is assumed already
  Hadamard-rotated (``hadamard_128``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from needlescope.errors import BadInput
from needlescope.setting import check_precision

__all__ = [
    "FP8_MAX",
    "FP8_MIN_AMAX",
    "FP4_GRID",
    "QUANTIZERS",
    "get_quantizer",
    "fp8_scale",
    "quantize_fp8_e4m3",
    "quantize_fp8_e4m3_block128",
    "quantize_fp4_e2m1",
    "hadamard_128",
    "quantize_query_fp8_per_head",
]

FP8_MAX = 448.0
FP8_MIN_AMAX = 1e-4
FP4_MAX = 6.0
FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

Quantizer = Callable[[torch.Tensor], torch.Tensor]


def _cast(dtype: torch.dtype) -> Quantizer:
    def q(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype).to(x.dtype)

    q.__doc__ = f"Round-trip [..., D] through {dtype}."
    return q


def fp8_scale(x: torch.Tensor) -> torch.Tensor:
    """fp32 scale [..., 1] per vector of x [..., D]: max(absmax, 1e-4) / 448."""
    return x.float().abs().amax(dim=-1, keepdim=True).clamp_min(FP8_MIN_AMAX) / FP8_MAX


def _fp8_codes(x32: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # x/scale lies in [-448, 448] by construction; cast is round-to-nearest-even.
    return (x32 / scale).to(torch.float8_e4m3fn).float()


def quantize_fp8_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Fake-quant x [..., D] to e4m3 with one fp32 scale per vector (SGLang index keys)."""
    x32 = x.float()
    s = fp8_scale(x32)  # [..., 1]
    return (_fp8_codes(x32, s) * s).to(x.dtype)


def _blocked(x: torch.Tensor, block: int) -> torch.Tensor:
    D = x.shape[-1]
    if D % block:
        raise BadInput(f"last dim {D} is not a multiple of the quantisation block {block}")
    return x.reshape(*x.shape[:-1], D // block, block)  # [..., D/b, b]


def quantize_fp8_e4m3_block128(x: torch.Tensor) -> torch.Tensor:
    """Fake-quant x [..., D] (D % 128 == 0) to e4m3 with one fp32 scale per 128 elements."""
    xb = _blocked(x.float(), 128)  # [..., D/128, 128]
    s = fp8_scale(xb)
    return (_fp8_codes(xb, s) * s).reshape(x.shape).to(x.dtype)


def _fp4_round(y: torch.Tensor) -> torch.Tensor:
    """Round |y| <= 6 to the signed e2m1 grid, nearest, ties to the smaller magnitude."""
    grid = torch.tensor(FP4_GRID, dtype=torch.float32, device=y.device)
    mids = (grid[1:] + grid[:-1]) / 2  # [7]
    idx = torch.bucketize(y.abs().clamp_max(FP4_MAX), mids, right=False)
    return torch.sign(y) * grid[idx]


def quantize_fp4_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Fake-quant x [..., D] (D % 32 == 0) to e2m1 with one UE8M0 (power-of-two) scale per 32."""
    xb = _blocked(x.float(), 32)  # [..., D/32, 32]
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp_min(FP8_MIN_AMAX)  # [..., D/32, 1]
    s = torch.exp2(torch.ceil(torch.log2(amax / FP4_MAX)))  # power of two, amax/s <= 6
    return (_fp4_round(xb / s) * s).reshape(x.shape).to(x.dtype)


# Exactly the names of ``needlescope.setting.PRECISIONS`` (tests/test_name_lists.py), which holds their bit widths.
QUANTIZERS: dict[str, Quantizer] = {
    "fp32": _cast(torch.float32),
    "bf16": _cast(torch.bfloat16),
    "fp16": _cast(torch.float16),
    "fp8_e4m3": quantize_fp8_e4m3,
    "fp8_e4m3_block128": quantize_fp8_e4m3_block128,
    "fp4_e2m1": quantize_fp4_e2m1,
}


def get_quantizer(name: str) -> Quantizer:
    """The fake-quant function registered as ``name``; BadInput (with suggestions) otherwise."""
    return QUANTIZERS[check_precision(name, "quantizer")]


def hadamard_128(x: torch.Tensor) -> torch.Tensor:
    """Walsh-Hadamard transform over the last dim (must be 128), scaled by 128**-0.5.

    Orthonormal and symmetric (its own inverse); preserves dot products. Math in fp32,
    result in x.dtype. x: [..., 128] -> [..., 128].
    """
    n = x.shape[-1]
    if n != 128:
        raise BadInput(f"hadamard_128 needs a last dim of 128, got {n}")
    lead = x.shape[:-1]
    y = x.float().reshape(-1, n)  # [N, 128]
    h = 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)  # [N, blocks, 2, h]
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(*lead, n) * (n**-0.5)).to(x.dtype)


def quantize_query_fp8_per_head(q: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang query quant: q [T, H, D], w [T, H] -> (q_hat [T, H, D] fp32 codes, w_folded [T, H]).

    One scale per (token, head), s = max(absmax, 1e-4)/448; q_hat = fp8(q/s) as fp32 and
    w_folded = w * s (fp32). Since s > 0, ReLU(s·a) = s·ReLU(a), so
    sum_h w_folded·ReLU(q_hat·k) equals sum_h w·ReLU(dequant(q)·k).
    """
    q32 = q.float()
    s = fp8_scale(q32)  # [T, H, 1]
    return _fp8_codes(q32, s), w.float() * s.squeeze(-1)
