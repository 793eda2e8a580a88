"""Top-k implementations as ``(scores, k, lengths) -> indices`` callables, for the conformance suite.

``scores`` fp32 [R, W], ``k`` an int, ``lengths`` int32 [R] (row r's entries: columns [0,
lengths[r])) -> integer [R, k], -1 in unused slots. ``OURS`` names every method and dispatch
path of needlescope's top-k (``needlescope kernels conform --impl ours`` runs them all);
``torch_topk`` wraps ``torch.topk``. Triton paths need CUDA tensors, or ``TRITON_INTERPRET=1``
on the CPU; the ``GPU_ONLY`` ones (the CUDA C++ method) need CUDA tensors. docs/conformance.md shows how to wrap an engine's kernel the same way.
"""

from __future__ import annotations

import torch

__all__ = ["OURS", "GPU_ONLY", "torch_topk", "reference"]


def torch_topk(scores: torch.Tensor, k: int, lengths: torch.Tensor) -> torch.Tensor:
    """``torch.topk`` on each row's first ``lengths[r]`` entries (a row at a time, so padding never
    competes with real entries), -1 padded."""
    out = torch.full((scores.shape[0], k), -1, dtype=torch.int64, device=scores.device)
    for r, n in enumerate(lengths.tolist()):
        take = min(k, n)
        if take > 0:
            out[r, :take] = torch.topk(scores[r, :n], take, sorted=False).indices
    return out


def reference(scores: torch.Tensor, k: int, lengths: torch.Tensor) -> torch.Tensor:
    """``kernels.reference.topk_reference``: the torch path ``indexer_topk`` takes off CUDA."""
    from needlescope.kernels.reference import topk_reference

    return topk_reference(scores, k, torch.zeros_like(lengths), lengths)


def _front(method: str | None, **knobs):
    def run(scores: torch.Tensor, k: int, lengths: torch.Tensor) -> torch.Tensor:
        from needlescope.kernels.topk import topk

        return topk(scores, k, None, lengths.to(torch.int32), method=method, **knobs)

    return run


def _sign_fold(key: torch.Tensor) -> torch.Tensor:
    """int64 keys in [0, 2**32) -> int32 with the same bits (the kernels' uint32 keys stored as int32)."""
    return torch.where(key >= 2**31, key - 2**32, key).to(torch.int32)


def _keys(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """int64 ordered keys (``topk_parts.ordered_key``), -inf's key past each row's length."""
    from needlescope.kernels.conformance import ordered_keys

    cols = torch.arange(scores.shape[1], device=scores.device)
    masked = torch.where(cols < lengths.long()[:, None], scores, float("-inf"))
    return ordered_keys(masked, torch.full_like(lengths, scores.shape[1]))


def given_maxima(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """int32 [R, ceil(W / 16)]: each row's group maxima of 16 columns as the paged logits kernel
    writes them (ordered keys stored as int32, -inf's key past the length)."""
    R, W = scores.shape
    key = torch.nn.functional.pad(_keys(scores, lengths), (0, -W % 16), value=0)
    return _sign_fold(key.view(R, -1, 16).amax(2))


def filter_given_maxima(scores: torch.Tensor, k: int, lengths: torch.Tensor) -> torch.Tensor:
    """The fused decode path's filter: group maxima of 16 columns supplied by the caller (as the
    paged logits kernel writes them, -inf past the length), so the filter skips its first launch."""
    from needlescope.kernels.triton_filter import filter_topk

    gmax = given_maxima(scores, lengths)
    return filter_topk(scores, k, None, lengths.to(torch.int32), gmax=gmax)


def cuda_given_maxima(scores: torch.Tensor, k: int, lengths: torch.Tensor) -> torch.Tensor:
    """The fused decode path's CUDA top-k (``cuda_topk.group_topk``) on the same supplied maxima."""
    from needlescope.kernels.cuda_topk import group_topk

    return group_topk(scores, k, lengths.to(torch.int32), given_maxima(scores, lengths))


def radix_first_pass(scores: torch.Tensor, k: int, lengths: torch.Tensor) -> torch.Tensor:
    """The fused decode path's radix select: pass 0's histogram (top 8 bits of each key in [0,
    length)) supplied by the caller, as the paged logits kernel builds it; the select starts at pass 1."""
    from needlescope.kernels.triton_radix import radix_topk

    R, W = scores.shape
    key = _keys(scores, lengths)
    cols = torch.arange(W, device=scores.device)
    digit = torch.where(cols < lengths.long()[:, None], key >> 24, 256)
    hist = torch.zeros(4, R, 256, dtype=torch.int32, device=scores.device)
    counts = torch.zeros(R, 257, dtype=torch.int64, device=scores.device)
    counts.scatter_add_(1, digit, torch.ones_like(digit))
    hist[0] = counts[:, :256].to(torch.int32)
    return radix_topk(scores, k, None, lengths.to(torch.int32), hist=hist, first_pass=1)


OURS = {
    "default": _front(None),
    "radix": _front("radix"),
    "radix-multi-launch": _front("radix", one_launch=False),
    "radix-small-chunks": _front("radix", chunk=256, one_launch=False),
    "radix-11bit": _front("radix", bits=11, one_launch=False),
    "radix-first-pass": radix_first_pass,
    "filter": _front("filter"),
    "filter-small-candidates": _front("filter", cand_block=64, block=1024),
    "filter-given-maxima": filter_given_maxima,
    "bisect": _front("bisect"),
    "bisect-unsplit": _front("bisect", segment=0),
    "bisect-radix8": _front("bisect", bits=8, segment=0),
    "cuda": _front("cuda"),
    "cuda-general": _front("cuda", path="general"),
    "cuda-cluster": _front("cuda", path="cluster"),
    "cuda-given-maxima": cuda_given_maxima,
    "reference": reference,
}
"""Every method and dispatch path of ours: ``default`` (``topk_method``'s choice), each method
with its defaults and with the knobs that take its other code paths (the filter's chunked
candidate search, the radix select over a launch per pass, with 11-bit digits, with pass 0 built
by a producer; the bisection unsplit and by radix digits; the CUDA method's register path, its
general path over the row in memory, its cluster path and its group path over supplied maxima),
and the torch reference."""
GPU_ONLY = ("cuda", "cuda-general", "cuda-cluster", "cuda-given-maxima")
"""Paths of ``OURS`` with no interpreter: they run on CUDA rows only."""
