"""Warm pods: a starting sidecar fills its L1 from L2 before it reports ready.

What a user would notice: after sidecar A has filled L2, a new sidecar B
answers its first request for a popular prompt from L1 (``HIT-L1``) and
``/status`` says what it warmed; ``--warm-bytes`` bounds what it takes; an
entry invalidated meanwhile is not warmed; with Redis down, B still becomes
ready once ``--warm-timeout`` has passed. Unlisted tenants (guests of
``tenantDefaults``) are warmed from their L2 pool too, the most recent first,
into the L1 partitions B has free.
"""

from __future__ import annotations

import asyncio
import time
import tracemalloc

import httpx
import pytest

from cachefleet_common.contract.clients import redis_from_url
from cachefleet_common.contract.messages import QuotaAssignment, TenantQuota
from cachefleet_common.contract.names import GUESTS, lru_key
from cachefleet_common.contract.ops import publish_quotas
from cachefleet_common.epochs import PURGE_SCOPE, EpochTracker
from cachefleet_e2e.services import free_port
from cachefleet_e2e.truth import VersionedUpstream
from cachefleet_operator.invalidation import Invalidator
from cachefleet_sidecar.cache.entry import L1_OVERHEAD_BYTES, Entry
from cachefleet_sidecar.cache.l2 import RedisL2
from cachefleet_sidecar.control.warm import WarmReport, warm_l1
from tests.integration.conftest import RunningSidecar, SidecarFactory

pytestmark = [pytest.mark.redis]

CACHE = "test/cache"
#: Bound on waiting for acks, background writes and readiness, seconds.
WAIT_S = 10.0
PROMPTS = [f"popular {i}" for i in range(6)]
#: Entries of 0.45 MB in L2 for the warm-up's read bound: 36 MB, nine times its budget.
BIG_ENTRIES = 80


