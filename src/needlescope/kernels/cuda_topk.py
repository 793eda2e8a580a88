"""Exact top-k in CUDA C++: the ``cuda`` method of ``topk``. Paths: one thread block a row (keys in
registers for rows of up to 32K entries, else the row from memory), or a row over a cluster of 8
blocks (sm_90+, rows of up to 64K entries; ``cuda_topk(path="cluster")``).

The kernel source is ``cuda_topk.cu`` beside this module (its header has the algorithm); it is
compiled by NVRTC through ``torch.cuda._compile_kernel`` at the first call on a device and cached
for the process. The contract is ``topk``'s (kernels/topk.py): logits fp32 [R, L], starts (None:
all 0) / ends int32 [R] clamped to [0, L] -> int32 [R, k], ties at the k-th key to the lower index,
output above the k-th key in index order then its ties, -1 in unused slots.

Needs a CUDA device and PyTorch's NVRTC binding; there is no interpreter path, so ``make test``
(CPU) checks the launcher's input validation only and the GPU script runs the conformance suite
on it (bench/indexer_gpu.sh, ``conform``).
"""

from __future__ import annotations

import ctypes
import functools
import warnings
from importlib import resources

import torch

__all__ = [
    "cuda_topk",
    "available",
    "clusters",
    "loaded",
    "prepare",
    "cuda_path",
    "cluster_shape",
    "FAST_WIDTH",
    "FAST_K",
    "CLUSTER_WIDTH",
    "PATHS",
    "group_topk",
    "group_loaded",
    "GROUP",
    "GROUP_WIDTH",
]

FAST_WIDTH = 32768
"""Rows of at most this many entries keep their keys in registers (1024 threads x 32)."""
FAST_K = 2048
"""k up to this takes the register path; larger k, longer rows, or a row where more than 4,096
entries pass the group-max bound take the general path (radix select over the row in memory)."""
_THREADS = 1024
_CLUSTER = 8  # thread blocks a row on the cluster path (``CL`` in the source)
_CLUSTER_NAMES = {  # rows of up to this many entries -> (kernel, threads a block)
    32768: ("needlescope_topk_cluster_32k", 1024),
    65536: ("needlescope_topk_cluster_64k", 512),
}
CLUSTER_WIDTH = max(_CLUSTER_NAMES)
"""Rows of at most this many entries can take the cluster path (sm_90 and later)."""
PATHS = ("auto", "block", "general", "cluster")
GROUP = 16
"""Entries a group maximum of ``group_topk`` covers (consecutive, aligned to column 0)."""
_GROUP_NAMES = {4096: "needlescope_topk_groups4", 16384: "needlescope_topk_groups16"}  # groups -> kernel
GROUP_WIDTH = GROUP * max(_GROUP_NAMES)
"""Rows of at most this many entries run ``group_topk`` (262,144: a 1M-token context)."""
_KERNELS: dict[tuple[int, str], object] = {}
_BROKEN: list[str] = []  # why compiling failed once in this process (then ``available`` is False)


def available() -> bool:
    """A CUDA device and PyTorch's NVRTC binding are both present (and compiling has not failed)."""
    return torch.cuda.is_available() and hasattr(torch.cuda, "_compile_kernel") and not _BROKEN


def clusters(device: torch.device) -> bool:
    """The device runs thread block clusters (compute capability 9.0 and later)."""
    return _has_clusters(_index(device))


@functools.cache
def _has_clusters(index: int) -> bool:
    # Once a device: an eager default call asks up to four times (the rule, prepare, the launch).
    return torch.cuda.get_device_capability(index)[0] >= 9


def cluster_shape(rows: int, width: int, k: int) -> bool:
    """Whether ``rows`` rows of ``width`` entries take the cluster path (where clusters run).
    Measured on an H100 (docs/perf/indexer.md, graph-replayed, k = 512): at 32K entries the
    cluster path took 7.0 / 7.1 us at 1 / 8 rows against the block kernel's 12.9 and the radix
    select's 11.9 at 1 row (run 36); at 16 rows 15.5 against the block kernel's 15.7 (run 33,
    before plain histogram atomics sped both up; not measured since); at 32 / 64 rows 19.8 /
    33.6 against the block kernel's 14.0 / 14.1 (run 36: eight blocks a row no longer all run at
    once), so rows of 16K-32K take it up to 8 rows. At 64K entries it took 31.3 us at 64 rows
    (run 36) and 14.4 / 29.3 at 8 / 32 (run 33) against the filter's 66.5 / 21.7 / 40.1 and the
    radix select's 97.9 / 21.8 / 55.9 (the block kernel's general path: 121-129), and 13.2 at 1
    row against the radix select's 12.9 (run 33), which grows ~1.2 us a row: rows of 32K-64K
    take it from 4 rows. Rows of 16K entries and fewer were not measured on it."""
    if k > FAST_K:
        return False
    if FAST_WIDTH // 2 < width <= FAST_WIDTH:
        return rows <= 8
    return FAST_WIDTH < width <= CLUSTER_WIDTH and rows >= 4


