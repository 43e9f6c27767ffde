"""CacheCannotMeetSLA as a user reads it: conditions and Warning Events, rebalance by rebalance.

The Reconciler runs against a real Redis (quotas published, epochs read) and
a metrics source whose answers the test sets; each reconcile is given the
status the previous one wrote, as kopf would.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from cachefleet_e2e.fake_metrics import FakeMetrics
from cachefleet_operator.allocation import TenantMetrics
from cachefleet_operator.curves import HitCurve, LatencyDist
from cachefleet_operator.metrics import OperatorMetrics
from cachefleet_operator.reach import REACH_REBALANCES
from cachefleet_operator.reconcile import Reconciler

pytestmark = pytest.mark.redis

NAMESPACE = "team-a"
L1 = 8 * 2**30
L2 = 64 * 2**30


def spec(redis_url: str) -> dict[str, Any]:
    return {
        "selector": {"matchLabels": {"cachefleet.io/cache": "chat"}},
        "model": {"name": "llama", "version": "v1"},
        "capacity": {"l1BytesPerPod": L1, "l2Bytes": L2},
        "redis": {"url": redis_url},
        "prometheus": {"url": "http://127.0.0.1:9", "window": "1m", "curveWindow": "10m"},
        "tenants": [
            {"name": "search", "minShare": 0.1, "sla": {"minHitRatio": 0.5}},
            {"name": "chat", "minShare": 0.1, "sla": {"minHitRatio": 0.2}},
        ],
    }


def per_pod_curve(best: float, rate: float = 50.0) -> HitCurve:
    """One pod's curve reaching ``best`` by half of L1 (50 requests/s over 10 min: enough)."""
    made = HitCurve.from_histogram(
        [(0.1 * L1, best * 0.8 * rate), (0.5 * L1, best * rate), (math.inf, rate)]
    )
    assert made is not None
    return made


def metrics(search_hit_ratio: float) -> dict[str, TenantMetrics]:
    slow = LatencyDist.from_buckets([(0.999, 0.0), (1.0, 100.0), (math.inf, 100.0)])
    return {
        "search": TenantMetrics(
            hit_ratio=search_hit_ratio, rps=50.0, curve=per_pod_curve(0.26), miss_latency=slow
        ),
        "chat": TenantMetrics(hit_ratio=0.6, rps=50.0, curve=per_pod_curve(0.8), miss_latency=slow),
    }


class Cache:
    """One InferenceCache reconciled again and again, its status carried over."""

    def __init__(self, redis_url: str) -> None:
        self.fake = FakeMetrics()
        self.reconciler = Reconciler(metrics_source=self.fake.factory, metrics=OperatorMetrics())
        self.spec = spec(redis_url)
        self.status: dict[str, Any] = {}

    async def rebalance(self, search_hit_ratio: float) -> tuple[dict[str, Any], list[str]]:
        """(CacheCannotMeetSLA condition, Warning Events) of one reconcile."""
        self.fake.data = metrics(search_hit_ratio)
        outcome = await self.reconciler.reconcile(NAMESPACE, "chat", 1, self.spec, self.status)
        assert outcome.result == "ok", outcome.failure_message
        self.status = {**self.status, **outcome.status}
        found = [c for c in self.status["conditions"] if c["type"] == "CacheCannotMeetSLA"]
        warnings = [f"{e.reason}: {e.message}" for e in outcome.events if e.type == "Warning"]
        return found[0], warnings


async def test_a_tenant_out_of_reach_is_named_after_rebalances_in_a_row(redis_url: str) -> None:
    cache = Cache(redis_url)
    for n in range(1, REACH_REBALANCES):
        cond, warnings = await cache.rebalance(search_hit_ratio=0.1)
        assert (cond["status"], cond["reason"]) == ("False", "WithinReach")
        assert f"not yet confirmed: search ({n}/{REACH_REBALANCES})" in cond["message"]
        assert warnings == []
    cond, warnings = await cache.rebalance(search_hit_ratio=0.1)
    assert (cond["status"], cond["reason"]) == ("True", "SLAOutOfReach")
    assert cond["message"].startswith("search: cache cannot meet its SLA: 74% of its requests")
    assert warnings == [f"SLAOutOfReach: {cond['message']}"]
    # the same finding again: the condition stays, no second Event
    cond, warnings = await cache.rebalance(search_hit_ratio=0.1)
    assert cond["status"] == "True"
    assert warnings == []


async def test_a_tenant_the_fleet_serves_is_never_named(redis_url: str) -> None:
    """The demo's case: one pod's curve tops out at 26 %, L2 brings the fleet to 65 %."""
    cache = Cache(redis_url)
    for _ in range(REACH_REBALANCES + 2):
        cond, warnings = await cache.rebalance(search_hit_ratio=0.65)
        assert (cond["status"], cond["message"]) == ("False", "cache can meet every observed SLA")
        assert warnings == []


async def test_a_transient_dip_is_not_named(redis_url: str) -> None:
    cache = Cache(redis_url)
    dips = [0.1] * (REACH_REBALANCES - 1) + [0.6] + [0.1] * (REACH_REBALANCES - 1)
    for hit_ratio in dips:
        cond, warnings = await cache.rebalance(search_hit_ratio=hit_ratio)
        assert cond["status"] == "False"
        assert warnings == []
