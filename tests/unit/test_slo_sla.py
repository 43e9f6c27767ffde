"""SLAs in time to first token and inter-token latency: attainment, pressure, targets (pure)."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from cachefleet_operator.allocation import (
    PriorityClass,
    TenantDemand,
    TenantMetrics,
    allocate,
    sla_met,
)
from cachefleet_operator.api import parse_spec
from cachefleet_operator.assignment import demands_from_spec, slo_targets
from cachefleet_operator.metrics import OperatorMetrics
from cachefleet_operator.metrics_source import tenant_metrics
from cachefleet_operator.pressure import CLASS_WEIGHT, TenantPressure, tenant_pressure

G, S = PriorityClass.GUARANTEED, PriorityClass.STANDARD
L1, L2 = 1 << 20, 1 << 24


def demands(ttft: float | None = 0.3, itl: float | None = None) -> list[TenantDemand]:
    return [
        TenantDemand("chat", S, p95_target_s=2.0, ttft_target_s=ttft, itl_target_s=itl),
        TenantDemand("batch", S, p95_target_s=2.0),
    ]


def metrics(ttft: float, itl: float | None = None) -> dict[str, TenantMetrics]:
    return {
        "chat": TenantMetrics(p95_s=1.0, hit_ratio=0.5, rps=10.0, ttft_p95_s=ttft, itl_p95_s=itl),
        "batch": TenantMetrics(p95_s=1.0, hit_ratio=0.5, rps=10.0, ttft_p95_s=9.0),
    }


def test_a_stated_ttft_target_exceeded_misses_the_sla() -> None:
    d = demands()[0]
    assert sla_met(d, metrics(0.2)["chat"]) is True
    assert sla_met(d, metrics(0.45)["chat"]) is False  # p95 latency met, TTFT not
    # only what the tenant states is judged: batch's slow first token is not its target
    assert sla_met(demands()[1], metrics(0.45)["batch"]) is True
    # ITL alone
    itl_only = TenantDemand("chat", itl_target_s=0.03)
    assert sla_met(itl_only, TenantMetrics(itl_p95_s=0.05)) is False
    assert sla_met(itl_only, TenantMetrics(itl_p95_s=0.02)) is True
    assert sla_met(itl_only, TenantMetrics(ttft_p95_s=0.02)) is None  # no observation


def test_allocation_judges_ttft_and_moves_no_share_for_it() -> None:
    missed = allocate(demands(), metrics(0.45), None, L1, L2)
    met = allocate(demands(), metrics(0.2), None, L1, L2)
    unstated = allocate(demands(ttft=None), metrics(0.45), None, L1, L2)
    rows = missed.by_name()
    assert rows["chat"].sla_met is False
    assert rows["batch"].sla_met is True
    assert met.by_name()["chat"].sla_met is True
    assert unstated.by_name()["chat"].sla_met is True
    # a model-server target: cache size does not fix it, so shares are the same
    assert missed.shares() == met.shares() == unstated.shares()
    reason = missed.reason(0)
    assert reason.startswith("SLA missed")
    assert "TTFT p95 0.45s > target 0.3s" in reason


def test_prometheus_columns_give_the_same_attainment() -> None:
    table = tenant_metrics(
        {"chat": 1.0, "batch": 1.0},
        {"chat": 0.5, "batch": 0.5},
        {"chat": 10.0, "batch": 10.0},
        {},
        {},
        {},
        {},
        ttft={"chat": 0.45, "batch": 9.0},
        itl={"chat": 0.02},
    )
    assert table["chat"].ttft_p95_s == 0.45
    assert table["chat"].itl_p95_s == 0.02
    assert table["batch"].itl_p95_s is None
    got = allocate(demands(itl=0.03), table, None, L1, L2).by_name()
    assert (got["chat"].sla_met, got["batch"].sla_met) == (False, True)
    itl_missed = tenant_metrics(
        {"chat": 1.0}, {"chat": 0.5}, {"chat": 10.0}, {}, {}, {}, {},
        ttft={"chat": 0.2}, itl={"chat": 0.05},
    )  # fmt: skip
    assert allocate(demands(itl=0.03)[:1], itl_missed, None, L1, L2).tenants[0].sla_met is False


def test_pressure_is_the_worst_stated_ratio_and_ttft_is_never_damped() -> None:
    # p95 met, TTFT at 1.5x its target: more replicas, whatever cache could do for p95
    t = TenantPressure(1.0, 2.0, G, cache_can_help=True, ttft_s=0.45, ttft_target_s=0.3)
    assert tenant_pressure(t) == pytest.approx(1.5)
    # ITL worse still
    worse = TenantPressure(
        1.0, 2.0, S, ttft_s=0.45, ttft_target_s=0.3, itl_s=0.1, itl_target_s=0.02
    )
    assert tenant_pressure(worse) == pytest.approx(CLASS_WEIGHT[S] * 5.0)
    # only TTFT stated and observed
    assert tenant_pressure(TenantPressure(None, None, G, ttft_s=0.15, ttft_target_s=0.3)) == 0.5
    # a target without an observation counts for nothing
    assert tenant_pressure(TenantPressure(None, None, G, ttft_target_s=0.3)) is None


def spec_with(sla: dict[str, float]) -> dict[str, object]:
    return {
        "selector": {"matchLabels": {"cachefleet.io/cache": "chat"}},
        "model": {"name": "m", "version": "v1"},
        "capacity": {"l1BytesPerPod": L1, "l2Bytes": L2},
        "redis": {"url": "redis://127.0.0.1:6379"},
        "prometheus": {"url": "http://127.0.0.1:9"},
        "tenants": [{"name": "chat", "sla": sla}, {"name": "batch"}],
    }


def test_the_crd_fields_reach_demands_and_the_target_series() -> None:
    spec = parse_spec(spec_with({"ttftP95Seconds": 0.3, "itlP95Seconds": 0.05}))
    chat = demands_from_spec(spec)[0]
    assert (chat.ttft_target_s, chat.itl_target_s, chat.p95_target_s) == (0.3, 0.05, None)
    assert slo_targets(spec) == {("chat", "ttft"): 0.3, ("chat", "itl"): 0.05}
    m = OperatorMetrics()
    m.set_slo_targets("ns/chat", slo_targets(spec))
    text = generate_latest(m.registry).decode()
    assert 'cachefleet_operator_tenant_slo_target_seconds{cache="ns/chat",objective="ttft",' in text
    # a target no longer stated is withdrawn
    m.set_slo_targets("ns/chat", {("chat", "ttft"): 0.3})
    text = generate_latest(m.registry).decode()
    assert 'objective="itl"' not in text
    assert 'objective="ttft"' in text
    with pytest.raises(Exception, match="ttftP95Seconds"):
        parse_spec(spec_with({"ttftP95Seconds": 0}))
