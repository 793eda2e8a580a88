"""Triton kernel launches with less host time than ``JITFunction.__getitem__``.

A JIT launch binds and specializes every argument, looks its compiled kernel up under a string
made of the whole specialization and options, and builds launch metadata for Triton's launch
hook chain (empty, but never None, since Triton 3.4), every call. ``launch`` keys each compiled
kernel by a tuple of exactly what Triton specializes a launch on (the current device; every
tensor's dtype and 16-byte alignment; every integer's being 1, being a multiple of 16 and its
32- or 64-bit range; every float's type; the keyword arguments, which hold the constexprs and
the compile options) and calls a hit's launcher the way the JIT's own ``run`` does after its
lookup, with no hooks and no metadata. A miss launches through the JIT, which compiles, and
keeps its compiled kernel.

Measured on an H100 host with Triton 3.6 (docs/perf/indexer.md, runs 20-21): an empty kernel
19.3 -> 15.0 us of host time a call; ``paged_logits`` 84-95 -> 71-72 us at 32 / 64 x 128K, the
default decode path 249-305 -> 201-235 us. The rest is the wrapper's own tensor operations and
the driver's launch, which a CUDA graph skips.

Launches fall back to the JIT under the interpreter, while a launch hook is set (profilers such
as proton attach one), for arguments of any other type (tensor descriptors), for keyword values
other than numbers, strings and None, and where ``use_direct_launch(False)`` turned the direct
path off.
"""

from __future__ import annotations

import os

import torch
from triton import knobs
from triton.runtime import driver

__all__ = ["INTERPRET", "launch", "specialization_key", "use_direct_launch"]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_COMPILED: dict = {}
_DIRECT = [not INTERPRET]
_I32 = (-(2**31), 2**31)
_PLAIN = (int, float, bool, str, type(None))


def use_direct_launch(enabled: bool) -> bool:
    """Turn the direct path on or off (off: every launch through the JIT); returns the previous
    setting. Under ``TRITON_INTERPRET=1`` launches always go through the JIT."""
    previous = _DIRECT[0]
    _DIRECT[0] = bool(enabled) and not INTERPRET
    return previous


def specialization_key(args: tuple) -> tuple | None:
    """What Triton's launch specializes ``args`` (positional kernel arguments) on, as a hashable
    tuple; None where an argument is of a type this key does not cover."""
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, bool):
            key.append(bool)
        elif isinstance(a, int):
            key.append((a == 1, a % 16 == 0, _I32[0] <= a < _I32[1], a >= 2**63))
        elif isinstance(a, float):
            key.append(float)
        else:
            return None
    return tuple(key)


def _tail(kernel, n_args: int, meta: dict) -> tuple:
    """The values of ``kernel``'s parameters after the first ``n_args``, in signature order:
    ``meta``'s where it names them, else the parameter's default (what the JIT binds)."""
    tail = []
    for p in kernel.params[n_args:]:
        if p.name in meta:
            tail.append(meta[p.name])
        elif p.has_default:
            tail.append(p.default)
        else:
            raise TypeError(f"{kernel.__name__}: no value for parameter {p.name!r}")
    return tuple(tail)


def _hooked(hook) -> bool:
    """Whether a launch hook is set: Triton 3.4+ holds hooks in a ``HookChain``, empty by default
    (and passes it to every launch, which then builds launch metadata for it); older Tritons None."""
    return hook is not None and bool(getattr(hook, "calls", True))


def launch(kernel, grid: tuple, *args, **meta) -> None:
    """``kernel[grid](*args, **meta)`` (``args`` positional, ``meta`` the constexprs and options
    by keyword), through the compiled kernel's launcher where an earlier launch compiled it."""
    direct = _DIRECT[0] and not _hooked(knobs.runtime.launch_enter_hook)
    key = specialization_key(args) if direct and all(type(v) in _PLAIN for v in meta.values()) else None
    if key is None:
        kernel[grid](*args, **meta)
        return
    device = driver.active.get_current_device()
    key = (kernel, device, key, tuple(meta.items()))
    hit = _COMPILED.get(key)
    if hit is None:
        compiled = kernel[grid](*args, **meta)
        if compiled is not None:  # None: compiled asynchronously, not launched yet
            _COMPILED[key] = (compiled, _tail(kernel, len(args), meta))
        return
    compiled, tail = hit
    g = (*grid, 1, 1)
    compiled.run(
        g[0], g[1], g[2], driver.active.get_current_stream(device), compiled.function,
        compiled.packed_metadata, None, None, None, *args, *tail,
    )  # fmt: skip
