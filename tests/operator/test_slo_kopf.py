"""A tenant's TTFT target through kopf: exceeded, the InferenceCache gets SLAViolated and
the operator's SLO pressure rises; met again, both clear (emulator, real Redis)."""

from __future__ import annotations

import pytest

from cachefleet_e2e.fake_metrics import FakeMetrics
from cachefleet_operator.allocation import TenantMetrics
from cachefleet_operator.metrics import OperatorMetrics
from cachefleet_operator.reconcile import Reconciler
from tests.operator.conftest import IC_PATH, EmulatorHandle, OperatorFactory, wait_for
from tests.operator.test_inferencecache_kopf import (
    ACT_TIMEOUT_S,
    cache_body,
    concave,
    conditions,
    steady_metrics,
    wait_condition,
)

pytestmark = [pytest.mark.k8s_emulator, pytest.mark.redis]


def pressure(metrics: OperatorMetrics) -> float | None:
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == "cachefleet_operator_slo_pressure" and s.labels["cache_name"] == "chat":
                return float(s.value)
    return None


def test_exceeded_ttft_target_sets_sla_violated_and_raises_pressure(
    emulator: EmulatorHandle, operator_factory: OperatorFactory, redis_url: str
) -> None:
    fake = FakeMetrics()
    fake.data = steady_metrics()
    fake.data["gold"] = TenantMetrics(
        p95_s=0.15, hit_ratio=0.5, rps=50.0, curve=concave(), ttft_p95_s=0.2
    )
    metrics = OperatorMetrics()
    operator_factory(Reconciler(metrics_source=fake.factory, metrics=metrics))
    body = cache_body("chat", redis_url)
    body["spec"]["tenants"][0]["sla"]["ttftP95Seconds"] = 0.3
    emulator.create(IC_PATH, body)
    wait_condition(emulator, "chat", "SLAViolated", "False")
    calm = wait_for(lambda: pressure(metrics), ACT_TIMEOUT_S, "SLO pressure")
    assert calm < 1.0

    # gold's p95 latency still within its target; its first token 1.5x its target
    fake.data["gold"] = TenantMetrics(
        p95_s=0.15, hit_ratio=0.5, rps=50.0, curve=concave(), ttft_p95_s=0.45
    )
    obj = wait_condition(emulator, "chat", "SLAViolated", "True")
    assert conditions(obj)["SLAViolated"]["message"] == "SLA missed by: gold"
    gold = next(t for t in obj["status"]["tenants"] if t["name"] == "gold")
    assert gold["observed"]["ttftP95Seconds"] == 0.45
    # Guaranteed (weight 1) at 1.5x: the pressure asks for half as many replicas more
    wait_for(lambda: pressure(metrics) == pytest.approx(1.5), ACT_TIMEOUT_S, "pressure 1.5")

    fake.data["gold"] = TenantMetrics(
        p95_s=0.15, hit_ratio=0.5, rps=50.0, curve=concave(), ttft_p95_s=0.2
    )
    wait_condition(emulator, "chat", "SLAViolated", "False")