def cuda_path(rows: int, width: int, k: int, device: torch.device) -> str:
    """The path ``auto`` takes: ``cluster`` where ``cluster_shape`` says so and the device runs
    clusters, else ``block``."""
    return "cluster" if cluster_shape(rows, width, k) and clusters(device) else "block"


def _kernel_for(path: str, width: int, k: int) -> tuple[str, int]:
    """(kernel name, threads a block) that a resolved ``path`` launches for rows of ``width``."""
    if path == "cluster":
        return next(v for w, v in sorted(_CLUSTER_NAMES.items()) if width <= w)
    return ("needlescope_topk_sub2" if k <= 512 else "needlescope_topk_sub8"), _THREADS


def _resolve(path: str, rows: int, width: int, k: int, device: torch.device) -> str:
    if path == "auto":
        path = cuda_path(rows, width, k, device)
    if path == "cluster" and not (width <= CLUSTER_WIDTH and clusters(device)):
        path = "block"
    return path


def _default_kernel(device: torch.device, rows: int, width: int, k: int) -> str:
    return _kernel_for(_resolve("auto", rows, width, k, device), width, k)[0]


def loaded(device: torch.device, rows: int, width: int, k: int) -> bool:
    """The kernel a default call on a [rows, width] top-k launches is compiled and loaded for
    ``device``, so a graph capture can launch it."""
    return (_index(device), _default_kernel(device, rows, width, k)) in _KERNELS


def prepare(device: torch.device, rows: int, width: int, k: int) -> None:
    """Compile and load the kernel a default call on a [rows, width] top-k launches, now, outside
    any graph capture (loading a module while a stream is captured is not something to rely on).
    The front calls it from eager calls whose shape the CUDA method takes. A failure is warned
    once and turns ``available`` off for the process, so the Triton methods keep working."""
    if not available() or torch.cuda.is_current_stream_capturing() or loaded(device, rows, width, k):
        return
    try:
        _kernel(device, _default_kernel(device, rows, width, k))
    except Exception as e:  # NVRTC or the driver: reported, and the method is not offered again
        _BROKEN.append(f"{type(e).__name__}: {e}")
        warnings.warn(
            f"needlescope: the CUDA top-k could not be compiled ({_BROKEN[0]}); using Triton", stacklevel=2
        )


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _kernel(device: torch.device, name: str):
    """The compiled kernel ``name`` for ``device``, compiled once a process."""
    key = (_index(device), name)
    if key not in _KERNELS:
        src = resources.files("needlescope.kernels").joinpath("cuda_topk.cu").read_text(encoding="utf-8")
        with torch.cuda.device(key[0]):
            _KERNELS[key] = torch.cuda._compile_kernel(src, name)
    return _KERNELS[key]


@functools.cache
def _driver():
    """libcuda's ``cuLaunchKernel``, typed once: PyTorch's wrapper opens the library and builds
    its argument conversion on every call (~270 us of host time a launch, run 26)."""
    lib = ctypes.CDLL("libcuda.so.1")
    launch = lib.cuLaunchKernel
    launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    launch.restype = ctypes.c_int
    return launch


