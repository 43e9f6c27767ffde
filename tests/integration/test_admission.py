"""Class-aware admission end to end: a real sidecar in front of the model-server simulator.

The simulator is saturated by holding its prefill queue (requests pile up in
``vllm:num_requests_waiting``), never by load; the gate is made to read the
metrics at the moments the test needs (``poll_once``), besides its own poller.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from cachefleet_e2e.modelserver_sim import ModelServerSim
from cachefleet_sidecar.adapt.admission import AdmissionConfig
from cachefleet_sidecar.adapt.gate import AdmissionGate
from cachefleet_sidecar.app import SidecarServer
from cachefleet_sidecar.config import SidecarConfig
from cachefleet_sidecar.contract.messages import QuotaAssignment, TenantQuota

CLASSES = {"gold": "Guaranteed", "silver": "Standard", "free": "BestEffort"}


@pytest.fixture
def sim() -> Iterator[ModelServerSim]:
    with ModelServerSim(kv_blocks=256, prefill_rate=1e6) as s:
        yield s


class Fleet:
    def __init__(self, server: SidecarServer, sim: ModelServerSim) -> None:
        self.server = server
        self.sim = sim
        self.gate = server.sidecar.gate
        assert isinstance(self.gate, AdmissionGate)
        port, admin = server.ports
        self.client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30)
        self.admin = httpx.AsyncClient(base_url=f"http://127.0.0.1:{admin}", timeout=30)
        self.background: list[asyncio.Task[httpx.Response]] = []

    async def chat(self, tenant: str, content: str) -> httpx.Response:
        body: dict[str, Any] = {
            "model": "sim",
            "messages": [{"role": "user", "content": content}],
            "temperature": 0,
            "max_tokens": 4,
        }
        return await self.client.post(
            "/v1/chat/completions", json=body, headers={"X-Tenant-ID": tenant}
        )

    def send(self, tenant: str, content: str) -> asyncio.Task[httpx.Response]:
        """Open loop: the request goes out now, its answer is collected later."""
        task = asyncio.get_running_loop().create_task(self.chat(tenant, content))
        self.background.append(task)
        return task

    async def saturate(self, waiting: int) -> None:
        """Hold the simulator's prefill until ``waiting`` Guaranteed requests queue there."""
        self.sim.hold()
        for i in range(waiting):
            self.send("gold", f"filler {i}")
        assert await asyncio.to_thread(self.sim.wait_queued, waiting)
        await self.gate.poll_once()
        assert self.gate.shedding

    async def until(self, predicate: Any, what: str) -> None:
        for _ in range(2000):  # bounded: 20 s and more (a loaded machine only waits longer)
            if predicate():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"never happened: {what}")

    async def aclose(self) -> None:
        self.sim.hold(False)
        for task in self.background:
            if not task.done():
                task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        await self.client.aclose()
        await self.admin.aclose()
        await self.server.stop(grace_s=2.0)


@pytest.fixture
async def make_fleet(sim: ModelServerSim) -> AsyncIterator[Any]:
    made: list[Fleet] = []

    async def make(**admission: Any) -> Fleet:
        config = SidecarConfig(
            listen=("127.0.0.1", 0),
            admin_listen=("127.0.0.1", 0),
            upstream=sim.url,
            cache="test/cache",
            pod="pod-a",
            l1_bytes=8 * 1024 * 1024,
            trusted_proxies=("127.0.0.1/32",),
            admission=AdmissionConfig(**{"max_waiting": 2, **admission}),
        )
        server = SidecarServer(dataclasses.replace(config))
        await server.start()
        server.sidecar.quotas.apply(
            QuotaAssignment(
                generation=1,
                tenants={
                    t: TenantQuota(l1_bytes=1 << 20, l2_bytes=0, priority_class=c)  # type: ignore[arg-type]
                    for t, c in CLASSES.items()
                },
            )
        )
        fleet = Fleet(server, sim)
        made.append(fleet)
        return fleet

    yield make
    for fleet in made:
        await fleet.aclose()


