"""Exact top-k over fp32 rows: the front of the four methods (three in Triton, one in CUDA C++), which
picks one.

Contract (every method keeps it): logits fp32 [R, L], starts (None: all 0) / ends int32 [R]
clamped to [0, L] -> int32 [R, k], the columns of each row's k largest entries inside [start,
end) under the key order of ``topk_parts.ordered_key`` (the float order; -0.0 equals +0.0; a NaN
with the sign bit clear ranks above +inf), ties at the k-th key to the lower index. Rows with
``end - start <= k`` give start..end-1 in order; unused slots are -1. Output order: the entries
above the k-th key in index order, then its ties in index order (``bisect`` keeps all k in index
order when the k-th key has no tie).

The methods, each with its own launcher and knobs:

* ``radix`` (``triton_radix.radix_topk``): cooperative radix select, every row split into chunks;
* ``filter`` (``triton_filter.filter_topk``): group-max filtering, then an exact search among the
  candidates;
* ``bisect`` (``triton_bisect.bisect_topk``): a threshold search in one program per row, or in
  segments merged by a second program;
* ``cuda`` (``cuda_topk.cuda_topk``): one CUDA thread block per row, keys in registers, or a row
  over a cluster of 8 blocks (sm_90+), compiled by NVRTC at first use (GPU only: no interpreter
  path).

``topk_method`` is the measured rule between them.
"""

from __future__ import annotations

import torch

__all__ = ["topk", "topk_method", "METHODS"]

METHODS = ("radix", "filter", "bisect", "cuda")


def topk_method(rows: int, width: int, k: int, cuda: bool | None = None, clusters: bool | None = None) -> str:
    """One of ``METHODS`` for a [rows, width] top-k; ``cuda``: whether the CUDA method is a candidate
    (None: where ``cuda_topk.available()``, and while a CUDA graph is being captured only if the
    kernel the shape launches is loaded, which ``topk``'s eager calls of such shapes do
    beforehand); ``clusters``: whether the device runs thread block clusters (None: the current
    CUDA device's capability, sm_90+). Its launch costs 18.5 us of host time a call eager through
    the driver (run 27; 270 us through PyTorch's NVRTC wrapper in run 26), against the filter's
    70.8 us, so eager calls take it too. Measured on an H100 (docs/perf/indexer.md), k = 512 at
    32K entries a row: the block kernel 12.9 / 14.0 / 14.1 us at 1 / 32 / 64 rows (one block a
    row; run 36) against the filter's 23.4 / 33.8 at 32 / 64 rows and the radix select's one
    launch at 1 row, 11.9 us (run 36; 12.3-14.7 at 1-4 rows in run 27, when the block kernel took
    15.5). So it takes 5+ rows of 4K-32K entries with k <= 2048, and, where clusters run, the
    shapes of ``cuda_topk.cluster_shape`` (its cluster path, a row over 8 blocks: 7.0-7.1 us at
    1-8 rows of 32K, 31.3 at 64 rows of 64K against the filter's 66.5; run 36). Without clusters
    rows 2-4 are left to the radix select's single launch (not measured against the block kernel
    since run 36 sped it up).
    Among the Triton methods, measured: one program per
    row wins at 2048 entries (8K-token decode rows: 10-12 us, launch-bound either way; H200, run
    7), so rows of up to 4096 entries take it. At 32-64 rows with k = 512 the filter wins (H100, docs/perf/indexer.md): 32 / 64 x 32K
    23.4 / 33.8 us against the split bisection's 36.4 / 52.7 (run 16), 32 / 64 x 64K 39.6 / 63.8
    against the radix select's 56.5 / 100.3 (run 17). Radix select elsewhere: the filter lost at
    1 x 32K (18 against 12 us), 8 x 256K (94 against 58) and every k = 2048 shape (run 16), where
    too few groups leave the threshold unselective."""
    from needlescope.kernels import cuda_topk

    if width <= 4096:
        return "bisect"
    if cuda is None:  # eager calls compile the kernel; a capture only uses loaded ones
        cuda = cuda_topk.available() and (
            not torch.cuda.is_current_stream_capturing()
            or cuda_topk.loaded(torch.device("cuda"), rows, width, k)
        )
    if cuda and rows >= 5 and width <= cuda_topk.FAST_WIDTH and k <= cuda_topk.FAST_K:
        return "cuda"
    if cuda and cuda_topk.cluster_shape(rows, width, k):
        if clusters is None:
            clusters = torch.cuda.is_available() and cuda_topk.clusters(torch.device("cuda"))
        if clusters:
            return "cuda"
    if rows >= 32 and k <= 512 and width <= 65536:
        return "filter"
    return "radix"


def topk(
    logits: torch.Tensor,
    k: int,
    starts: torch.Tensor | None,
    ends: torch.Tensor,
    *,
    method: str | None = None,
    out: torch.Tensor | None = None,
    **knobs,
) -> torch.Tensor:
    """logits fp32 [R, L], starts (None: all 0) / ends int32 [R] -> int32 [R, k] (module docstring).

    ``method``: one of ``METHODS``; None: ``topk_method``'s choice. ``knobs`` go to that method's
    launcher unchanged (``radix_topk``: chunk, bits, one_launch, num_warps, hist, first_pass;
    ``filter_topk``: block, cand_block, gmax_block, group, gmax, num_warps, counts;
    ``bisect_topk``: bits, block, num_warps, segment; ``cuda_topk``: path), which rejects
    another method's. The default method is ``cuda`` only for CUDA tensors.
    ``out`` (int32 [R, k], optional) is written in place; every element gets written.
    """
    if method is None:
        method = topk_method(*logits.shape, k, cuda=None if logits.is_cuda else False)
        if method == "cuda":
            from needlescope.kernels import cuda_topk

            cuda_topk.prepare(logits.device, *logits.shape, k)  # compiled here, not in a capture
            if not cuda_topk.available():  # compiling failed (warned once): a Triton method instead
                method = topk_method(*logits.shape, k, cuda=False)
    if method == "radix":
        from needlescope.kernels.triton_radix import radix_topk as launcher
    elif method == "filter":
        from needlescope.kernels.triton_filter import filter_topk as launcher
    elif method == "bisect":
        from needlescope.kernels.triton_bisect import bisect_topk as launcher
    elif method == "cuda":
        from needlescope.kernels.cuda_topk import cuda_topk as launcher
    else:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    return launcher(logits, k, starts, ends, out=out, **knobs)
