"""The sidecar and the operator's Redis calls under the least-privilege ACLs of docs/security.md.

The users are created on the real server with exactly the rules
:func:`sidecar_acl` / :func:`operator_acl` give; the whole
data and control path then runs as those users, and ``ACL LOG`` must show no
refusal. The same users are refused what they should not do.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, ResponseError

from cachefleet_common.contract.acls import operator_acl, sidecar_acl
from cachefleet_common.contract.clients import redis_from_url
from cachefleet_common.contract.fleet import FLEET_BATCH_MAX
from cachefleet_common.contract.messages import QuotaAssignment, TenantQuota
from cachefleet_common.contract.names import lru_key
from cachefleet_common.contract.ops import (
    advance_epoch,
    fence_tenants,
    live_members,
    publish_epochs,
    publish_quotas,
    read_acks,
)
from cachefleet_e2e.fake_upstream import FakeUpstream
from cachefleet_operator.invalidation import Invalidator
from cachefleet_operator.publisher import RedisControlPlane

from .conftest import SidecarFactory
from .test_sidecar import CHAT, answer

pytestmark = pytest.mark.redis

CACHE = "test/cache"
SIDECAR_PASSWORD = "sidecar-pw-7c1e"
OPERATOR_PASSWORD = "operator-pw-44ad"


async def wait_until(predicate: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = predicate()  # type: ignore[operator]
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout_s}s")


@pytest.fixture
async def admin(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = redis_from_url(redis_url)
    assert isinstance(client, aioredis.Redis)
    await client.execute_command(
        "ACL", "SETUSER", "cf-sidecar", "reset", "on", f">{SIDECAR_PASSWORD}",
        *sidecar_acl(CACHE),
    )  # fmt: skip
    await client.execute_command(
        "ACL", "SETUSER", "cf-operator", "reset", "on", f">{OPERATOR_PASSWORD}",
        *operator_acl(),
    )  # fmt: skip
    await client.execute_command("ACL", "LOG", "RESET")
    yield client
    await client.execute_command("ACL", "DELUSER", "cf-sidecar", "cf-operator")
    await client.aclose()


def as_user(redis_url: str, user: str, password: str) -> str:
    return redis_url.replace("redis://", f"redis://{user}:{password}@", 1)


async def refusals(admin: aioredis.Redis) -> list[str]:
    entries = await admin.execute_command("ACL", "LOG")
    out = []
    for entry in entries:
        fields = (
            dict(zip(entry[::2], entry[1::2], strict=False)) if isinstance(entry, list) else entry
        )
        fields = {k.decode() if isinstance(k, bytes) else k: v for k, v in fields.items()}
        out.append(f"{fields.get('username')!r} {fields.get('reason')!r} {fields.get('object')!r}")
    return out


async def test_sidecar_and_operator_work_under_least_privilege(
    sidecar_factory: SidecarFactory,
    upstream: FakeUpstream,
    redis_url: str,
    admin: aioredis.Redis,
) -> None:
    sidecar_url = as_user(redis_url, "cf-sidecar", SIDECAR_PASSWORD)
    operator = redis_from_url(as_user(redis_url, "cf-operator", OPERATOR_PASSWORD))
    try:
        pod_a = await sidecar_factory(redis_url=sidecar_url, cache=CACHE, patient=True)
        first = await pod_a.chat("under ACL")
        await pod_a.stored()
        pod_b = await sidecar_factory(redis_url=sidecar_url, cache=CACHE, pod="pod-b", patient=True)
        second = await pod_b.chat("under ACL")
        assert second.headers["x-cache"] == "HIT-L2"
        assert answer(second) == answer(first)
        assert upstream.calls[CHAT] == 1

        # The operator publishes quotas and runs an invalidation; the sidecars follow and ack.
        assignment = QuotaAssignment(
            generation=3,
            tenants={"acme": TenantQuota(l1_bytes=1 << 20, l2_bytes=4 << 20)},
        )
        await publish_quotas(operator, CACHE, assignment)
        await wait_until(lambda: pod_a.sidecar.tenants.quota_generation == 3)
        epoch = await advance_epoch(operator, CACHE, "cache")
        await fence_tenants(operator, CACHE, {"cache": epoch})
        await publish_epochs(operator, CACHE, {"cache": epoch})
        await wait_until(lambda: pod_b.sidecar.tracker.known.get("cache") == epoch)

        async def acked() -> bool:
            acks = await read_acks(operator, CACHE)
            return all(
                pod in acks and acks[pod].epochs.get("cache") == epoch for pod in ("pod-a", "pod-b")
            )

        await wait_until(acked)
        members = await live_members(operator, CACHE)
        assert {m.pod for m in members} >= {"pod-a", "pod-b"}
        after = await pod_b.chat("under ACL")
        assert after.headers["x-cache"] == "MISS"  # the invalidation reached L2 too
        status = (await pod_a.admin.get("/status")).json()
        assert status["redis"] == "ok"
        assert SIDECAR_PASSWORD not in str(status)
        assert await refusals(admin) == []

        # A key purge (operator) applied by both sidecars, and a warm-up, under the same users.
        async def rewritten() -> bool:  # the entry before the invalidation, and the one after
            return int(await admin.zcard(lru_key(CACHE, "acme"))) == 2

        await wait_until(rewritten)
        newest = await admin.zrange(lru_key(CACHE, "acme"), -1, -1)
        pod_c = await sidecar_factory(
            redis_url=sidecar_url, cache=CACHE, pod="pod-c", warm_bytes=1 << 20
        )
        await wait_until(lambda: pod_c.sidecar.upkeep.warm.state == "done")
        assert pod_c.sidecar.upkeep.warm.entries == 1
        digest = newest[0].decode().rpartition(":e:")[2]
        operator_url = as_user(redis_url, "cf-operator", OPERATOR_PASSWORD)
        async with Invalidator.from_url(operator_url, CACHE, poll_s=0.05) as inv:
            purged, at = await inv.purge(digest)
            result = await inv.await_acks("purge", purged, timeout_s=20.0, started_at=at)
        assert (result.completed, result.acks) == (True, 3)
        assert (await pod_c.chat("under ACL")).headers["x-cache"] == "MISS"
        assert await refusals(admin) == []

        # Fleet samples: the sidecar appends to the stream (XADD), the operator reads it (XRANGE).
        assert pod_c.sidecar.mrc is not None
        pod_c.sidecar.mrc.forward_fleet(1.0, FLEET_BATCH_MAX)  # every key, not 1/16
        await pod_c.chat("under ACL")
        plane = RedisControlPlane(as_user(redis_url, "cf-operator", OPERATOR_PASSWORD))

        async def sampled() -> bool:
            return bool((await plane.fleet_batches(CACHE, None))[0])

        await wait_until(sampled)
        assert await refusals(admin) == []
    finally:
        await operator.aclose()
    # The operator's clean-up of a deleted cache (SCAN + UNLINK), under its user.
    plane = RedisControlPlane(as_user(redis_url, "cf-operator", OPERATOR_PASSWORD))
    assert await plane.delete_cache_state(CACHE) > 0
    assert await refusals(admin) == []


async def test_the_sidecar_user_is_refused_everything_else(
    redis_url: str, admin: aioredis.Redis
) -> None:
    await admin.set("other:secret", "x")
    await admin.set("cf:{cf:other/cache}:quotas", "x")
    client = redis_from_url(as_user(redis_url, "cf-sidecar", SIDECAR_PASSWORD))
    try:
        for command in (
            ("GET", "other:secret"),
            ("GET", "cf:{cf:other/cache}:quotas"),  # another cache's keys
            ("FLUSHALL",),
            ("KEYS", "*"),
            ("CONFIG", "GET", "*"),
            ("SCAN", "0"),
            ("ACL", "LIST"),
            ("EVAL", "return redis.call('GET', KEYS[1])", "1", "other:secret"),
            ("PUBLISH", "cf:{cf:other/cache}:control", "x"),
        ):
            with pytest.raises((NoPermissionError, ResponseError), match=r"(?i)permissions"):
                await client.execute_command(*command)
        assert await client.execute_command("PING")
    finally:
        await client.aclose()
    assert await admin.get("other:secret") == b"x"
