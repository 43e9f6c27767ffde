"""The router's KV-event subscriber against real ZMQ PUB sockets on loopback.

The publishers send vLLM-format frames (topic, 8-byte big-endian sequence,
msgpack ``[ts, events]``). ZMQ drops what a PUB sends before a subscriber's
connection is up, so each test first repeats a probe frame until the index
has seen it (bounded by a generous deadline), as a fresh server's first
``AllBlocksCleared`` would arrive.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from cachefleet_router.endpoints import Endpoint, RouteRequest
from cachefleet_router.kvevents import encode_frame
from cachefleet_router.kvindex import KvIndex
from cachefleet_router.kvsub import KvEventSubscriber
from cachefleet_router.scoring import ScoringConfig, ScoringPicker

DEADLINE_S = 10.0
BS = 4
PROMPT = list(range(100, 112))
CLEAR = {"type": "AllBlocksCleared"}


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
    }


async def until(
    check: Callable[[], bool], poke: Callable[[], Awaitable[None]] | None = None
) -> None:
    """Wait (bounded) until ``check()``; ``poke`` runs between looks."""
    loop = asyncio.get_running_loop()
    end = loop.time() + DEADLINE_S
    while not check():
        assert loop.time() < end, "timed out"
        if poke is not None:
            await poke()
        await asyncio.sleep(0.02)


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.term()


async def serve(
    routes: dict[str, Callable[[web.Request], Awaitable[web.Response]]],
) -> tuple[web.AppRunner, str]:
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_get(path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"127.0.0.1:{runner.addresses[0][1]}"


async def test_a_bound_publisher_is_found_subscribed_and_applied(zctx: zmq.asyncio.Context) -> None:
    pub = zctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")

    async def sources(_: web.Request) -> web.Response:
        # vLLM 0.32's answer: the KV events config per data-parallel rank; "*": it binds
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv-events"}
        return web.json_response({"0": {**config, "endpoint": f"tcp://*:{port}"}})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text='vllm:cache_config_info{block_size="4",num_gpu_blocks="1"} 1.0\n')

    runner, address = await serve({"/kv_event_sources": sources, "/metrics": metrics})
    index = KvIndex(resync_blocks=1000)
    sub = KvEventSubscriber(index, lambda: [Endpoint(address)], context=zctx)
    try:
        await sub.refresh()
        assert sub.subscribed() == {address: f"tcp://127.0.0.1:{port}"}

        async def probe() -> None:
            await pub.send_multipart(encode_frame("kv-events", 0, [CLEAR]))

        await until(lambda: index.known(address), probe)
        assert index.gaps(address) == 0  # a fresh subscription to a fresh server: no gap
        await pub.send_multipart(encode_frame("kv-events", 1, [stored([11, 12], None, PROMPT[:8])]))
        # an older server's positional encoding, chained onto block 12
        await pub.send_multipart(
            encode_frame("kv-events", 2, [["BlockStored", [13], 12, PROMPT[8:], BS, None, "GPU"]])
        )
        await until(lambda: index.blocks(address) >= 2)
        # num_gpu_blocks 1: at most 1 + 1 (the slack); with block 13 the oldest (11) went
        await until(lambda: index.matched(address, PROMPT) == (0, 0))
        assert index.blocks(address) == 2

        await pub.send_multipart(encode_frame("kv-events", 3, [CLEAR]))
        await pub.send_multipart(encode_frame("kv-events", 4, [stored([21, 22], None, PROMPT[:8])]))
        await until(lambda: index.matched(address, PROMPT) == (2, 8))

        # the precise index decides: the endpoint holding the prompt gets it, no estimate
        other = Endpoint("127.0.0.1:1")
        picker = ScoringPicker(
            ScoringConfig(block_tokens=BS, home_block=-1, default_rate=1.0), precise=index
        )
        request = RouteRequest(tokens=len(PROMPT), token_ids=tuple(PROMPT))
        decision = picker.pick(request, [other, Endpoint(address)])
        assert decision is not None
        assert decision.address == address
        assert decision.matched_blocks == 2

        # messages 5..6 lost: the state is not known, the approximate index serves it
        await pub.send_multipart(encode_frame("kv-events", 7, [stored([31], None, [1, 1, 1, 1])]))
        await until(lambda: not index.known(address))
        assert index.matched(address, PROMPT) is None
        # a frame that does not decode: still not known, counted
        await pub.send_multipart([b"kv-events", b"\x00"])
        await until(lambda: sub.bad_frames == 1)
        await pub.send_multipart(encode_frame("kv-events", 8, [CLEAR]))
        await until(lambda: index.known(address))

        # the endpoint leaves the pool: unsubscribed and forgotten
        sub.members = list
        await sub.refresh()
        assert sub.subscribed() == {}
        assert index.endpoints() == []
    finally:
        await sub.aclose()
        pub.close(linger=0)
        await runner.cleanup()


async def test_an_endpoint_without_event_sources_is_left_to_the_estimate(
    zctx: zmq.asyncio.Context,
) -> None:
    asked: list[str] = []

    async def none(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.json_response({}, status=404)  # an older vLLM, another server

    runner, address = await serve({"/kv_event_sources": none})
    index = KvIndex()
    members = [Endpoint(address)]
    sub = KvEventSubscriber(index, lambda: members, context=zctx)
    try:
        await sub.refresh()
        assert sub.subscribed() == {}
        assert index.matched(address, PROMPT) is None
        await sub.refresh()
        assert asked == ["/kv_event_sources"]  # not asked again at once
        members = []
        await sub.refresh()
        members = [Endpoint(address)]  # a new pod on the same address: asked at once
        await sub.refresh()
        assert asked == ["/kv_event_sources"] * 2
    finally:
        await sub.aclose()
        await runner.cleanup()


async def test_central_listen_tells_pods_apart_by_topic(zctx: zmq.asyncio.Context) -> None:
    """Servers that connect to one address (llm-d's deployment): topics name the pods."""
    members = [Endpoint("127.0.0.1:8000"), Endpoint("127.0.0.2:8000")]
    index = KvIndex()
    sub = KvEventSubscriber(
        index, lambda: members, discover=False, listen="tcp://127.0.0.1:*", context=zctx
    )
    pod1, pod2 = zctx.socket(zmq.PUB), zctx.socket(zmq.PUB)
    try:
        sub.bind()
        assert sub.bound is not None
        pod1.connect(sub.bound)
        pod2.connect(sub.bound)

        async def probe() -> None:
            await pod1.send_multipart(encode_frame("kv@127.0.0.1:8000@tiny", 0, [CLEAR]))
            # a topic naming the pod by its IP alone still finds the member
            await pod2.send_multipart(encode_frame("kv@127.0.0.2@tiny", 0, [CLEAR]))

        await until(lambda: index.known("127.0.0.1:8000") and index.known("127.0.0.2:8000"), probe)
        await pod1.send_multipart(
            encode_frame("kv@127.0.0.1:8000@tiny", 1, [stored([11, 12, 13], None, PROMPT)])
        )
        await pod2.send_multipart(
            encode_frame("kv@127.0.0.2@tiny", 1, [stored([11], None, PROMPT[:4])])
        )
        await until(lambda: index.matched("127.0.0.1:8000", PROMPT) == (3, 12))
        await until(lambda: index.matched("127.0.0.2:8000", PROMPT) == (1, 4))
        assert sub.frames >= 4
    finally:
        pod1.close(linger=0)
        pod2.close(linger=0)
        await sub.aclose()
