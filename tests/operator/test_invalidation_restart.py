"""A CacheInvalidation survives an operator restart without advancing the epoch twice.

The runner records the epoch it intends to reach (phase Running) before the
CAS; a run that finds it recorded advances only if Redis is still below it.
Each call below is one handler invocation, with the status the previous one
left, as kopf would hand it over after a restart. Real Redis, no sidecars
(so the wait for acknowledgements ends at once).
"""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aredis

from cachefleet_common.contract.ops import read_epochs
from cachefleet_operator.invalidation import InvalidationRunner
from cachefleet_operator.metrics import OperatorMetrics
from cachefleet_operator.reconcile import Reconciler

pytestmark = [pytest.mark.redis]

NS = "default"
CACHE = f"{NS}/chat"


def cache_obj(redis_url: str) -> dict[str, Any]:
    return {
        "spec": {
            "selector": {},
            "model": {"name": "m", "version": "v1"},
            "capacity": {"l1BytesPerPod": 1, "l2Bytes": 1},
            "redis": {"url": redis_url},
            "prometheus": {"url": "http://127.0.0.1:9"},
        },
        "status": {},
    }


SPEC = {"cacheRef": {"name": "chat"}, "scope": {"type": "Cache"}, "timeoutSeconds": 5}


async def test_restart_after_the_cas_does_not_advance_again(redis_url: str) -> None:
    runner = InvalidationRunner(Reconciler(metrics=OperatorMetrics()))
    client = aredis.Redis.from_url(redis_url)
    try:
        first = await runner.run(NS, 1, SPEC, {}, cache_obj(redis_url))
        # recorded, not yet advanced; shown as Running; retried at once
        assert first.status["phase"] == "Running"
        assert first.status["epoch"] == 1
        assert (first.failure, first.delay) == ("temporary", 0.0)
        assert await read_epochs(client, CACHE) == {}

        second = await runner.run(NS, 1, SPEC, first.status, cache_obj(redis_url))
        assert second.status["phase"] == "Completed"
        assert second.status["epoch"] == 1
        assert await read_epochs(client, CACHE) == {"cache": 1}

        # the operator died after the CAS, before Completed was written: kopf
        # hands the Running status over again
        again = await runner.run(NS, 1, SPEC, first.status, cache_obj(redis_url))
        assert again.status["phase"] == "Completed"
        assert again.status["epoch"] == 1
        assert "resumed" in again.status["message"]
        assert await read_epochs(client, CACHE) == {"cache": 1}
    finally:
        await client.aclose()


async def test_a_recorded_intention_survives_a_redis_fault(redis_url: str) -> None:
    runner = InvalidationRunner(Reconciler(metrics=OperatorMetrics()))
    first = await runner.run(NS, 1, SPEC, {}, cache_obj(redis_url))
    broken = cache_obj("redis://127.0.0.1:9/0")
    faulted = await runner.run(NS, 1, SPEC, first.status, broken)
    assert faulted.failure == "temporary"
    assert faulted.status["phase"] == "Running"
    assert "epoch" not in faulted.status  # a merge patch: the recorded epoch stays
    done = await runner.run(NS, 1, SPEC, {**first.status, **faulted.status}, cache_obj(redis_url))
    assert (done.status["phase"], done.status["epoch"]) == ("Completed", 1)


def with_version(obj: dict[str, Any], version: str) -> dict[str, Any]:
    spec = dict(obj["spec"])
    spec["model"] = {"name": "m", "version": version}
    return spec


async def test_a_model_version_change_advances_once_even_when_its_status_is_lost(
    redis_url: str,
) -> None:
    # Prometheus is unreachable (port 9): the reconcile is degraded but still
    # publishes quotas and runs the epoch flow, which is what is tested here.
    reconciler = Reconciler(metrics=OperatorMetrics())
    obj = cache_obj(redis_url)
    client = aredis.Redis.from_url(redis_url)
    try:
        first = await reconciler.reconcile(NS, "chat", 1, with_version(obj, "v1"), {})
        assert first.status["modelVersion"] == "v1"
        assert "model:m" not in (first.status.get("epochs") or {})

        v2 = await reconciler.reconcile(NS, "chat", 2, with_version(obj, "v2"), first.status)
        assert v2.status["modelVersion"] == "v2"
        assert v2.status["epochs"]["model:m"] == 1
        [changed] = [e for e in v2.events if e.reason == "ModelVersionChanged"]
        assert "v1 -> v2" in changed.message
        assert "advanced to epoch 1" in changed.message

        # the status patch of that reconcile was lost: the next one sees v1 in status again
        again = await reconciler.reconcile(NS, "chat", 2, with_version(obj, "v2"), first.status)
        assert again.status["epochs"]["model:m"] == 1
        [changed] = [e for e in again.events if e.reason == "ModelVersionChanged"]
        assert "already advanced to epoch 1" in changed.message
        assert (await read_epochs(client, CACHE))["model:m"] == 1

        # a later change is a new advance
        v3 = await reconciler.reconcile(NS, "chat", 3, with_version(obj, "v3"), v2.status)
        assert v3.status["epochs"]["model:m"] == 2
        assert (await read_epochs(client, CACHE))["model:m"] == 2
    finally:
        await client.aclose()
