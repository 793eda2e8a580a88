"""How many programs of a compiled Triton kernel one SM holds at once.

The persistent decode loop launches that many programs a SM: it asks the CUDA occupancy
calculator about the exact compiled kernel (registers, shared memory, threads), so the number
follows the Triton version and the GPU instead of a table.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["blocks_per_sm", "cached_blocks_per_sm", "known_blocks_per_sm", "normal_device", "sm_count"]

_CACHE: dict = {}
_SMS: dict = {}


def normal_device(device) -> torch.device:
    """``device`` with its index filled in ("cuda" and "cuda:0" are one device)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (1 off CUDA), cached: ``get_device_properties``
    took a measurable part of a decode call's host time."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def blocks_per_sm(compiled) -> int:
    """Programs of ``compiled`` (a Triton ``CompiledKernel``) one SM of the current device holds at once."""
    compiled._init_handles()
    cuda = ctypes.CDLL("libcuda.so.1")
    n = ctypes.c_int(0)
    rc = cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(n),
        ctypes.c_void_p(compiled.function),
        ctypes.c_int(compiled.metadata.num_warps * 32),
        ctypes.c_size_t(compiled.metadata.shared),
    )
    if rc != 0:
        raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor returned CUresult {rc}")
    return n.value


def cached_blocks_per_sm(key: tuple, compile_kernel) -> int:
    """``blocks_per_sm`` of ``compile_kernel()`` (a ``JITFunction.warmup`` call), once per ``key``."""
    if key not in _CACHE:
        _CACHE[key] = blocks_per_sm(compile_kernel())
    return _CACHE[key]


def known_blocks_per_sm() -> dict:
    """Every ``cached_blocks_per_sm`` answer so far, keyed by the repr of its key (for benchmark records)."""
    return {repr(k): v for k, v in _CACHE.items()}
