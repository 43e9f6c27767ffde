"""Fixtures for sidecar integration tests: stand-in upstreams, in-process sidecars, and
Redis standalone and clustered (``any_redis``)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import httpx
import pytest

from cachefleet_e2e.fake_upstream import FakeUpstream
from cachefleet_e2e.truth import VersionedUpstream
from cachefleet_sidecar.app import SidecarServer
from cachefleet_sidecar.config import SidecarConfig

#: L2 operation budget of a patient sidecar, seconds (the default is 50 ms).
PATIENT_L2_S = 5.0
#: Staleness bound of a steady sidecar, seconds (the default is 2 s).
STEADY_BOUND_S = 60.0
#: Bound on waiting for a sidecar's background work in these tests, seconds.
SETTLE_BOUND_S = 20.0


async def until(done: Callable[[], bool], what: Callable[[], str]) -> None:
    """Wait, within :data:`SETTLE_BOUND_S`, until ``done()``; else fail saying ``what()``."""
    deadline = time.monotonic() + SETTLE_BOUND_S
    while not done():
        assert time.monotonic() < deadline, what()
        await asyncio.sleep(0.02)


@pytest.fixture
def upstream() -> Iterator[FakeUpstream]:
    with FakeUpstream() as up:
        yield up


class RunningSidecar:
    def __init__(self, server: SidecarServer) -> None:
        self.server = server
        self.sidecar = server.sidecar
        ports = server.ports
        self.url = f"http://127.0.0.1:{ports[0]}"
        self.admin_url = f"http://127.0.0.1:{ports[1]}" if len(ports) > 1 else self.url
        self.client = httpx.AsyncClient(base_url=self.url, timeout=10.0)
        self.admin = httpx.AsyncClient(base_url=self.admin_url, timeout=10.0)

    async def chat(
        self, content: str = "hello", *, tenant: str | None = "acme", **fields: Any
    ) -> httpx.Response:
        body: dict[str, Any] = {
            "model": "m1",
            "messages": [{"role": "user", "content": content}],
            "temperature": 0,
        }
        body.update(fields.pop("body", {}))
        headers = {"X-Tenant-ID": tenant} if tenant is not None else {}
        headers.update(fields.pop("headers", {}))
        return await self.client.post("/v1/chat/completions", json=body, headers=headers)

    def patient(self) -> RunningSidecar:
        """Give its L2 operations 5 s: a loaded machine must not turn a write into a drop or
        a hit into a miss where the test is about something else."""
        if self.sidecar.l2 is not None:
            self.sidecar.l2.op_timeout_s = PATIENT_L2_S
        return self

    def steady(self) -> RunningSidecar:
        """Keep confirmed epochs valid for 60 s (the poll keeps its pace, a quarter of the
        2 s default): a loaded machine must not lapse the staleness bound, and so stop the
        L1 hits a test expects, where the test is about something else. A confirmation
        already made is stretched to the new bound too (its ``valid_until`` was its send
        time + the old bound)."""
        tracker = self.sidecar.tracker
        if math.isfinite(tracker.valid_until):
            tracker.valid_until += STEADY_BOUND_S - tracker.bound_s
        tracker.bound_s = STEADY_BOUND_S
        return self

    async def confirmed(self) -> None:
        """Wait (bounded) until its epochs are confirmed: with Redis, L1 serves only then
        (readiness does not wait for it: L2 checks its own fences)."""
        await until(self.sidecar.tracker.fresh, lambda: "the sidecar never confirmed its epochs")

    async def stored(self, n: int = 1) -> None:
        """Wait (bounded) until its L2 has stored ``n`` entries in all: L2 writes are in the
        background, so the next pod's hit is certain only then."""
        l2 = self.sidecar.l2
        assert l2 is not None, "this sidecar has no L2"
        counters = l2.counters
        await until(
            lambda: counters.stores >= n, lambda: f"{counters.stores} of {n} L2 writes stored"
        )

    async def settled(self) -> None:
        """Wait (bounded) until its background work (L2 writes, L3 comparisons) has ended."""
        tasks = self.sidecar.background.tasks
        await until(lambda: not tasks, lambda: f"{len(tasks)} background tasks still running")

    async def aclose(self) -> None:
        await self.client.aclose()
        await self.admin.aclose()
        await self.server.stop(grace_s=2.0)


SidecarFactory = Callable[..., Awaitable[RunningSidecar]]


@pytest.fixture
async def sidecar_factory(upstream: FakeUpstream) -> AsyncIterator[SidecarFactory]:
    running: list[RunningSidecar] = []

    async def make(*, patient: bool = False, **overrides: Any) -> RunningSidecar:
        base: dict[str, Any] = dict(
            listen=("127.0.0.1", 0),
            admin_listen=("127.0.0.1", 0),
            upstream=upstream.url,
            cache="test/cache",
            pod="pod-a",
            l1_bytes=8 * 1024 * 1024,
            # The test client names tenants by header, from loopback.
            trusted_proxies=("127.0.0.1/32",),
        )
        server = SidecarServer(SidecarConfig.from_flat(**{**base, **overrides}))
        await server.start()
        sc = RunningSidecar(server)
        running.append(sc)
        return sc.patient() if patient else sc

    yield make
    for sc in running:
        await sc.aclose()


@pytest.fixture
async def sidecar(sidecar_factory: SidecarFactory) -> RunningSidecar:
    return await sidecar_factory()


@pytest.fixture(params=["standalone", "cluster"])
def any_redis(request: pytest.FixtureRequest) -> str:
    """A flushed standalone Redis, then a flushed 3-node cluster."""
    if request.param == "cluster":
        request.applymarker(pytest.mark.redis_cluster)
        return str(request.getfixturevalue("cluster_url"))
    return str(request.getfixturevalue("redis_url"))


@pytest.fixture
async def truth() -> AsyncIterator[VersionedUpstream]:
    async with VersionedUpstream() as up:
        yield up
