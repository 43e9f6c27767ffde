"""Model servers whose /metrics is slow, failing, huge or not vLLM's, against the running router.

Each hostile server is a small aiohttp app on loopback. The tests assert
outcomes (which endpoints are ready, where requests go, how many bytes were
served), never timings: every wait is a bounded poll with a generous deadline.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from aiohttp import web

from cachefleet_common.modelserver import parse_metrics
from cachefleet_router.discovery import EndpointPool, MetricsScraper
from cachefleet_router.picking import LeastLoadedPicker
from cachefleet_router.server import RouterConfig, RouterServer

from .conftest import VLLM_METRICS, Gateway, body_message, headers_message

#: how long a poll may wait for the router to reach a state (generous: a loaded machine)
DEADLINE_S = 20.0
CHAT = {":method": "POST", ":path": "/v1/chat/completions"}


class Hostile:
    """A /metrics server whose behaviour the test sets: ``ok``, ``500``, ``trickle``, ``huge``."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.served = 0  # answer bytes handed to the transport
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        if self.mode == "ok":
            return web.Response(text=VLLM_METRICS.format(waiting=0, running=0))
        if self.mode == "500":
            return web.Response(status=500, text="internal error\n")
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        try:
            if self.mode == "trickle":  # a byte every 0.3 s, for at most a minute
                for _ in range(200):
                    await response.write(b"v")
                    self.served += 1
                    await asyncio.sleep(0.3)
            elif self.mode == "huge":  # 150 MiB of comment lines, written as fast as read
                line = b"# " + b"x" * (64 * 1024 - 3) + b"\n"
                for _ in range(2400):
                    await response.write(line)
                    self.served += len(line)
        except (ConnectionError, asyncio.CancelledError):
            pass  # the reader hung up
        return response

    async def start(self) -> Hostile:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.port = self.runner.addresses[0][1]
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def hostile() -> AsyncIterator[Callable[[str], Any]]:
    started: list[Hostile] = []

    async def make(mode: str) -> Hostile:
        server = await Hostile(mode).start()
        started.append(server)
        return server

    yield make
    for server in started:
        await server.stop()


async def until(condition: Callable[[], bool]) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while not condition():
        assert loop.time() < deadline, "the router did not get there in time"
        await asyncio.sleep(0.05)


async def picks(router: RouterServer, n: int) -> list[str]:
    """Where ``n`` concurrent headers-only requests go (all held open until all are answered,
    so that the load picker spreads them over every ready endpoint)."""
    out = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel:
        gateway = Gateway(channel)
        calls = [gateway.open() for _ in range(n)]
        for call in calls:
            await call.write(headers_message(CHAT, end_of_stream=True))
            answer = await call.read()
            assert answer.WhichOneof("response") == "request_headers", answer
            sets = answer.request_headers.response.header_mutation.set_headers
            out.append(sets[0].header.raw_value.decode())
        for call in calls:
            await call.done_writing()
    return out


def router_for(*addresses: str) -> RouterServer:
    return RouterServer(
        RouterConfig(
            grpc_listen=("127.0.0.1", 0),
            metrics_listen=None,
            endpoints=addresses,
            scrape_interval_s=0.2,
        ),
        picker=LeastLoadedPicker(),  # by requests in flight: spreads over all that are ready
    )


async def test_a_trickling_metrics_neither_freezes_the_start_nor_keeps_a_failing_one_in(
    hostile: Callable[[str], Any],
) -> None:
    slow, healthy, flaky = await hostile("trickle"), await hostile("ok"), await hostile("ok")
    router = router_for(slow.address, healthy.address, flaky.address)
    await router.start()
    try:
        # at start: the healthy endpoints are ready although one endpoint's reading stalls
        await until(lambda: {e.address for e in router.pool.ready()} >= {healthy.address})
        await until(lambda: {e.address for e in router.pool.ready()} >= {flaky.address})
        assert set(await picks(router, 6)) == {healthy.address, flaky.address}
        assert slow.served > 0  # it was read, and never became ready
        # once running: an endpoint whose /metrics answers 500 stops receiving picks
        flaky.mode = "500"
        await until(lambda: flaky.address not in {e.address for e in router.pool.ready()})
        assert set(await picks(router, 8)) == {healthy.address}
        assert slow.address not in {e.address for e in router.pool.ready()}
        scraper = router.scraper
        assert scraper is not None
        # the healthy endpoint kept being read while the slow one stalled
        before = router.pool.get(healthy.address)
        assert before is not None
        seen = before.scraped_at
        await until(lambda: before.scraped_at > seen)
    finally:
        await router.stop(0)


async def test_a_reading_is_bounded_in_total_time_and_counts_as_failed(
    hostile: Callable[[str], Any],
) -> None:
    slow = await hostile("trickle")
    pool = EndpointPool()
    pool.set_members({slow.address: slow.address})
    scraper = MetricsScraper(pool, 0.2, timeout_s=1.0)
    try:
        # the first reading failing keeps a new endpoint out; each round returns
        await asyncio.wait_for(scraper.scrape_once(), DEADLINE_S)
        await asyncio.wait_for(scraper.scrape_once(), DEADLINE_S)
        assert pool.ready() == []
        assert 0 < slow.served < 50  # it trickled, and the reading gave up
    finally:
        await scraper.aclose()


