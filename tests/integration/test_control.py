"""Quota sync and heartbeats between operator and sidecars through real Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from cachefleet_common.contract.clients import RedisClient, redis_from_url
from cachefleet_common.contract.lua import PUBLISH_QUOTAS_LUA
from cachefleet_common.contract.messages import (
    ControlMessage,
    EpochAck,
    Heartbeat,
    QuotaAssignment,
    TenantQuota,
)
from cachefleet_common.contract.names import Policy, control_channel, quotas_key, tombstone_key
from cachefleet_common.contract.ops import (
    advance_epoch,
    live_members,
    publish_epochs,
    publish_quotas,
    read_acks,
)
from cachefleet_common.contract.urls import parse_redis_url
from cachefleet_common.epochs import EpochTracker
from cachefleet_e2e.services import RedisServer
from cachefleet_sidecar.control.control import ControlSync

CACHE = "team-a/chat"
#: Bound of every "eventually" below, seconds: generous, a slow machine only waits longer.
WAIT_S = 20.0
#: Heartbeat TTL in the heartbeat test, seconds.
BEAT_TTL_S = 1.5


def assignment(generation: int, l2_bytes: int = 1000) -> QuotaAssignment:
    return QuotaAssignment(
        generation=generation,
        tenants={"alice": TenantQuota(l1_bytes=100, l2_bytes=l2_bytes, policy=Policy.LIRS)},
    )


async def eventually(check: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> float:
    """Wait (bounded) until ``check()``; returns the seconds it took."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if check():
            return time.monotonic() - started
        await asyncio.sleep(0.02)
    pytest.fail(f"timed out after {timeout_s}s waiting for {what}")


@pytest.fixture(
    params=[
        pytest.param("standalone", marks=pytest.mark.redis),
        pytest.param("cluster", marks=pytest.mark.redis_cluster),
    ]
)
def backend_url(request: pytest.FixtureRequest) -> str:
    name = "redis_url" if request.param == "standalone" else "cluster_url"
    url: str = request.getfixturevalue(name)
    return url


@pytest.fixture
async def operator_client(backend_url: str) -> AsyncIterator[RedisClient]:
    """What the operator would hold: a client for the same URL."""
    client = redis_from_url(backend_url)
    yield client
    await client.aclose()


@pytest.fixture
async def make_sync(backend_url: str) -> AsyncIterator[Callable[..., ControlSync]]:
    made: list[ControlSync] = []

    def make(
        pod: str, on_quotas: Callable[[QuotaAssignment], None], **options: object
    ) -> ControlSync:
        sync = ControlSync(backend_url, CACHE, pod, on_quotas, **options)  # type: ignore[arg-type]
        made.append(sync)
        return sync

    yield make
    for sync in made:
        await sync.stop()


async def test_published_quotas_reach_the_sidecar_by_message(
    make_sync: Callable[..., ControlSync], operator_client: RedisClient
) -> None:
    applied: list[QuotaAssignment] = []
    # No resync within the test: only the pub/sub message can deliver it.
    sync = make_sync("pod-a", applied.append, resync_interval_s=3600.0)
    await sync.start()
    await eventually(lambda: sync.connected, "subscription")

    sent = assignment(1)
    assert await publish_quotas(operator_client, CACHE, sent) == 1
    await eventually(lambda: len(applied) == 1, "quota generation 1")

    assert applied[0].tenants == sent.tenants
    assert sync.applied_generation == 1


async def test_missed_message_is_caught_up_by_resync(
    make_sync: Callable[..., ControlSync], operator_client: RedisClient
) -> None:
    applied: list[QuotaAssignment] = []
    # Written before the sidecar starts: nobody was listening.
    await publish_quotas(operator_client, CACHE, assignment(3))
    sync = make_sync("pod-a", applied.append, resync_interval_s=0.3)
    await sync.start()
    await eventually(lambda: [a.generation for a in applied] == [3], "initial catch-up")

    # Stored without any message at all (as if the message were lost).
    await operator_client.eval(
        PUBLISH_QUOTAS_LUA,
        2,
        quotas_key(CACHE),
        tombstone_key(CACHE),
        "4",
        assignment(4, l2_bytes=2000).model_dump_json(),
    )
    # No message was sent: only the 0.3 s resync can deliver it (however long that takes).
    await eventually(lambda: len(applied) == 2, "generation 4 by resync")
    assert applied[1].tenants["alice"].l2_bytes == 2000


