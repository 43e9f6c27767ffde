"""Deleting an InferenceCache leaves nothing in Redis, and a namesake starts clean.

Against a real Redis: the operator's cleanup (through :class:`Reconciler`),
then the writes a sidecar that outlived the object would still make
(heartbeat, acknowledgement, epoch restore, tenant registration) through
the protocol functions the sidecar uses, then a re-created cache of the same
name reconciled from scratch.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aredis

from cachefleet_common.contract.lua import L2_PUT_VERSIONED_LUA
from cachefleet_common.contract.messages import EpochAck, Heartbeat
from cachefleet_common.contract.names import (
    l2_versioned_keys,
    members_key,
    tenant_tombstone_key,
    tombstone_key,
)
from cachefleet_common.contract.ops import (
    advance_epoch,
    live_members,
    read_epochs,
    register_tenant,
    restore_epochs,
    write_ack,
    write_heartbeat,
)
from cachefleet_common.contract.versioned import vector_args
from cachefleet_operator.allocation import TenantMetrics
from cachefleet_operator.metrics import OperatorMetrics
from cachefleet_operator.reconcile import Reconciler

pytestmark = [pytest.mark.redis]

NS, NAME = "default", "chat"
CACHE = f"{NS}/{NAME}"


class Metrics:
    def factory(self, url: str, timeout_s: float) -> Metrics:
        return self

    async def fetch(
        self, cache: str, window: str, curve_window: str | None = None
    ) -> dict[str, TenantMetrics]:
        return {"gold": TenantMetrics(p95_s=0.1, hit_ratio=0.5, rps=10.0)}


def spec(redis_url: str, **extra: Any) -> dict[str, Any]:
    return {
        "selector": {"matchLabels": {"cachefleet.io/cache": NAME}},
        "model": {"name": "m", "version": "v1"},
        "capacity": {"l1BytesPerPod": 2**20, "l2Bytes": 2**24},
        "redis": {"url": redis_url},
        "prometheus": {"url": "http://127.0.0.1:9"},
        "tenants": [
            {"name": "gold", "priorityClass": "Guaranteed", "sla": {"p95LatencySeconds": 0.2}}
        ],
        **extra,
    }


async def keys(client: Any) -> list[str]:
    return sorted(k.decode() for k in await client.keys("cf:*"))


async def l2_put(client: Any, tenant: str, epochs: dict[str, int]) -> int:
    """A versioned L2 write as the sidecar's L2 store makes it; returns the script's status."""
    vector = tuple(sorted(epochs.items()))
    keys = l2_versioned_keys(CACHE, tenant, "ab" * 32)
    args = [b"value", 60_000, 2**20, 10, *vector_args(vector)]
    reply = await client.eval(L2_PUT_VERSIONED_LUA, len(keys), *keys, *args)
    return int(reply[0])


async def sidecar_writes(client: Any, epochs: dict[str, int], tenant: str = "gold") -> int:
    """Everything a running sidecar writes; returns the status of its L2 write."""
    await write_heartbeat(client, CACHE, Heartbeat(pod="p1", quota_generation=1))
    await write_ack(client, CACHE, EpochAck(pod="p1", epochs=epochs))
    await restore_epochs(client, CACHE, epochs)
    await register_tenant(client, CACHE, tenant)
    return await l2_put(client, tenant, epochs)


async def test_delete_then_recreate_starts_clean(redis_url: str) -> None:
    reconciler = Reconciler(metrics_source=Metrics().factory, metrics=OperatorMetrics())
    pressure_labels = {"cache": CACHE, "cache_namespace": NS, "cache_name": NAME}
    registry = reconciler.metrics.registry
    client = aredis.Redis.from_url(redis_url)
    try:
        first = await reconciler.reconcile(NS, NAME, 1, spec(redis_url), {})
        assert first.failure is None
        # the autoscaling signal: gold's p95 0.1 s against 0.2 s
        pressure = registry.get_sample_value("cachefleet_operator_slo_pressure", pressure_labels)
        assert pressure == pytest.approx(0.5)
        assert await sidecar_writes(client, {"cache": 4}) == 1  # stored
        await advance_epoch(client, CACHE, "cache")
        assert await read_epochs(client, CACHE) == {"cache": 5}

        # delete with a spec that is invalid elsewhere: only spec.redis is needed
        removed = await reconciler.cleanup(NS, NAME, spec(redis_url, bogus=1), uid="uid-1")
        assert removed > 0
        tombstones = [tombstone_key(CACHE), tenant_tombstone_key(CACHE, "gold")]
        assert await keys(client) == sorted(tombstones)
        pressure = registry.get_sample_value("cachefleet_operator_slo_pressure", pressure_labels)
        assert pressure is None

        # a sidecar that outlived the object writes nothing back: no control state,
        # no L2 data, for a tenant known before or one first seen now
        assert await sidecar_writes(client, {"cache": 5}) == -2
        assert await sidecar_writes(client, {"cache": 5}, tenant="newcomer") == -2
        tombstones.append(tenant_tombstone_key(CACHE, "newcomer"))
        assert await keys(client) == sorted(tombstones)
        assert await live_members(client, CACHE) == []
        assert min([await client.pttl(k) for k in tombstones]) > 0

        # the namesake: its first reconcile starts from no state at all
        again = await reconciler.reconcile(NS, NAME, 1, spec(redis_url), {})
        assert again.failure is None
        assert not [k for k in await keys(client) if k.endswith(":deleted")]
        assert await read_epochs(client, CACHE) == {}
        assert again.status["quotaGeneration"] == 1
        assert again.status["sidecars"]["seen"] == 0
        # and sidecars of the new cache are heard and cache again
        assert await l2_put(client, "gold", {}) == 1
        await write_heartbeat(client, CACHE, Heartbeat(pod="p2", quota_generation=1))
        assert [m.pod for m in await live_members(client, CACHE)] == ["p2"]
        assert await client.pttl(members_key(CACHE)) > 0
    finally:
        await client.aclose()


async def test_cleanup_with_an_invalid_redis_names_the_field(redis_url: str) -> None:
    reconciler = Reconciler(metrics_source=Metrics().factory, metrics=OperatorMetrics())
    with pytest.raises(Exception, match=r"spec\.redis"):
        await reconciler.cleanup(NS, NAME, {"redis": {"url": "http://nope"}}, uid="u")


class DownMetrics:
    def factory(self, url: str, timeout_s: float) -> DownMetrics:
        return self

    async def fetch(
        self, cache: str, window: str, curve_window: str | None = None
    ) -> dict[str, TenantMetrics]:
        from cachefleet_operator.metrics_source import MetricsUnavailable

        raise MetricsUnavailable("PrometheusUnavailable", "connection refused")


async def test_retry_during_a_prometheus_outage_announces_and_bumps_nothing(redis_url: str) -> None:
    """The retry of a reconcile that published class-based quotas changes nothing."""
    reconciler = Reconciler(metrics_source=DownMetrics().factory, metrics=OperatorMetrics())
    body = spec(redis_url, tenants=[{"name": "gold"}, {"name": "silver"}, {"name": "bronze"}])
    first = await reconciler.reconcile(NS, NAME, 1, body, {})
    assert [e.reason for e in first.events] == ["QuotasAssigned", "PrometheusUnavailable"]
    assert first.status["quotaGeneration"] == 1
    status = dict(first.status)
    for _ in range(3):
        again = await reconciler.reconcile(NS, NAME, 1, body, status, "timer")
        assert again.events == []
        assert again.status["quotaGeneration"] == 1
        status = {**status, **again.status}
