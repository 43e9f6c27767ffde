"""The sidecar with its Redis tiers: L2 across pods and restarts, quotas, faults."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from cachefleet_common.contract.clients import redis_from_url
from cachefleet_common.contract.messages import QuotaAssignment, TenantQuota
from cachefleet_common.contract.names import Policy
from cachefleet_common.contract.ops import (
    advance_epoch,
    live_members,
    publish_epochs,
    publish_quotas,
)
from cachefleet_e2e.fake_upstream import FakeUpstream
from cachefleet_e2e.services import RedisServer
from cachefleet_sidecar.cache.l2_guard import DEFAULT_COOLDOWN_S

from .conftest import SidecarFactory
from .test_fast_miss import spy_on_handle
from .test_sidecar import CHAT, answer, metric

pytestmark = pytest.mark.redis


async def wait_until(predicate: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = predicate()  # type: ignore[operator]
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout_s}s")


async def test_l2_serves_another_pod_and_survives_a_restart(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream, redis_url: str
) -> None:
    # Outcomes, not timing: wait for the (asynchronous) L2 write and for the epochs to be
    # confirmed, with a staleness bound a loaded machine cannot lapse mid-test.
    bound = {"staleness_bound_s": 60.0}
    pod_a = await sidecar_factory(redis_url=redis_url, pod="pod-a", patient=True, **bound)
    first = await pod_a.chat("shared across pods")
    assert first.headers["x-cache"] == "MISS"
    l2_a = pod_a.sidecar.l2
    await wait_until(lambda: l2_a.counters.stores >= 1, timeout_s=20.0)
    pod_b = await sidecar_factory(redis_url=redis_url, pod="pod-b", **bound)
    pod_b.sidecar.l2.op_timeout_s = 5.0  # a loaded machine must not turn the hit into a miss
    from_b = await pod_b.chat("shared across pods")
    assert from_b.headers["x-cache"] == "HIT-L2"
    assert answer(from_b) == answer(first)
    await wait_until(pod_b.sidecar.tracker.fresh, timeout_s=20.0)
    assert (await pod_b.chat("shared across pods")).headers["x-cache"] == "HIT-L1"
    # Restart pod A (a new process would have an empty L1): still a hit.
    await pod_a.aclose()
    pod_a2 = await sidecar_factory(redis_url=redis_url, pod="pod-a", **bound)
    pod_a2.sidecar.l2.op_timeout_s = 5.0
    assert (await pod_a2.chat("shared across pods")).headers["x-cache"] == "HIT-L2"
    assert upstream.calls[CHAT] == 1
    text = (await pod_b.admin.get("/metrics")).text
    assert metric(text, "cachefleet_requests_total", tier="l2", result="hit") == 1


async def test_l2_is_isolated_per_tenant(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream, redis_url: str
) -> None:
    pod_a = await sidecar_factory(redis_url=redis_url, patient=True)
    await pod_a.chat("same words", tenant="alpha")
    await pod_a.stored()
    pod_b = await sidecar_factory(redis_url=redis_url, pod="pod-b", patient=True)
    assert (await pod_b.chat("same words", tenant="beta")).headers["x-cache"] == "MISS"
    assert (await pod_b.chat("same words", tenant="alpha")).headers["x-cache"] == "HIT-L2"


@pytest.mark.redis_cluster
async def test_l2_on_redis_cluster(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream, cluster_url: str
) -> None:
    pod_a = await sidecar_factory(redis_url=cluster_url, patient=True)
    tenants = [f"t{i}" for i in range(6)]  # spread over several slots
    for t in tenants:
        await pod_a.chat("cluster prompt", tenant=t)
    await pod_a.stored(len(tenants))
    pod_b = await sidecar_factory(redis_url=cluster_url, pod="pod-b", patient=True)
    for t in tenants:
        assert (await pod_b.chat("cluster prompt", tenant=t)).headers["x-cache"] == "HIT-L2"


async def test_stream_replays_from_l2(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream, redis_url: str
) -> None:
    pod_a = await sidecar_factory(redis_url=redis_url, patient=True)
    first = await pod_a.chat("stream", body={"stream": True})
    await pod_a.stored()
    pod_b = await sidecar_factory(redis_url=redis_url, pod="pod-b", patient=True)
    hit = await pod_b.chat("stream", body={"stream": True})
    assert hit.headers["x-cache"] == "HIT-L2"
    assert hit.headers["content-type"] == "text/event-stream"
    assert hit.content == first.content


async def test_corrupt_l2_entry_is_a_miss_not_an_error(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream, redis_url: str
) -> None:
    pod_a = await sidecar_factory(redis_url=redis_url, patient=True)
    await pod_a.chat("fragile")
    await pod_a.stored()  # the L2 write is in the background
    client = redis_from_url(redis_url)
    try:
        keys = [k async for k in client.scan_iter(match="cf:*:e:*")]
        assert len(keys) == 1
        await client.set(keys[0], b"garbage")
    finally:
        await client.aclose()
    # patient: its read must reach the corrupt entry, not time out on a loaded machine
    pod_b = await sidecar_factory(redis_url=redis_url, pod="pod-b", patient=True)
    resp = await pod_b.chat("fragile")
    assert resp.status_code == 200
    assert resp.headers["x-cache"] == "MISS"
    text = (await pod_b.admin.get("/metrics")).text
    assert metric(text, "cachefleet_cache_faults_total", kind="corrupt_entry") == 1


async def test_redis_killed_mid_test_requests_keep_flowing(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    with RedisServer() as redis:
        # the L1 hit below is served on the last confirmation: it must not lapse (2 s) on a
        # loaded machine, and must have been made before Redis goes
        pod = await sidecar_factory(redis_url=redis.url, staleness_bound_s=60.0)
        await pod.confirmed()
        await pod.chat("before")
        redis.kill()
        # L1 still hits; misses go upstream; nothing becomes a user-visible error.
        assert (await pod.chat("before")).headers["x-cache"] == "HIT-L1"
        l2 = pod.sidecar.l2
        l2.breaker.cooldown_s = 3600.0  # no half-open probe mid-loop, however slow the machine
        tried = 0
        for i in range(12):
            if i == 4:
                tried, cut_short = (
                    l2.counters.errors + l2.counters.timeouts,
                    l2.counters.short_circuited,
                )
            resp = await pod.chat(f"during outage {i}")
            assert resp.status_code == 200
            assert resp.headers["x-cache"] == "MISS"
        # Once the fault is known (breaker open), Redis adds no waiting: nothing is tried,
        # each later request's L2 read is cut short at once.
        assert l2.breaker.state == "open"
        assert l2.counters.errors + l2.counters.timeouts == tried
        assert l2.counters.short_circuited - cut_short >= 8
        l2.breaker.cooldown_s = DEFAULT_COOLDOWN_S
        assert (await pod.admin.get("/readyz")).status_code == 200
        status = (await pod.admin.get("/status")).json()
        assert status["redis"] != "ok"
        assert status["degraded"]["redis"] is True
        redis.restart()
        # It reconnects by itself: a fresh pod's entry is found through L2 again.
        probes = iter(range(1000))

        async def recovered() -> bool:
            # New prompts miss L1, so they reach L2: the breaker half-opens and retries.
            await pod.chat(f"probe {next(probes)}")
            return bool(pod.sidecar.l2.state == "ok")

        await wait_until(recovered, 10.0)
        pod.patient()
        stores = pod.sidecar.l2.counters.stores
        await pod.chat("after restart")
        await pod.stored(stores + 1)
        other = await sidecar_factory(redis_url=redis.url, pod="pod-b", patient=True)
        assert (await other.chat("after restart")).headers["x-cache"] == "HIT-L2"


async def test_quotas_published_by_the_operator_reach_the_sidecar(
    sidecar_factory: SidecarFactory, redis_url: str
) -> None:
    pod = await sidecar_factory(redis_url=redis_url, cache="team/chat")
    client = redis_from_url(redis_url)
    try:
        assignment = QuotaAssignment(
            generation=7,
            tenants={
                "gold": TenantQuota(l1_bytes=2 << 20, l2_bytes=8 << 20, policy=Policy.LIRS),
                "silver": TenantQuota(l1_bytes=1 << 20, l2_bytes=4 << 20),
            },
        )
        await publish_quotas(client, "team/chat", assignment)
        await wait_until(lambda: pod.sidecar.tenants.quota_generation == 7)
        assert (await pod.chat("hi", tenant="stranger")).status_code == 403
        assert (await pod.chat("hi", tenant="gold")).status_code == 200
        stats = pod.sidecar.l1.stats()
        assert stats["gold"].policy == "lirs"
        assert stats["gold"].capacity_bytes == 2 << 20

        async def heartbeat_seen() -> bool:
            members = await live_members(client, "team/chat")
            return any(m.pod == "pod-a" and m.quota_generation == 7 for m in members)

        await wait_until(heartbeat_seen, 10.0)
    finally:
        await client.aclose()


async def test_redis_and_epoch_state_are_metrics(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream, redis_url: str
) -> None:
    # patient: a loaded machine must not turn the write or the usage read into an error
    pod = await sidecar_factory(redis_url=redis_url, patient=True)
    await pod.chat("counted")
    await pod.stored()  # the L2 write is in the background
    await pod.sidecar.admin.refresh_l2_usage()
    text = (await pod.admin.get("/metrics")).text
    assert metric(text, "cachefleet_redis_up") == 1
    assert metric(text, "cachefleet_redis_errors_total") == 0
    assert metric(text, "cachefleet_epochs_confirmed") == 1
    client = redis_from_url(redis_url)
    try:
        epoch = await advance_epoch(client, "test/cache", "cache")
        await publish_epochs(client, "test/cache", {"cache": epoch})
    finally:
        await client.aclose()
    await wait_until(lambda: pod.sidecar.tracker.known.get("cache") == epoch)
    text = (await pod.admin.get("/metrics")).text
    assert metric(text, "cachefleet_epoch", scope="cache") == epoch
    used = metric(text, "cachefleet_cache_bytes", tenant="acme", tier="l2")
    assert used is not None
    assert used > 0
    assert (await pod.admin.get("/status")).json()["tenants"]["acme"]["l2_bytes"] == used


def _raw_chat(content: str) -> bytes:
    body = json.dumps(
        {"model": "m1", "messages": [{"role": "user", "content": content}], "temperature": 0}
    ).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Tenant-ID: acme\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )


async def _read_answer(reader: asyncio.StreamReader) -> tuple[str, bytes]:
    """(X-Cache, body) of the next response on a keep-alive connection."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower().split("\r\n")
    fields = dict(line.split(": ", 1) for line in head[1:] if ": " in line)
    return fields["x-cache"].upper(), await reader.readexactly(int(fields["content-length"]))


