"""Class-aware admission end to end: a real sidecar in front of the model-server simulator.

The simulator is saturated by holding its prefill queue (requests pile up in
``vllm:num_requests_waiting``), never by load; the gate is made to read the
metrics at the moments the test needs (``poll_once``), besides its own poller.
"""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from cachefleet_common.contract.messages import QuotaAssignment, TenantQuota
from cachefleet_e2e.modelserver_sim import ModelServerSim
from cachefleet_sidecar.adapt.admission import AdmissionConfig
from cachefleet_sidecar.app import SidecarServer
from cachefleet_sidecar.config import SidecarConfig
from cachefleet_sidecar.http.gate import AdmissionGate

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
        config = SidecarConfig.from_flat(
            listen=("127.0.0.1", 0),
            admin_listen=("127.0.0.1", 0),
            upstream=sim.url,
            cache="test/cache",
            pod="pod-a",
            l1_bytes=8 * 1024 * 1024,
            trusted_proxies=("127.0.0.1/32",),
            admission=AdmissionConfig(**{"max_waiting": 2, **admission}),
        )
        server = SidecarServer(config)
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


# ------------------------------------------------------------- hostile model servers

SATURATED = b"vllm:num_requests_waiting 50\n"
#: Two lines whose sum is infinite (issue 34, 2), and a mean prefill time to multiply it by.
OVERFLOWING = (
    b'vllm:num_requests_waiting{m="a"} 1e308\n'
    b'vllm:num_requests_waiting{m="b"} 1e308\n'
    b"vllm:request_prefill_time_seconds_sum 1.5\n"
    b"vllm:request_prefill_time_seconds_count 3\n"
)
FLOOD_BYTES = 64 * 1024 * 1024
CHUNK = b"# " + b"x" * (64 * 1024 - 3) + b"\n"


class HostileMetrics:
    """A ``/metrics`` server on loopback that answers as ``mode`` says: ``body`` (whole),
    ``trickle`` (headers, then a byte every 0.3 s: at most 100, the bound of its loop) or
    ``flood`` (:data:`FLOOD_BYTES` without a length, until the reader hangs up)."""

    def __init__(self) -> None:
        self.mode = "body"
        self.body = SATURATED
        self.sent = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> HostileMetrics:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:  # a trickle still going ends here
            writer.close()
        await self._server.wait_closed()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/metrics"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        try:
            await reader.readuntil(b"\r\n\r\n")
            if self.mode == "body":
                writer.write(
                    b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
                    % len(self.body)
                )
                writer.write(self.body)
            elif self.mode == "trickle":
                writer.write(
                    b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 1000\r\n\r\n"
                )
                for _ in range(100):
                    writer.write(b"#")
                    await writer.drain()
                    await asyncio.sleep(0.3)
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n")
                while self.sent < FLOOD_BYTES:
                    writer.write(CHUNK)
                    await writer.drain()
                    self.sent += len(CHUNK)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


def hostile_gate(url: str, **admission: Any) -> AdmissionGate:
    """A gate reading ``url``; a reading's deadline is 2 s here (1 s by default), so that a
    loaded machine does not fail the readings that must succeed."""
    config = AdmissionConfig(**{"max_waiting": 2, "standard_max_wait_s": 0.5, **admission})
    return AdmissionGate(config, url, poll_s=0.05, read_timeout_s=2.0)


def status_of(answer: bytes | None) -> int:
    return 0 if answer is None else int(answer.split(b" ", 2)[1])


async def test_an_overflowing_reading_is_refused_cleanly_and_the_poller_lives(
    make_fleet: Any,
) -> None:
    """Issue 34 (2): two ``1e308`` lines raised OverflowError in ``Retry-After``: BestEffort
    lost its connection, /status failed, the poller died and parked requests hung."""
    fleet: Fleet = await make_fleet(standard_max_wait_s=0.5)
    async with HostileMetrics() as hostile:
        hostile.body = OVERFLOWING
        fleet.gate.metrics_url = hostile.url
        await fleet.gate.poll_once()
        assert fleet.gate.shedding
        shed = await fleet.chat("free", "a new question")
        assert shed.status_code == 429
        assert 1 <= int(shed.headers["retry-after"]) <= 60
        status = await fleet.admin.get("/status")
        assert status.status_code == 200
        assert status.json()["admission"]["shedding"] is True
        # a parked Standard request is answered when its wait runs out, by the poller or
        # by its own deadline; the poller goes on reading after that
        fleet.gate.start()
        waited = await asyncio.wait_for(fleet.chat("silver", "patient"), 20.0)
        assert waited.status_code == 503
        assert waited.json()["error"]["reason"] == "queue_timeout"
        polls = fleet.gate.polls
        await fleet.until(lambda: fleet.gate.polls >= polls + 3, "the poller reads on")
        assert fleet.gate._task is not None
        assert not fleet.gate._task.done()


async def test_a_trickling_metrics_answer_is_a_failed_reading_within_its_deadline() -> None:
    """Issue 34 (2): a ``/metrics`` that trickles a byte every 0.3 s never timed out (the 1 s
    bound was per read), so shedding stayed frozen. Now a reading has a deadline in all."""
    async with HostileMetrics() as hostile:
        gate = hostile_gate(hostile.url)
        try:
            await gate.poll_once()
            assert gate.shedding
            hostile.mode = "trickle"
            # generous: the reading's own deadline is 2 s; the trickle lasts 30 s
            await asyncio.wait_for(gate.poll_once(), 15.0)
            assert gate.core.faults == 1
            assert not gate.shedding
            assert await gate.admit("free", "BestEffort") is None
        finally:
            await gate.aclose()


async def test_a_parked_request_gets_its_answer_when_its_own_wait_runs_out() -> None:
    """Issue 34 (2): with readings stalled, a parked Standard request waited forever (its
    maximum wait was checked only when a reading arrived)."""
    async with HostileMetrics() as hostile:
        gate = hostile_gate(hostile.url)
        try:
            await gate.poll_once()  # saturated; no reading comes after this one
            assert gate.shedding
            # a client that leaves while parked leaves the queue
            left = asyncio.get_running_loop().create_task(gate.admit("silver", "Standard"))
            for _ in range(1000):  # bounded: 10 s and more
                if gate.core.queued:
                    break
                await asyncio.sleep(0.01)
            assert gate.core.queued == 1
            left.cancel()
            with pytest.raises(asyncio.CancelledError):
                await left
            assert gate.core.queued == 0
            answer = await asyncio.wait_for(gate.admit("silver", "Standard"), 10.0)
            assert status_of(answer) == 503
            assert answer is not None
            assert b"queue_timeout" in answer
            assert gate.core.queued == 0
        finally:
            await gate.aclose()


async def test_a_huge_metrics_answer_is_read_only_up_to_the_cap() -> None:
    """Issue 34 (4): the body was read whole before its 4 MiB check (two 200 MiB answers:
    +622 MiB). Now reading stops at the cap: a failed reading, memory near the cap."""
    async with HostileMetrics() as hostile:
        hostile.mode = "flood"
        gate = hostile_gate(hostile.url)
        try:
            tracemalloc.start()
            try:
                await asyncio.wait_for(gate.poll_once(), 30.0)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert gate.core.faults == 1
            assert peak < 16 * 1024 * 1024, f"{peak / 2**20:.1f} MiB held for one reading"
            await asyncio.sleep(0.2)  # the server notices the hang-up at its next write
            assert hostile.sent < FLOOD_BYTES // 2
        finally:
            await gate.aclose()
