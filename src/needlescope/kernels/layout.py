"""Key layouts the indexer kernels read: contiguous keys (prefill) and SGLang-style pages (decode).

Pure torch, no Triton: this module builds and validates inputs for both the Triton kernels
and the reference, so tests and the benchmark lay out keys exactly one way.

* **Contiguous keys** (``ContiguousKeys``): ``codes`` [N, D] bf16 or ``float8_e4m3fn``,
  ``scales`` [N] fp32 (all ones for bf16). Each query reads its own ``[start, end)``.
* **Paged fp8 cache** (SGLang's index-key page for DeepSeek-V4's indexer): one page is
  ``PAGE_ENTRIES`` (64) entries of D fp8 values, then 64 fp32 scales: ``64 * (D + 4)`` bytes,
  stored as uint8 [P, 64 * (D + 4)].
* **Paged bf16 cache**: the same 64 entries a page, bf16 [P, 64, D], no scales (scale 1).

A ``block_table`` [B, max_pages] int32 maps each request's logical page to a physical page;
``context_lens`` [B] int32 counts its visible entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from needlescope.dsa.quant import fp8_scale
from needlescope.errors import BadInput

__all__ = [
    "PAGE_ENTRIES",
    "KEY_DTYPES",
    "ContiguousKeys",
    "PagedKeys",
    "quantize_keys",
    "quantize_queries",
    "page_keys",
    "gather_paged",
]

PAGE_ENTRIES = 64
KEY_DTYPES = ("fp8_e4m3", "bf16")
_FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class ContiguousKeys:
    """Quantized keys in one buffer. codes: [N, D] bf16 or float8_e4m3fn; scales: [N] fp32."""

    codes: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        if self.codes.dim() != 2 or self.codes.dtype not in (torch.bfloat16, _FP8):
            raise BadInput(
                f"key codes must be [N, D] bf16 or float8_e4m3fn, got {tuple(self.codes.shape)} {self.codes.dtype}"
            )
        if self.codes.shape[1] not in (64, 128):
            raise BadInput(f"key dim must be 64 or 128, got {self.codes.shape[1]}")
        if self.scales.shape != self.codes.shape[:1] or self.scales.dtype != torch.float32:
            raise BadInput(
                f"key scales must be fp32 [{self.codes.shape[0]}], got {tuple(self.scales.shape)} {self.scales.dtype}"
            )

    @property
    def key_dtype(self) -> str:
        return "fp8_e4m3" if self.codes.dtype == _FP8 else "bf16"


@dataclass(frozen=True)
class PagedKeys:
    """A paged key cache. data: uint8 [P, 64*(D+4)] (fp8) or bf16 [P, 64, D]; block_table: int32 [B, max_pages]."""

    data: torch.Tensor
    block_table: torch.Tensor
    dim: int

    def __post_init__(self) -> None:
        if self.dim not in (64, 128):
            raise BadInput(f"key dim must be 64 or 128, got {self.dim}")
        if self.data.dtype == torch.uint8:
            ok = self.data.dim() == 2 and self.data.shape[1] == PAGE_ENTRIES * (self.dim + 4)
        else:
            ok = self.data.dtype == torch.bfloat16 and tuple(self.data.shape[1:]) == (PAGE_ENTRIES, self.dim)
        if not ok:
            raise BadInput(
                f"paged cache must be uint8 [P, {PAGE_ENTRIES * (self.dim + 4)}] (fp8 page) or bf16 "
                f"[P, {PAGE_ENTRIES}, {self.dim}], got {tuple(self.data.shape)} {self.data.dtype}"
            )
        if self.block_table.dim() != 2 or self.block_table.dtype != torch.int32:
            raise BadInput(
                f"block_table must be int32 [B, max_pages], got {tuple(self.block_table.shape)} {self.block_table.dtype}"
            )

    @property
    def key_dtype(self) -> str:
        return "fp8_e4m3" if self.data.dtype == torch.uint8 else "bf16"

    @property
    def width(self) -> int:
        """Logits row width: every entry the block table can address."""
        return self.block_table.shape[1] * PAGE_ENTRIES


def quantize_keys(k: torch.Tensor, key_dtype: str) -> ContiguousKeys:
    """k [N, D] float -> ContiguousKeys; fp8_e4m3 uses SGLang's rule scale = max(absmax, 1e-4)/448."""
    if key_dtype not in KEY_DTYPES:
        raise BadInput(f"key dtype must be one of {', '.join(KEY_DTYPES)}, got {key_dtype!r}")
    if key_dtype == "bf16":
        return ContiguousKeys(k.to(torch.bfloat16), torch.ones(k.shape[0], device=k.device))
    k32 = k.float()
    s = fp8_scale(k32)  # [N, 1]
    return ContiguousKeys((k32 / s).to(_FP8), s.squeeze(-1).contiguous())


