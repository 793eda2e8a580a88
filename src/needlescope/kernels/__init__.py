"""GPU kernels for the lightning indexer (Triton, the ``[gpu]`` extra) with a torch reference fallback.

``indexer_topk(q, w, keys, k, ...)`` computes indexer logits over contiguous keys (prefill,
per-query [start, end)) or an SGLang-style paged cache (decode, block table and context
lengths), with bf16 or fp8 e4m3 keys, and takes the exact top-k. On CUDA it runs the Triton
kernels; elsewhere the torch reference (``needlescope.kernels.reference``). Triton is imported
only when a Triton path runs, so this package imports on a machine without it.
"""

from needlescope.kernels.dispatch import KERNELS, indexer_logits, indexer_topk, resolve_kernel, topk
from needlescope.kernels.layout import (
    KEY_DTYPES,
    PAGE_ENTRIES,
    ContiguousKeys,
    PagedKeys,
    page_keys,
    quantize_keys,
    quantize_queries,
)
from needlescope.kernels.reference import KERNEL_FAULTS

__all__ = [
    "KERNELS",
    "KERNEL_FAULTS",
    "KEY_DTYPES",
    "PAGE_ENTRIES",
    "ContiguousKeys",
    "PagedKeys",
    "indexer_logits",
    "indexer_topk",
    "page_keys",
    "quantize_keys",
    "quantize_queries",
    "resolve_kernel",
    "topk",
]
