"""CacheInvalidation and the model-version flow end to end: kopf, the emulator, real Redis.

The "sidecars" are real :class:`ControlSync` instances with epoch trackers
(heartbeats, epoch sync, acknowledgements) running in the test's event loop,
so every emulator call goes through a thread to keep them running.

What a user would notice: ``kubectl apply`` of a CacheInvalidation ends
``Completed`` with the new epoch, the ack count and a propagation time; a
sidecar that stops answering makes it ``Failed`` with that pod named; a new
``spec.model.version`` advances the model's epoch and the InferenceCache
status shows the epoch and how many sidecars converged; a spec without its
tenant is refused with the field named.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from cachefleet_common.contract.clients import redis_from_url
from cachefleet_common.contract.names import entry_key
from cachefleet_common.contract.ops import read_epochs, register_tenant
from cachefleet_common.epochs import EpochTracker
from cachefleet_operator.metrics import OperatorMetrics
from cachefleet_operator.reconcile import Reconciler
from cachefleet_sidecar.control.control import ControlSync
from tests.operator.conftest import IC_PATH, NAMESPACE, EmulatorHandle, OperatorFactory
from tests.operator.test_inferencecache_kopf import FakeMetrics, cache_body, steady_metrics

pytestmark = [pytest.mark.k8s_emulator, pytest.mark.redis]

CI_PATH = f"/apis/cachefleet.io/v1alpha1/namespaces/{NAMESPACE}/cacheinvalidations"
CACHE = f"{NAMESPACE}/chat"
#: Bound on waiting for the operator to act, seconds.
ACT_TIMEOUT_S = 20.0


def invalidation(name: str, scope: dict[str, Any], timeout_s: int = 10) -> dict[str, Any]:
    return {
        "apiVersion": "cachefleet.io/v1alpha1",
        "kind": "CacheInvalidation",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "cacheRef": {"name": "chat"},
            "scope": scope,
            "reason": "knowledge base refreshed",
            "timeoutSeconds": timeout_s,
        },
    }


async def eventually(
    predicate: Callable[[], Any], message: str, timeout_s: float = ACT_TIMEOUT_S
) -> Any:
    """Poll a blocking ``predicate`` in a thread until it is truthy (bounded)."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = await asyncio.to_thread(predicate)
        if last:
            return last
        await asyncio.sleep(0.1)
    pytest.fail(f"timed out after {timeout_s}s: {message} (last: {last!r})")


def status_of(emulator: EmulatorHandle, path: str) -> dict[str, Any]:
    obj = emulator.get(path) or {}
    return dict(obj.get("status") or {})


@pytest.fixture
async def sidecars(redis_url: str) -> AsyncIterator[list[ControlSync]]:
    """Two sidecars' control planes (heartbeat, epoch sync, acks) for cache default/chat."""
    syncs = [
        ControlSync(
            redis_url, CACHE, f"pod-{i}", lambda _a: None, tracker=EpochTracker(), epoch_poll_s=0.2
        )
        for i in range(2)
    ]
    for sync in syncs:
        await sync.start()
    yield syncs
    for sync in syncs:
        await sync.stop()


async def test_invalidation_completes_fails_on_a_silent_pod_and_model_version_flows(
    emulator: EmulatorHandle,
    operator_factory: OperatorFactory,
    redis_url: str,
    sidecars: list[ControlSync],
) -> None:
    fake = FakeMetrics()
    fake.data = steady_metrics()
    operator_factory(Reconciler(metrics_source=fake.factory, metrics=OperatorMetrics()))
    await asyncio.to_thread(emulator.create, IC_PATH, cache_body("chat", redis_url))
    await eventually(
        lambda: status_of(emulator, f"{IC_PATH}/chat").get("sidecars", {}).get("epochsInSync") == 2,
        "InferenceCache status with both sidecars in sync",
    )
    assert status_of(emulator, f"{IC_PATH}/chat")["modelVersion"] == "v1"

    # a whole-cache invalidation, acknowledged by both sidecars
    await asyncio.to_thread(emulator.create, CI_PATH, invalidation("inv-1", {"type": "Cache"}))
    done = await eventually(
        lambda: (s := status_of(emulator, f"{CI_PATH}/inv-1")).get("phase") == "Completed" and s,
        "inv-1 Completed",
    )
    assert done["epoch"] == 1
    assert (done["acks"], done["expectedAcks"]) == (2, 2)
    assert done["propagationSeconds"] > 0  # reported (not bounded: a loaded machine is slow)
    assert done["laggingPods"] == []
    for sync in sidecars:
        assert sync.tracker is not None
        assert sync.tracker.known == {"cache": 1}
    reasons = {e.get("reason") for e in await asyncio.to_thread(emulator.events)}
    assert "Invalidated" in reasons

    # a new model version advances the model's epoch; status shows convergence
    await asyncio.to_thread(
        emulator.patch, f"{IC_PATH}/chat", {"spec": {"model": {"name": "llama", "version": "v2"}}}
    )
    status = await eventually(
        lambda: (s := status_of(emulator, f"{IC_PATH}/chat")).get("modelVersion") == "v2" and s,
        "modelVersion v2 in status",
    )
    assert status["epochs"] == {"cache": 1, "model:llama": 1}
    assert status["sidecars"]["epochsInSync"] == 2
    for sync in sidecars:
        assert sync.tracker is not None
        assert sync.tracker.known == {"cache": 1, "model:llama": 1}
    reasons = {e.get("reason") for e in await asyncio.to_thread(emulator.events)}
    assert "ModelVersionChanged" in reasons

    # one sidecar goes silent (its heartbeat stays live): Failed, naming it
    await sidecars[1].stop(leave=False)
    await asyncio.to_thread(
        emulator.create,
        CI_PATH,
        invalidation("inv-2", {"type": "Tenant", "tenant": "gold"}, timeout_s=4),
    )
    # while it waits for acknowledgements it shows Running with the epoch it advances to
    running = await eventually(
        lambda: (s := status_of(emulator, f"{CI_PATH}/inv-2")).get("phase") == "Running" and s,
        "inv-2 Running",
    )
    assert running["epoch"] == 1
    assert "tenant:gold" in running["message"]
    failed = await eventually(
        lambda: (s := status_of(emulator, f"{CI_PATH}/inv-2")).get("phase") == "Failed" and s,
        "inv-2 Failed",
    )
    assert failed["laggingPods"] == ["pod-1"]
    assert (failed["acks"], failed["expectedAcks"]) == (1, 2)
    assert failed["epoch"] == 1
    assert "pod-1" in failed["message"]
    assert "propagationSeconds" not in failed
    reasons = {e.get("reason") for e in await asyncio.to_thread(emulator.events)}
    assert "InvalidationFailed" in reasons
    client = redis_from_url(redis_url)
    try:
        assert (await read_epochs(client, CACHE))["tenant:gold"] == 1
    finally:
        await client.aclose()