async def test_a_huge_metrics_answer_is_read_no_further_than_the_cap(
    hostile: Callable[[str], Any],
) -> None:
    huge, ok = await hostile("huge"), await hostile("ok")
    pool = EndpointPool()
    pool.set_members({huge.address: "huge", ok.address: "ok"})
    cap = 4 * 1024 * 1024
    scraper = MetricsScraper(pool, 0.2, timeout_s=10.0, max_bytes=cap)
    try:
        await asyncio.wait_for(scraper.scrape_once(), DEADLINE_S)
        assert [e.name for e in pool.ready()] == ["ok"]
        assert huge.address not in {e.address for e in pool.ready()}
        # what the router took in: the cap and at most one more network read
        ok_bytes = len(VLLM_METRICS.format(waiting=0, running=0))
        assert scraper.bytes_read - ok_bytes <= cap + 256 * 1024
        await asyncio.sleep(0.2)  # let the server notice the hang-up
        # what the server got out: the cap plus what loopback socket buffers hold (a few
        # MiB), far from the 150 MiB it would have sent to a reader without a cap
        assert huge.served < cap + 32 * 1024 * 1024
    finally:
        await scraper.aclose()


async def test_a_server_without_metrics_is_ready_and_takes_requests(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = web.Application()  # an OpenAI-compatible server without /metrics: 404
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    bare = f"127.0.0.1:{runner.addresses[0][1]}"
    router = router_for(bare)
    caplog.set_level(logging.INFO, logger="cachefleet_router.discovery")
    await router.start()
    try:
        await until(lambda: [e.address for e in router.pool.ready()] == [bare])
        assert set(await picks(router, 3)) == {bare}
        scraper = router.scraper
        assert scraper is not None
        rounds = scraper.rounds
        await until(lambda: scraper.rounds >= rounds + 3)
        said = [r.getMessage() for r in caplog.records if bare in r.getMessage()]
        assert len([m for m in said if "routed by load alone" in m]) == 1, said  # once
        assert "404" in next(m for m in said if "routed by load alone" in m)
    finally:
        await router.stop(0)
        await runner.cleanup()


def test_tensorrt_llm_names_of_the_gie_protocol_are_read() -> None:
    triton = parse_metrics(
        "# TYPE nv_trt_llm_request_metrics gauge\n"
        'nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="context",version="1"} 1\n'
        'nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="scheduled",version="1"} 5\n'
        'nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="waiting",version="1"} 7\n'
        'nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="max",version="1"} 512\n'
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="m"} 0.5\n'
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per",model="m"} 64\n'
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="m"} 1000\n'
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="m"} 500\n'
    )
    assert (triton.server, triton.waiting, triton.running) == ("triton", 7.0, 5.0)
    assert triton.kv_usage == 0.5
    assert triton.kv_capacity_tokens == 64_000
    serve = parse_metrics(
        'trtllm_num_requests_waiting{model_name="m",engine_type="trtllm"} 2\n'
        'trtllm_num_requests_running{model_name="m",engine_type="trtllm"} 3\n'
        'trtllm_kv_cache_utilization{model_name="m",engine_type="trtllm"} 0.25\n'
        "trtllm_kv_cache_tokens_per_block 32\n"
        "trtllm_kv_cache_max_blocks 100\n"
    )
    assert (serve.server, serve.waiting, serve.running, serve.kv_usage) == (
        "trtllm",
        2.0,
        3.0,
        0.25,
    )
    assert serve.kv_capacity_tokens == 3200
    hostile_capacity = parse_metrics(
        "trtllm_num_requests_waiting 1\n"
        "trtllm_kv_cache_tokens_per_block 1e300\n"
        "trtllm_kv_cache_max_blocks 1e300\n"
    )
    assert hostile_capacity.kv_capacity_tokens is None  # an infinite product is no capacity


async def test_a_server_without_metrics_takes_its_share_beside_vllm(
    hostile: Callable[[str], Any],
) -> None:
    vllm = await hostile("ok")
    app = web.Application()  # a plain OpenAI-compatible server: /metrics is a 404
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    bare = f"127.0.0.1:{runner.addresses[0][1]}"
    router = RouterServer(  # the default scoring picker
        RouterConfig(
            grpc_listen=("127.0.0.1", 0),
            metrics_listen=None,
            endpoints=(vllm.address, bare),
            scrape_interval_s=0.2,
        )
    )
    await router.start()
    try:
        await until(lambda: len(router.pool.ready()) == 2)
        chosen: list[str] = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel:
            gateway = Gateway(channel)
            calls = []
            for i in range(8):  # distinct prompts, all in flight at once
                call = gateway.open()
                calls.append(call)
                prompt = f"conversation {i}: " + "words " * 2000
                body = json.dumps({"model": "m", "prompt": prompt}).encode()
                await call.write(headers_message(CHAT))
                await call.write(body_message(body, end_of_stream=True))
                answer = await asyncio.wait_for(call.read(), DEADLINE_S)
                sets = answer.request_headers.response.header_mutation.set_headers
                chosen.append(sets[0].header.raw_value.decode())
            for call in calls:
                call.cancel()
        assert set(chosen) == {vllm.address, bare}, chosen
    finally:
        await router.stop(0)
        await runner.cleanup()
