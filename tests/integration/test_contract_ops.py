"""contract.ops: each operation is written once and gives the same answers on both clients.

The operator runs them on redis-py, the sidecar (and the operator's propagation
path) on the RESP client; every test runs on each, against a standalone Redis
and a 3-node cluster.
"""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import AsyncIterator

import orjson
import pytest
from redis.asyncio import Redis

from cachefleet_common.contract.clients import RedisClient, redis_from_url, resp_client
from cachefleet_common.contract.lua import L2_PUT_LUA
from cachefleet_common.contract.messages import EpochAck, Heartbeat
from cachefleet_common.contract.names import (
    acks_key,
    control_channel,
    entry_key,
    guest,
    l2_keys,
    purge_log_key,
    tenant_epochs_key,
)
from cachefleet_common.contract.ops import (
    AnyClient,
    fence_tenants,
    live_acks,
    live_members,
    log_purge,
    purge_fence,
    purge_logged,
    purges_since,
    read_acks,
    register_tenant,
    remove_member,
    write_ack,
    write_heartbeat,
)
from cachefleet_common.contract.urls import parse_redis_url

pytestmark = [pytest.mark.redis]

CACHE = "team/chat"
DIGEST = "ab" * 32
OTHER = "cd" * 32


@pytest.fixture
async def admin(any_redis: str) -> AsyncIterator[RedisClient]:
    """A redis-py client that sets the stage and checks what the operations wrote."""
    client = redis_from_url(any_redis)
    yield client
    await client.aclose()


@pytest.fixture(params=["redis-py", "resp"])
async def client(request: pytest.FixtureRequest, any_redis: str) -> AsyncIterator[AnyClient]:
    """The client under test: the operator's redis-py or the sidecar's RESP client."""
    if request.param == "redis-py":
        py = redis_from_url(any_redis)
        yield py
        await py.aclose()
    else:
        lean = resp_client(any_redis, command_timeout_s=5.0)
        yield lean
        await lean.aclose()


@pytest.fixture
async def announcements(any_redis: str) -> AsyncIterator[asyncio.Queue[dict[str, object]]]:
    """Notices on the control channel, heard on one node (pub/sub spans a cluster)."""
    host, port = parse_redis_url(any_redis).nodes[0]
    node = Redis(host=host, port=port)
    pubsub = node.pubsub()
    await pubsub.subscribe(control_channel(CACHE))
    heard: asyncio.Queue[dict[str, object]] = asyncio.Queue()

    async def listen() -> None:
        async for message in pubsub.listen():
            if message["type"] == "message":
                heard.put_nowait(orjson.loads(message["data"]))

    task = asyncio.create_task(listen())
    yield heard
    task.cancel()
    await pubsub.aclose()  # type: ignore[no-untyped-call]
    await node.aclose()


async def fence_of(admin: RedisClient, tenant: str) -> dict[str, int]:
    raw = await admin.hgetall(tenant_epochs_key(CACHE, tenant))
    return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}


async def test_fences_announcements_members_and_acks(
    client: AnyClient, admin: RedisClient, announcements: asyncio.Queue[dict[str, object]]
) -> None:
    for tenant in ("a", "b"):
        await register_tenant(admin, CACHE, tenant)
    assert await fence_tenants(client, CACHE, {"cache": 3}, announce=True) == 2
    assert await fence_of(admin, "a") == await fence_of(admin, "b") == {"cache": 3}
    notice = await asyncio.wait_for(announcements.get(), 10.0)
    assert (notice["kind"], notice["epochs"]) == ("epochs", {"cache": 3})
    # one named tenant (its slot, and its scope in the guests' pool); a lower epoch
    # never lowers a fence; no scope, no work
    assert await fence_tenants(client, CACHE, {"tenant:a": 5, "cache": 1}, ["a"]) == 2
    assert await fence_of(admin, "a") == {"cache": 3, "tenant:a": 5}
    assert await fence_of(admin, guest("a")) == {"tenant:a": 5, "cache": 1}
    assert await fence_of(admin, "b") == {"cache": 3}
    assert await fence_tenants(client, CACHE, {}) == 0
    with pytest.raises(ValueError, match="invalid epoch scope"):
        await fence_tenants(client, CACHE, {"no such scope": 1})

    for pod in ("p2", "p1", "p3"):
        await write_heartbeat(client, CACHE, Heartbeat(pod=pod, quota_generation=4))
    await write_ack(client, CACHE, EpochAck(pod="p1", epochs={"cache": 3}))
    await write_ack(client, CACHE, EpochAck(pod="p2", epochs={"cache": 2, "tenant:a": 5}))
    await admin.hset(acks_key(CACHE), "p3", "not an ack")  # skipped by every reader
    await remove_member(admin, CACHE, "p2")  # gone from members and acks at once

    assert [(m.pod, m.quota_generation) for m in await live_members(client, CACHE)] == [
        ("p1", 4),
        ("p3", 4),
    ]
    acks = await read_acks(client, CACHE)
    assert {pod: ack.epochs for pod, ack in acks.items()} == {"p1": {"cache": 3}}
    assert await live_acks(client, CACHE) == (["p1", "p3"], {"p1": {"cache": 3}})


