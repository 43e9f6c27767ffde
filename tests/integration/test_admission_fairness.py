"""Fair queuing in admission, end to end: a real sidecar in front of a saturated stand-in.

The stand-in model server says it is saturated through its ``/metrics`` (a
number the test sets) and records the order in which requests reach it. The
gate's own poller is stopped: the test takes each reading itself, with room
for exactly one request, and waits for that request to reach the stand-in
before the next reading, so the order asserted is the gate's release order,
never a race between sockets (no timing is asserted).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from cachefleet_common.classes import FAIRNESS_ID_HEADER, OBJECTIVE_HEADER
from cachefleet_common.contract.messages import QuotaAssignment, TenantQuota
from cachefleet_sidecar.adapt.admission import AdmissionConfig
from cachefleet_sidecar.app import SidecarServer
from cachefleet_sidecar.config import SidecarConfig
from cachefleet_sidecar.http.gate import AdmissionGate

MAX_WAITING = 2
ANSWER = orjson.dumps(
    {
        "id": "chatcmpl-standin",
        "object": "chat.completion",
        "created": 0,
        "model": "standin",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
)


class SaturatedStandIn:
    """``GET /metrics``: ``vllm:num_requests_waiting`` = :attr:`waiting`; any ``POST``:
    recorded in :attr:`arrivals` as (tenant, fairness id, question), answered at once."""

    def __init__(self) -> None:
        self.waiting = MAX_WAITING
        self.arrivals: list[tuple[str, str, str]] = []
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> SaturatedStandIn:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 5.0)

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for _ in range(10_000):  # keep-alive: one request after another, bounded
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path = lines[0].split(" ")[:2]
                headers = {
                    k.strip().lower(): v.strip()
                    for k, _, v in (line.partition(":") for line in lines[1:] if line)
                }
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if method == "GET" and path.startswith("/metrics"):
                    out = b"vllm:num_requests_waiting %d\nvllm:num_requests_running 0\n" % (
                        self.waiting
                    )
                    ctype = b"text/plain"
                else:
                    question = orjson.loads(body)["messages"][-1]["content"]
                    self.arrivals.append(
                        (
                            headers.get("x-tenant-id", ""),
                            headers.get(FAIRNESS_ID_HEADER, ""),
                            question,
                        )
                    )
                    out, ctype = ANSWER, b"application/json"
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
                    % (ctype, len(out))
                    + out
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


class Fleet:
    def __init__(self, server: SidecarServer, standin: SaturatedStandIn) -> None:
        self.server = server
        self.standin = standin
        gate = server.sidecar.gate
        assert isinstance(gate, AdmissionGate)
        self.gate = gate
        port, _ = server.ports
        self.client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120)
        self.tasks: list[asyncio.Task[httpx.Response]] = []

    def send(self, tenant: str, question: str, **headers: str) -> asyncio.Task[httpx.Response]:
        """Open loop: the request goes out now, its answer is collected later."""
        body = {
            "model": "standin",
            "messages": [{"role": "user", "content": question}],
            "temperature": 0,
        }
        sent = {"X-Tenant-ID": tenant, **{k.replace("_", "-"): v for k, v in headers.items()}}
        task = asyncio.get_running_loop().create_task(
            self.client.post("/v1/chat/completions", json=body, headers=sent)
        )
        self.tasks.append(task)
        return task

    async def until(self, predicate: Any, what: str) -> None:
        for _ in range(3000):  # bounded: 30 s and more (a loaded machine only waits longer)
            if predicate():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"never happened: {what}")

    async def saturate(self) -> None:
        self.standin.waiting = MAX_WAITING
        await self.gate.poll_once()
        assert self.gate.shedding

    async def release_one(self) -> tuple[str, str, str]:
        """One reading with room for exactly one request; that request's arrival."""
        before = len(self.standin.arrivals)
        self.standin.waiting = MAX_WAITING - 1
        await self.gate.poll_once()
        assert self.gate.core.saturated  # the one it let go fills the room again
        await self.until(lambda: len(self.standin.arrivals) > before, "a request arrives")
        assert len(self.standin.arrivals) == before + 1
        return self.standin.arrivals[-1]

    async def finish(self) -> list[httpx.Response]:
        self.standin.waiting = 0
        for _ in range(100):  # bounded: every reading lets max_waiting more go
            if not self.gate.core.queued:
                break
            await self.gate.poll_once()
        return list(await asyncio.gather(*self.tasks))


