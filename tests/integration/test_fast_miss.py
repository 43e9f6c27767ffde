"""A miss sent upstream from the fast path (issue 10): no task for a plain miss on
a warm upstream connection; the slow path only finishes what it cannot (a
stream, an error), and the single-flight, storage and shutdown rules hold as
for any miss. Against the stand-in upstream, L1 only; outcomes, not timing."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from cachefleet_e2e.fake_upstream import FakeUpstream

from .conftest import RunningSidecar, SidecarFactory
from .test_server_resume import until
from .test_sidecar import answer, metric

CHAT = "/v1/chat/completions"


def spy_on_handle(sc: RunningSidecar, monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Record every request that reaches the slow path (a task)."""
    slow: list[bytes] = []
    handle = sc.sidecar.handler.handle

    async def recorded(request: Any, conn: Any) -> None:
        slow.append(request.url)
        await handle(request, conn)

    monkeypatch.setattr(sc.sidecar.handler, "handle", recorded)
    return slow


async def warm(sc: RunningSidecar) -> None:
    """Open the upstream connection the next misses go out on (the first miss opens it).

    Idle connections are kept past their usual age, so that a slow machine
    cannot send the next miss down the slow path by letting it go stale.
    """
    sc.sidecar.upstream.max_idle_age_s = 3600.0
    assert (await sc.chat("warm-up")).status_code == 200


async def test_a_miss_on_a_warm_connection_is_answered_without_a_task(
    sidecar: RunningSidecar, upstream: FakeUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    await warm(sidecar)
    slow = spy_on_handle(sidecar, monkeypatch)
    first = await sidecar.chat("fresh")
    assert first.status_code == 200
    assert first.headers["x-cache"] == "MISS"
    assert first.headers["content-type"] == "application/json"
    again = await sidecar.chat("fresh")  # stored right after the answer went out
    assert again.headers["x-cache"] == "HIT-L1"
    assert answer(again) == answer(first)
    assert slow == []
    assert upstream.calls[CHAT] == 2
    assert sidecar.sidecar.handler.slow.inflight == {}
    # The upstream saw the tenant the sidecar decided, as on the slow path.
    assert upstream.seen_headers[-1]["x-tenant-id"] == "acme"
    metrics = (await sidecar.admin.get("/metrics")).text
    misses = metric(
        metrics, "cachefleet_requests_total", tenant="acme", tier="upstream", result="miss"
    )
    assert misses == 2


async def test_concurrent_l1_hits_are_answered_without_a_task_and_all_counted(
    sidecar: RunningSidecar, upstream: FakeUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = await sidecar.chat("hot")
    assert first.headers["x-cache"] == "MISS"
    slow = spy_on_handle(sidecar, monkeypatch)
    hits = await asyncio.gather(*(sidecar.chat("hot") for _ in range(16)))
    assert [r.headers["x-cache"] for r in hits] == ["HIT-L1"] * 16
    assert {answer(r) for r in hits} == {answer(first)}
    assert slow == []  # every hit answered on the fast path, with no task
    assert upstream.calls[CHAT] == 1
    metrics = (await sidecar.admin.get("/metrics")).text  # the bookkeeping ran for each
    hits_counted = metric(
        metrics, "cachefleet_requests_total", tenant="acme", tier="l1", result="hit"
    )
    assert hits_counted == 16


async def test_a_streamed_answer_to_a_begun_miss_is_relayed_by_the_slow_path(
    sidecar: RunningSidecar, upstream: FakeUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    await warm(sidecar)
    slow = spy_on_handle(sidecar, monkeypatch)
    first = await sidecar.chat("stream me", body={"stream": True})
    assert first.headers["x-cache"] == "MISS"
    assert first.text.endswith("data: [DONE]\n\n")
    assert slow == [CHAT.encode()]  # sent from the fast path, relayed by the slow one
    again = await sidecar.chat("stream me", body={"stream": True})
    assert again.headers["x-cache"] == "HIT-L1"
    assert again.text == first.text
    assert upstream.calls[CHAT] == 2


async def test_an_upstream_that_drops_a_begun_miss_gets_a_502_and_frees_the_key(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    await warm(sidecar)
    upstream.drop_next = 1
    dropped = await sidecar.chat("dropped")
    assert dropped.status_code == 502
    assert "upstream" in dropped.json()["error"]["message"]
    assert sidecar.sidecar.handler.slow.inflight == {}
    retried = await sidecar.chat("dropped")  # not stuck behind a flight that never ends
    assert retried.status_code == 200
    assert retried.headers["x-cache"] == "MISS"


async def test_joiners_of_a_begun_miss_share_its_answer(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    await warm(sidecar)
    upstream.default_latency_s = 1.0  # all four arrive while the first is out
    results = await asyncio.gather(*(sidecar.chat("popular") for _ in range(4)))
    assert upstream.calls[CHAT] == 2
    assert all(r.status_code == 200 for r in results)
    assert {answer(r) for r in results} == {answer(results[0])}
    metrics = (await sidecar.admin.get("/metrics")).text
    assert metric(metrics, "cachefleet_single_flight_joins_total") == 3
    assert sidecar.sidecar.handler.slow.inflight == {}


async def test_a_client_gone_during_a_begun_miss_still_gets_it_stored(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    await warm(sidecar)
    upstream.default_latency_s = 0.2
    body = json.dumps(
        {"model": "m1", "messages": [{"role": "user", "content": "left"}], "temperature": 0}
    ).encode()
    port = int(sidecar.url.rsplit(":", 1)[1])
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST %s HTTP/1.1\r\nHost: x\r\nX-Tenant-ID: acme\r\ncontent-type: application/json"
        b"\r\nContent-Length: %d\r\n\r\n%s" % (CHAT.encode(), len(body), body)
    )
    await until(lambda: upstream.calls[CHAT] == 2)  # the call is out
    writer.close()
    await until(lambda: not sidecar.sidecar.handler.slow.inflight)  # answered into the void, stored
    upstream.default_latency_s = 0.0
    again = await sidecar.chat("left")
    assert again.headers["x-cache"] == "HIT-L1"
    assert upstream.calls[CHAT] == 2


async def test_graceful_shutdown_finishes_a_begun_miss(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    sc = await sidecar_factory()
    await warm(sc)
    upstream.default_latency_s = 0.4
    pending = asyncio.create_task(sc.chat("slow"))
    await until(lambda: upstream.calls[CHAT] == 2)
    await sc.server.stop(grace_s=5.0)
    resp = await pending
    assert resp.status_code == 200
    assert resp.headers["x-cache"] == "MISS"


async def test_a_silent_upstream_times_out_a_begun_miss_with_504(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    sc = await sidecar_factory(upstream_timeout_s=0.3)
    pool = sc.sidecar.upstream
    pool.read_timeout_s = 20.0  # the healthy calls: a loaded machine must not time them out
    await warm(sc)
    pool.read_timeout_s = 0.3
    upstream.default_latency_s = 1.5
    resp = await sc.chat("slow")
    assert resp.status_code == 504
    assert "silent" in resp.json()["error"]["message"]
    assert sc.sidecar.handler.slow.inflight == {}
    pool.read_timeout_s = 20.0
    upstream.default_latency_s = 0
    assert (await sc.chat("slow")).status_code == 200
