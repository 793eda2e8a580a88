"""Peak CPU memory that torch allocates while a function runs (the profiler's allocator events).

``peak_allocated(fn)`` runs ``fn()`` under ``torch.profiler.profile(profile_memory=True)``: the
profiler records every allocation and free of torch's CPU allocator as a ``[memory]`` event
with its signed byte count. Summed in time order they give the bytes live at each moment above
what was live before ``fn`` started; the maximum is the peak. Tensors made before the call (the
weights) are not counted; Python objects and memory that is not a torch tensor are not either.
Exact and deterministic, unlike the process's RSS (which the allocator's caching and the
kernel's page accounting blur); costs about 2x the call's time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

__all__ = ["peak_allocated"]

T = TypeVar("T")


def peak_allocated(fn: Callable[[], T]) -> tuple[T, int]:
    """(``fn()``, the peak bytes of CPU tensors allocated during it above the starting level)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        if e.device_type() != DeviceType.CPU:  # only host tensors are measured here
            continue
        live += e.nbytes()
        peak = max(peak, live)
    return result, peak