def quantize_queries(q: torch.Tensor, w: torch.Tensor, key_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], w [T, H] -> (q codes [T, H, D], w [T, H] fp32) for keys of ``key_dtype``.

    fp8: one scale per (token, head), folded into w (``dsa.quant.quantize_query_fp8_per_head``);
    bf16: q cast to bf16, w unchanged.
    """
    if key_dtype == "bf16":
        return q.to(torch.bfloat16).contiguous(), w.float().contiguous()
    q32 = q.float()
    s = fp8_scale(q32)  # [T, H, 1]
    return (q32 / s).to(_FP8).contiguous(), (w.float() * s.squeeze(-1)).contiguous()


def page_keys(
    keys: ContiguousKeys, block_table: torch.Tensor, num_pages: int, entry_of: torch.Tensor
) -> PagedKeys:
    """Scatter contiguous keys into a paged cache.

    keys: N entries; block_table: int32 [B, max_pages]; entry_of: long [B, max_pages*64], the
    row of ``keys`` stored at each request's logical entry (-1: leave the slot as filler).
    Filler slots hold random codes so that a kernel reading the wrong page scores garbage.
    """
    N, D = keys.codes.shape
    dev = keys.codes.device
    B, max_pages = block_table.shape
    phys = block_table.long().repeat_interleave(PAGE_ENTRIES, dim=1)  # [B, W]
    slot = torch.arange(max_pages * PAGE_ENTRIES, device=dev).remainder(PAGE_ENTRIES).expand(B, -1)
    used = entry_of >= 0
    phys, slot, src = phys[used], slot[used], entry_of[used]
    gen = torch.Generator(device=dev).manual_seed(num_pages)
    if keys.key_dtype == "bf16":
        data = torch.randn(num_pages, PAGE_ENTRIES, D, generator=gen, device=dev).to(torch.bfloat16)
        data[phys, slot] = keys.codes[src]
        return PagedKeys(data, block_table, D)
    data = torch.empty(num_pages, PAGE_ENTRIES * (D + 4), dtype=torch.uint8, device=dev)
    vals = data[:, : PAGE_ENTRIES * D].view(num_pages, PAGE_ENTRIES, D)
    scales = data[:, PAGE_ENTRIES * D :].view(torch.float32)  # [P, 64]
    vals.copy_(torch.randn(num_pages, PAGE_ENTRIES, D, generator=gen, device=dev).to(_FP8).view(torch.uint8))
    scales.copy_(torch.rand(num_pages, PAGE_ENTRIES, generator=gen, device=dev) + 0.5)
    vals[phys, slot] = keys.codes[src].view(torch.uint8)
    scales[phys, slot] = keys.scales[src]
    return PagedKeys(data, block_table, D)


def gather_paged(
    paged: PagedKeys, physical_pages: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read entries of a paged cache: (codes [..., D] float32, scales [...] fp32) at (page, slot) pairs."""
    D = paged.dim
    if paged.key_dtype == "bf16":
        codes = paged.data[physical_pages, slots].float()
        return codes, torch.ones_like(codes[..., 0])
    P = paged.data.shape[0]
    vals = paged.data[:, : PAGE_ENTRIES * D].view(P, PAGE_ENTRIES, D).view(_FP8)
    scales = paged.data[:, PAGE_ENTRIES * D :].view(torch.float32)  # [P, 64]
    return vals[physical_pages, slots].float(), scales[physical_pages, slots]
