"""The sidecar in front of real vLLM servers: what the simulator-backed tests claim, checked
against the model server users run.

The answers come from the tiny random model, so the tests assert on what vLLM reports
(``usage``, ``finish_reason``, its own request counters and queue gauges) and on bytes
(a hit replays the stored answer exactly), never on the generated text.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from cachefleet_common.contract.messages import QuotaAssignment, TenantQuota
from cachefleet_common.epochs import model_scope
from cachefleet_e2e.vllm_server import SERVED_MODEL, VllmServer
from cachefleet_operator.invalidation import Invalidator
from cachefleet_sidecar.adapt.admission import AdmissionConfig
from cachefleet_sidecar.http.gate import AdmissionGate
from tests.integration.conftest import RunningSidecar
from tests.integration.test_invalidation import until_acked
from tests.integration.test_sidecar import metric
from tests.vllm.conftest import (
    MAX_NUM_SEQS,
    METRICS_BOUND_S,
    VllmSidecarFactory,
    ask,
    chat_body,
    finished,
    until_finished,
    vllm_metric,
)

#: Tokens each test request asks for (``max_tokens`` of :func:`chat_body`).
MAX_TOKENS = 8
#: Bound on waiting for acknowledgements, seconds (generous: a loaded machine only waits).
ACK_TIMEOUT_S = 20.0


def usage(resp: httpx.Response) -> dict[str, int]:
    body = resp.json()
    assert body["choices"][0]["finish_reason"] == "length", body
    found: dict[str, int] = body["usage"]
    return found


async def test_repeated_request_is_an_l1_hit_with_the_same_body(
    vllm_sidecar_factory: VllmSidecarFactory, vllm: VllmServer
) -> None:
    sc = await vllm_sidecar_factory()
    before = await finished(vllm)
    first = await ask(sc, "what is a prefix cache")
    assert (first.status_code, first.headers["x-cache"]) == (200, "MISS"), first.text
    used = usage(first)
    assert used["completion_tokens"] == MAX_TOKENS
    assert used["prompt_tokens"] > 0
    assert first.json()["model"] == SERVED_MODEL
    await until_finished(vllm, before + 1)

    for _ in range(3):
        again = await ask(sc, "what is a prefix cache")
        assert (again.status_code, again.headers["x-cache"]) == (200, "HIT-L1")
        assert again.content == first.content  # the stored answer, byte for byte
    assert await finished(vllm) == before + 1  # vLLM saw the question once

    other = await ask(sc, "what is a prefix cache", tenant="globex")
    assert other.headers["x-cache"] == "MISS"  # tenants do not share entries
    # Counted after every earlier answer (vLLM's counters move in engine-step order): so
    # exactly two means the hits above never reached vLLM.
    await until_finished(vllm, before + 2)
    assert await finished(vllm) == before + 2


async def test_concurrent_identical_requests_reach_vllm_once(
    vllm_sidecar_factory: VllmSidecarFactory, vllm: VllmServer
) -> None:
    """Eight clients asking the same question at once: vLLM answers one of them; the others
    wait for that answer (or, arriving after it, hit it). Every client gets the same bytes."""
    sc = await vllm_sidecar_factory()
    before = await finished(vllm)
    answers = await asyncio.gather(*(ask(sc, "everyone asks this") for _ in range(8)))
    assert [a.status_code for a in answers] == [200] * 8
    assert {a.content for a in answers} == {answers[0].content}
    hits = [a.headers["x-cache"] for a in answers].count("HIT-L1")
    text = (await sc.admin.get("/metrics")).text
    assert metric(text, "cachefleet_single_flight_joins_total") == 7 - hits
    # A sentinel sent after every answer came back: once vLLM counts it, it has counted
    # every request answered before it (its counters move in engine-step order).
    async with httpx.AsyncClient(timeout=60) as http:
        sentinel = await http.post(f"{vllm.url}/v1/chat/completions", json=chat_body("sentinel"))
    assert sentinel.status_code == 200
    await until_finished(vllm, before + 2)
    assert await finished(vllm) == before + 2


async def test_stream_is_cached_and_replayed(
    vllm_sidecar_factory: VllmSidecarFactory, vllm: VllmServer
) -> None:
    sc = await vllm_sidecar_factory()
    before = await finished(vllm)
    streamed = {"stream": True, "stream_options": {"include_usage": True}}
    first = await ask(sc, "stream the answer", **streamed)
    assert (first.status_code, first.headers["x-cache"]) == (200, "MISS"), first.text
    assert first.headers["content-type"].startswith("text/event-stream")
    events = [e.removeprefix("data: ") for e in first.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS  # include_usage's last chunk
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert reasons[-1] == "length"
    await until_finished(vllm, before + 1)

    second = await ask(sc, "stream the answer", **streamed)
    assert (second.status_code, second.headers["x-cache"]) == (200, "HIT-L1")
    assert second.headers["content-type"].startswith("text/event-stream")
    assert second.content == first.content
    assert await finished(vllm) == before + 1

    # The non-streamed form of the same question is another entry, and another request.
    plain = await ask(sc, "stream the answer")
    assert plain.headers["x-cache"] == "MISS"
    await until_finished(vllm, before + 2)
    assert await finished(vllm) == before + 2  # the replay never reached vLLM


async def test_savings_are_the_real_answers_usage(
    vllm_sidecar_factory: VllmSidecarFactory, vllm: VllmServer
) -> None:
    prices = {"prompt": 0.5, "completion": 2.0}  # per 1k tokens
    sc = await vllm_sidecar_factory(
        price_table={SERVED_MODEL: (prices["prompt"], prices["completion"])}
    )
    first = await ask(sc, "how much does a hit save")
    assert first.headers["x-cache"] == "MISS"
    used = usage(first)
    hits = 3
    for _ in range(hits):
        assert (await ask(sc, "how much does a hit save")).headers["x-cache"] == "HIT-L1"

    text = (await sc.admin.get("/metrics")).text
    where = {"tenant": "acme", "model": SERVED_MODEL}
    saved_prompt = metric(text, "cachefleet_saved_tokens_total", **where, kind="prompt")
    saved_completion = metric(text, "cachefleet_saved_tokens_total", **where, kind="completion")
    assert saved_prompt == hits * used["prompt_tokens"]
    assert saved_completion == hits * used["completion_tokens"]
    cost = metric(text, "cachefleet_saved_cost_total", **where)
    expected = hits * (used["prompt_tokens"] * prices["prompt"] + MAX_TOKENS * prices["completion"])
    assert cost == pytest.approx(expected / 1000)
    # The model seconds a hit saves are the real fill's upstream time: more than nothing.
    seconds = metric(text, "cachefleet_saved_model_seconds_total", **where)
    assert seconds is not None
    assert seconds > 0


# ------------------------------------------------------------------ admission


CLASSES = {"gold": "Guaranteed", "silver": "Standard", "free": "BestEffort"}


@contextlib.asynccontextmanager
async def saturated(server: VllmServer, waiting: int) -> AsyncIterator[list[asyncio.Task[Any]]]:
    """Fill the server's batch and queue with long requests sent to it directly, until its
    own ``vllm:num_requests_waiting`` shows ``waiting``; then pause its engine (``/pause``
    with ``mode=keep``) so the reading holds still while the test looks. On exit the
    engine resumes and the fillers are cancelled (vLLM aborts a request whose client left).
    """
    http = httpx.AsyncClient(base_url=server.url, timeout=httpx.Timeout(300.0))
    fillers: list[asyncio.Task[Any]] = []
    paused = False
    try:
        long = {"prompt": "fill the batch", "max_tokens": 1000, "ignore_eos": True}
        for i in range(MAX_NUM_SEQS + waiting):
            body = {"model": SERVED_MODEL, **long, "prompt": f"filler {i}: {long['prompt']}"}
            fillers.append(asyncio.create_task(http.post("/v1/completions", json=body)))
        deadline = time.monotonic() + METRICS_BOUND_S
        while await vllm_metric(server, "vllm:num_requests_waiting") < waiting:
            assert time.monotonic() < deadline, "vLLM's queue never filled"
            assert not any(f.done() for f in fillers), "a filler ended before the queue filled"
            await asyncio.sleep(0.02)
        paused = (await http.post("/pause", params={"mode": "keep"})).status_code == 200
        assert paused
        yield fillers
    finally:
        if paused:
            await http.post("/resume")
        for task in fillers:
            task.cancel()
        await asyncio.gather(*fillers, return_exceptions=True)
        await http.aclose()


async def drained(server: VllmServer) -> None:
    """Wait (bounded) until the server runs and queues nothing."""
    deadline = time.monotonic() + METRICS_BOUND_S
    while (
        await vllm_metric(server, "vllm:num_requests_waiting")
        + await vllm_metric(server, "vllm:num_requests_running")
        > 0
    ):
        assert time.monotonic() < deadline, "vLLM never drained"
        await asyncio.sleep(0.05)


async def test_admission_reads_the_real_queue(
    vllm_sidecar_factory: VllmSidecarFactory, vllm: VllmServer
) -> None:
    """max_waiting 2: vLLM's own queue gauge saturates the gate; BestEffort is shed with
    429 while its cached answers still hit; /status shows the reading; once vLLM drains,
    the same tenant is admitted again."""
    sc = await vllm_sidecar_factory(admission=AdmissionConfig(max_waiting=2))
    sc.sidecar.quotas.apply(
        QuotaAssignment(
            generation=1,
            tenants={
                t: TenantQuota(l1_bytes=1 << 20, l2_bytes=0, priority_class=c)  # type: ignore[arg-type]
                for t, c in CLASSES.items()
            },
        )
    )
    gate = sc.sidecar.gate
    assert isinstance(gate, AdmissionGate)
    cached = await ask(sc, "asked before the rush", tenant="free")
    assert (cached.status_code, cached.headers["x-cache"]) == (200, "MISS")

    async with saturated(vllm, waiting=2):
        await gate.poll_once()
        status = (await sc.admin.get("/status")).json()["admission"]
        assert status["shedding"] is True
        assert status["cause"] == "queue"
        assert status["waiting"] >= 2
        assert status["running"] == MAX_NUM_SEQS
        assert 0 < status["kv_usage"] < 1  # the running requests' blocks, as vLLM reports
        assert status["metrics_faults"] == 0
        assert status["metrics_url"] == f"{vllm.url}/metrics"

        shed = await ask(sc, "a new question", tenant="free")
        assert shed.status_code == 429
        assert shed.json()["error"]["reason"] == "saturated_queue"
        assert int(shed.headers["retry-after"]) >= 1
        hit = await ask(sc, "asked before the rush", tenant="free")
        assert (hit.status_code, hit.headers["x-cache"]) == (200, "HIT-L1")
        assert hit.content == cached.content

    await drained(vllm)
    await gate.poll_once()
    status = (await sc.admin.get("/status")).json()["admission"]
    assert (status["shedding"], status["waiting"], status["running"]) == (False, 0, 0)
    after = await ask(sc, "a new question", tenant="free")
    assert (after.status_code, after.headers["x-cache"]) == (200, "MISS")
    assert usage(after)["completion_tokens"] == MAX_TOKENS


# ------------------------------------------------------------------ invalidation


async def test_model_version_change_stops_serving_the_old_entry(
    vllm_sidecar_factory: VllmSidecarFactory, vllm_pair: list[VllmServer], redis_url: str
) -> None:
    """Two pods, each in front of its own vLLM, sharing L2. The operator's answer to a new
    model version (one advance of the model's epoch, acknowledged by every sidecar) makes
    both stop serving the old answer: the next request goes to vLLM again."""
    server_a, server_b = vllm_pair
    pods: list[RunningSidecar] = []
    for name, server in (("pod-a", server_a), ("pod-b", server_b)):
        sc = await vllm_sidecar_factory(server=server, redis_url=redis_url, pod=name)
        sc.patient().steady()
        await until_acked(sc)
        pods.append(sc)
    a, b = pods
    a_before, b_before = await finished(server_a), await finished(server_b)

    old = await ask(a, "which version answers")
    assert old.headers["x-cache"] == "MISS"
    await a.stored()
    from_l2 = await ask(b, "which version answers")
    assert from_l2.headers["x-cache"] == "HIT-L2"
    assert from_l2.content == old.content
    assert (await ask(a, "which version answers")).headers["x-cache"] == "HIT-L1"
    await until_finished(server_a, a_before + 1)
    assert await finished(server_b) == b_before  # B answered from the fleet's cache

    inv = Invalidator.from_url(redis_url, "test/cache", poll_s=0.05)
    try:
        result = await inv.invalidate(model_scope(SERVED_MODEL), timeout_s=ACK_TIMEOUT_S)
    finally:
        await inv.aclose()
    assert result.completed
    assert (result.acks, result.expected) == (2, 2)

    new_a = await ask(a, "which version answers")
    assert new_a.headers["x-cache"] == "MISS"
    assert new_a.content != old.content  # a new answer (its id and timestamp are vLLM's)
    await until_finished(server_a, a_before + 2)
    new_b = await ask(b, "which version answers")
    assert new_b.content != old.content
    assert new_b.headers["x-cache"] in ("MISS", "HIT-L2")
    if new_b.headers["x-cache"] == "MISS":
        await until_finished(server_b, b_before + 1)
    else:
        assert new_b.content == new_a.content


async def test_a_request_vllm_refuses_is_passed_through_and_not_cached(
    vllm_sidecar_factory: VllmSidecarFactory, vllm: VllmServer
) -> None:
    """vLLM's own 400 (more tokens asked than its context holds) reaches the client as
    vLLM wrote it, every time: an error is never stored."""
    sc = await vllm_sidecar_factory()
    too_long = {"max_tokens": 100_000}
    async with httpx.AsyncClient(timeout=60) as http:
        direct = await http.post(
            f"{vllm.url}/v1/chat/completions", json=chat_body("too long", **too_long)
        )
    assert direct.status_code == 400, direct.text
    for _ in range(2):
        refused = await ask(sc, "too long", **too_long)
        assert refused.status_code == 400
        assert refused.headers["x-cache"] != "HIT-L1"
        assert refused.json()["error"]["message"] == direct.json()["error"]["message"]
