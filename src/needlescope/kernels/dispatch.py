"""``indexer_topk``: lightning-indexer logits plus exact top-k, Triton on CUDA, the reference elsewhere.

``kernel`` picks the implementation: ``auto`` (Triton when the tensors are on a CUDA device and
Triton imports, else the torch reference), ``reference`` or ``triton``. ``triton`` on CPU
tensors runs only under ``TRITON_INTERPRET=1`` (Triton's interpreter; the tests use it).
``fault`` (debug only) runs one of ``KERNEL_FAULTS`` in whichever implementation is chosen.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from needlescope.errors import BadInput
from needlescope.kernels.layout import ContiguousKeys, PagedKeys
from needlescope.kernels.names import KERNELS
from needlescope.kernels.reference import (
    check_fault,
    logits_reference,
    paged_logits_reference,
    topk_reference,
)

__all__ = ["KERNELS", "resolve_kernel", "indexer_logits", "topk", "indexer_topk"]


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """``reference`` or ``triton`` for ``kernel`` on ``device``; BadInput when it cannot run there."""
    if kernel not in KERNELS:
        raise BadInput(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    has_triton = importlib.util.find_spec("triton") is not None
    on_gpu = torch.device(device).type == "cuda"
    if kernel == "auto":
        return "triton" if on_gpu and has_triton else "reference"
    if kernel == "triton":
        if not has_triton:
            raise BadInput("the triton kernel needs the [gpu] extra: pip install 'needlescope[gpu]'")
        if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
            raise BadInput(
                "the triton kernel needs a CUDA device (or TRITON_INTERPRET=1 for Triton's interpreter)"
            )
    return kernel


def _ranges(keys, rows: int, starts, ends, context_lens, device) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(keys, PagedKeys):
        if context_lens is None or starts is not None or ends is not None:
            raise BadInput("a paged cache takes context_lens (and no starts/ends)")
        ends = context_lens.to(device=device, dtype=torch.int32)
        return torch.zeros_like(ends), ends
    if not isinstance(keys, ContiguousKeys):
        raise BadInput(f"keys must be ContiguousKeys or PagedKeys, got {type(keys).__name__}")
    if context_lens is not None:
        raise BadInput("contiguous keys take starts/ends (and no context_lens)")
    n = keys.codes.shape[0]
    st = (
        torch.zeros(rows, dtype=torch.int32, device=device)
        if starts is None
        else starts.to(device, torch.int32)
    )
    en = (
        torch.full((rows,), n, dtype=torch.int32, device=device)
        if ends is None
        else ends.to(device, torch.int32)
    )
    return st, en


def _check_queries(q: torch.Tensor, w: torch.Tensor) -> None:
    if q.dim() != 3 or w.shape != q.shape[:2]:
        raise BadInput(f"q must be [R, H, D] and w [R, H], got {tuple(q.shape)} and {tuple(w.shape)}")
    if q.shape[1] > 64:
        raise BadInput(f"at most 64 heads, got {q.shape[1]}")


def _check_k(k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise BadInput(f"k must be a positive integer, got {k!r}")


def indexer_logits(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: ContiguousKeys | PagedKeys,
    *,
    starts: torch.Tensor | None = None,
    ends: torch.Tensor | None = None,
    context_lens: torch.Tensor | None = None,
    kernel: str = "auto",
    fault: str | None = None,
) -> torch.Tensor:
    """Logits fp32 [R, N] (contiguous; -inf outside [start, end)) or [B, width] (paged; -inf past
    context_lens). q [R, H, D] codes (bf16 or float8_e4m3fn); w [R, H] with any q scale folded in."""
    _check_queries(q, w)
    paged = isinstance(keys, PagedKeys)
    check_fault(fault, paged)
    st, en = _ranges(keys, q.shape[0], starts, ends, context_lens, q.device)
    impl = resolve_kernel(kernel, q.device)
    if impl == "reference":
        if paged:
            return paged_logits_reference(q, w, keys, en, fault=fault)
        return logits_reference(q, w, keys, st, en, fault=fault)
    from needlescope.kernels import triton_logits

    if paged:
        return triton_logits.paged_logits(q, w, keys, en, fault=fault)
    return triton_logits.prefill_logits(q, w, keys, st, en, fault=fault)


def topk(
    logits: torch.Tensor, k: int, starts: torch.Tensor, ends: torch.Tensor, *, kernel: str = "auto"
) -> torch.Tensor:
    """int32 [R, k]: exact top-k columns of logits [R, L] inside [start, end), ties to the lower
    index, rows with end - start <= k give start..end-1, -1 padding (``reference.topk_reference``)."""
    _check_k(k)
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise BadInput(f"logits must be fp32 [R, L], got {tuple(logits.shape)} {logits.dtype}")
    if resolve_kernel(kernel, logits.device) == "reference":
        return topk_reference(logits, k, starts, ends)
    from needlescope.kernels.topk import topk as triton_topk

    return triton_topk(logits, k, starts, ends)


def indexer_topk(
    q: torch.Tensor, w: torch.Tensor, keys: ContiguousKeys | PagedKeys, k: int, **ranges_and_kernel
) -> torch.Tensor:
    """int32 [R, k] selected entries (-1 padded) for each query row: ``indexer_logits`` then ``topk``
    (a paged cache on the Triton path: ``triton_decode.decode_topk``, fused where it wins).

    ``ranges_and_kernel``: ``indexer_logits``' keywords (starts, ends, context_lens, kernel, fault).
    k is any positive integer; the Triton path is measured at 512, 1024 and 2048 (docs/perf/indexer.md).
    """
    opt = ranges_and_kernel.get
    if isinstance(keys, PagedKeys) and resolve_kernel(opt("kernel", "auto"), q.device) == "triton":
        _check_queries(q, w)
        _check_k(k)
        check_fault(opt("fault"), paged=True)
        _, lens = _ranges(keys, q.shape[0], opt("starts"), opt("ends"), opt("context_lens"), q.device)
        from needlescope.kernels import triton_decode

        return triton_decode.decode_topk(q, w, keys, lens, k, fault=opt("fault"))
    logits = indexer_logits(q, w, keys, **ranges_and_kernel)
    st, en = _ranges(keys, q.shape[0], opt("starts"), opt("ends"), opt("context_lens"), q.device)
    return topk(logits, k, st, en, kernel=opt("kernel", "auto"))
