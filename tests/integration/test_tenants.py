"""Tenants are not free: a flood of made-up tenant names, black-box over real sockets.

Known tenants keep their entries and their share, the L1, its slots and the
metric series stay bounded, idle tenants expire so new ones are cached again,
and a /metrics scrape hands the event loop back while it renders.
"""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cachefleet_common.contract.clients import redis_from_url
from cachefleet_common.contract.messages import QuotaAssignment, TenantQuota
from cachefleet_common.contract.names import Policy
from cachefleet_sidecar.compose import Sidecar
from cachefleet_sidecar.http.server import Request
from cachefleet_sidecar.observe.metrics import OTHER_TENANT
from cachefleet_sidecar.tenancy.identity import TENANT_MEMO_MAX

from .conftest import RunningSidecar, SidecarFactory

JUNK = 100


def tenant_labels(text: str) -> set[str]:
    return {
        sample.labels["tenant"]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if "tenant" in sample.labels
    }


async def fill(sc: RunningSidecar, tenant: str, count: int) -> None:
    for i in range(count):
        resp = await sc.chat(f"question {i}", tenant=tenant)
        assert resp.status_code == 200


async def flood(sc: RunningSidecar, count: int, prefix: str = "junk") -> list[httpx.Response]:
    out = []
    for i in range(count):
        out.append(await sc.chat(f"junk {i}", tenant=f"{prefix}-{i}"))
    return out


async def test_junk_tenants_never_dilute_a_known_tenant(sidecar_factory: SidecarFactory) -> None:
    sc = await sidecar_factory(
        tenants=("alpha",), guest_share=0.25, l1_bytes=256 * 1024, max_tenants=16
    )
    await fill(sc, "alpha", 150)
    before = sc.sidecar.l1.stats()["alpha"]
    assert before.entries == 150  # it all fits in alpha's share
    assert before.capacity_bytes == 192 * 1024  # 1 - guest share

    answers = await flood(sc, JUNK)
    assert {r.status_code for r in answers} == {200}  # guests are served...
    assert {r.headers["x-cache"] for r in answers} <= {"MISS", "BYPASS"}

    after = sc.sidecar.l1.stats()
    assert after["alpha"].entries == before.entries  # ...and took nothing from alpha
    assert after["alpha"].capacity_bytes == before.capacity_bytes
    assert after["alpha"].evictions == 0
    for i in range(150):
        assert (await sc.chat(f"question {i}", tenant="alpha")).headers["x-cache"] == "HIT-L1"
    # Bounded: slots, bytes, series.
    assert len(after) <= 16
    assert sum(s.used_bytes for s in after.values()) <= 256 * 1024
    guests = [t for t in after if t != "alpha"]
    assert sum(after[t].capacity_bytes for t in guests) <= 64 * 1024
    labels = tenant_labels((await sc.admin.get("/metrics")).text)
    assert "alpha" in labels
    assert OTHER_TENANT in labels
    assert len(labels) <= 16 + 1 + 1  # max_tenants series, alpha (known), _other
    status = (await sc.admin.get("/status")).json()
    assert len(status["tenants"]) <= 16


async def test_without_a_guest_share_unknown_names_are_refused(
    sidecar_factory: SidecarFactory,
) -> None:
    sc = await sidecar_factory(tenants=("alpha",), l1_bytes=256 * 1024)
    await fill(sc, "alpha", 20)
    answers = await flood(sc, 20)
    assert {r.status_code for r in answers} == {403}
    assert list(sc.sidecar.l1.stats()) == ["alpha"]
    assert tenant_labels((await sc.admin.get("/metrics")).text) == {"alpha"}


async def test_a_newcomer_takes_the_least_recent_slot_and_idle_ones_expire(
    sidecar_factory: SidecarFactory,
) -> None:
    # Open mode: every name is admitted; when the slots run out, the tenant seen least
    # recently gives its slot to the newcomer, which is cached at once.
    sc = await sidecar_factory(max_tenants=8, l1_bytes=256 * 1024, tenant_idle_expiry_s=0)
    await flood(sc, 8, prefix="early")
    await sc.chat("junk 0", tenant="early-0")  # early-1 is now the least recent
    assert (await sc.chat("late question", tenant="latecomer")).headers["x-cache"] == "MISS"
    assert (await sc.chat("late question", tenant="latecomer")).headers["x-cache"] == "HIT-L1"
    stats = sc.sidecar.l1.stats()
    assert len(stats) == 8
    assert "early-1" not in stats
    assert "early-0" in stats
    assert (await sc.chat("junk 1", tenant="early-1")).headers["x-cache"] == "MISS"  # dropped

    # Three ticks pass; "early-0" keeps asking, the rest are idle for more than two ticks.
    for _ in range(3):
        await sc.chat("junk 0", tenant="early-0")
        sc.sidecar.tenants.expire_idle(2)
    stats = sc.sidecar.l1.stats()
    assert set(stats) == {"early-0"}
    labels = tenant_labels((await sc.admin.get("/metrics")).text)
    assert "early-5" not in labels
    assert "early-0" in labels


