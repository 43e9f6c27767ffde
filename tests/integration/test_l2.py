"""The L2 Redis tier against real redis-server, standalone and Redis Cluster."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest

from cachefleet_common.contract.clients import redis_from_url
from cachefleet_common.contract.lua import L2_FORGET_STALE_LUA
from cachefleet_common.contract.names import entry_key, l2_keys, lru_key, tenant_epochs_key
from cachefleet_common.contract.versioned import entry_head
from cachefleet_e2e.services import RedisCluster, RedisServer, free_port, redis_command
from cachefleet_sidecar.cache.l2 import CORRUPT, RedisL2
from cachefleet_sidecar.cache.l2_guard import CircuitBreaker

CACHE = "team-a/chat"

MakeL2 = Callable[..., RedisL2]

#: Bound on waiting for an outcome (an expiry, a recovery), seconds: generous, a slow
#: machine only makes the test wait longer.
WAIT_S = 20.0
#: The L2 budget where a test needs Redis to answer (the default is 50 ms), seconds.
PATIENT_S = 5.0
#: A short TTL for the expiry tests, seconds.
SHORT_TTL_S = 0.5


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def state_of(thing: RedisL2 | CircuitBreaker) -> str:
    """Read ``state`` afresh (keeps mypy from narrowing it across awaits)."""
    return thing.state


@pytest.fixture(
    params=[
        pytest.param("standalone", marks=pytest.mark.redis),
        pytest.param("cluster", marks=pytest.mark.redis_cluster),
    ]
)
def backend_url(request: pytest.FixtureRequest) -> str:
    """A flushed Redis URL: standalone or ``redis+cluster://``."""
    name = "redis_url" if request.param == "standalone" else "cluster_url"
    url: str = request.getfixturevalue(name)
    return url


@pytest.fixture
async def make_l2(backend_url: str) -> AsyncIterator[MakeL2]:
    """Build tiers on the backend; all are closed after the test."""
    made: list[RedisL2] = []

    def make(**options: object) -> RedisL2:
        options.setdefault("op_timeout_s", PATIENT_S)  # generous: this is not the fault test
        tier = RedisL2.from_url(backend_url, CACHE, **options)  # type: ignore[arg-type]
        made.append(tier)
        return tier

    yield make
    for tier in made:
        await tier.aclose()


async def test_put_then_get_returns_the_value(make_l2: MakeL2) -> None:
    l2 = make_l2()
    assert await l2.get("alice", digest("q1")) is None
    assert await l2.put("alice", digest("q1"), b"answer one")
    assert await l2.get("alice", digest("q1")) == b"answer one"
    assert (l2.counters.hits, l2.counters.misses, l2.counters.stores) == (1, 1, 1)
    assert state_of(l2) == "ok"


async def test_overwrite_is_counted_once(make_l2: MakeL2) -> None:
    l2 = make_l2()
    assert await l2.put("alice", digest("q"), b"x" * 100)
    assert await l2.put("alice", digest("q"), b"y" * 40)
    assert await l2.get("alice", digest("q")) == b"y" * 40
    used, _ = await l2.usage("alice")
    assert used == 40