async def _exchange(url: str, *requests: bytes) -> list[tuple[str, bytes]]:
    """Send ``requests`` pipelined in one write; their answers, in the order they came."""
    reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    try:
        writer.write(b"".join(requests))
        async with asyncio.timeout(20.0):
            return [await _read_answer(reader) for _ in requests]
    finally:
        writer.close()


async def test_pipelined_l2_hit_l1_hit_and_miss_are_answered_in_order(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream, redis_url: str
) -> None:
    """An L2 hit is answered from the Redis reply's callback (no task): requests
    pipelined behind it wait for it, and an L2 miss asks Redis once, not again
    on the way upstream."""
    bound = {"staleness_bound_s": 60.0}
    pod_a = await sidecar_factory(redis_url=redis_url, pod="pod-a", patient=True, **bound)
    ((tier, in_l2),) = await _exchange(pod_a.url, _raw_chat("kept in L2"))
    assert tier == "MISS"
    l2_a = pod_a.sidecar.l2
    await wait_until(lambda: l2_a.counters.stores >= 1, timeout_s=20.0)
    pod_b = await sidecar_factory(redis_url=redis_url, pod="pod-b", **bound)
    l2 = pod_b.sidecar.l2
    l2.op_timeout_s = 5.0  # a loaded machine must not turn the hit into a miss
    ((tier, in_l1),) = await _exchange(pod_b.url, _raw_chat("kept in L1"))
    assert tier == "MISS"
    await wait_until(pod_b.sidecar.tracker.fresh, timeout_s=20.0)
    hits, misses = l2.counters.hits, l2.counters.misses
    answers = await _exchange(
        pod_b.url, _raw_chat("kept in L2"), _raw_chat("kept in L1"), _raw_chat("new")
    )
    assert [tier for tier, _ in answers] == ["HIT-L2", "HIT-L1", "MISS"]
    assert answers[0][1] == in_l2
    assert answers[1][1] == in_l1
    assert answers[2][1] not in (in_l1, in_l2)
    assert (l2.counters.hits, l2.counters.misses) == (hits + 1, misses + 1)
    assert upstream.calls[CHAT] == 3