@pytest.fixture
async def make_fleet() -> AsyncIterator[Any]:
    stack = contextlib.AsyncExitStack()
    fleets: list[Fleet] = []

    async def make(
        classes: dict[str, str],
        weights: dict[str, float] | None = None,
        objectives: dict[str, str] | None = None,
        **config: Any,
    ) -> Fleet:
        standin = await stack.enter_async_context(SaturatedStandIn())
        settings = SidecarConfig.from_flat(
            listen=("127.0.0.1", 0),
            admin_listen=("127.0.0.1", 0),
            upstream=standin.url,
            cache="test/cache",
            pod="pod-a",
            l1_bytes=8 * 1024 * 1024,
            trusted_proxies=("127.0.0.1/32",),
            admission=AdmissionConfig(
                max_waiting=MAX_WAITING, standard_queue=64, standard_max_wait_s=300.0
            ),
            admission_metrics_url=standin.url + "/metrics",
            **config,
        )
        server = SidecarServer(settings)
        await server.start()
        server.sidecar.quotas.apply(
            QuotaAssignment(
                generation=1,
                tenants={
                    t: TenantQuota(
                        l1_bytes=1 << 20,
                        l2_bytes=0,
                        priority_class=c,  # type: ignore[arg-type]
                        fairness_weight=(weights or {}).get(t),
                    )
                    for t, c in classes.items()
                },
                objectives=objectives or {},  # type: ignore[arg-type]
            )
        )
        fleet = Fleet(server, standin)
        # the test takes every reading itself: the gate's own poller stops
        task = fleet.gate._task
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            fleet.gate._task = None
        fleets.append(fleet)
        return fleet

    yield make
    for fleet in fleets:
        fleet.standin.waiting = 0
        for task in fleet.tasks:
            task.cancel()
        await asyncio.gather(*fleet.tasks, return_exceptions=True)
        await fleet.client.aclose()
        await fleet.server.stop(grace_s=2.0)
    await stack.aclose()


async def test_one_tenants_request_is_served_before_anothers_tenth(make_fleet: Any) -> None:
    """Issue 36's acceptance: Standard tenants A (50 queued) and B (1 queued), saturated."""
    fleet: Fleet = await make_fleet({"team-a": "Standard", "team-b": "Standard"})
    await fleet.saturate()
    for i in range(50):
        fleet.send("team-a", f"A question {i}")
    await fleet.until(lambda: fleet.gate.core.queued == 50, "A's fifty wait")
    fleet.send("team-b", "B question 0")
    await fleet.until(lambda: fleet.gate.core.queued == 51, "B's one waits behind them")
    assert fleet.standin.arrivals == []  # nothing reached the saturated server

    served: list[tuple[str, str, str]] = []
    for _ in range(10):
        served.append(await fleet.release_one())
    tenants = [tenant for tenant, _, _ in served]
    assert "team-b" in tenants
    assert tenants.index("team-b") < 9  # fewer than nine of A's before B: before A's tenth
    assert tenants.count("team-a") == 9
    # A's own requests keep their order
    a_questions = [q for t, _, q in served if t == "team-a"]
    assert a_questions == [f"A question {i}" for i in range(9)]

    answers = await fleet.finish()
    assert [a.status_code for a in answers] == [200] * 51
    assert len(fleet.standin.arrivals) == 51


async def test_fairness_weights_from_the_flag_share_the_releases(make_fleet: Any) -> None:
    """No operator weight: the sidecar's --admission-fairness-weights says A counts 3 to B's 1."""
    fleet: Fleet = await make_fleet(
        {"team-a": "Standard", "team-b": "Standard"}, admission_weights={"team-a": 3.0}
    )
    await fleet.saturate()
    for i in range(20):
        fleet.send("team-a", f"A question {i}")
    await fleet.until(lambda: fleet.gate.core.queued == 20, "A's twenty wait")
    for i in range(20):
        fleet.send("team-b", f"B question {i}")
    await fleet.until(lambda: fleet.gate.core.queued == 40, "B's twenty wait")
    served = [await fleet.release_one() for _ in range(16)]
    counts = {t: [s[0] for s in served].count(t) for t in ("team-a", "team-b")}
    assert counts == {"team-a": 12, "team-b": 4}
    await fleet.finish()


async def test_the_operators_weight_wins_over_the_flag(make_fleet: Any) -> None:
    fleet: Fleet = await make_fleet(
        {"team-a": "Standard", "team-b": "Standard"},
        weights={"team-a": 5.0},
        admission_weights={"team-a": 2.0, "team-b": 4.0},
    )
    tenants = fleet.server.sidecar.tenants
    assert tenants.admission_of("team-a", [])[1].weight == 5.0
    assert tenants.admission_of("team-b", [])[1].weight == 4.0  # the table says nothing
    assert tenants.admission_of("team-c", [])[1].weight == 1.0