async def test_saturated_server_sheds_besteffort_queues_standard_passes_guaranteed(
    make_fleet: Any,
) -> None:
    fleet: Fleet = await make_fleet()
    cached = await fleet.chat("free", "a question asked before the rush")
    assert (cached.status_code, cached.headers["x-cache"]) == (200, "MISS")

    await fleet.saturate(3)

    shed = await fleet.chat("free", "a new question")
    assert shed.status_code == 429
    assert int(shed.headers["retry-after"]) >= 1
    error = shed.json()["error"]
    assert error["reason"] == "saturated_queue"
    assert error["type"] == "cachefleet_admission"

    hit = await fleet.chat("free", "a question asked before the rush")
    assert (hit.status_code, hit.headers["x-cache"]) == (200, "HIT-L1")
    assert hit.json() == cached.json()

    gold = fleet.send("gold", "an urgent question")
    assert await asyncio.to_thread(fleet.sim.wait_queued, 4)  # it reached the model server

    silver = fleet.send("silver", "a patient question")
    await fleet.until(lambda: fleet.gate.core.queued == 1, "the Standard request waits")
    assert fleet.sim.snapshot()["waiting"] == 4  # ... in the sidecar, not at the server

    status = (await fleet.admin.get("/status")).json()["admission"]
    assert (status["shedding"], status["queued"], status["cause"]) == (True, 1, "queue")

    fleet.sim.hold(False)
    assert (await gold).status_code == 200
    await fleet.gate.poll_once()  # the queue drained: room again
    answer = await silver
    assert (answer.status_code, answer.headers["x-cache"]) == (200, "MISS")
    assert not fleet.gate.shedding
    assert fleet.server.sidecar.admin.heartbeat().shedding is False

    metrics = (await fleet.admin.get("/metrics")).text
    assert (
        'cachefleet_admission_refused_total{cache="test/cache",class="BestEffort",'
        'reason="saturated_queue",tenant="free"} 1.0'
    ) in metrics
    assert 'cachefleet_admission_waited_total{cache="test/cache",tenant="silver"} 1.0' in metrics
    assert 'cachefleet_admission_shedding_starts_total{cache="test/cache"} 1.0' in metrics
    assert 'class="Guaranteed"' not in metrics  # Guaranteed is never refused


async def test_standard_queue_full_gets_429_and_a_timed_out_wait_503(make_fleet: Any) -> None:
    fleet: Fleet = await make_fleet(standard_queue=1, standard_max_wait_s=0.5)
    await fleet.saturate(2)
    assert fleet.server.sidecar.admin.heartbeat().shedding is True
    waiting = fleet.send("silver", "first in line")
    await fleet.until(lambda: fleet.gate.core.queued == 1, "the first Standard request waits")
    full = await fleet.chat("silver", "second in line")
    assert full.status_code == 429
    assert full.json()["error"]["reason"] == "queue_full"
    timed_out = await waiting  # the server stays saturated past the wait bound
    assert timed_out.status_code == 503
    assert int(timed_out.headers["retry-after"]) >= 1
    assert timed_out.json()["error"]["reason"] == "queue_timeout"


async def test_unreadable_metrics_admit_everyone_and_are_counted(make_fleet: Any) -> None:
    fleet: Fleet = await make_fleet()
    fleet.gate.metrics_url = fleet.sim.url + "/no-such-metrics"
    await fleet.gate.poll_once()
    assert fleet.gate.core.faults >= 1
    assert not fleet.gate.shedding
    answer = await fleet.chat("free", "anyone home?")
    assert answer.status_code == 200
    metrics = (await fleet.admin.get("/metrics")).text
    assert 'cachefleet_admission_metrics_faults_total{cache="test/cache"}' in metrics


async def test_an_unlisted_tenant_is_admitted_by_the_class_of_the_tenant_defaults(
    make_fleet: Any,
) -> None:
    fleet: Fleet = await make_fleet()
    sidecar = fleet.server.sidecar
    sidecar.quotas.apply(
        QuotaAssignment(
            generation=2,
            tenants=dict(sidecar.tenants.quotas),
            default_tenant=TenantQuota(l1_bytes=1 << 20, l2_bytes=0, priority_class="BestEffort"),
        )
    )
    cached = await fleet.chat("customer-17", "asked before the rush")
    assert (cached.status_code, cached.headers["x-cache"]) == (200, "MISS")  # admitted, cached
    await fleet.saturate(3)
    shed = await fleet.chat("customer-17", "a new question")
    assert shed.status_code == 429  # BestEffort, from the defaults
    assert shed.json()["error"]["reason"] == "saturated_queue"
    hit = await fleet.chat("customer-17", "asked before the rush")
    assert (hit.status_code, hit.headers["x-cache"]) == (200, "HIT-L1")  # a hit is never refused