async def test_invalid_scope_and_unknown_cache_fail_with_a_reason(
    emulator: EmulatorHandle, operator_factory: OperatorFactory, redis_url: str
) -> None:
    fake = FakeMetrics()
    operator_factory(Reconciler(metrics_source=fake.factory, metrics=OperatorMetrics()))
    await asyncio.to_thread(emulator.create, IC_PATH, cache_body("chat", redis_url))
    await asyncio.sleep(0.5)
    await asyncio.to_thread(emulator.create, CI_PATH, invalidation("bad", {"type": "Tenant"}))
    failed = await eventually(
        lambda: (s := status_of(emulator, f"{CI_PATH}/bad")).get("phase") == "Failed" and s,
        "bad Failed",
    )
    assert "spec.scope" in failed["message"]
    assert "tenant" in failed["message"]
    body = invalidation("orphan", {"type": "Cache"})
    body["spec"]["cacheRef"]["name"] = "nope"
    await asyncio.to_thread(emulator.create, CI_PATH, body)
    pending = await eventually(
        lambda: (s := status_of(emulator, f"{CI_PATH}/orphan")).get("phase") and s,
        "orphan reported",
    )
    assert "not found" in pending["message"]


async def test_key_and_namespace_invalidations_complete_with_acks(
    emulator: EmulatorHandle,
    operator_factory: OperatorFactory,
    redis_url: str,
    sidecars: list[ControlSync],
) -> None:
    fake = FakeMetrics()
    fake.data = steady_metrics()
    operator_factory(Reconciler(metrics_source=fake.factory, metrics=OperatorMetrics()))
    await asyncio.to_thread(emulator.create, IC_PATH, cache_body("chat", redis_url))
    await eventually(
        lambda: status_of(emulator, f"{IC_PATH}/chat").get("sidecars", {}).get("epochsInSync") == 2,
        "InferenceCache status with both sidecars in sync",
    )
    digest = "5e" * 32
    client = redis_from_url(redis_url)
    try:  # an L2 entry of a registered tenant, and one of the same digest elsewhere
        await register_tenant(client, CACHE, "gold")
        await client.set(entry_key(CACHE, "gold", digest), b"old answer")
        await client.set(entry_key(CACHE, "gold", "6f" * 32), b"other answer")

        body = invalidation("purge-1", {"type": "Key", "key": digest})
        await asyncio.to_thread(emulator.create, CI_PATH, body)
        done = await eventually(
            lambda: (
                (s := status_of(emulator, f"{CI_PATH}/purge-1")).get("phase") == "Completed" and s
            ),
            "purge-1 Completed",
        )
        assert (done["epoch"], done["acks"], done["expectedAcks"]) == (1, 2, 2)
        assert digest in done["message"]
        assert await client.get(entry_key(CACHE, "gold", digest)) is None
        assert await client.get(entry_key(CACHE, "gold", "6f" * 32)) == b"other answer"
        assert (await read_epochs(client, CACHE))["purge"] == 1
    finally:
        await client.aclose()
    for sync in sidecars:
        assert sync.tracker is not None
        assert sync.tracker.known.get("purge") == 1
        assert sync.purges_applied == 1

    ns = {"type": "Namespace", "tenant": "gold", "namespace": "kb-7"}
    await asyncio.to_thread(emulator.create, CI_PATH, invalidation("kb-7", ns))
    done = await eventually(
        lambda: (s := status_of(emulator, f"{CI_PATH}/kb-7")).get("phase") == "Completed" and s,
        "kb-7 Completed",
    )
    assert (done["epoch"], done["acks"], done["expectedAcks"]) == (1, 2, 2)
    assert "namespace:gold/kb-7" in done["message"]
    for sync in sidecars:
        assert sync.tracker is not None
        assert sync.tracker.known.get("namespace:gold/kb-7") == 1

    # a bad digest fails with the field named
    bad = invalidation("bad-key", {"type": "Key", "key": "NOT-A-DIGEST"})
    await asyncio.to_thread(emulator.create, CI_PATH, bad)
    failed = await eventually(
        lambda: (s := status_of(emulator, f"{CI_PATH}/bad-key")).get("phase") == "Failed" and s,
        "bad-key Failed",
    )
    assert "spec.scope.key" in failed["message"]
