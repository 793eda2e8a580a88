"""GPU kernels for the lightning indexer (Triton, the ``[gpu]`` extra) with a torch reference fallback.

``indexer_topk(q, w, keys, k, ...)`` computes indexer logits over contiguous keys (prefill,
per-query [start, end)) or an SGLang-style paged cache (decode, block table and context
lengths), with bf16 or fp8 e4m3 keys, and takes the exact top-k. On CUDA it runs the Triton
kernels; elsewhere the torch reference (``needlescope.kernels.reference``). Triton is imported
only when a Triton path runs, so this package imports on a machine without it.
"""

from importlib import import_module
from typing import Any

from needlescope.kernels.names import KERNEL_FAULTS, KERNELS

# Everything else needs torch; it loads on first use so that configs and CLIs that only check
# kernel names (serve's flags, every `needlescope --help`) do not pay torch's import. No lazy name
# is ``topk``: that is the Triton top-k module (the dispatch's function is ``dispatch.topk``).
_LAZY = {
    "indexer_logits": "dispatch",
    "indexer_topk": "dispatch",
    "resolve_kernel": "dispatch",
    "KEY_DTYPES": "layout",
    "PAGE_ENTRIES": "layout",
    "ContiguousKeys": "layout",
    "PagedKeys": "layout",
    "page_keys": "layout",
    "quantize_keys": "layout",
    "quantize_queries": "layout",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)


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
]