async def _until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Wait (bounded, generously) until ``await check()`` is truthy."""
    deadline = time.monotonic() + WAIT_S
    while not await check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def test_entries_expire_after_ttl(make_l2: MakeL2) -> None:
    l2 = make_l2(ttl_s=SHORT_TTL_S)
    # The entry is live while its TTL runs: checked only in a round that took less than
    # the TTL (a slow machine retries the round, with a fresh key, instead of failing).
    for attempt in range(20):
        key = digest(f"q{attempt}")
        started = time.monotonic()
        assert await l2.put("alice", key, b"short-lived")
        got = await l2.get("alice", key)
        if time.monotonic() - started < SHORT_TTL_S:
            assert got == b"short-lived"
            break
    else:
        pytest.fail("no put-then-get round finished within the TTL")

    async def expired() -> bool:
        return await l2.get("alice", key) is None

    await _until(expired, "the entry outlived its TTL")


async def test_usage_drops_when_entries_expire(make_l2: MakeL2) -> None:
    l2 = make_l2(ttl_s=SHORT_TTL_S, default_limit_bytes=1000)

    async def drained() -> bool:
        return await l2.usage("alice") == (0, 1000)

    # Usage counts the live entries: checked only in a round that took less than the TTL
    # (a slow machine lets the round expire and retries it instead of failing).
    for attempt in range(20):
        await _until(drained, "usage did not drop to 0 as the entries expired")
        started = time.monotonic()
        for i in range(3):
            assert await l2.put("alice", digest(f"q{attempt}-{i}"), b"v" * 100)
        used = await l2.usage("alice")
        if time.monotonic() - started < SHORT_TTL_S:
            assert used == (300, 1000)
            break
    else:
        pytest.fail("no round of puts finished within the TTL")
    await _until(drained, "usage did not drop to 0 as the entries expired")
    # The whole limit is available again and nothing live had to be evicted.
    assert await l2.put("alice", digest("big"), b"b" * 1000)
    assert l2.counters.evictions == 0


async def test_put_reclaims_expired_entries_before_evicting_live_ones(make_l2: MakeL2) -> None:
    short = make_l2(ttl_s=0.2, default_limit_bytes=300)
    long = make_l2(ttl_s=60, default_limit_bytes=300)
    # Both short-lived entries must be live together (else the second put reclaims the
    # first): a round slower than their TTL is retried with a fresh tenant, not failed.
    for attempt in range(20):
        tenant = f"alice-{attempt}"
        assert await long.put(tenant, digest("keep"), b"k" * 100)
        started = time.monotonic()
        assert await short.put(tenant, digest("gone1"), b"g" * 100)
        assert await short.put(tenant, digest("gone2"), b"g" * 100)
        if time.monotonic() - started < 0.2:
            break
    else:
        pytest.fail("no two puts finished within the 0.2 s TTL")
    await asyncio.sleep(0.35)  # both expired (a slow machine only sleeps longer)
    assert await long.put(tenant, digest("new"), b"n" * 200)
    # The LRU-oldest entry ("keep") survived: the expired ones made the room.
    assert await long.get(tenant, digest("keep")) == b"k" * 100
    assert long.counters.evictions == 0
    assert long.counters.reclaimed_expired == 2
    assert await long.usage(tenant) == (300, 300)


async def test_quota_evicts_least_recently_used_of_that_tenant_only(make_l2: MakeL2) -> None:
    l2 = make_l2()
    await l2.set_limit("alice", 300)
    await l2.set_limit("bob", 300)
    for name in ("b1", "b2", "b3"):
        assert await l2.put("bob", digest(name), b"B" * 100)
    for name in ("a1", "a2", "a3"):
        assert await l2.put("alice", digest(name), b"A" * 100)
    assert await l2.get("alice", digest("a1")) is not None  # a1 is now the most recent

    assert await l2.put("alice", digest("a4"), b"A" * 100)

    assert await l2.get("alice", digest("a2")) is None
    for name in ("a1", "a3", "a4"):
        assert await l2.get("alice", digest(name)) == b"A" * 100
    for name in ("b1", "b2", "b3"):
        assert await l2.get("bob", digest(name)) == b"B" * 100
    assert await l2.usage("alice") == (300, 300)
    assert await l2.usage("bob") == (300, 300)
    assert l2.counters.evictions == 1


async def test_tenants_are_isolated(make_l2: MakeL2) -> None:
    l2 = make_l2(default_limit_bytes=1000)
    await l2.set_limit("alice", 100)
    assert await l2.put("alice", digest("same"), b"alice's")
    assert await l2.put("bob", digest("same"), b"bob's")
    assert await l2.get("alice", digest("same")) == b"alice's"
    assert await l2.get("bob", digest("same")) == b"bob's"
    # alice's small limit does not apply to bob, who gets the default.
    assert await l2.put("bob", digest("big"), b"x" * 900)
    assert await l2.usage("bob") == (905, 1000)
    assert await l2.usage("alice") == (7, 100)


async def test_oversize_value_is_refused_without_evicting(make_l2: MakeL2) -> None:
    l2 = make_l2()
    await l2.set_limit("alice", 200)
    assert await l2.put("alice", digest("small"), b"s" * 150)
    assert not await l2.put("alice", digest("huge"), b"h" * 201)
    assert await l2.get("alice", digest("small")) == b"s" * 150
    assert await l2.get("alice", digest("huge")) is None
    assert l2.counters.refused == 1
    assert l2.counters.evictions == 0


async def test_eviction_per_put_is_bounded(make_l2: MakeL2) -> None:
    l2 = make_l2(max_evict=2, default_limit_bytes=1000)
    for i in range(10):
        assert await l2.put("alice", digest(f"q{i}"), b"v" * 100)
    # Needs 5 evictions, may do 2: refused, and the 2 oldest are gone.
    assert not await l2.put("alice", digest("big"), b"b" * 500)
    assert await l2.usage("alice") == (800, 1000)
    assert await l2.get("alice", digest("q0")) is None
    assert await l2.get("alice", digest("q2")) == b"v" * 100
    # The next try evicts 2 more, and the one after fits.
    assert not await l2.put("alice", digest("big"), b"b" * 500)
    assert await l2.put("alice", digest("big"), b"b" * 500)


async def test_zero_limit_means_the_default(make_l2: MakeL2) -> None:
    l2 = make_l2(default_limit_bytes=250)
    await l2.set_limit("alice", 0)
    assert await l2.usage("alice") == (0, 250)
    assert not await l2.put("alice", digest("q"), b"x" * 251)
    assert await l2.put("alice", digest("q"), b"x" * 250)


async def test_limit_is_shared_by_every_sidecar(make_l2: MakeL2) -> None:
    pod_a, pod_b = make_l2(), make_l2()
    await pod_a.set_limit("alice", 200)
    assert await pod_a.put("alice", digest("from-a"), b"a" * 100)
    assert await pod_b.put("alice", digest("from-b"), b"b" * 100)
    assert await pod_b.put("alice", digest("from-b2"), b"b" * 100)
    assert await pod_a.get("alice", digest("from-a")) is None  # evicted by pod_b
    assert await pod_a.usage("alice") == (200, 200)


async def test_lowering_the_limit_evicts_down_to_it_at_once(make_l2: MakeL2) -> None:
    l2 = make_l2(max_evict=2, default_limit_bytes=10_000)
    bob = make_l2(default_limit_bytes=10_000)
    for i in range(20):
        assert await l2.put("alice", digest(f"q{i}"), b"v" * 100)
    assert await bob.put("bob", digest("q0"), b"b" * 100)
    assert await l2.get("alice", digest("q0")) is not None  # q0 is now the most recent
    assert await l2.set_limit("alice", 450)
    # At once, not over the next puts (which may evict only max_evict=2 each).
    assert await l2.usage("alice") == (400, 450)
    assert l2.counters.evictions == 16
    assert await l2.get("alice", digest("q0")) == b"v" * 100
    for i in (17, 18, 19):
        assert await l2.get("alice", digest(f"q{i}")) == b"v" * 100
    assert await l2.get("alice", digest("q1")) is None
    assert await bob.usage("bob") == (100, 10_000)  # other tenants untouched
    assert await l2.set_limit("alice", 0)  # back to the default: nothing to evict
    assert await l2.usage("alice") == (400, 10_000)


async def _lru_order(url: str, tenant: str) -> list[bytes]:
    client = redis_from_url(url)
    try:
        return list(await client.zrange(lru_key(CACHE, tenant), 0, -1))
    finally:
        await client.aclose()


def _entry(tenant: str, name: str) -> bytes:
    return entry_key(CACHE, tenant, digest(name)).encode()


async def test_hits_touch_the_lru_in_batches_that_every_sidecar_sees(
    make_l2: MakeL2, backend_url: str
) -> None:
    reader, writer = make_l2(), make_l2()
    assert await writer.set_limit("alice", 300)
    for name in ("a1", "a2", "a3"):
        assert await writer.put("alice", digest(name), b"A" * 100)
    # hits in the order a3, a1: both touches go in one batch, in that order
    assert await reader.get("alice", digest("a3")) is not None
    assert await reader.get("alice", digest("a1")) is not None
    expected = [_entry("alice", n) for n in ("a2", "a3", "a1")]
    deadline = time.monotonic() + 10.0  # a safety net: the batch goes after 50 ms
    while await _lru_order(backend_url, "alice") != expected:
        assert time.monotonic() < deadline, await _lru_order(backend_url, "alice")
        await asyncio.sleep(0.02)
    # another sidecar's eviction now takes the least recently read entry
    assert await writer.put("alice", digest("a4"), b"A" * 100)
    assert await writer.get("alice", digest("a2")) is None
    for name in ("a1", "a3", "a4"):
        assert await writer.get("alice", digest(name)) == b"A" * 100


async def test_an_entry_of_other_epochs_is_dropped_unless_rewritten_meanwhile(
    make_l2: MakeL2, backend_url: str
) -> None:
    old = (("cache", 0), ("tenant:acme", 0))
    new = (("cache", 1), ("tenant:acme", 0))
    l2 = make_l2()
    assert await l2.put("acme", digest("q"), b"old answer", old)
    # a reader ahead of the entry (and not behind the fence): a miss, the entry dropped
    assert await l2.get("acme", digest("q"), new) == CORRUPT
    deadline = time.monotonic() + 10.0
    while await l2.usage("acme") != (0, l2.default_limit_bytes):
        assert time.monotonic() < deadline, await l2.usage("acme")
        await asyncio.sleep(0.02)
    assert await _lru_order(backend_url, "acme") == []
    # the drop is conditional: an entry of the reader's epochs written meanwhile stays
    assert await l2.put("acme", digest("q"), b"new answer", new)
    client = redis_from_url(backend_url)
    try:
        keys = l2_keys(CACHE, "acme", digest("q"))
        head = entry_head(new).decode()
        assert await client.eval(L2_FORGET_STALE_LUA, len(keys), *keys, head) == 0
    finally:
        await client.aclose()
    assert await l2.get("acme", digest("q"), new) == b"new answer"


async def test_a_new_tenants_first_writes_register_it_once_and_keep_their_order(
    make_l2: MakeL2, backend_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import cachefleet_sidecar.cache.l2 as l2_module

    registered: list[str] = []
    real = l2_module.register_tenant

    async def counted(client: object, cache: str, tenant: str) -> None:
        registered.append(tenant)
        await real(client, cache, tenant)  # type: ignore[arg-type]

    monkeypatch.setattr(l2_module, "register_tenant", counted)
    vector = (("cache", 0), ("tenant:acme", 0))
    l2 = make_l2()
    names = [digest(f"q{i}") for i in range(6)]
    # six first writes of a tenant at once, as six answers' background writes are
    stored = await asyncio.gather(*(l2.put("acme", d, b"answer", vector) for d in names))
    assert stored == [True] * 6
    assert registered == ["acme"]  # one registration, shared
    client = redis_from_url(backend_url)
    try:
        lru = [m.decode() for m in await client.zrange(lru_key(CACHE, "acme"), 0, -1)]
    finally:
        await client.aclose()
    # least recent first: the order the writes were made in
    assert lru == [entry_key(CACHE, "acme", d) for d in names]
    assert await l2.put("acme", digest("later"), b"answer", vector)
    assert registered == ["acme"]


async def test_a_reader_is_refused_once_the_fence_it_was_served_under_moves_ahead(
    make_l2: MakeL2, backend_url: str
) -> None:
    vector = (("cache", 0), ("tenant:acme", 0))
    l2 = make_l2()
    behind: list[bool] = []
    l2.on_behind = lambda: behind.append(True)
    assert await l2.put("acme", digest("q"), b"answer", vector)
    for _ in range(2):  # the second read finds the fence reply it judged already
        assert await l2.get("acme", digest("q"), vector) == b"answer"
    client = redis_from_url(backend_url)
    try:  # what an invalidation of the tenant does to its fence
        await client.hset(tenant_epochs_key(CACHE, "acme"), "tenant:acme", "1")
    finally:
        await client.aclose()
    refused = l2.counters.stale_refused
    assert await l2.get("acme", digest("q"), vector) is None
    assert l2.counters.stale_refused == refused + 1
    assert behind == [True]


@pytest.mark.redis_cluster
async def test_tenants_spread_over_cluster_slots(cluster_url: str, cluster_urls: list[str]) -> None:
    l2 = RedisL2.from_url(cluster_url, CACHE, op_timeout_s=1.0)
    try:
        tenants = [f"tenant-{i}" for i in range(24)]
        for tenant in tenants:
            await l2.set_limit(tenant, 250)
            for j in range(3):
                assert await l2.put(tenant, digest(f"{tenant}-{j}"), b"z" * 100)
        for tenant in tenants:
            # quota enforced per tenant on whichever node holds its slot
            assert await l2.get(tenant, digest(f"{tenant}-0")) is None
            assert await l2.get(tenant, digest(f"{tenant}-2")) == b"z" * 100
            assert await l2.usage(tenant) == (200, 250)
    finally:
        await l2.aclose()
    sizes = [int(redis_command(int(url.rsplit(":", 1)[1]), "DBSIZE")[1:]) for url in cluster_urls]
    assert sum(1 for size in sizes if size > 0) >= 2, sizes


# ----------------------------------------------------------------- faults


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A private redis-server this test may kill, pause and restart."""
    with RedisServer() as server:
        yield server


