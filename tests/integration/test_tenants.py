"""Tenants are not free: a flood of made-up tenant names, black-box over real sockets.

Known tenants keep their entries and their share, the L1, its slots and the
metric series stay bounded, idle tenants expire so new ones are cached again,
and a /metrics scrape hands the event loop back while it renders.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cachefleet_sidecar import protocol
from cachefleet_sidecar.app import Sidecar
from cachefleet_sidecar.metrics import OTHER_TENANT
from cachefleet_sidecar.server import Request

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


async def test_idle_tenants_expire_and_their_slots_come_back(
    sidecar_factory: SidecarFactory,
) -> None:
    # Open mode: every name is admitted; slots run out, then idle ones are reclaimed.
    sc = await sidecar_factory(max_tenants=8, l1_bytes=256 * 1024, tenant_idle_expiry_s=0)
    await flood(sc, 8, prefix="early")
    late = await sc.chat("late question", tenant="latecomer")
    assert late.status_code == 200  # served, uncached: no slot
    assert "latecomer" not in sc.sidecar.l1.stats()
    assert (await sc.chat("late question", tenant="latecomer")).headers["x-cache"] == "BYPASS"

    # Three ticks pass; "early-0" keeps asking, the rest are idle for more than two ticks.
    for _ in range(3):
        await sc.chat("junk 0", tenant="early-0")
        sc.sidecar.expire_idle(2)
    stats = sc.sidecar.l1.stats()
    assert "early-0" in stats
    assert not any(t.startswith("early-") and t != "early-0" for t in stats)
    labels = tenant_labels((await sc.admin.get("/metrics")).text)
    assert "early-5" not in labels
    assert "early-0" in labels

    await sc.chat("late question", tenant="latecomer")
    assert (await sc.chat("late question", tenant="latecomer")).headers["x-cache"] == "HIT-L1"


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
    await app.admin(request, sink)  # type: ignore[arg-type]
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
    await asyncio.sleep(0.3)  # L2 writes are in the background
    client = protocol.redis_from_url(redis_url)
    try:
        found = [k async for k in client.scan_iter(match="cf:*", count=1000)]
    finally:
        await client.aclose()
    names = b"\n".join(k if isinstance(k, bytes) else k.encode() for k in found)
    assert b"|alpha}" in names
    assert b"junk" not in names
