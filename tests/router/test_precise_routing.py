"""The whole router, precise: three vLLM-like servers with /tokenize and KV events on ZMQ.

Each fake server answers ``/tokenize`` with the tiny model's real tokenizer and
``/kv_event_sources`` with a ZMQ publisher it binds (``tcp://*:PORT``, as vLLM
does); the router runs with its defaults (``--kv-events auto``, ``--tokenizer
auto``). A conversation's prefix stored on one server (its events say so)
attracts the conversation's next turn there; after that server's cache is
cleared (``AllBlocksCleared``, what ``/reset_prefix_cache`` publishes) the
attraction is gone.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from cachefleet_router.kvevents import encode_frame
from cachefleet_router.server import RouterConfig, RouterServer
from cachefleet_router.tokens import LocalBackend

from .conftest import Gateway, Mode, body_message, headers_message

TINY = Path(__file__).parents[1] / "data" / "vllm" / "tiny"
BLOCK = 16
DEADLINE_S = 10.0
HEADERS = {":method": "POST", ":path": "/v1/chat/completions"}
MESSAGES = [
    {"role": "system", "content": "You are a cache. " * 12},
    {"role": "user", "content": "hello world, tell me about the cache and the blocks it holds"},
]


class FakeVllm:
    """/tokenize, /kv_event_sources and /metrics on loopback, and a bound ZMQ publisher."""

    def __init__(self, ctx: zmq.asyncio.Context, tokenizer: LocalBackend) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.zmq_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.tokenizer = tokenizer
        self.seq = 0
        self.runner: web.AppRunner | None = None
        self.address = ""

    async def _tokenize(self, request: web.Request) -> web.Response:
        doc = await request.json()
        if "messages" in doc:
            tokens = self.tokenizer.encode(
                "chat", doc["messages"], doc.get("add_generation_prompt", True)
            )
        else:
            tokens = self.tokenizer.encode("prompt", doc["prompt"], False)
        return web.json_response({"tokens": tokens, "count": len(tokens or [])})

    async def _sources(self, _: web.Request) -> web.Response:
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv-events"}
        return web.json_response({"0": {**config, "endpoint": f"tcp://*:{self.zmq_port}"}})

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(
            text="vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n"
            f'vllm:cache_config_info{{block_size="{BLOCK}",num_gpu_blocks="1000"}} 1.0\n'
        )

    async def start(self) -> FakeVllm:
        app = web.Application()
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/kv_event_sources", self._sources)
        app.router.add_get("/metrics", self._metrics)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.address = f"127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def publish(self, *events: object, seq: int | None = None) -> None:
        await self.pub.send_multipart(
            encode_frame("kv-events", self.seq if seq is None else seq, list(events))
        )
        if seq is None:
            self.seq += 1

    async def stop(self) -> None:
        self.pub.close(linger=0)
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def fleet() -> AsyncIterator[list[FakeVllm]]:
    ctx = zmq.asyncio.Context()
    tokenizer = LocalBackend(TINY)
    servers = [await FakeVllm(ctx, tokenizer).start() for _ in range(3)]
    yield servers
    for server in servers:
        await server.stop()
    ctx.term()


async def until(check: Callable[[], bool], poke: Callable[[], Awaitable[None]]) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + DEADLINE_S
    while not check():
        assert loop.time() < end, "timed out"
        await poke()
        await asyncio.sleep(0.05)


async def routed(gateway: Gateway, messages: list[dict[str, str]]) -> str:
    body = json.dumps({"model": "tiny", "messages": messages, "max_tokens": 4}).encode()
    head, _passed = await gateway.exchange(
        [
            headers_message(HEADERS, mode=Mode.FULL_DUPLEX_STREAMED),
            body_message(body, end_of_stream=True),
        ],
        2,
    )
    sets = head.request_headers.response.header_mutation.set_headers
    return sets[0].header.raw_value.decode()


async def test_a_prefix_the_servers_events_place_attracts_its_conversation(
    fleet: list[FakeVllm],
) -> None:
    import grpc

    by_address = sorted(fleet, key=lambda s: s.address)
    lowest, holder = by_address[0], by_address[-1]  # ties go to the lowest address
    router = RouterServer(
        RouterConfig(
            grpc_listen=("127.0.0.1", 0),
            metrics_listen=None,
            endpoints=tuple(s.address for s in fleet),
            scrape_interval_s=0,
        )
    )
    await router.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.grpc_port}")
    try:
        index = router.kv_index
        assert index is not None

        async def fresh() -> None:  # each server's first message: sequence 0, an empty cache
            for server in fleet:
                await server.publish({"type": "AllBlocksCleared"}, seq=0)

        await until(lambda: all(index.known(s.address) for s in fleet), fresh)
        for server in fleet:
            server.seq = 1

        # the holder stores the conversation's prompt (sent there directly, not via the router)
        tokens = LocalBackend(TINY).encode("chat", MESSAGES, True)
        assert tokens is not None
        whole = len(tokens) // BLOCK
        assert whole >= 4
        stored = {
            "type": "BlockStored",
            "block_hashes": list(range(1, whole + 1)),
            "parent_block_hash": None,
            "token_ids": tokens[: whole * BLOCK],
            "block_size": BLOCK,
            "medium": "GPU",
        }
        await holder.publish(stored)

        async def wait() -> None:
            await asyncio.sleep(0)

        await until(lambda: index.blocks(holder.address) == whole, wait)

        gateway = Gateway(channel)
        assert await routed(gateway, MESSAGES) == holder.address
        follow_up = [*MESSAGES, {"role": "assistant", "content": "ok"}]
        follow_up.append({"role": "user", "content": "and then?"})
        assert await routed(gateway, follow_up) == holder.address

        # the holder's cache is reset: nobody holds the prefix, the tie goes by address
        await holder.publish({"type": "AllBlocksCleared"})
        await until(lambda: index.blocks(holder.address) == 0, wait)
        assert await routed(gateway, follow_up) == lowest.address
        assert router.tokenization is not None
        assert router.tokenization.hits >= 3  # every decision had the server's tokens
    finally:
        await channel.close()
        await router.stop(0)