async def test_older_generation_is_ignored(
    make_sync: Callable[..., ControlSync], operator_client: RedisClient
) -> None:
    applied: list[QuotaAssignment] = []
    messages: list[ControlMessage] = []
    sync = make_sync("pod-a", applied.append, resync_interval_s=30.0, on_message=messages.append)
    await sync.start()
    await eventually(lambda: sync.connected, "subscription")
    await publish_quotas(operator_client, CACHE, assignment(5))
    await eventually(lambda: len(applied) == 1, "generation 5")

    # A stale operator: the script keeps the newer generation and says so.
    assert await publish_quotas(operator_client, CACHE, assignment(3)) == 5
    # A writer that bypasses the script and announces an older generation.
    await operator_client.hset(
        quotas_key(CACHE),
        mapping={"generation": "4", "assignment": assignment(4).model_dump_json()},
    )
    stale = ControlMessage(kind="quotas", generation=4).model_dump_json()
    await operator_client.publish(control_channel(CACHE), stale)
    await eventually(lambda: len(messages) == 2, "the stale notice")
    assert not await sync.resync()
    assert [a.generation for a in applied] == [5]

    await publish_quotas(operator_client, CACHE, assignment(6))
    await eventually(lambda: [a.generation for a in applied] == [5, 6], "generation 6")


async def test_heartbeats_are_visible_and_expire(
    make_sync: Callable[..., ControlSync], operator_client: RedisClient
) -> None:
    pod_a = make_sync("pod-a", lambda _: None, heartbeat_ttl_s=BEAT_TTL_S)
    pod_b = make_sync(
        "pod-b",
        lambda _: None,
        heartbeat_ttl_s=BEAT_TTL_S,
        heartbeat=lambda: Heartbeat(pod="ignored", quota_generation=7, redis_ok=False),
    )
    await pod_a.start()
    await pod_b.start()

    members: list[Heartbeat] = []

    async def poll() -> list[str]:
        members[:] = await live_members(operator_client, CACHE)
        return [m.pod for m in members]

    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if await poll() == ["pod-a", "pod-b"]:
            break
        await asyncio.sleep(0.05)
    assert [m.pod for m in members] == ["pod-a", "pod-b"]
    assert members[1].quota_generation == 7
    assert not members[1].redis_ok

    # Still there well after one TTL: the heartbeats are refreshed (each pod's latest
    # heartbeat was sent more than a TTL after its first).
    first = {m.pod: m.sent_at for m in members}
    deadline = time.monotonic() + WAIT_S
    while True:
        pods = await poll()
        if pods == ["pod-a", "pod-b"] and all(
            m.sent_at > first[m.pod] + BEAT_TTL_S for m in members
        ):
            break
        assert time.monotonic() < deadline, f"heartbeats not refreshed: {members}"
        await asyncio.sleep(0.05)

    # pod-a's own heartbeat, just written, is live for a TTL: its presence is checked only
    # while that TTL surely runs (a slow machine skips the check instead of failing).
    beat_at = time.monotonic()
    await pod_a.beat()
    await pod_b.stop()  # graceful: leaves at once
    pods = await poll()
    assert "pod-b" not in pods
    if time.monotonic() - beat_at < BEAT_TTL_S:
        assert pods == ["pod-a"]
    beat_at = time.monotonic()
    await pod_a.beat()
    await pod_a.stop(leave=False)  # as if killed: the heartbeat expires
    pods = await poll()
    if time.monotonic() - beat_at < BEAT_TTL_S:
        assert pods == ["pod-a"]  # not left: still listed until the heartbeat expires
    deadline = time.monotonic() + WAIT_S
    while await poll() != []:
        assert time.monotonic() < deadline, "the killed pod's heartbeat never expired"
        await asyncio.sleep(0.05)


