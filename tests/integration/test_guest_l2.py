"""Unlisted tenants ("guests", ``spec.tenantDefaults``) in L2: one pooled byte budget.

What a user would notice, on real Redis and real sidecars:

* a guest's answer stored by one sidecar is served from L2 by another;
* two guests never share an entry (each keeps its own key scope in the pool's
  slot: only the budget is pooled);
* the pool's bytes stay within its budget however many guests write, and no
  guest holds more than its cap (``tenantDefaults.l2GuestMaxShare`` of it, a
  quarter by default: a busy guest evicts its own oldest entries first, so the
  others keep theirs);
* a Key purge, a Namespace and a Tenant invalidation reach a guest's entries
  in L2 as they reach a listed tenant's;
* a cache-wide (or model) invalidation raises one fence for all guests, and
  every guest's reader and writer that missed it is refused;
* a Key purge with no tenant named deletes the digest in every guest's scope
  in a few script calls (batches of ``ops.PURGE_BATCH``), not one per guest.
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from cachefleet_common.contract.clients import redis_from_url
from cachefleet_common.contract.lua import DEFAULT_GUEST_MAX_SHARE, GUEST_MAX_SHARE_FIELD
from cachefleet_common.contract.messages import QuotaAssignment, TenantQuota
from cachefleet_common.contract.names import (
    GUESTS,
    entry_key,
    guest,
    guest_usage_key,
    usage_key,
)
from cachefleet_common.contract.ops import (
    PURGE_BATCH,
    advance_epoch,
    fence_tenants,
    log_purge,
    purge_fence,
)
from cachefleet_common.epochs import PURGE_SCOPE, namespace_scope, tenant_scope
from cachefleet_e2e.truth import VersionedUpstream
from cachefleet_operator.invalidation import Invalidator
from cachefleet_sidecar.cache.l2 import RedisL2
from tests.integration.conftest import RunningSidecar, SidecarFactory
from tests.integration.test_sidecar import metric

pytestmark = [pytest.mark.redis]

CACHE = "test/cache"
ACK_TIMEOUT_S = 20.0  # generous: a loaded machine only waits longer
#: Bound on waiting for background L2 writes, seconds.
SETTLE_S = 5.0
POOL_BYTES = 1 << 20
#: One listed tenant, and defaults for every other name with an L2 pool.
QUOTAS = QuotaAssignment(
    generation=1,
    tenants={"listed": TenantQuota(l1_bytes=1 << 20, l2_bytes=1 << 20)},
    default_tenant=TenantQuota(l1_bytes=1 << 20, l2_bytes=POOL_BYTES, l2_guest_max_share=0.5),
)
VECTOR = (("cache", 0), ("tenant:x", 0), ("model:m1", 0), (PURGE_SCOPE, 0))


async def ask(
    sc: RunningSidecar, prompt: str, tenant: str, namespace: str | None = None
) -> tuple[int, str]:
    headers = {} if namespace is None else {"X-Cache-Namespace": namespace}
    resp = await sc.chat(prompt, tenant=tenant, headers=headers)
    assert resp.status_code == 200, resp.text
    return int(resp.json()["version"]), resp.headers["x-cache"]


async def fleet(
    factory: SidecarFactory, url: str, upstream: str, n: int = 2
) -> list[RunningSidecar]:
    # patient: a loaded machine must not turn an L2 hit the test expects into a miss
    pods = [
        await factory(redis_url=url, upstream=upstream, pod=f"pod-{i}", patient=True)
        for i in range(n)
    ]
    for sc in pods:
        sc.sidecar.quotas.apply(QUOTAS)
        deadline = time.monotonic() + ACK_TIMEOUT_S
        while not (sc.server.control.acks_written > 0 and sc.sidecar.tracker.fresh()):
            assert time.monotonic() < deadline, "the sidecar never acknowledged its epochs"
            await asyncio.sleep(0.02)
    return pods


async def l2_digest(url: str, name: str, prompt: str, besides: frozenset[str] = frozenset()) -> str:
    """The digest of ``prompt``'s entry under L2 name ``name`` (not one of ``besides``);
    waits for the write."""
    client = redis_from_url(url)
    try:
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            async for raw in client.scan_iter(match=entry_key(CACHE, name, "*")):
                key = raw.decode()
                value = await client.get(key)
                digest = key.rpartition(":e:")[2]
                ours = value is not None and f'"{prompt}@v'.encode() in value
                if ours and digest not in besides:
                    return digest
            await asyncio.sleep(0.02)
    finally:
        await client.aclose()
    raise AssertionError(f"no L2 entry for {prompt!r} under {name!r}")


async def test_a_guests_answer_is_served_from_l2_by_another_sidecar(
    sidecar_factory: SidecarFactory, truth: VersionedUpstream, redis_url: str
) -> None:
    a, b = await fleet(sidecar_factory, redis_url, truth.url)
    assert await ask(a, "q", "cust-1") == (1, "MISS")
    await l2_digest(redis_url, guest("cust-1"), "q")
    assert await ask(b, "q", "cust-1") == (1, "HIT-L2")
    # another guest asking the same question is not served cust-1's entry
    assert await ask(b, "q", "cust-2") == (1, "MISS")
    await l2_digest(redis_url, guest("cust-2"), "q")
    assert await ask(a, "q", "cust-2") == (1, "HIT-L2")
    await a.sidecar.admin.refresh_l2_usage()  # periodic; now, for the test
    status = (await a.admin.get("/status")).json()
    assert status["l2_guests"]["limit_bytes"] == POOL_BYTES
    assert 0 < status["l2_guests"]["bytes"] <= POOL_BYTES
    # /metrics says the same, and how many guests this pod holds (cust-1, cust-2)
    text = (await a.admin.get("/metrics")).text
    assert metric(text, "cachefleet_guest_pool_quota_bytes", tier="l2") == POOL_BYTES
    assert metric(text, "cachefleet_guest_pool_bytes", tier="l2") == status["l2_guests"]["bytes"]
    assert metric(text, "cachefleet_guests", cache=CACHE) == 2
    # the heartbeat (kubectl cachefleet top) counts them by policy and names none
    beat = a.sidecar.admin.heartbeat()
    assert sum(beat.unlisted_by_policy.values()) == 2
    assert not {"cust-1", "cust-2"} & set(beat.policy_by_tenant)
    # the guests' entries are in the pool's slot, none in a slot of their own
    client = redis_from_url(redis_url)
    try:
        keys = [k.decode() async for k in client.scan_iter(match="cf:*", count=1000)]
        # the operator's l2GuestMaxShare is stored with the pool's limit
        pool = await client.hmget(usage_key(CACHE, GUESTS), "limit", GUEST_MAX_SHARE_FIELD)
    finally:
        await client.aclose()
    assert not [k for k in keys if "|cust-" in k]
    assert [k for k in keys if k.startswith(entry_key(CACHE, guest("cust-1"), ""))]
    assert pool == [str(POOL_BYTES).encode(), b"0.5"]


async def test_a_cache_without_tenant_defaults_has_no_guest_series(
    sidecar_factory: SidecarFactory, truth: VersionedUpstream, redis_url: str
) -> None:
    pod = await sidecar_factory(redis_url=redis_url, upstream=truth.url)
    pod.sidecar.quotas.apply(QUOTAS.model_copy(update={"default_tenant": None}))
    await pod.chat("q", tenant="listed")
    await pod.sidecar.admin.refresh_l2_usage()
    text = (await pod.admin.get("/metrics")).text
    assert metric(text, "cachefleet_cache_quota_bytes", tenant="listed", tier="l2") == 1 << 20
    for name in ("cachefleet_guests", "cachefleet_guest_pool_bytes"):
        assert metric(text, name) is None, name
    beat = pod.sidecar.admin.heartbeat()
    assert set(beat.policy_by_tenant) == {"listed"}
    assert beat.unlisted_by_policy == {}


async def test_guests_never_read_each_others_entries(any_redis: str) -> None:
    digest = "ab" * 32
    async with RedisL2.from_url(any_redis, CACHE, op_timeout_s=1.0) as l2:
        assert await l2.set_limit(GUESTS, POOL_BYTES)
        assert await l2.put(guest("cust-1"), digest, b"cust-1's answer", VECTOR)
        assert await l2.get(guest("cust-2"), digest, VECTOR) is None
        assert await l2.get("cust-1", digest, VECTOR) is None  # nor a listed namesake
        assert await l2.get(guest("cust-1"), digest, VECTOR) == b"cust-1's answer"
        recent = await l2.recent(guest("cust-2"), 10, 1.0, 1 << 20)
        assert recent is not None
        assert recent[0] == []


async def test_the_pool_stays_within_its_budget_and_a_busy_guest_within_its_cap(
    any_redis: str,
) -> None:
    budget = 64 * 1024
    value = b"x" * 1000
    cap = int(budget * DEFAULT_GUEST_MAX_SHARE)
    async with RedisL2.from_url(any_redis, CACHE, op_timeout_s=1.0) as l2:
        assert await l2.set_limit(GUESTS, budget)
        for g in range(8):  # eight quiet guests, five entries each
            for i in range(5):
                assert await l2.put(guest(f"quiet-{g}"), f"{g:02x}{i:062x}", value, VECTOR)
        for i in range(500):  # one busy guest writes ten times the pool
            assert await l2.put(guest("busy"), f"ff{i:062x}", value, VECTOR)
        used, limit = await l2.usage(GUESTS)
        assert limit == budget
        assert used <= budget
        client = redis_from_url(any_redis)
        try:
            busy = int(await client.hget(guest_usage_key(CACHE, "busy"), "bytes") or 0)
            stored: dict[str, int] = {}
            async for raw in client.scan_iter(match=entry_key(CACHE, guest("*"), "*")):
                key = raw.decode()
                owner = key.split(":g:", 1)[1].split(":e:", 1)[0]
                stored[owner] = stored.get(owner, 0) + int(await client.strlen(key))
            pool = await client.hget(usage_key(CACHE, GUESTS), "bytes")
        finally:
            await client.aclose()
    # what Redis holds is what the accounting says, and within the budget
    assert sum(stored.values()) == int(pool) == used
    assert busy == stored["busy"] <= cap
    # the busy guest evicted its own entries, not the quiet guests'
    quiet = {g: n for g, n in stored.items() if g.startswith("quiet-")}
    assert len(quiet) == 8
    assert all(n > 0 for n in quiet.values())


async def busy_guest_bytes(l2: RedisL2, url: str, budget: int, tag: str, n: int = 200) -> int:
    """What one guest holds after writing ``n`` 1000-byte entries (several times its cap)."""
    for i in range(n):
        assert await l2.put(guest("busy"), f"{tag}{i:062x}", b"x" * 1000, VECTOR)
    used, _ = await l2.usage(GUESTS)
    assert used <= budget
    client = redis_from_url(url)
    try:
        return int(await client.hget(guest_usage_key(CACHE, "busy"), "bytes") or 0)
    finally:
        await client.aclose()


async def test_the_cap_of_one_guest_is_the_share_stored_with_the_pools_limit(
    any_redis: str,
) -> None:
    budget = 64 * 1024
    async with RedisL2.from_url(any_redis, CACHE, op_timeout_s=1.0) as l2:
        # l2GuestMaxShare 0.75: the busy guest fills three quarters, not the default quarter
        assert await l2.set_limit(GUESTS, budget, guest_max_share=0.75)
        held = await busy_guest_bytes(l2, any_redis, budget, "a0")
        assert budget * DEFAULT_GUEST_MAX_SHARE < held <= budget * 0.75
        assert held > budget * 0.75 - 2000  # filled up to its cap, one entry short at most
        # a pool written before the share existed (no field): the default quarter, and a
        # lowered cap sheds the guest's excess on its next puts
        client = redis_from_url(any_redis)
        try:
            assert await client.hget(usage_key(CACHE, GUESTS), GUEST_MAX_SHARE_FIELD) == b"0.75"
            await client.hdel(usage_key(CACHE, GUESTS), GUEST_MAX_SHARE_FIELD)
        finally:
            await client.aclose()
        assert await busy_guest_bytes(l2, any_redis, budget, "b0", n=5) <= (
            budget * DEFAULT_GUEST_MAX_SHARE
        )
        # the whole pool (1): one guest may take all of it
        assert await l2.set_limit(GUESTS, budget, guest_max_share=1.0)
        assert await busy_guest_bytes(l2, any_redis, budget, "c0") > budget - 2000
        # set without a share: the field goes, the default holds again
        assert await l2.set_limit(GUESTS, budget)
        assert await busy_guest_bytes(l2, any_redis, budget, "d0", n=5) <= (
            budget * DEFAULT_GUEST_MAX_SHARE
        )


@pytest.mark.parametrize("scope", ["cache", "model:m1"])
async def test_a_cache_wide_invalidation_fences_every_guest_at_once(
    any_redis: str, scope: str
) -> None:
    guests = [guest(f"g{i}") for i in range(40)]
    old, new = "ab" * 32, "cd" * 32
    moved = tuple((s, 1 if s == scope else e) for s, e in VECTOR)
    async with RedisL2.from_url(any_redis, CACHE, op_timeout_s=1.0) as l2:
        assert await l2.set_limit(GUESTS, POOL_BYTES)
        for name in [*guests, "listed"]:  # each registers for fencing on its first write
            assert await l2.put(name, old, b"before", VECTOR)
        client = redis_from_url(any_redis)
        try:
            epoch = await advance_epoch(client, CACHE, scope)
            # the listed tenant's fence and one for all forty guests
            assert await fence_tenants(client, CACHE, {scope: epoch}) == 2
        finally:
            await client.aclose()
        # a reader or writer that missed the invalidation is refused for every guest,
        # one that has it is not
        refused = l2.counters.stale_refused
        for name in [*guests, guest("newcomer"), "listed"]:
            assert await l2.get(name, old, VECTOR) is None
            assert not await l2.put(name, new, b"stale", VECTOR)
            assert await l2.put(name, new, b"after", moved)
            assert await l2.get(name, new, moved) == b"after"
        assert l2.counters.stale_refused - refused == 2 * (len(guests) + 2)


async def test_a_key_purge_reaches_every_guest_in_a_few_script_calls(redis_url: str) -> None:
    guests = [guest(f"g{i}") for i in range(2 * PURGE_BATCH + 200)]
    digest, other = "ef" * 32, "0a" * 32
    async with RedisL2.from_url(redis_url, CACHE, op_timeout_s=2.0) as l2:
        assert await l2.set_limit(GUESTS, POOL_BYTES)
        for name in [*guests, "listed"]:  # each registers on its first write
            assert await l2.put(name, digest, b"answer", VECTOR)
        assert await l2.put(guests[0], other, b"kept", VECTOR)
        held, _ = await l2.usage(GUESTS)
        client = redis_from_url(redis_url)
        try:
            epoch = await log_purge(client, CACHE, digest)
            await purge_fence(client, CACHE, "00" * 32, epoch, ["listed"])  # scripts loaded
            await client.config_resetstat()
            assert await purge_fence(client, CACHE, digest, epoch) == len(guests) + 1
            stats = await client.info("commandstats")
            gone = [await client.exists(entry_key(CACHE, g, digest)) for g in guests]
            kept = await client.exists(entry_key(CACHE, guests[0], other))
        finally:
            await client.aclose()
        calls = sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("evalsha", "eval"))
        # the listed tenant's call, and the pool's guests in batches
        assert calls == 1 + math.ceil(len(guests) / PURGE_BATCH)
        assert sum(gone) == 0
        assert kept == 1
        # the pool's accounting gave back every purged entry's bytes, and only theirs
        left, _ = await l2.usage(GUESTS)
        assert 0 < left < held
        assert await l2.get(guests[0], other, (*VECTOR[:3], (PURGE_SCOPE, epoch))) == b"kept"


async def test_a_purge_and_a_tenant_invalidation_reach_a_guest(
    sidecar_factory: SidecarFactory, truth: VersionedUpstream, redis_url: str
) -> None:
    a, b = await fleet(sidecar_factory, redis_url, truth.url)
    for prompt in ("q1", "q2"):
        assert await ask(a, prompt, "cust-1") == (1, "MISS")
        await l2_digest(redis_url, guest("cust-1"), prompt)
    assert await ask(a, "q1", "cust-2") == (1, "MISS")
    await l2_digest(redis_url, guest("cust-2"), "q1")
    digest = await l2_digest(redis_url, guest("cust-1"), "q1")
    truth.bump()
    inv = Invalidator.from_url(redis_url, CACHE, poll_s=0.05)
    try:
        epoch, at = await inv.purge(digest)
        result = await inv.await_acks(PURGE_SCOPE, epoch, timeout_s=ACK_TIMEOUT_S, started_at=at)
        assert result.completed, result
        # the purged entry is gone from L1 and L2; the guest's other entry stays
        assert await ask(b, "q1", "cust-1") == (2, "MISS")
        assert await ask(b, "q2", "cust-1") == (1, "HIT-L2")
        # a Namespace invalidation of one guest's namespace: the other namespace stays
        seen: frozenset[str] = frozenset()
        for kb in ("kb1", "kb2"):
            assert await ask(a, "q3", "cust-1", kb) == (2, "MISS")
            seen |= {await l2_digest(redis_url, guest("cust-1"), "q3", seen)}
        truth.bump()
        scope = namespace_scope("cust-1", "kb1")
        epoch, at = await inv.advance(scope)
        result = await inv.await_acks(scope, epoch, timeout_s=ACK_TIMEOUT_S, started_at=at)
        assert result.completed, result
        assert await ask(b, "q3", "cust-1", "kb1") == (3, "MISS")
        assert await ask(b, "q3", "cust-1", "kb2") == (2, "HIT-L2")
        # a Tenant invalidation of one guest: its entries go, another guest's stay
        truth.bump()
        scope = tenant_scope("cust-1")
        epoch, at = await inv.advance(scope)
        result = await inv.await_acks(scope, epoch, timeout_s=ACK_TIMEOUT_S, started_at=at)
        assert result.completed, result
    finally:
        await inv.aclose()
    assert await ask(a, "q2", "cust-1") == (4, "MISS")
    assert await ask(b, "q1", "cust-2") == (1, "HIT-L2")
