"""GPU telemetry: the real NVML path where there is no GPU, and the numbers path on a fake."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from cachefleet_sidecar import telemetry
from cachefleet_sidecar.telemetry import GpuSample, GpuTelemetry, NvmlBackend


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