async def test_a_fairness_id_is_the_flow_inside_its_tenant(make_fleet: Any) -> None:
    """GIE's x-gateway-inference-fairness-id: one user's burst inside a tenant does not hold
    another user of that tenant back; and a hundred ids do not outweigh another tenant."""
    fleet: Fleet = await make_fleet({"shared": "Standard", "other": "Standard"})
    await fleet.saturate()
    for i in range(20):
        fleet.send("shared", f"bulk {i}", **{FAIRNESS_ID_HEADER: "user-bulk"})
    await fleet.until(lambda: fleet.gate.core.queued == 20, "the bulk user's twenty wait")
    fleet.send("shared", "chat 0", **{FAIRNESS_ID_HEADER: "user-chat"})
    for i in range(20):  # another tenant's client sends twenty fairness ids
        fleet.send("other", f"spread {i}", **{FAIRNESS_ID_HEADER: f"id-{i}"})
    await fleet.until(lambda: fleet.gate.core.queued == 41, "everyone waits")
    served = [await fleet.release_one() for _ in range(10)]
    shared = [(fid, q) for t, fid, q in served if t == "shared"]
    assert ("user-chat", "chat 0") in shared[:2]
    assert [t for t, _, _ in served].count("other") == 5  # twenty ids: still one tenant's half
    await fleet.finish()


async def test_an_objective_lowers_a_class_and_never_raises_it(make_fleet: Any) -> None:
    """x-gateway-inference-objective: a Guaranteed tenant's batch objective is shed like
    BestEffort; a Standard tenant naming a Guaranteed objective still waits its turn."""
    fleet: Fleet = await make_fleet(
        {"gold": "Guaranteed", "silver": "Standard"},
        objectives={"batch": "BestEffort", "premium": "Guaranteed"},
    )
    await fleet.saturate()
    shed = await fleet.send("gold", "a nightly batch", **{OBJECTIVE_HEADER: "batch"})
    assert shed.status_code == 429
    assert shed.json()["error"]["reason"] == "saturated_queue"
    urgent = await fleet.send("gold", "urgent", **{OBJECTIVE_HEADER: "no-such-objective"})
    assert urgent.status_code == 200  # an unknown objective leaves the tenant's class
    fleet.send("silver", "let me in", **{OBJECTIVE_HEADER: "premium"})
    await fleet.until(lambda: fleet.gate.core.queued == 1, "the forged Guaranteed waits")
    assert [q for _, _, q in fleet.standin.arrivals] == ["urgent"]
    answers = await fleet.finish()
    assert answers[-1].status_code == 200


async def test_a_full_queue_gives_a_place_to_the_tenant_holding_none(make_fleet: Any) -> None:
    fleet: Fleet = await make_fleet({"team-a": "Standard", "team-b": "Standard"})
    fleet.gate.core.config = dataclasses.replace(fleet.gate.core.config, standard_queue=4)
    await fleet.saturate()
    burst = [fleet.send("team-a", f"A question {i}") for i in range(4)]
    await fleet.until(lambda: fleet.gate.core.queued == 4, "A fills the queue")
    refused = await fleet.send("team-a", "A question 4")
    assert refused.status_code == 429
    assert refused.json()["error"]["reason"] == "queue_full"
    fleet.send("team-b", "B question 0")
    evicted = await burst[3]  # A's newest gave its place up
    assert evicted.status_code == 429
    assert evicted.json()["error"]["reason"] == "queue_full"
    assert fleet.gate.core.queued == 4
    first = await fleet.release_one()
    second = await fleet.release_one()
    assert "team-b" in {first[0], second[0]}


async def test_the_flags_objectives_stay_under_the_operators(make_fleet: Any) -> None:
    fleet: Fleet = await make_fleet(
        {"gold": "Guaranteed"},
        objectives={"chat": "Standard"},
        admission_objectives={"batch": "BestEffort", "chat": "BestEffort"},
    )
    tenants = fleet.server.sidecar.tenants
    of = tenants.admission_of
    assert of("gold", [(OBJECTIVE_HEADER.encode(), b"batch")])[0] == "BestEffort"  # the flag's
    assert of("gold", [(OBJECTIVE_HEADER.encode(), b"chat")])[0] == "Standard"  # the table's
    assert of("gold", [])[0] == "Guaranteed"
    # two objectives: each may only lower
    two = [(OBJECTIVE_HEADER.encode(), b"chat"), (OBJECTIVE_HEADER.encode(), b"batch")]
    assert of("gold", two)[0] == "BestEffort"
    assert of("gold", [(OBJECTIVE_HEADER.encode(), b"chat, batch")])[0] == "BestEffort"
    # two different fairness ids: none (the tenant's own flow)
    fid = FAIRNESS_ID_HEADER.encode()
    assert of("gold", [(fid, b"u1"), (fid, b"u2")])[1].fairness_id == ""
    assert of("gold", [(fid, b"u1"), (fid, b"u1")])[1].fairness_id == "u1"