async def test_an_l2_miss_goes_upstream_from_the_reply_callback(
    sidecar_factory: SidecarFactory,
    upstream: FakeUpstream,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On an L2 miss read from the fast path, the upstream call is sent from the
    Redis reply's callback: no task, L2 read once, the answer stored in L1 and L2."""
    pod = await sidecar_factory(redis_url=redis_url, staleness_bound_s=60.0)
    l2 = pod.sidecar.l2
    l2.op_timeout_s = 5.0  # a loaded machine must not turn the read into a fault
    pod.sidecar.upstream.max_idle_age_s = 3600.0  # nor let the upstream connection go stale
    ((tier, _),) = await _exchange(pod.url, _raw_chat("warm-up"))  # opens both connections
    assert tier == "MISS"
    await wait_until(lambda: l2.counters.stores >= 1, timeout_s=20.0)
    await wait_until(pod.sidecar.tracker.fresh, timeout_s=20.0)
    slow = spy_on_handle(pod, monkeypatch)
    misses = l2.counters.misses
    ((tier, first),) = await _exchange(pod.url, _raw_chat("fresh"))
    assert tier == "MISS"
    assert slow == []
    assert l2.counters.misses == misses + 1
    await wait_until(lambda: l2.counters.stores >= 2, timeout_s=20.0)
    ((tier, again),) = await _exchange(pod.url, _raw_chat("fresh"))
    assert (tier, again) == ("HIT-L1", first)
    assert upstream.calls[CHAT] == 2


async def test_l2_hits_an_l1_cannot_hold_are_counted_and_not_promoted(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream, redis_url: str
) -> None:
    """With no room in L1 every repeat is an L2 hit, answered from the reply's
    callback, with its request, latency and savings counted (at the turn's end)
    and nothing put in L1."""
    pod = await sidecar_factory(redis_url=redis_url, l1_bytes=0, staleness_bound_s=60.0)
    l2 = pod.sidecar.l2
    l2.op_timeout_s = 5.0  # a loaded machine must not turn a hit into a miss
    ((tier, first),) = await _exchange(pod.url, _raw_chat("no room in L1"))
    assert tier == "MISS"
    await wait_until(lambda: l2.counters.stores >= 1, timeout_s=20.0)
    await wait_until(pod.sidecar.tracker.fresh, timeout_s=20.0)
    answers = await _exchange(pod.url, *[_raw_chat("no room in L1")] * 3)
    assert answers == [("HIT-L2", first)] * 3
    assert pod.sidecar.l1.used_bytes == 0
    assert upstream.calls[CHAT] == 1
    text = (await pod.admin.get("/metrics")).text
    hits = {"tenant": "acme", "tier": "l2", "result": "hit"}
    assert metric(text, "cachefleet_requests_total", **hits) == 3
    latency = {"tenant": "acme", "tier": "l2"}
    assert metric(text, "cachefleet_request_duration_seconds_count", **latency) == 3
    saved = {"tenant": "acme", "model": "m1"}
    assert metric(text, "cachefleet_saved_tokens_total", **saved, kind="prompt") == 3 * 5
    assert metric(text, "cachefleet_saved_tokens_total", **saved, kind="completion") == 3 * 3