async def ready(sc: RunningSidecar) -> httpx.Response:
    """/readyz once it is 200 (bounded)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        resp = await sc.admin.get("/readyz")
        if resp.status_code == 200 or time.monotonic() > deadline:
            return resp
        await asyncio.sleep(0.05)


async def l2_entries(url: str, tenant: str) -> int:
    client = redis_from_url(url)
    try:
        return int(await client.zcard(lru_key(CACHE, tenant)))
    finally:
        await client.aclose()


async def filled(factory: SidecarFactory, url: str, upstream: str) -> RunningSidecar:
    """Sidecar A, with every prompt answered once and written to L2."""
    # patient: a loaded machine must not drop an L2 write (50 ms budget) the test waits for
    a = await factory(redis_url=url, upstream=upstream, pod="pod-a", patient=True)
    for _ in range(1000):  # bounded: 20 s and more
        if a.sidecar.tracker.fresh():
            break
        await asyncio.sleep(0.02)
    for prompt in PROMPTS:
        assert (await a.chat(prompt)).headers["x-cache"] == "MISS"
    for _ in range(1000):  # the L2 writes are in the background (bounded: 20 s and more)
        if await l2_entries(url, "acme") >= len(PROMPTS):
            break
        await asyncio.sleep(0.02)
    assert await l2_entries(url, "acme") == len(PROMPTS)
    return a


async def test_a_new_sidecar_answers_warmed_entries_from_l1(
    sidecar_factory: SidecarFactory, truth: VersionedUpstream, any_redis: str
) -> None:
    redis_url = any_redis
    await filled(sidecar_factory, redis_url, truth.url)
    b = await sidecar_factory(
        redis_url=redis_url,
        upstream=truth.url,
        pod="pod-b",
        tenants=("acme",),
        warm_bytes=1024 * 1024,
    )
    b.steady()  # L1 hits are asserted: the staleness bound must not lapse
    assert (await ready(b)).status_code == 200
    await b.confirmed()  # and L1 serves only once the epochs are confirmed
    warm = (await b.admin.get("/status")).json()["warmup"]
    assert warm["state"] == "done"
    assert (warm["entries"], warm["tenants"]) == (len(PROMPTS), 1)
    assert warm["bytes"] > 0
    calls = truth.calls
    for prompt in PROMPTS:
        resp = await b.chat(prompt)
        assert resp.headers["x-cache"] == "HIT-L1", prompt
        assert resp.json()["version"] == 1
    assert truth.calls == calls  # nothing went upstream
    # a warmed entry is purged like any other
    client = redis_from_url(redis_url)
    try:
        members = await client.zrange(lru_key(CACHE, "acme"), -1, -1)
    finally:
        await client.aclose()
    digest = members[0].decode().rpartition(":e:")[2]
    truth.bump()
    async with Invalidator.from_url(redis_url, CACHE, poll_s=0.05) as inv:
        epoch, at = await inv.purge(digest)
        result = await inv.await_acks(PURGE_SCOPE, epoch, timeout_s=20.0, started_at=at)
    assert result.completed
    answers = [(await b.chat(p)).headers["x-cache"] for p in PROMPTS]
    assert answers.count("MISS") == 1
    assert answers.count("HIT-L1") == len(PROMPTS) - 1


async def test_the_warm_up_keeps_to_its_bytes_and_skips_invalidated_entries(
    sidecar_factory: SidecarFactory, truth: VersionedUpstream, redis_url: str
) -> None:
    a = await filled(sidecar_factory, redis_url, truth.url)
    # an entry costs its body, its head (under 400 bytes here) and L1's own overhead
    size = len((await a.chat(PROMPTS[0])).content) + 400 + L1_OVERHEAD_BYTES
    b = await sidecar_factory(
        redis_url=redis_url,
        upstream=truth.url,
        pod="pod-b",
        tenants=("acme",),
        warm_bytes=3 * size,
    )
    b.steady()  # L1 hits are asserted: the staleness bound must not lapse
    assert (await ready(b)).status_code == 200
    await b.confirmed()  # and L1 serves only once the epochs are confirmed
    warm = (await b.admin.get("/status")).json()["warmup"]
    assert 1 <= warm["entries"] < len(PROMPTS)
    assert warm["bytes"] <= 3 * size
    assert warm["skipped"]["over_budget"] == len(PROMPTS) - warm["entries"]
    # the tenant's entries are invalidated: a newcomer warms none of them
    async with Invalidator.from_url(redis_url, CACHE, poll_s=0.05) as inv:
        assert (await inv.invalidate("tenant:acme", timeout_s=20.0)).completed
    c = await sidecar_factory(
        redis_url=redis_url,
        upstream=truth.url,
        pod="pod-c",
        tenants=("acme",),
        warm_bytes=1024 * 1024,
    )
    assert (await ready(c)).status_code == 200
    warm = (await c.admin.get("/status")).json()["warmup"]
    assert (warm["state"], warm["entries"]) == ("done", 0)
    assert sum(warm["skipped"].values()) > 0  # read, judged stale, not warmed
    assert (await c.chat(PROMPTS[0])).headers["x-cache"] == "MISS"


async def test_with_redis_down_the_sidecar_is_ready_after_the_warm_up_timeout(
    sidecar_factory: SidecarFactory, truth: VersionedUpstream
) -> None:
    nobody = f"redis://127.0.0.1:{free_port()}/0"
    b = await sidecar_factory(
        redis_url=nobody,
        upstream=truth.url,
        tenants=("acme",),
        warm_bytes=1024 * 1024,
        warm_timeout_s=3.0,
    )
    first = await b.admin.get("/readyz")
    assert first.status_code == 503
    assert b"warming" in first.content
    assert (await ready(b)).status_code == 200
    warm = (await b.admin.get("/status")).json()["warmup"]
    assert (warm["state"], warm["entries"]) == ("timed_out", 0)
    resp = await b.chat("still served")
    assert (resp.status_code, resp.headers["x-cache"]) == (200, "MISS")


async def test_the_warm_up_keeps_to_each_tenant_l1_share(
    sidecar_factory: SidecarFactory, truth: VersionedUpstream, redis_url: str
) -> None:
    a = await filled(sidecar_factory, redis_url, truth.url)
    mine = (await a.admin.get("/status")).json()["tenants"]["acme"]
    per_entry = mine["l1_bytes"] // mine["l1_entries"]
    share = int(2.5 * per_entry)  # room for two entries
    client = redis_from_url(redis_url)
    try:
        quotas = QuotaAssignment(
            generation=1,
            tenants={"acme": TenantQuota(l1_bytes=share, l2_bytes=64 << 20)},
        )
        await publish_quotas(client, CACHE, quotas)
    finally:
        await client.aclose()
    b = await sidecar_factory(
        redis_url=redis_url, upstream=truth.url, pod="pod-b", warm_bytes=1024 * 1024
    )
    b.steady()  # L1 hits are asserted: the staleness bound must not lapse
    assert (await ready(b)).status_code == 200
    await b.confirmed()  # and L1 serves only once the epochs are confirmed
    status = (await b.admin.get("/status")).json()
    assert status["quota_generation"] == 1  # the share was known before the warm-up
    assert status["warmup"]["entries"] == 2
    assert status["warmup"]["bytes"] <= share
    assert status["tenants"]["acme"]["l1_bytes"] <= share
    # the two warmed are the two most recently used
    answers = [(await b.chat(p)).headers["x-cache"] for p in PROMPTS[-2:]]
    assert answers == ["HIT-L1", "HIT-L1"]


async def test_a_new_sidecar_warms_the_guests_most_recent_entries(
    sidecar_factory: SidecarFactory, truth: VersionedUpstream, any_redis: str
) -> None:
    redis_url = any_redis
    quotas = QuotaAssignment(
        generation=1,
        tenants={"acme": TenantQuota(l1_bytes=1 << 20, l2_bytes=1 << 20)},
        default_tenant=TenantQuota(l1_bytes=1 << 20, l2_bytes=1 << 20),
    )
    client = redis_from_url(redis_url)
    try:
        await publish_quotas(client, CACHE, quotas)
        # patient: a loaded machine must not drop an L2 write (50 ms budget) waited for below
        a = await sidecar_factory(
            redis_url=redis_url, upstream=truth.url, pod="pod-a", patient=True
        )
        a.sidecar.quotas.apply(quotas)
        asked = [("cust-1", "q1"), ("cust-1", "q2"), ("cust-1", "q3"), ("cust-2", "q1")]
        # one after the other, so cust-2's entry is the pool's most recent
        for n, (tenant, prompt) in enumerate(asked, 1):
            assert (await a.chat(prompt, tenant=tenant)).headers["x-cache"] == "MISS"
            for _ in range(1000):  # the L2 writes are in the background (bounded: 20 s and more)
                if await client.zcard(lru_key(CACHE, GUESTS)) >= n:
                    break
                await asyncio.sleep(0.02)
            assert await client.zcard(lru_key(CACHE, GUESTS)) == n
    finally:
        await client.aclose()
    b = await sidecar_factory(
        redis_url=redis_url, upstream=truth.url, pod="pod-b", warm_bytes=1024 * 1024
    )
    b.steady()  # L1 hits are asserted: the staleness bound must not lapse
    assert (await ready(b)).status_code == 200
    await b.confirmed()  # and L1 serves only once the epochs are confirmed
    warm = (await b.admin.get("/status")).json()["warmup"]
    assert (warm["state"], warm["entries"], warm["guests"]) == ("done", len(asked), 2)
    calls = truth.calls
    for tenant, prompt in asked:
        assert (await b.chat(prompt, tenant=tenant)).headers["x-cache"] == "HIT-L1"
    assert truth.calls == calls  # nothing went upstream
    # one free partition: the guest used last gets it, none takes its slot
    c = await sidecar_factory(
        redis_url=redis_url, upstream=truth.url, pod="pod-c", warm_bytes=1 << 20, max_tenants=1
    )
    c.steady()  # L1 hits are asserted: the staleness bound must not lapse
    assert (await ready(c)).status_code == 200
    await c.confirmed()  # and L1 serves only once the epochs are confirmed
    warm = (await c.admin.get("/status")).json()["warmup"]
    assert (warm["entries"], warm["guests"]) == (1, 1)
    assert warm["skipped"] == {"guest_slots": 3}
    assert (await c.chat("q1", tenant="cust-2")).headers["x-cache"] == "HIT-L1"


async def test_the_warm_up_reads_in_batches_and_stops_at_its_bytes(any_redis: str) -> None:
    """Issue 34 (6): the warm-up fetched up to 512 entries per tenant in one MGET whatever
    ``--warm-bytes`` said (``4Mi`` with 301 entries of 0.45 MB: the new pod peaked at
    212 MiB). Now it asks each value's length first and reads only what fits, in batches."""
    budget = 4 * 1024 * 1024
    tracker = EpochTracker()
    vector = tracker.vector("acme", "m1", "")
    body = b'{"answer": "' + b"x" * 450_000 + b'"}'  # a stored answer is whole JSON
    entry = Entry(200, b"content-type: application/json\r\n", body, stream=False, tenant="acme")
    async with RedisL2.from_url(any_redis, CACHE, op_timeout_s=5.0) as l2:
        assert await l2.set_limit("acme", 128 << 20)
        for i in range(BIG_ENTRIES):
            assert await l2.put("acme", f"{i:064x}", entry.dumps(), vector, l1_id=i)
        warmed: dict[int, int] = {}

        def put(tenant: str, digest: str, l1_key: int, got: Entry) -> int:
            assert got.body == body
            warmed[l1_key] = got.l1_bytes(digest)
            return warmed[l1_key]

        report = WarmReport()
        tracemalloc.start()
        try:
            await warm_l1(
                l2,
                ["acme"],
                tracker,
                put,
                budget_bytes=budget,
                share=lambda _: None,
                resident=lambda _, key: key in warmed,
                report=report,
                read_timeout_s=20.0,
            )
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    # the values read and the entries made of them (the L1 would hold those anyway)
    assert peak < 4 * budget, f"{peak / 2**20:.1f} MiB held to warm {budget / 2**20:.0f} MiB"
    assert report.read_bytes <= budget
    assert 1 <= report.entries == len(warmed) <= budget // len(body)
    assert report.bytes <= budget
    # the most recent were read and warmed; the rest counted, not read
    assert sorted(warmed) == list(range(BIG_ENTRIES - report.entries, BIG_ENTRIES))
    assert report.entries + report.skipped["over_budget"] == BIG_ENTRIES
