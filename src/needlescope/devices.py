"""The ``--device`` check every command that runs torch shares. Torch is imported only when a
device is checked, so the command line imports this module without it."""

from __future__ import annotations

from needlescope.errors import BadInput

__all__ = ["check_device"]


def check_device(device: str, flag: str = "--device") -> None:
    """BadInput (one line, exit 2) when ``device`` is not a cpu or CUDA device, or names a CUDA
    device this torch cannot use."""
    import torch

    try:
        kind = torch.device(str(device)).type
    except (RuntimeError, ValueError):
        kind = None
    if kind not in ("cpu", "cuda"):
        raise BadInput(f"{flag} {device!r} is not a device these tools run on; pass cpu, cuda or cuda:N")
    if kind == "cpu":
        return
    if not torch.cuda.is_available():
        build = "a CPU-only torch build" if torch.version.cuda is None else "no CUDA GPU visible"
        raise BadInput(f"{flag} {device} was given but CUDA is not available ({build}); pass {flag} cpu")
    index = str(device).partition(":")[2]
    if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
        raise BadInput(f"{flag} {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
