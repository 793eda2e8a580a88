"""Place a DeepSeek-V4 checkpoint across devices, refuse before loading when it does not fit, and load it.

``plan_placement`` assigns the model's units in forward order (the embedding, each decoder layer
whole, then the final norm / hyper-connection head / lm head) to devices, filling each device's
weight budget before the next; a checkpoint whose weights exceed the budgets is refused with the
numbers before a byte is read. ``load_placed`` builds the model on the meta device, reads each
safetensors tensor once (memory-mapped), dequantizes block-fp8 weights on their target device
(``dsa.blockfp8``), stacks the release's per-expert matrices into transformers' expert
parameters (``dsa.release``), and, across several devices, adds accelerate's hooks that move
activations between them (the KV cache is left where each layer keeps it).

Budgets: ``max_memory`` gives the bytes of weights per device. Left out, a GPU's budget is its
free memory minus ``reserve`` (the chunked prefill's activations and the KV cache need it; see
docs/scale.md for the numbers at 128K tokens) and the CPU's is unbounded. The same code places
on CPU "devices" (``devices=["cpu", "cpu"]``), which is how the two-device split is tested.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from needlescope.errors import BadInput

__all__ = [
    "DEFAULT_RESERVE",
    "GiB",
    "Placement",
    "auto_devices",
    "default_budget",
    "human_bytes",
    "parse_max_memory",
    "plan_placement",
    "unit_bytes",
]

GiB = 1 << 30
DEFAULT_RESERVE = 24 * GiB
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}  # fmt: skip


def _size(text: str) -> int:
    m = _SIZE.match(text)
    if m is None:
        raise BadInput(
            f"memory size {text!r} is not a number with an optional unit (e.g. 70GiB, 64GB, 1024MiB)"
        )
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])


def human_bytes(n: int) -> str:
    """``n`` bytes with a binary unit that keeps two significant decimals meaningful."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def parse_max_memory(spec: str | None, n_devices: int) -> list[int | None]:
    """Per-device weight budgets from ``"70GiB"`` (every device) or ``"70GiB,60GiB"`` (one per device)."""
    if spec is None:
        return [None] * n_devices
    parts = [p for p in spec.split(",") if p.strip()]
    sizes = [_size(p) for p in parts]
    if len(sizes) == 1:
        return sizes * n_devices
    if len(sizes) != n_devices:
        raise BadInput(
            f"--max-memory names {len(sizes)} budgets for {n_devices} devices; give one, or one per device"
        )
    return sizes


def auto_devices() -> list[str]:
    """The visible GPUs (``cuda:0`` ...), else ``["cpu"]``."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu"]


def default_budget(device: str, reserve: int) -> int | None:
    """A GPU's free memory minus ``reserve``; None (unbounded) for the CPU."""
    if not device.startswith("cuda"):
        return None
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return max(free - reserve, 0)


def unit_bytes(model: torch.nn.Module) -> list[tuple[str, int]]:
    """(module path, bytes of parameters and persistent buffers) of each placement unit, in forward order.

    Units: every direct child of ``model.model`` except ``layers``, each decoder layer, and every
    other direct child of ``model`` (``lm_head``). Sizes count each tensor's own dtype.
    """
    inner = model.model
    units: list[tuple[str, torch.nn.Module]] = []
    for name, child in inner.named_children():
        if name == "layers":
            units += [(f"model.layers.{i}", layer) for i, layer in enumerate(child)]
        else:
            units.append((f"model.{name}", child))
    units += [(name, child) for name, child in model.named_children() if name != "model"]
    out = []
    for path, mod in units:
        n = sum(p.numel() * p.element_size() for p in mod.parameters())
        n += sum(b.numel() * b.element_size() for b in mod.buffers())
        out.append((path, n))
    return out


@dataclass(frozen=True)
class Placement:
    """Which device each unit goes to, and the bytes that puts on each device."""

    devices: list[str]
    budgets: list[int | None]
    units: dict[str, int]  # unit path -> index into devices
    unit_sizes: dict[str, int] = field(default_factory=dict)

    def device_map(self) -> dict[str, str]:
        return {path: self.devices[i] for path, i in self.units.items()}

    def bytes_per_device(self) -> list[int]:
        out = [0] * len(self.devices)
        for path, i in self.units.items():
            out[i] += self.unit_sizes.get(path, 0)
        return out

    def report(self) -> dict:
        """JSON-ready: per device its name, weight bytes, budget and the units placed there."""
        used = self.bytes_per_device()
        return {
            "devices": [
                {
                    "index": i,
                    "device": d,
                    "weight_bytes": used[i],
                    "budget_bytes": self.budgets[i],
                    "units": [p for p, j in self.units.items() if j == i],
                }
                for i, d in enumerate(self.devices)
            ],
            "total_weight_bytes": sum(used),
        }


def plan_placement(
    sizes: Sequence[tuple[str, int]], devices: Sequence[str], budgets: Sequence[int | None]
) -> Placement:
    """Assign ``sizes`` (unit path, bytes) in order to ``devices`` within ``budgets`` (None: unbounded).

    A unit never straddles devices; the next device starts when a unit does not fit the current
    one. BadInput, with the bytes needed against the bytes available, when the units do not fit.
    """
    if not devices or len(devices) != len(budgets):
        raise ValueError(f"{len(devices)} devices for {len(budgets)} budgets")
    units: dict[str, int] = {}
    used = [0] * len(devices)
    slot = 0
    for path, n in sizes:
        while slot < len(devices) and budgets[slot] is not None and used[slot] + n > budgets[slot]:
            slot += 1
        if slot == len(devices):
            total = sum(s for _, s in sizes)
            room = ", ".join(
                f"{d}: {'unbounded' if b is None else human_bytes(b)}" for d, b in zip(devices, budgets)
            )
            raise BadInput(
                f"the checkpoint's weights need {human_bytes(total)} ({len(sizes)} units, the largest "
                f"{human_bytes(max(s for _, s in sizes))}) but the budgets are {room}; unit {path!r} "
                f"({human_bytes(n)}) fits nowhere. Give more devices or a larger --max-memory"
            )
        units[path] = slot
        used[slot] += n
    return Placement(list(devices), list(budgets), units, dict(sizes))