async def _until_works(l2: RedisL2, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if await l2.put("alice", digest("back"), b"again"):
            return
        await asyncio.sleep(0.05)
    pytest.fail(f"L2 did not recover within {deadline_s}s (state {l2.state})")


@pytest.mark.redis
async def test_redis_killed_fails_fast_then_recovers_by_itself(own_redis: RedisServer) -> None:
    breaker = CircuitBreaker(failure_threshold=3, cooldown_s=0.3)
    # 50 ms only while Redis is down: a loaded machine must not fail the healthy calls
    l2 = RedisL2.from_url(own_redis.url, CACHE, op_timeout_s=PATIENT_S, breaker=breaker)
    try:
        assert await l2.connect()
        assert await l2.put("alice", digest("q"), b"v")
        l2.op_timeout_s = 0.05
        own_redis.kill()

        breaker.cooldown_s = 3600.0  # no half-open probe mid-test, however slow the machine
        for _ in range(3):  # the failures that open the breaker
            # Each is cut short (error or the op timeout), never a hang.
            assert await asyncio.wait_for(l2.get("alice", digest("q")), WAIT_S) is None
        assert l2.counters.errors + l2.counters.timeouts == 3
        assert state_of(l2) == "down"

        for _ in range(200):
            assert await l2.get("alice", digest("q")) is None
            assert not await l2.put("alice", digest("q"), b"v")
        # The breaker is open: Redis is not tried again, every call returns at once.
        assert l2.counters.short_circuited == 400
        assert l2.counters.errors + l2.counters.timeouts == 3

        breaker.cooldown_s = 0.3
        own_redis.restart()
        await _until_works(l2, deadline_s=WAIT_S)
        l2.op_timeout_s = PATIENT_S
        assert await l2.get("alice", digest("back")) == b"again"
        assert state_of(l2) == "ok"
    finally:
        await l2.aclose()


@pytest.mark.redis
async def test_hung_redis_costs_at_most_the_op_timeout(own_redis: RedisServer) -> None:
    breaker = CircuitBreaker(failure_threshold=2, cooldown_s=0.3)
    # 50 ms only while Redis hangs: a loaded machine must not fail the healthy calls
    l2 = RedisL2.from_url(own_redis.url, CACHE, op_timeout_s=PATIENT_S, breaker=breaker)
    try:
        assert await l2.connect()
        assert await l2.put("alice", digest("q"), b"v")
        l2.op_timeout_s = 0.05
        own_redis.pause()
        breaker.cooldown_s = 3600.0  # no half-open probe mid-test, however slow the machine
        for _ in range(2):
            # The op timeout cuts it short, not the hang (which would outlast WAIT_S).
            assert await asyncio.wait_for(l2.get("alice", digest("q")), WAIT_S) is None
        assert state_of(l2) == "down"
        assert l2.counters.timeouts == 2
        for _ in range(50):
            assert await l2.get("alice", digest("q")) is None
        # Breaker open: no waiting, Redis is not tried again.
        assert l2.counters.short_circuited == 50
        assert l2.counters.timeouts == 2

        breaker.cooldown_s = 0.3
        own_redis.resume()
        await _until_works(l2, deadline_s=WAIT_S)
        l2.op_timeout_s = PATIENT_S
        assert await l2.get("alice", digest("q")) == b"v"  # data survived the pause
    finally:
        await l2.aclose()


async def test_unreachable_redis_at_start_up_is_not_an_error_for_callers() -> None:
    l2 = RedisL2.from_url(f"redis://127.0.0.1:{free_port()}/0", CACHE, op_timeout_s=0.05)
    try:
        # Nothing hangs (each call is cut short; WAIT_S is only a net against a hang).
        assert not await asyncio.wait_for(l2.connect(timeout_s=0.5), WAIT_S)
        assert await asyncio.wait_for(l2.get("alice", digest("q")), WAIT_S) is None
        assert not await asyncio.wait_for(l2.put("alice", digest("q"), b"v"), WAIT_S)
        assert await asyncio.wait_for(l2.usage("alice"), WAIT_S) == (0, 0)
        assert state_of(l2) != "ok"
        assert l2.last_error is not None
    finally:
        await l2.aclose()


def test_breaker_opens_probes_and_closes() -> None:
    now = [0.0]
    breaker = CircuitBreaker(failure_threshold=2, cooldown_s=1.0, clock=lambda: now[0])
    assert breaker.allow()
    breaker.failure()
    assert state_of(breaker) == "closed"
    breaker.failure()
    assert state_of(breaker) == "open"
    assert not breaker.allow()
    now[0] = 1.0
    assert breaker.allow()  # the probe
    assert not breaker.allow()  # only one probe at a time
    breaker.failure()  # probe failed: open again for a full cool-down
    assert state_of(breaker) == "open"
    now[0] = 1.5
    assert not breaker.allow()
    now[0] = 2.0
    assert breaker.allow()
    breaker.success()
    assert state_of(breaker) == "closed"
    assert breaker.allow()


def test_keys_of_one_tenant_share_a_slot() -> None:
    keys = l2_keys(CACHE, "alice", digest("q"))
    tags = {key[key.index("{") + 1 : key.index("}")] for key in keys}
    assert len(tags) == 1
    other = l2_keys(CACHE, "bob", digest("q"))
    assert other[0] != keys[0]


@pytest.mark.redis_cluster
@pytest.mark.slow
async def test_cluster_node_killed_costs_at_most_the_timeout_then_recovers() -> None:
    with RedisCluster() as cluster:
        # 50 ms only while the node is dead: a loaded machine must not fail the set-up
        l2 = RedisL2.from_url(cluster.url, CACHE, op_timeout_s=PATIENT_S)
        try:
            assert await l2.connect()
            tenants = [f"tenant-{i}" for i in range(12)]
            for tenant in tenants:
                assert await l2.put(tenant, digest("q"), b"v")
            l2.op_timeout_s = 0.05
            cluster.nodes[0].kill()

            served = 0
            for tenant in tenants:
                # Each call is cut short (error or the 50 ms timeout), never a hang.
                got = await asyncio.wait_for(l2.get(tenant, digest("q")), WAIT_S)
                served += got == b"v"
            assert 0 < served < len(tenants)  # the other nodes still serve
            # The dead node's calls failed (errors, timeouts) or were cut short by its breaker.
            failed = l2.counters.errors + l2.counters.timeouts + l2.counters.short_circuited
            assert failed + l2.counters.not_ready >= len(tenants) - served

            cluster.nodes[0].restart()  # rejoins from its nodes.conf, data lost
            deadline = time.monotonic() + WAIT_S
            while time.monotonic() < deadline:
                results = [await l2.put(tenant, digest("q2"), b"w") for tenant in tenants]
                if all(results):
                    break
                await asyncio.sleep(0.1)
            assert all(results)
        finally:
            await l2.aclose()


@pytest.mark.redis_cluster
@pytest.mark.slow
async def test_breaker_is_per_node_healthy_nodes_do_not_reset_a_dead_ones() -> None:
    with RedisCluster() as cluster:
        breaker = CircuitBreaker(failure_threshold=2, cooldown_s=60.0)
        # patient: the healthy nodes' calls must succeed however loaded the machine (the
        # dead node refuses at once, its failures are errors either way)
        l2 = RedisL2.from_url(cluster.url, CACHE, op_timeout_s=PATIENT_S, breaker=breaker)
        try:
            assert await l2.connect()
            tenants = [f"tenant-{i}" for i in range(24)]
            for tenant in tenants:
                assert await l2.put(tenant, digest("q"), b"v")
            dead = ("127.0.0.1", cluster.nodes[0].port)
            home = {t: l2._client.address_for(l2_keys(CACHE, t, digest("q"))[0]) for t in tenants}
            on_dead = [t for t in tenants if home[t] == dead]
            assert 0 < len(on_dead) < len(tenants)
            cluster.nodes[0].kill()

            for _ in range(5):  # interleaved: healthy successes between the dead node's calls
                for tenant in tenants:
                    got = await l2.get(tenant, digest("q"))
                    assert (got == b"v") is (tenant not in on_dead)
            # The dead node cost exactly the failures that opened its breaker; every
            # later call for its tenants returned at once.
            assert l2.counters.errors + l2.counters.timeouts == 2
            assert l2.counters.short_circuited == 5 * len(on_dead) - 2
            states = l2.node_states()
            assert states[f"{dead[0]}:{dead[1]}"] == "open"
            assert sorted(s for n, s in states.items() if n != f"{dead[0]}:{dead[1]}") == [
                "closed",
                "closed",
            ]
            assert state_of(l2) == "degraded"
        finally:
            await l2.aclose()


@pytest.mark.redis
async def test_connecting_does_not_count_against_the_op_budget(own_redis: RedisServer) -> None:
    # A connection whose set-up outlasts the 50 ms budget (here: AUTH to a paused
    # server; in production a TLS handshake): the operation is a miss, the breaker
    # is untouched, and the connection keeps being made for the next operations.
    reply = redis_command(own_redis.port, "ACL", "SETUSER", "cf", "on", ">pw", "~*", "+@all")
    assert reply.startswith(b"+OK"), reply
    url = own_redis.url.replace("redis://", "redis://cf:pw@")
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=60.0)
    l2 = RedisL2.from_url(url, CACHE, op_timeout_s=0.05, breaker=breaker)
    try:
        own_redis.pause()
        try:
            for _ in range(3):
                assert await l2.get("alice", digest("q")) is None
        finally:
            own_redis.resume()
        assert l2.counters.not_ready >= 1
        assert (l2.counters.errors, l2.counters.timeouts) == (0, 0)
        assert state_of(breaker) == "closed"  # one failure would have opened it
        await _until_works(l2, deadline_s=10.0)
        assert state_of(l2) == "ok"
    finally:
        await l2.aclose()