# ----------------------------------------------------------------- faults


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.mark.redis
async def test_sync_survives_a_redis_restart(own_redis: RedisServer) -> None:
    applied: list[QuotaAssignment] = []
    sync = ControlSync(own_redis.url, CACHE, "pod-a", applied.append, resync_interval_s=30.0)
    operator = redis_from_url(own_redis.url)
    try:
        await sync.start()
        await eventually(lambda: sync.connected, "subscription")
        await publish_quotas(operator, CACHE, assignment(1))
        await eventually(lambda: len(applied) == 1, "generation 1")

        own_redis.kill()
        await eventually(lambda: not sync.connected, "noticing the loss")
        own_redis.restart()  # empty: no persistence
        await publish_quotas(operator, CACHE, assignment(2))

        # Either the message or the re-read after re-subscribing delivers it,
        # long before the 30 s periodic resync.
        await eventually(lambda: len(applied) == 2, "generation 2 after restart")
        assert sync.errors >= 1
        assert sync.connected
    finally:
        await sync.stop()
        await operator.aclose()


@pytest.mark.redis
async def test_failing_callback_is_retried_on_next_resync(redis_url: str) -> None:
    calls: list[int] = []

    def flaky(received: QuotaAssignment) -> None:
        calls.append(received.generation)
        if len(calls) == 1:
            raise RuntimeError("not ready yet")

    operator = redis_from_url(redis_url)
    sync = ControlSync(redis_url, CACHE, "pod-a", flaky, resync_interval_s=0.2)
    try:
        await publish_quotas(operator, CACHE, assignment(1))
        await sync.start()
        await eventually(lambda: sync.applied_generation == 1, "retry of generation 1")
        assert calls[:2] == [1, 1]
    finally:
        await sync.stop()
        await operator.aclose()


@pytest.mark.redis
async def test_an_ack_that_fails_is_written_again_by_the_poll_it_asks_for(redis_url: str) -> None:
    """A notice is acknowledged from the subscription callback; when that write
    fails (here: the script cache was flushed, NOSCRIPT), the failure forgets
    what was acknowledged and pokes the epoch poll, whose ack reloads the
    script. The regular poll is an hour away, so only the poke can do it."""
    tracker = EpochTracker()
    operator = redis_from_url(redis_url)
    sync = ControlSync(
        redis_url, CACHE, "pod-a", lambda _a: None, tracker=tracker, epoch_poll_s=3600.0
    )
    try:
        await sync.start()
        await eventually(lambda: sync.acks_written >= 1, "the first acknowledgement")
        written, errors = sync.acks_written, sync.errors
        await operator.script_flush()
        epoch = await advance_epoch(operator, CACHE, "cache")
        await publish_epochs(operator, CACHE, {"cache": epoch})
        acks: dict[str, EpochAck] = {}

        async def acked() -> bool:
            acks.update(await read_acks(operator, CACHE))
            return "pod-a" in acks and acks["pod-a"].epochs.get("cache") == epoch

        started = time.monotonic()
        while not await acked():
            assert time.monotonic() - started < WAIT_S, f"no ack of epoch {epoch}: {acks}"
            await asyncio.sleep(0.02)
        assert tracker.known["cache"] == epoch
        assert sync.errors == errors + 1  # the callback's EVALSHA met NOSCRIPT
        assert sync.acks_written == written + 1  # the poll's, after reloading the script
    finally:
        await sync.stop()
        await operator.aclose()


def test_redis_url_convention() -> None:
    single = parse_redis_url("redis://:s3cret@127.0.0.1:7000/2")
    assert (single.cluster, single.nodes, single.db, single.password) == (
        False,
        (("127.0.0.1", 7000),),
        2,
        "s3cret",
    )
    many = parse_redis_url("rediss+cluster://u:p@10.0.0.1:7000,10.0.0.2")
    assert many.cluster
    assert many.tls
    assert many.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 6379))
    assert many.username == "u"
    assert parse_redis_url("redis://h:1", cluster=True).cluster
    with pytest.raises(ValueError):
        parse_redis_url("http://h:1")
