"""GPU telemetry: the real NVML path where there is no GPU, and the numbers path on a fake."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from cachefleet_sidecar.adapt import telemetry
from cachefleet_sidecar.adapt.switching import gpu_pressure
from cachefleet_sidecar.adapt.telemetry import GpuSample, GpuTelemetry, NvmlBackend


class Exposed(Collector):
    def __init__(self, tel: GpuTelemetry) -> None:
        self.tel = tel

    def collect(self):  # type: ignore[no-untyped-def]
        return self.tel.collect()


def scrape(tel: GpuTelemetry) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(Exposed(tel))
    text = generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + ("{" + s.labels["gpu"] + "}" if "gpu" in s.labels else "")
            out[key] = s.value
    return out


class FakeNvml:
    def __init__(self, fail_init: bool = False) -> None:
        self.fail_init = fail_init
        self.calls = 0
        self.fail_sample = False

    def init(self) -> None:
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def sample(self) -> list[GpuSample]:
        self.calls += 1
        if self.fail_sample:
            raise RuntimeError("GPU is lost")
        return [
            GpuSample(0, "NVIDIA H200", 40 << 30, 141 << 30, 0.75, 0.5),
            GpuSample(1, "NVIDIA H200", 1 << 30, 141 << 30, 0.0, 0.0),
        ]


def nvml_present() -> bool:
    try:
        NvmlBackend().init()
    except Exception:
        return False
    return True


@pytest.mark.skipif(nvml_present(), reason="this machine has NVML: the no-GPU path cannot run")
def test_without_nvml_the_sidecar_says_so_once_and_exports_zero(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="cachefleet.telemetry")
    tel = GpuTelemetry()  # the real NVML adapter
    assert tel.available is False
    assert tel.reason
    assert scrape(tel) == {"cachefleet_gpu_telemetry_available": 0.0}
    scrape(tel)
    assert sum("unavailable" in r.message for r in caplog.records) == 1
    assert tel.describe() == {"available": False, "reason": tel.reason, "gpus": []}


def test_samples_become_gauges_in_base_units() -> None:
    tel = GpuTelemetry(FakeNvml())
    values = scrape(tel)
    assert values["cachefleet_gpu_telemetry_available"] == 1.0
    assert values["cachefleet_gpu_memory_used_bytes{0}"] == 40 << 30
    assert values["cachefleet_gpu_memory_total_bytes{1}"] == 141 << 30
    assert values["cachefleet_gpu_sm_utilization_ratio{0}"] == 0.75
    assert values["cachefleet_gpu_memory_bandwidth_utilization_ratio{0}"] == 0.5


def test_sampling_is_rate_limited(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml()
    tel = GpuTelemetry(fake)
    for _ in range(5):
        tel.samples()
    assert fake.calls == 1
    monkeypatch.setattr(telemetry, "SAMPLE_INTERVAL_S", 0.0)
    tel.samples()
    assert fake.calls == 2


def test_a_failing_sample_is_counted_never_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(telemetry, "SAMPLE_INTERVAL_S", 0.0)
    fake = FakeNvml()
    tel = GpuTelemetry(fake)
    fake.fail_sample = True
    assert scrape(tel) == {"cachefleet_gpu_telemetry_available": 1.0}
    assert tel.errors == 1
    fake.fail_sample = False
    assert "cachefleet_gpu_memory_used_bytes{0}" in scrape(tel)


def test_init_failure_is_the_no_gpu_path() -> None:
    tel = GpuTelemetry(FakeNvml(fail_init=True))
    assert tel.available is False
    assert "Not Found" in tel.reason
    assert tel.samples() == []


@pytest.mark.gpu
@pytest.mark.skipif(not nvml_present(), reason="needs an NVIDIA driver with NVML")
def test_real_nvml_reports_memory() -> None:
    samples = GpuTelemetry().samples()
    assert samples
    assert all(s.memory_total_bytes > 0 for s in samples)
    assert all(0 <= s.sm_utilization_ratio <= 1 for s in samples)


# ------------------------------------------------------------------ NVML GPM
# A fake of the pynvml module (the adapter's only dependency): the real
# ctypes structures, scripted answers. No GPU was lent to check it on a real
# Hopper (docs/sits.md).


class FakePynvml:
    """Two GPUs: 0 offers GPM (a busy H200), 1 does not (an older part)."""

    NVML_GPM_METRICS_GET_VERSION = pynvml.NVML_GPM_METRICS_GET_VERSION
    NVML_GPM_METRIC_SM_OCCUPANCY = pynvml.NVML_GPM_METRIC_SM_OCCUPANCY
    NVML_GPM_METRIC_DRAM_BW_UTIL = pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL
    c_nvmlGpmMetricsGet_t = pynvml.c_nvmlGpmMetricsGet_t

    def __init__(self) -> None:
        self.allocated: list[int] = []
        self.freed: list[int] = []
        self.taken: dict[int, int] = {}  # sample id -> how many samples device 0 had taken
        self.metrics_error: Exception | None = None
        self.dram_return = 0

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(used=100 << 30, total=141 << 30)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        # utilization.gpu says 100 % on GPU 0 under any busy kernel
        return (
            SimpleNamespace(gpu=100, memory=40)
            if handle == 0
            else SimpleNamespace(gpu=10, memory=5)
        )

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        return b"NVIDIA H200" if handle == 0 else b"NVIDIA T4"

    def nvmlGpmQueryDeviceSupport(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(isSupportedDevice=1 if handle == 0 else 0)

    def nvmlGpmSampleAlloc(self) -> Any:
        ident = 1000 + len(self.allocated)
        self.allocated.append(ident)
        return ctypes.cast(ctypes.c_void_p(ident), pynvml.c_nvmlGpmSample_t)

    def nvmlGpmSampleGet(self, handle: int, sample: Any) -> Any:
        assert handle == 0
        self.taken[_address(sample)] = len(self.taken) + 1
        return sample

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        self.freed.append(_address(sample))

    def nvmlGpmMetricsGet(self, query: Any) -> Any:
        if self.metrics_error is not None:
            raise self.metrics_error
        first, second = self.taken[_address(query.sample1)], self.taken[_address(query.sample2)]
        assert second == first + 1, "metrics must come from consecutive samples"
        values = {
            pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: (0, 60.0 + second),
            pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: (self.dram_return, 85.0),
        }
        assert query.version == pynvml.NVML_GPM_METRICS_GET_VERSION
        for i in range(query.numMetrics):
            ret, value = values[query.metrics[i].metricId]
            query.metrics[i].nvmlReturn = ret
            query.metrics[i].value = value
        return query


def _address(sample: Any) -> int:
    return int(ctypes.cast(sample, ctypes.c_void_p).value or 0)


def test_gpm_metrics_come_from_consecutive_samples_where_the_gpu_offers_them() -> None:
    fake = FakePynvml()
    backend = NvmlBackend(fake)
    backend.init()
    first = backend.sample()
    assert [(s.sm_occupancy_ratio, s.dram_bandwidth_ratio) for s in first] == [
        (None, None),  # a rate needs two samples
        (None, None),  # GPU 1 has no GPM
    ]
    second = backend.sample()
    assert second[0].sm_occupancy_ratio == pytest.approx(0.62)
    assert second[0].dram_bandwidth_ratio == pytest.approx(0.85)
    assert second[1].sm_occupancy_ratio is None
    assert "does not support GPM" in backend.gpm_missing[1]
    third = backend.sample()
    assert third[0].sm_occupancy_ratio == pytest.approx(0.63)
    # Every GPM sample but the one kept for the next rate was freed.
    assert fake.freed == fake.allocated[:-1]
    # The pressure the switching engine gets: GPM's DRAM 0.85, not utilization.gpu's 1.0.
    assert gpu_pressure(third) == pytest.approx(0.85)


def test_a_failing_or_partial_gpm_answer_falls_back_to_the_plain_gauges() -> None:
    fake = FakePynvml()
    fake.dram_return = pynvml.NVML_ERROR_NOT_SUPPORTED
    backend = NvmlBackend(fake)
    backend.init()
    backend.sample()
    partial = backend.sample()[0]
    assert partial.sm_occupancy_ratio == pytest.approx(0.62)
    assert partial.dram_bandwidth_ratio is None
    assert gpu_pressure([partial]) == 1.0  # not both GPM figures: the plain gauges decide
    fake.metrics_error = pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    after = backend.sample()[0]
    assert (after.sm_occupancy_ratio, after.dram_bandwidth_ratio) == (None, None)
    assert after.sm_utilization_ratio == 1.0  # the plain gauges go on
    assert "NVMLError" in backend.gpm_missing[0]
    assert set(fake.freed) == set(fake.allocated)  # nothing held after giving up
    backend.sample()  # and GPM is not tried again on that device
    assert len(fake.allocated) == 3


def test_gpm_figures_are_exported_and_described(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(telemetry, "SAMPLE_INTERVAL_S", 0.0)
    tel = GpuTelemetry(NvmlBackend(FakePynvml()))
    scrape(tel)
    values = scrape(tel)
    assert values["cachefleet_gpu_sm_occupancy_ratio{0}"] == pytest.approx(0.62)
    assert values["cachefleet_gpu_dram_bandwidth_utilization_ratio{0}"] == pytest.approx(0.85)
    assert "cachefleet_gpu_sm_occupancy_ratio{1}" not in values
    described = tel.describe()
    assert "does not support GPM" in described["gpm_unavailable"]["1"]