def _launch(device: torch.device, name: str, grid: tuple[int, int], threads: int, args: list) -> None:
    """One launch of kernel ``name``: ``args`` are CUDA tensors (passed as pointers) and ints."""
    kernel = _kernel(device, name)
    values = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else ctypes.c_int(a) for a in args]
    pointers = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
    stream = torch.cuda.current_stream(device).cuda_stream
    rc = _driver()(kernel.func, grid[0], grid[1], 1, threads, 1, 1, 0, stream, pointers, None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernel({name}) failed with CUresult {rc}")


def _check(logits: torch.Tensor, k: int, starts: torch.Tensor | None, ends: torch.Tensor) -> None:
    if not available():
        raise RuntimeError("the cuda top-k needs a CUDA device and torch.cuda._compile_kernel (NVRTC)")
    if logits.dim() != 2 or logits.dtype != torch.float32 or not logits.is_cuda:
        raise ValueError(
            f"logits must be a 2-D float32 CUDA tensor, got {tuple(logits.shape)} {logits.dtype}"
        )
    if logits.shape[1] > 0 and logits.stride(1) != 1:
        raise ValueError("logits rows must be contiguous (stride 1 along a row)")
    if not 1 <= k < 2**31 or logits.stride(0) >= 2**31:
        raise ValueError(f"k must be in [1, 2**31) and the row stride below 2**31, got k={k}")
    for name, t in (("ends", ends), ("starts", starts)):
        if t is None:
            continue
        if t.dtype != torch.int32 or t.shape != (logits.shape[0],) or t.device != logits.device:
            raise ValueError(f"{name} must be int32 [{logits.shape[0]}] on {logits.device}")


def _output(out: torch.Tensor | None, R: int, k: int, device: torch.device) -> torch.Tensor:
    """``out`` checked (a contiguous int32 [R, k]), or a new one."""
    if out is None:
        return torch.empty(R, k, dtype=torch.int32, device=device)
    if out.shape != (R, k) or out.dtype != torch.int32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous int32 [{R}, {k}] tensor")
    return out


def cuda_topk(
    logits: torch.Tensor,
    k: int,
    starts: torch.Tensor | None,
    ends: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    path: str = "auto",
) -> torch.Tensor:
    """logits fp32 [R, L], starts (None: all 0) / ends int32 [R] -> int32 [R, k] (module docstring).

    ``path``: ``block`` (one block a row: keys in registers, the general path where they do not
    fit), ``general`` (every row on the block's general path over the row in memory), ``cluster``
    (a row over a cluster of blocks where it fits: rows of at most ``CLUSTER_WIDTH`` on sm_90+;
    the block path otherwise) or ``auto`` (``cuda_path``'s choice). ``out`` (int32 [R, k],
    contiguous) is written in place; every element gets written."""
    _check(logits, k, starts, ends)
    R, L = logits.shape
    if path not in PATHS:
        raise ValueError(f"path must be one of {', '.join(PATHS)}, got {path!r}")
    path = _resolve(path, R, L, k, logits.device)
    out = _output(out, R, k, logits.device)
    if R == 0:
        return out
    has_starts = starts is not None
    ends = ends.contiguous()
    starts = starts.contiguous() if has_starts else ends  # not read when has_starts is 0
    args = [logits, logits.stride(0), starts, int(has_starts), ends, L, k, out]
    name, threads = _kernel_for(path, L, k)
    if path == "cluster":
        _launch(logits.device, name, (_CLUSTER, R), threads, args)
    else:
        _launch(logits.device, name, (R, 1), threads, [*args, int(path == "general")])
    return out


def _group_kernel(groups: int) -> str:
    """The group path's kernel for rows of ``groups`` group maxima."""
    return next(v for g, v in sorted(_GROUP_NAMES.items()) if groups <= g)


def group_loaded(device: torch.device, width: int) -> bool:
    """``group_topk``'s kernel for rows of ``width`` entries is compiled and loaded for ``device``
    (a graph capture launches only loaded kernels)."""
    return width <= GROUP_WIDTH and (_index(device), _group_kernel(-(-width // GROUP))) in _KERNELS


def group_topk(
    logits: torch.Tensor,
    k: int,
    ends: torch.Tensor,
    gmax: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits fp32 [R, L] with L <= ``GROUP_WIDTH``, ends int32 [R] (rows are [0, ends[r]), clamped
    to [0, L]), gmax int32 [R, >= ceil(L / 16)] -> int32 [R, k], the contract of ``cuda_topk``.

    ``gmax[r, j]``: the largest ``ordered_key`` (uint32 stored as int32) of columns [16 j, 16 j + 16)
    of row r, with -inf's key (or 0) standing for columns at or past ``ends[r]``, as the paged
    logits kernel writes them (``triton_logits.paged_logits(gmax=...)``). The kernel reads the
    maxima and only the groups whose maximum reaches the bound (the source's group path), so a
    decode step that wrote the maxima with its logits skips reading most of each row. Maxima
    that break that rule are not detected. One below an entry of its group (e.g. from other
    logits) can make the selection inexact. Ones above every entry of their groups cost only
    time: every entry at or above the bound is still read, and rows they leave with fewer than k
    candidates take the general path (docs/perf/indexer.md; measured exact with k + 100 groups
    claiming +inf, run 41, and one ulp high, run 43). Either way the kernel writes only the
    rows' k slots. Pass only maxima written with these logits, as ``decode_topk`` does."""
    _check(logits, k, None, ends)
    R, L = logits.shape
    if L > GROUP_WIDTH:
        raise ValueError(f"group_topk takes rows of at most {GROUP_WIDTH} entries, got {L}")
    groups = -(-L // GROUP)
    if gmax.dtype != torch.int32 or gmax.dim() != 2 or gmax.shape[0] != R or gmax.shape[1] < groups:
        raise ValueError(f"gmax must be int32 [{R}, >= {groups}], got {gmax.dtype} {tuple(gmax.shape)}")
    if gmax.device != logits.device or (groups > 1 and gmax.stride(1) != 1) or gmax.stride(0) >= 2**31:
        raise ValueError(f"gmax must be on {logits.device} with contiguous rows")
    out = _output(out, R, k, logits.device)
    if R == 0:
        return out
    name = _group_kernel(groups)
    if torch.cuda.is_current_stream_capturing() and (_index(logits.device), name) not in _KERNELS:
        raise RuntimeError(f"{name} is not loaded: call group_topk once outside the graph capture first")
    args = [logits, logits.stride(0), gmax, gmax.stride(0), ends.contiguous(), L, k, out]
    _launch(logits.device, name, (R, 1), _THREADS, args)
    return out
