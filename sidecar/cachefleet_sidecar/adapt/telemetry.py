"""GPU telemetry through NVML (nvidia-ml-py), behind a small adapter.

:class:`GpuTelemetry` samples every visible GPU (memory used/total, SM and
memory-bandwidth utilisation) at most once per :data:`SAMPLE_INTERVAL_S`,
when ``/metrics`` is scraped. Where NVML is absent (no driver, no GPU) it
logs that once, exports ``cachefleet_gpu_telemetry_available 0`` and carries
on; an NVML error later marks the sample stale, never the request path.

GPM (GPU Performance Monitoring, Hopper and later): where the driver offers
it for a device, :class:`NvmlBackend` also reads SM occupancy and DRAM
bandwidth utilisation between two consecutive samples (``nvmlGpmSampleGet``
each time, ``nvmlGpmMetricsGet`` on the pair: no sleeping on the caller's
path). Those are finer than NVML's ``utilization.gpu`` (the share of time
*any* kernel ran: 1.0 under a single busy kernel), so the switching engine's
GPU pressure prefers them where present. A device without GPM support (or
a driver without the API) keeps the plain gauges only, said once per device.

The NVML calls go through :class:`NvmlBackend` so tests can inject a fake;
the real backend is what runs in production and in the no-GPU tests. The
backend itself takes the ``pynvml`` module as a parameter, so the GPM path
is tested against a fake of that module (no GPU was lent to check it on a
real Hopper: docs/sits.md).
"""

from __future__ import annotations

import contextlib
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
    #: GPM SM occupancy (0..1) since the previous sample; None without GPM.
    sm_occupancy_ratio: float | None = None
    #: GPM DRAM bandwidth utilisation (0..1) since the previous sample; None without GPM.
    dram_bandwidth_ratio: float | None = None


class Backend(Protocol):
    def init(self) -> None: ...

    def sample(self) -> list[GpuSample]: ...


class NvmlBackend:
    """The real NVML calls (``nvml``: the ``pynvml`` module, or a fake of it in tests)."""

    def __init__(self, nvml: Any = None) -> None:
        self._given = nvml
        self._nvml: Any = None
        #: device index -> the previous GPM sample (None: GPM not offered there).
        self._gpm: dict[int, Any] = {}
        #: device index -> why GPM is not read there (for /status).
        self.gpm_missing: dict[int, str] = {}

    def init(self) -> None:
        nvml = self._given
        if nvml is None:
            import pynvml

            nvml = pynvml
        nvml.nvmlInit()
        self._nvml = nvml

    def sample(self) -> list[GpuSample]:
        nvml = self._nvml
        out: list[GpuSample] = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            util = nvml.nvmlDeviceGetUtilizationRates(handle)
            name = nvml.nvmlDeviceGetName(handle)
            occupancy, dram = self._gpm_metrics(index, handle)
            out.append(
                GpuSample(
                    index=index,
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    memory_used_bytes=int(mem.used),
                    memory_total_bytes=int(mem.total),
                    sm_utilization_ratio=util.gpu / 100.0,
                    memory_bandwidth_utilization_ratio=util.memory / 100.0,
                    sm_occupancy_ratio=occupancy,
                    dram_bandwidth_ratio=dram,
                )
            )
        return out

    def _gpm_metrics(self, index: int, handle: Any) -> tuple[float | None, float | None]:
        """GPM SM occupancy and DRAM bandwidth since the previous sample of this device."""
        if index in self.gpm_missing:
            return None, None
        nvml = self._nvml
        try:
            if index not in self._gpm:
                if not nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice:
                    self._no_gpm(index, "the device does not support GPM (before Hopper?)")
                    return None, None
                self._gpm[index] = nvml.nvmlGpmSampleGet(handle, nvml.nvmlGpmSampleAlloc())
                return None, None  # a rate needs two samples
            fresh = nvml.nvmlGpmSampleGet(handle, nvml.nvmlGpmSampleAlloc())
            previous, self._gpm[index] = self._gpm[index], fresh
            try:
                query = nvml.c_nvmlGpmMetricsGet_t()
                query.version = nvml.NVML_GPM_METRICS_GET_VERSION
                query.numMetrics = 2
                query.sample1 = previous
                query.sample2 = fresh
                query.metrics[0].metricId = nvml.NVML_GPM_METRIC_SM_OCCUPANCY
                query.metrics[1].metricId = nvml.NVML_GPM_METRIC_DRAM_BW_UTIL
                nvml.nvmlGpmMetricsGet(query)
            finally:
                nvml.nvmlGpmSampleFree(previous)
        except Exception as exc:  # NVMLError_NotSupported, FunctionNotFound (old driver), ...
            self._no_gpm(index, f"{type(exc).__name__}: {exc}")
            return None, None
        occupancy, dram = (
            _ratio(m.value) if m.nvmlReturn == 0 else None for m in query.metrics[:2]
        )
        return occupancy, dram

    def _no_gpm(self, index: int, reason: str) -> None:
        self.gpm_missing[index] = reason
        previous = self._gpm.pop(index, None)
        if previous is not None:
            with contextlib.suppress(Exception):  # the sample is lost either way
                self._nvml.nvmlGpmSampleFree(previous)
        log.info("GPU %d: GPM metrics unavailable (%s); plain NVML gauges only", index, reason)


def _ratio(percent: float) -> float:
    """A GPM percentage as a ratio in [0, 1]."""
    return min(1.0, max(0.0, float(percent) / 100.0))


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
            "sm_occupancy_ratio": GaugeMetricFamily(
                "cachefleet_gpu_sm_occupancy_ratio",
                "SM occupancy between two samples (NVML GPM; only where the GPU offers it).",
                labels=["gpu", "name"],
            ),
            "dram_bandwidth_ratio": GaugeMetricFamily(
                "cachefleet_gpu_dram_bandwidth_utilization_ratio",
                "DRAM bandwidth used, of the peak, between two samples (NVML GPM; where offered).",
                labels=["gpu", "name"],
            ),
        }
        for s in samples:
            for attr, family in families.items():
                value = getattr(s, attr)
                if value is not None:
                    family.add_metric([str(s.index), s.name], float(value))
        yield from (f for f in families.values() if f.samples)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "available": self.available,
            "reason": self.reason or None,
            "gpus": [asdict(s) for s in self.samples()],
        }
        missing = getattr(self.backend, "gpm_missing", None)
        if missing:
            out["gpm_unavailable"] = {str(i): why for i, why in missing.items()}
        return out
