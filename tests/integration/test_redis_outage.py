"""Availability when Redis is down: strict (the default) or serve L1 up to a stated bound."""

from __future__ import annotations

import asyncio
import time

import pytest

from cachefleet_common.contract.clients import redis_from_url
from cachefleet_common.contract.ops import advance_epoch, fence_tenants, publish_epochs
from cachefleet_e2e.fake_upstream import FakeUpstream
from cachefleet_e2e.services import RedisServer

from .conftest import RunningSidecar, SidecarFactory
from .test_sidecar import CHAT

pytestmark = pytest.mark.redis

#: Safety net for waits; the assertions are about order, not speed.
WAIT_S = 20.0


async def l1_stops(pod: RunningSidecar, content: str) -> float:
    """Ask until ``content`` is no longer an L1 hit; the monotonic time it stopped."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        resp = await pod.chat(content)
        assert resp.status_code == 200  # never a user-visible error
        if resp.headers["x-cache"] != "HIT-L1":
            return time.monotonic()
        await asyncio.sleep(0.1)
    raise AssertionError(f"L1 hits did not stop within {WAIT_S}s")


async def test_strict_stops_l1_hits_and_serve_stale_keeps_them_within_its_bound(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    with RedisServer() as redis:
        strict = await sidecar_factory(redis_url=redis.url, pod="strict")
        lenient = await sidecar_factory(
            redis_url=redis.url, pod="lenient", redis_outage_staleness_s=6.0
        )
        assert (await strict.admin.get("/status")).json()["redis_outage"]["mode"] == "strict"
        lenient_status = (await lenient.admin.get("/status")).json()["redis_outage"]
        assert lenient_status["mode"] == "serve-stale"
        assert lenient_status["max_staleness_s"] == 6.0
        for pod in (strict, lenient):
            await pod.chat("warm")
            assert (await pod.chat("warm")).headers["x-cache"] == "HIT-L1"

        # While Redis answers, serve-stale is no slower to honour an invalidation than strict.
        admin = redis_from_url(redis.url)
        try:
            epoch = await advance_epoch(admin, "test/cache", "cache")
            await fence_tenants(admin, "test/cache", {"cache": epoch})
            await publish_epochs(admin, "test/cache", {"cache": epoch})
        finally:
            await admin.aclose()
        for pod in (strict, lenient):
            deadline = time.monotonic() + WAIT_S
            while pod.sidecar.tracker.known.get("cache") != epoch:
                assert time.monotonic() < deadline, "the invalidation never arrived"
                await asyncio.sleep(0.05)
            # Not the old L1 entry: a fresh answer (or the other pod's, through L2, new epoch).
            assert (await pod.chat("warm")).headers["x-cache"] in {"MISS", "HIT-L2"}
            assert (await pod.chat("warm")).headers["x-cache"] == "HIT-L1"

        redis.kill()
        await l1_stops(strict, "warm")  # strict: past the 2 s bound, everything goes upstream
        calls = upstream.calls[CHAT]
        # The lenient pod still answers from L1 at that point: no upstream call. (Checked
        # only if the answer came within its 6 s bound: a loaded machine may take longer
        # to get here, and then the bound rightly stops the hit.)
        still = (await lenient.chat("warm")).headers["x-cache"]
        if time.monotonic() < lenient.sidecar.tracker.valid_until:
            assert still == "HIT-L1"
            assert upstream.calls[CHAT] == calls
        # ...but not forever: its stated bound holds too.
        await l1_stops(lenient, "warm")
        confirmed_at = lenient.sidecar.tracker.confirmed_at
        assert confirmed_at is not None
        assert lenient.sidecar.tracker.valid_until == pytest.approx(confirmed_at + 6.0)
        assert strict.sidecar.tracker.bound_s == 2.0

        # Redis back: both confirm their epochs again and serve L1 hits.
        redis.restart()
        for pod in (strict, lenient):
            deadline = time.monotonic() + WAIT_S
            while (await pod.chat("warm")).headers["x-cache"] != "HIT-L1":
                assert time.monotonic() < deadline, "L1 hits did not come back"
                await asyncio.sleep(0.1)
