"""GPU gauges read through NVML (``nvidia-ml-py``) at scrape time, one series per GPU.

Without the package, the driver or a GPU, ``needlescope_gpu_devices`` is 0 and no per-GPU series
exist; ``GpuCollector.reason`` says why (the canary logs it once). A reading one GPU does not
support (power on some boards) is left out for that GPU rather than reported as 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["GPU_COUNT", "GPU_METRICS", "GpuCollector", "NoNvml"]

# name -> (help, NVML reading for one device handle)
GPU_METRICS = {
    "needlescope_gpu_utilization_ratio": (
        "Fraction of the last sample period a kernel ran",
        lambda nv, h: nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0,
    ),
    "needlescope_gpu_memory_used_bytes": (
        "Device memory in use",
        lambda nv, h: float(nv.nvmlDeviceGetMemoryInfo(h).used),
    ),
    "needlescope_gpu_memory_total_bytes": (
        "Device memory in all",
        lambda nv, h: float(nv.nvmlDeviceGetMemoryInfo(h).total),
    ),
    "needlescope_gpu_power_watts": (
        "Board power draw",
        lambda nv, h: nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
    ),
    "needlescope_gpu_temperature_celsius": (
        "GPU core temperature",
        lambda nv, h: float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
    ),
}
GPU_COUNT = "needlescope_gpu_devices"


class NoNvml:
    """An NVML stand-in with no GPU: for listing metric names and for tests, never the driver."""

    @staticmethod
    def nvmlInit() -> None:
        return None

    @staticmethod
    def nvmlDeviceGetCount() -> int:
        return 0


class GpuCollector(Collector):
    """A prometheus-client collector over NVML; ``nvml`` may be given (tests) or is imported."""

    def __init__(self, nvml: Any = None) -> None:
        self.nvml: Any = None
        self.reason = ""
        try:
            if nvml is None:
                import pynvml as nvml  # nvidia-ml-py
            nvml.nvmlInit()
            self.count = int(nvml.nvmlDeviceGetCount())
            self.nvml = nvml
        except ImportError:
            self.count, self.reason = 0, "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
        except Exception as e:  # pynvml.NVMLError and its many generated subclasses
            self.count, self.reason = 0, f"NVML unavailable: {e}"

    def describe(self) -> list:
        return []  # families vary with the GPUs present; read them at scrape time only

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(GPU_COUNT, "GPUs NVML reports (0 without NVML)", value=self.count)
        if self.nvml is None:
            return
        nv = self.nvml
        families = {
            name: GaugeMetricFamily(name, help_text, labels=["gpu", "name"])
            for name, (help_text, _) in GPU_METRICS.items()
        }
        for i in range(self.count):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(i)
                name = nv.nvmlDeviceGetName(handle)
            except Exception:  # a GPU that fell off the bus: leave it out of this scrape
                continue
            name = name.decode() if isinstance(name, bytes) else str(name)
            for metric, (_, read) in GPU_METRICS.items():
                try:
                    families[metric].add_metric([str(i), name], read(nv, handle))
                except Exception:  # NVMLError_NotSupported and kin: this board has no such reading
                    continue
        yield from families.values()
