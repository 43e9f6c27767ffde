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

from cachefleet_operator.allocation import TenantMetrics
from cachefleet_operator.metrics import OperatorMetrics
from cachefleet_operator.reconcile import Reconciler
from cachefleet_sidecar import protocol
from cachefleet_sidecar.protocol import EpochAck, Heartbeat

pytestmark = [pytest.mark.redis]

NS, NAME = "default", "chat"
CACHE = f"{NS}/{NAME}"


class Metrics:
    def factory(self, url: str, timeout_s: float) -> Metrics:
        return self

    async def fetch(self, cache: str, window: str) -> dict[str, TenantMetrics]:
        return {"gold": TenantMetrics(p95_s=0.1, hit_ratio=0.5, rps=10.0)}


def spec(redis_url: str, **extra: Any) -> dict[str, Any]:
    return {
        "selector": {"matchLabels": {"cachefleet.io/cache": NAME}},
        "model": {"name": "m", "version": "v1"},
        "capacity": {"l1BytesPerPod": 2**20, "l2Bytes": 2**24},
        "redis": {"url": redis_url},
        "prometheus": {"url": "http://127.0.0.1:9"},
        "tenants": [{"name": "gold"}],
        **extra,
    }


async def keys(client: Any) -> list[str]:
    return sorted(k.decode() for k in await client.keys("cf:*"))


async def sidecar_writes(client: Any, epochs: dict[str, int]) -> None:
    await protocol.write_heartbeat(client, CACHE, Heartbeat(pod="p1", quota_generation=1))
    await protocol.write_ack(client, CACHE, EpochAck(pod="p1", epochs=epochs))
    await protocol.restore_epochs(client, CACHE, epochs)
    await protocol.register_tenant(client, CACHE, "gold")


async def test_delete_then_recreate_starts_clean(redis_url: str) -> None:
    reconciler = Reconciler(metrics_source=Metrics().factory, metrics=OperatorMetrics())
    client = aredis.Redis.from_url(redis_url)
    try:
        first = await reconciler.reconcile(NS, NAME, 1, spec(redis_url), {})
        assert first.failure is None
        await sidecar_writes(client, {"cache": 4})
        await protocol.advance_epoch(client, CACHE, "cache")
        assert await protocol.read_epochs(client, CACHE) == {"cache": 5}

        # delete with a spec that is invalid elsewhere: only spec.redis is needed
        removed = await reconciler.cleanup(NS, NAME, spec(redis_url, bogus=1), uid="uid-1")
        assert removed > 0
        assert await keys(client) == [protocol.tombstone_key(CACHE)]

        # a sidecar that outlived the object writes nothing back
        await sidecar_writes(client, {"cache": 5})
        assert await keys(client) == [protocol.tombstone_key(CACHE)]
        assert await protocol.live_members(client, CACHE) == []

        # the namesake: its first reconcile starts from no state at all
        again = await reconciler.reconcile(NS, NAME, 1, spec(redis_url), {})
        assert again.failure is None
        assert await client.exists(protocol.tombstone_key(CACHE)) == 0
        assert await protocol.read_epochs(client, CACHE) == {}
        assert again.status["quotaGeneration"] == 1
        assert again.status["sidecars"]["seen"] == 0
        # and sidecars of the new cache are heard again
        await protocol.write_heartbeat(client, CACHE, Heartbeat(pod="p2", quota_generation=1))
        assert [m.pod for m in await protocol.live_members(client, CACHE)] == ["p2"]
        assert await client.pttl(protocol.members_key(CACHE)) > 0
    finally:
        await client.aclose()


async def test_cleanup_with_an_invalid_redis_names_the_field(redis_url: str) -> None:
    reconciler = Reconciler(metrics_source=Metrics().factory, metrics=OperatorMetrics())
    with pytest.raises(Exception, match=r"spec\.redis"):
        await reconciler.cleanup(NS, NAME, {"redis": {"url": "http://nope"}}, uid="u")
