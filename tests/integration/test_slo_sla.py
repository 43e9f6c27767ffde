"""A tenant whose ttftP95Seconds is exceeded gets SLAViolated and raises SLOPressure.

The reconciler runs against a real Redis (it publishes the quota table) and
a metrics source that answers as Prometheus would from the sidecars' TTFT
histograms: the tenant's p95 latency is within its target, its time to
first token is not.
"""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import generate_latest

from cachefleet_operator.allocation import TenantMetrics
from cachefleet_operator.metrics import OperatorMetrics
from cachefleet_operator.reconcile import Reconciler

pytestmark = pytest.mark.redis

NS, NAME = "default", "chat"


class Metrics:
    def __init__(self) -> None:
        self.ttft = 0.45

    def factory(self, url: str, timeout_s: float) -> Metrics:
        return self

    async def fetch(
        self, cache: str, window: str, curve_window: str | None = None
    ) -> dict[str, TenantMetrics]:
        return {
            "chat": TenantMetrics(p95_s=0.5, hit_ratio=0.5, rps=10.0, ttft_p95_s=self.ttft),
            "batch": TenantMetrics(p95_s=0.5, hit_ratio=0.5, rps=10.0, ttft_p95_s=3.0),
        }


def spec(redis_url: str) -> dict[str, Any]:
    return {
        "selector": {"matchLabels": {"cachefleet.io/cache": NAME}},
        "model": {"name": "m", "version": "v1"},
        "capacity": {"l1BytesPerPod": 2**20, "l2Bytes": 2**24},
        "redis": {"url": redis_url},
        "prometheus": {"url": "http://127.0.0.1:9", "window": "5m"},
        "tenants": [
            {
                "name": "chat",
                "priorityClass": "Guaranteed",
                "sla": {"p95LatencySeconds": 2.0, "ttftP95Seconds": 0.3},
            },
            {"name": "batch", "sla": {"p95LatencySeconds": 2.0}},
        ],
    }


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == kind)


def sample(metrics: OperatorMetrics, name: str) -> float | None:
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == name:
                return float(s.value)
    return None


async def test_exceeded_ttft_target_violates_the_sla_and_raises_pressure(redis_url: str) -> None:
    source, metrics = Metrics(), OperatorMetrics()
    reconciler = Reconciler(metrics_source=source.factory, metrics=metrics)
    status = (await reconciler.reconcile(NS, NAME, 1, spec(redis_url), {})).status
    violated = condition(status, "SLAViolated")
    assert violated["status"] == "True"
    assert violated["message"] == "SLA missed by: chat"  # batch states no TTFT target
    assert status["slaAttainment"] == "1/2"
    chat = next(t for t in status["tenants"] if t["name"] == "chat")
    assert chat["slaMet"] is False
    assert chat["observed"]["ttftP95Seconds"] == 0.45
    assert "TTFT p95 0.45s > target 0.3s" in chat["reason"]
    # Guaranteed, 1.5x its TTFT target: pressure 1.5 (p95 latency alone would say 0.25)
    assert sample(metrics, "cachefleet_operator_slo_pressure") == pytest.approx(1.5)
    text = generate_latest(metrics.registry).decode()
    assert 'objective="ttft",tenant="chat"} 0.3' in text

    source.ttft = 0.2  # back within its target
    status = (await reconciler.reconcile(NS, NAME, 1, spec(redis_url), status)).status
    assert condition(status, "SLAViolated")["status"] == "False"
    assert sample(metrics, "cachefleet_operator_slo_pressure") == pytest.approx(2.0 / 3.0)
