"""GPU telemetry through NVML (nvidia-ml-py), behind a small adapter.

:class:`GpuTelemetry` samples every visible GPU (memory used/total, SM and
memory-bandwidth utilisation) at most once per :data:`SAMPLE_INTERVAL_S`,
when ``/metrics`` is scraped. Where NVML is absent (no driver, no GPU) it
logs that once, exports ``cachefleet_gpu_telemetry_available 0`` and carries
on; an NVML error later marks the sample stale, never the request path.

The NVML calls go through :class:`NvmlBackend` so tests can inject a fake;
the real backend is what runs in production and in the no-GPU tests.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from prometheus_client.core import GaugeMetricFamily, Metric

log = logging.getLogger("cachefleet.telemetry")

#: Minimum seconds between two NVML samples.
SAMPLE_INTERVAL_S = 1.0


@dataclass(frozen=True, slots=True)
class GpuSample:
    index: int
    name: str
    memory_used_bytes: int
    memory_total_bytes: int
    sm_utilization_ratio: float
    memory_bandwidth_utilization_ratio: float


class Backend(Protocol):
    def init(self) -> None: ...

    def sample(self) -> list[GpuSample]: ...


class NvmlBackend:
    """The real NVML calls."""

    def __init__(self) -> None:
        self._nvml: Any = None

    def init(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml

    def sample(self) -> list[GpuSample]:
        nvml = self._nvml
        out: list[GpuSample] = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            util = nvml.nvmlDeviceGetUtilizationRates(handle)
            name = nvml.nvmlDeviceGetName(handle)
            out.append(
                GpuSample(
                    index=index,
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    memory_used_bytes=int(mem.used),
                    memory_total_bytes=int(mem.total),
                    sm_utilization_ratio=util.gpu / 100.0,
                    memory_bandwidth_utilization_ratio=util.memory / 100.0,
                )
            )
        return out


class GpuTelemetry:
    """Cached GPU samples for the metrics endpoint and ``/status``."""

    def __init__(self, backend: Backend | None = None) -> None:
        self.backend: Backend = backend or NvmlBackend()
        self.available = False
        self.reason = ""
        self.errors = 0
        self._samples: list[GpuSample] = []
        self._sampled_at = 0.0
        self._lock = threading.Lock()
        try:
            self.backend.init()
            self.available = True
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError...
            self.reason = f"{type(exc).__name__}: {exc}"
            log.info("GPU telemetry unavailable (%s); carrying on without it", self.reason)

    def samples(self) -> list[GpuSample]:
        if not self.available:
            return []
        with self._lock:
            now = time.monotonic()
            if now - self._sampled_at >= SAMPLE_INTERVAL_S:
                try:
                    self._samples = self.backend.sample()
                except Exception as exc:
                    self.errors += 1
                    self._samples = []
                    log.warning("NVML sample failed: %s", exc)
                self._sampled_at = now
            return list(self._samples)

    def collect(self) -> Iterator[Metric]:
        avail = GaugeMetricFamily(
            "cachefleet_gpu_telemetry_available", "1 when NVML telemetry works on this pod."
        )
        avail.add_metric([], 1.0 if self.available else 0.0)
        yield avail
        samples = self.samples()
        if not samples:
            return
        families = {
            "memory_used_bytes": GaugeMetricFamily(
                "cachefleet_gpu_memory_used_bytes", "GPU memory in use.", labels=["gpu", "name"]
            ),
            "memory_total_bytes": GaugeMetricFamily(
                "cachefleet_gpu_memory_total_bytes", "GPU memory in all.", labels=["gpu", "name"]
            ),
            "sm_utilization_ratio": GaugeMetricFamily(
                "cachefleet_gpu_sm_utilization_ratio",
                "Fraction of time a kernel ran on the GPU (NVML utilization.gpu).",
                labels=["gpu", "name"],
            ),
            "memory_bandwidth_utilization_ratio": GaugeMetricFamily(
                "cachefleet_gpu_memory_bandwidth_utilization_ratio",
                "Fraction of time device memory was read or written (NVML utilization.memory).",
                labels=["gpu", "name"],
            ),
        }
        for s in samples:
            for attr, family in families.items():
                family.add_metric([str(s.index), s.name], float(getattr(s, attr)))
        yield from families.values()

    def describe(self) -> dict[str, Any]:
        return {
            "available": self.available,
            "reason": self.reason or None,
            "gpus": [asdict(s) for s in self.samples()],
        }
