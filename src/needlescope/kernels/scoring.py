"""The indexer kernels behind ``lightning_scores``' signature, for the model and synthetic paths.

``kernel_backend(kernel, device)`` is what the CLI enters around a run: with ``auto`` (the
default) the kernels score every call they can (CUDA, bf16 or fp8_e4m3 keys and queries, fp32
accumulation) and the reference scores the rest; ``triton`` refuses what the kernels cannot do;
``reference`` (or ``auto`` off CUDA) leaves ``needlescope.dsa`` on its torch reference.

``needlescope.dsa`` scores through ``dsa.reference.lightning_scores`` on fake-quantized fp32
tensors. ``scores_factory(kernel)`` returns what ``dsa.emulate.scores_backend`` takes: a
function of (index_k, index_q) that gives a drop-in scorer running ``indexer_logits`` on the
exact codes of those tensors. Re-quantizing a fake-quantized tensor is exact (its absmax maps
to 448 again, every value is already on the grid), so the kernel sees the same numbers the
reference does. The kernel reads q and k as bf16 or fp8_e4m3 and accumulates in fp32; other
precisions are refused with BadInput rather than silently rounded.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from needlescope.dsa.emulate import scores_backend
from needlescope.dsa.reference import lightning_scores
from needlescope.errors import BadInput
from needlescope.kernels.dispatch import indexer_logits, resolve_kernel
from needlescope.kernels.layout import KEY_DTYPES, quantize_keys, quantize_queries
from needlescope.kernels.reference import check_fault

__all__ = ["scores_factory", "kernel_backend"]

Scores = Callable[..., torch.Tensor]


def _check(index_k: str, index_q: str) -> None:
    if index_k not in KEY_DTYPES or index_q not in KEY_DTYPES:
        raise BadInput(
            f"the indexer kernel reads keys and queries as {' or '.join(KEY_DTYPES)}; got keys {index_k!r} "
            f"and queries {index_q!r}: pass --index-k/--index-q from those (or --kernel reference)"
        )


def scores_factory(
    kernel: str = "triton", *, strict: bool = True, fault: str | None = None
) -> Callable[[str, str], Scores]:
    """(index_k, index_q) -> scorer with ``lightning_scores``' signature, computed by ``kernel``.

    ``strict``: refuse precisions the kernels cannot compute; otherwise score those with the reference.
    ``fault`` (debug): a kernel fault of the contiguous layout (``indexer_key_slot``).
    """
    check_fault(fault, paged=False)

    def make(index_k: str, index_q: str) -> Scores:
        if not strict and (index_k not in KEY_DTYPES or index_q not in KEY_DTYPES):
            return lightning_scores
        _check(index_k, index_q)

        def scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, **how) -> torch.Tensor:
            """``lightning_scores(q, k, w, **how)`` on the kernel: q [..., S, H, D], k [..., L, D],
            w [..., S, H] (fake-quantized) -> fp32 [..., S, L]."""
            acc_dtype = how.get("acc_dtype", torch.float32)
            if acc_dtype != torch.float32 and not strict:
                return lightning_scores(q, k, w, **how)
            if acc_dtype != torch.float32:
                raise BadInput(
                    "the indexer kernel accumulates in fp32; use --score-dtype fp32 (or --kernel reference)"
                )
            lead = q.shape[:-3]
            S, H, D = q.shape[-3:]
            if k.shape[-2] == 0:
                return q.new_zeros((*lead, S, 0), dtype=torch.float32)
            qs, ks, ws = q.reshape(-1, S, H, D), k.reshape(-1, *k.shape[-2:]), w.reshape(-1, S, H)
            if ks.shape[0] != qs.shape[0]:
                ks = ks.expand(qs.shape[0], -1, -1)
            rows = []
            for qb, kb, wb in zip(qs, ks, ws):
                # scale > 0 and weight_scale > 0 commute with ReLU, so both fold into w.
                fold = how["scale"] * how.get("weight_scale", 1.0)
                codes, wf = quantize_queries(qb, wb.float() * fold, index_q)
                rows.append(indexer_logits(codes, wf, quantize_keys(kb, index_k), kernel=kernel, fault=fault))
            return torch.stack(rows).reshape(*lead, S, k.shape[-2])

        return scores

    return make


def kernel_backend(
    kernel: str, device: str | torch.device, fault: str | None = None
) -> AbstractContextManager:
    """Context in which ``needlescope.dsa`` scores through ``kernel`` (auto | reference | triton) on
    ``device``; ``fault`` (debug) runs a kernel fault and needs ``kernel="triton"``."""
    impl = resolve_kernel(kernel, torch.device(device))
    if fault is not None and kernel != "triton":
        raise BadInput("a kernel fault runs in the triton kernel: add --kernel triton")
    if impl == "reference":
        return scores_backend(None)
    return scores_backend(scores_factory(impl, strict=kernel == "triton", fault=fault))