class _Raw:
    """A bare keep-alive HTTP/1.1 client: 10,000 requests through httpx take minutes here."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(cls, url: str) -> _Raw:
        host, port = url.removeprefix("http://").split(":")
        return cls(*await asyncio.open_connection(host, int(port)))

    async def chat(self, content: str, tenant: str) -> tuple[int, str]:
        """(status, X-Cache) of one chat completion of ``tenant``."""
        body = orjson.dumps(
            {"model": "m1", "messages": [{"role": "user", "content": content}], "temperature": 0}
        )
        self.writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            b"x-tenant-id: %s\r\ncontent-length: %d\r\n\r\n%s" % (tenant.encode(), len(body), body)
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        fields = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
        await self.reader.readexactly(int(fields["content-length"]))
        return int(lines[0].split()[1]), fields.get("x-cache", "").upper()

    async def aclose(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


async def test_five_thousand_tenants_through_sixty_four_slots(
    sidecar_factory: SidecarFactory,
) -> None:
    # A SaaS with one tenant per customer: 5,000 names, two of them listed, 64 slots.
    names = 5000
    slots = 64
    l1_bytes = 1 << 20
    sc = await sidecar_factory(
        tenants=("alpha", "beta"), guest_share=0.25, l1_bytes=l1_bytes, max_tenants=slots
    )
    app: Sidecar = sc.sidecar
    await fill(sc, "alpha", 10)
    await fill(sc, "beta", 10)
    listed = {t: app.l1.stats()[t] for t in ("alpha", "beta")}
    most = 0
    raw = await _Raw.connect(sc.url)
    try:
        for i in range(names):  # one after the other: each answer before the next request
            tenant = f"customer-{i}"
            assert await raw.chat(f"question of {tenant}", tenant) == (200, "MISS"), tenant
            assert await raw.chat(f"question of {tenant}", tenant) == (200, "HIT-L1"), tenant
            most = max(most, len(app.l1.tenants))
    finally:
        await raw.aclose()
    assert most == slots
    assert app.l1.replaced == names - (slots - 2)
    assert app.metrics.cache_faults.get("tenant_limit", 0) == 0  # nobody was sent uncached

    # The listed tenants kept their slots, bytes and every entry.
    stats = app.l1.stats()
    for tenant, before in listed.items():
        assert stats[tenant].capacity_bytes == before.capacity_bytes
        assert stats[tenant].entries == before.entries == 10
        assert stats[tenant].evictions == 0
    for i in range(10):
        for tenant in listed:
            hit = await sc.chat(f"question {i}", tenant=tenant)
            assert hit.headers["x-cache"] == "HIT-L1"
    # Bounded: bytes, the guests' pool, series, /status, the per-tenant state of the pod.
    assert app.l1.used_bytes <= l1_bytes
    assert sum(s.capacity_bytes for t, s in stats.items() if t not in listed) <= l1_bytes // 4
    labels = tenant_labels((await sc.admin.get("/metrics")).text)
    assert {"alpha", "beta", OTHER_TENANT} <= labels
    assert len(labels) <= slots + 2 + 1  # max_tenants series, the listed ones, _other
    assert len(app.metrics.tenants) <= slots + 2 + 1
    status = (await sc.admin.get("/status")).json()
    assert len(status["tenants"]) <= slots
    assert len(app.tenants.rules.memo) <= TENANT_MEMO_MAX


async def test_unlisted_tenants_follow_the_operators_tenant_defaults(
    sidecar_factory: SidecarFactory,
) -> None:
    l1_bytes = 1 << 20
    sc = await sidecar_factory(l1_bytes=l1_bytes, max_tenants=8)
    app: Sidecar = sc.sidecar
    quotas = {"alpha": TenantQuota(l1_bytes=l1_bytes * 3 // 4, l2_bytes=0)}
    app.quotas.apply(QuotaAssignment(generation=1, tenants=quotas))
    assert (await sc.chat("hello", tenant="customer-1")).status_code == 403  # no defaults

    unlisted = TenantQuota(
        l1_bytes=l1_bytes // 4, l2_bytes=0, policy=Policy.LIRS, priority_class="BestEffort"
    )
    app.quotas.apply(QuotaAssignment(generation=2, tenants=quotas, default_tenant=unlisted))
    await fill(sc, "alpha", 3)
    for i in range(20):
        tenant = f"customer-{i}"
        assert (await sc.chat("hello", tenant=tenant)).headers["x-cache"] == "MISS"
        assert (await sc.chat("hello", tenant=tenant)).headers["x-cache"] == "HIT-L1"
    stats = app.l1.stats()
    assert len(stats) == 8
    assert stats["alpha"].capacity_bytes == l1_bytes * 3 // 4
    assert stats["alpha"].entries == 3
    guests = {t: s for t, s in stats.items() if t != "alpha"}
    assert {s.policy for s in guests.values()} == {"lirs"}
    assert sum(s.capacity_bytes for s in guests.values()) <= l1_bytes // 4

    app.quotas.apply(QuotaAssignment(generation=3, tenants=quotas))  # defaults gone
    assert (await sc.chat("hello", tenant="customer-99")).status_code == 403


class _Sink:
    """Collects what the admin handler writes."""

    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data


async def test_a_scrape_gives_the_loop_back_between_pieces(
    sidecar_factory: SidecarFactory,
) -> None:
    tenants = 64
    sc = await sidecar_factory(max_tenants=tenants, l1_bytes=1 << 20)
    await flood(sc, tenants)
    app: Sidecar = sc.sidecar
    scraping = True
    turns = 0

    async def other_work() -> None:
        nonlocal turns
        while scraping:
            turns += 1
            await asyncio.sleep(0)

    worker = asyncio.get_running_loop().create_task(other_work())
    await asyncio.sleep(0)
    turns = 0
    sink = _Sink()
    request = Request(b"GET", b"/metrics", [], b"", True, 0.0)
    await app.admin.handle(request, sink)  # type: ignore[arg-type]
    scraping = False
    await worker
    # Other work ran between the pieces (at least between the per-tenant families and the
    # rest), not only before and after the whole scrape.
    assert turns >= 4
    assert tenant_labels(sink.data.split(b"\r\n\r\n", 1)[1].decode()) >= {"junk-0", "junk-63"}


@pytest.mark.redis
async def test_guests_never_write_redis(sidecar_factory: SidecarFactory, redis_url: str) -> None:
    sc = await sidecar_factory(tenants=("alpha",), guest_share=0.25, redis_url=redis_url)
    await fill(sc, "alpha", 3)
    answers = await flood(sc, 30)
    assert {r.status_code for r in answers} == {200}
    await sc.settled()  # L2 writes are in the background
    client = redis_from_url(redis_url)
    try:
        found = [k async for k in client.scan_iter(match="cf:*", count=1000)]
    finally:
        await client.aclose()
    names = b"\n".join(k if isinstance(k, bytes) else k.encode() for k in found)
    assert b"|alpha}" in names
    assert b"junk" not in names


@pytest.mark.redis
async def test_tenants_under_defaults_stay_out_of_redis(
    sidecar_factory: SidecarFactory, redis_url: str
) -> None:
    # tenantDefaults with no tenant listed: every tenant is unlisted, L1 only.
    # steady: L1 hits are asserted, a loaded machine must not lapse the staleness bound
    sc = (await sidecar_factory(redis_url=redis_url, l1_bytes=1 << 20)).steady()
    await sc.confirmed()
    unlisted = TenantQuota(l1_bytes=1 << 20, l2_bytes=0)
    sc.sidecar.quotas.apply(QuotaAssignment(generation=1, default_tenant=unlisted))
    for i in range(20):
        assert (await sc.chat("hello", tenant=f"junk-{i}")).headers["x-cache"] == "MISS"
        assert (await sc.chat("hello", tenant=f"junk-{i}")).headers["x-cache"] == "HIT-L1"
    await sc.settled()  # L2 writes are in the background
    client = redis_from_url(redis_url)
    try:
        found = [k async for k in client.scan_iter(match="cf:*", count=1000)]
    finally:
        await client.aclose()
    assert not [k for k in found if b"junk" in (k if isinstance(k, bytes) else k.encode())]