async def test_key_purges_delete_fence_announce_and_are_logged(
    client: AnyClient, admin: RedisClient, announcements: asyncio.Queue[dict[str, object]]
) -> None:
    for tenant in ("a", "b"):
        await register_tenant(admin, CACHE, tenant)
        stored = await admin.eval(
            L2_PUT_LUA, 5, *l2_keys(CACHE, tenant, DIGEST), "value", "60000", "1000000", "10"
        )
        assert stored[0] == 1
    epoch = await log_purge(admin, CACHE, DIGEST)
    assert epoch == 1

    # only tenant a's slot, then every registered one (a's entry is gone already)
    assert await purge_fence(client, CACHE, DIGEST, epoch, ["a"]) == 1
    assert await admin.exists(entry_key(CACHE, "a", DIGEST)) == 0
    assert await admin.exists(entry_key(CACHE, "b", DIGEST)) == 1
    assert await purge_fence(client, CACHE, DIGEST, epoch, announce=True) == 1
    assert await admin.exists(entry_key(CACHE, "b", DIGEST)) == 0
    assert await fence_of(admin, "a") == await fence_of(admin, "b") == {"purge": 1}
    notice = await asyncio.wait_for(announcements.get(), 10.0)
    assert notice["epochs"] == {"purge": 1}

    assert await purge_logged(client, CACHE, DIGEST, 1) == 1
    assert await purge_logged(client, CACHE, DIGEST, 2) is None
    assert await purge_logged(client, CACHE, OTHER, 0) is None
    assert await purges_since(client, CACHE, 0, 1) == ([DIGEST], True)
    assert await purges_since(client, CACHE, 1, 1) == ([], True)
    # a number the log does not hold: the caller must drop everything
    assert await purges_since(client, CACHE, 0, 2) == ([DIGEST], False)


async def test_reading_the_purge_log_costs_the_log_not_the_purge_counter(
    client: AnyClient, admin: RedisClient
) -> None:
    """Issue 34 (5): a new pod asks for every purge since 0; checking that the log held them
    built a set of every number in the range (counter 12,000,000: 1.15 GiB at start-up).
    Now the check costs what the log holds, whatever the counter."""
    counter = 2_000_000
    assert await log_purge(admin, CACHE, DIGEST, floor=counter - 2) == counter - 1
    assert await log_purge(admin, CACHE, OTHER) == counter
    tracemalloc.start()
    try:
        found = await purges_since(client, CACHE, 0, counter)  # a new pod's first read
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert found == ([DIGEST, OTHER], False)  # the log lost the numbers before the floor
    assert peak < 4 * 1024 * 1024, f"{peak / 2**20:.1f} MiB to check the purge log"
    # a range the log holds whole, and one with a number missing in its middle
    assert await purges_since(client, CACHE, counter - 2, counter) == ([DIGEST, OTHER], True)
    assert await purges_since(client, CACHE, counter - 1, counter) == ([OTHER], True)
    await admin.zrem(purge_log_key(CACHE), f"{counter - 1}:{DIGEST}")
    assert await purges_since(client, CACHE, counter - 2, counter) == ([OTHER], False)
