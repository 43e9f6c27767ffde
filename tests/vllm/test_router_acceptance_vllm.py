"""Issue 35's routing acceptance over the tier's three real vLLM servers.

The router runs in process with its defaults and ``--endpoints`` only: it finds each
server's KV events through ``GET /kv_event_sources`` (the servers bind ``tcp://*:PORT``),
tokenizes through their ``POST /tokenize`` and reads the block size from
``vllm:cache_config_info``. It is asked as a gateway asks (ext_proc over gRPC, the body
in full-duplex mode). The router starts after the servers, which have served other tests
of the tier: its first KV-event message has a later sequence (it joins late, as a
restarted router does).

* A conversation's first turn sent to one server directly (not through the router)
  attracts its next turn there, for at least 11 of 12 conversations.
* After that server's ``POST /reset_prefix_cache`` the attraction is gone: the router
  knows it holds none of its conversations, and once they are warmed on another server
  their next turns go there.
* A plain OpenAI-compatible server without model-server metrics in the same pool gets
  traffic (routed by load alone).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from cachefleet_e2e import routing_demo
from cachefleet_e2e.fake_upstream import FakeUpstream
from cachefleet_e2e.gateway import Gateway
from cachefleet_e2e.vllm_server import SERVED_MODEL, VllmServer
from cachefleet_router.endpoints import RouteRequest
from cachefleet_router.server import RouterConfig, RouterServer
from tests.vllm.conftest import healthy

CONVERSATIONS = 12
#: the acceptance bound: conversations whose next turn goes where their prefix was warmed
ATTRACTED_AT_LEAST = 11
#: bound on waiting for the router to hear a server's KV events, seconds
EVENTS_BOUND_S = 30.0
WORDS = ["cache", "block", "route", "prefix", "token", "server", "queue", "event"]


def conversation(salt: str, i: int) -> list[dict[str, str]]:
    """Conversation ``i``'s first turn: a ~10-block system prompt of its own (``salt``
    keeps it apart from what earlier runs left in the servers' caches)."""
    system = " ".join(WORDS[(i * 7 + k) % 8] + str(i) for k in range(120))
    return [
        {"role": "system", "content": f"{salt} {system}"},
        {"role": "user", "content": f"question {i}: tell me about the cache"},
    ]


def next_turn(messages: list[dict[str, str]], answer: str = "ok") -> list[dict[str, str]]:
    return [
        *messages,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "and then?"},
    ]


async def routed(stub: Any, messages: list[dict[str, str]]) -> str:
    """The endpoint the router names for a chat request (full-duplex body, as GIE sends)."""
    body = json.dumps({"model": SERVED_MODEL, "messages": messages, "max_tokens": 4}).encode()
    call = stub.Process()
    headers = pb.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[
                base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
                base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
            ]
        )
    )
    first = pb.ProcessingRequest(request_headers=headers)
    first.protocol_config.request_body_mode = (
        processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    )
    await call.write(first)
    await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
    head = await call.read()
    await call.read()
    await call.done_writing()
    mutation = head.request_headers.response.header_mutation
    return str(mutation.set_headers[0].header.raw_value.decode())


async def until(what: str, check: Any, bound_s: float = EVENTS_BOUND_S) -> None:
    deadline = time.monotonic() + bound_s
    while not check():
        assert time.monotonic() < deadline, f"not within {bound_s} s: {what}"
        await asyncio.sleep(0.05)


@dataclass
class Routed:
    router: RouterServer
    stub: Any
    addresses: list[str]


@pytest.fixture
async def routed_pool(vllm_pool: list[VllmServer]) -> AsyncIterator[Routed]:
    """A fresh router (defaults, ``--endpoints`` only) over the pool, subscribed to every
    server's KV events."""
    servers = [await healthy(server) for server in vllm_pool]
    addresses = [f"127.0.0.1:{server.port}" for server in servers]
    router = RouterServer(
        RouterConfig(grpc_listen=("127.0.0.1", 0), metrics_listen=None, endpoints=tuple(addresses))
    )
    await router.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.grpc_port}")
    try:
        kv = router.kv_events
        assert kv is not None, "KV events are on by default"
        await until("subscribed to every server's KV events", lambda: len(kv.subscribed()) == 3)
        yield Routed(router, pb_grpc.ExternalProcessorStub(channel), addresses)
    finally:
        await channel.close()
        await router.stop(0)


async def warm_directly(
    http: httpx.AsyncClient, routed_: Routed, address: str, messages: Any
) -> str:
    """Send a conversation's first turn to ``address`` itself; wait until the router has
    heard the blocks it stored. Returns the answer's text."""
    index = routed_.router.kv_index
    assert index is not None
    before = index.blocks(address)
    answer = await http.post(
        f"http://{address}/v1/chat/completions",
        json={"model": SERVED_MODEL, "messages": messages, "max_tokens": 4, "temperature": 0},
    )
    assert answer.status_code == 200, answer.text
    await until(f"{address}'s KV events reach the router", lambda: index.blocks(address) > before)
    # and a scrape after the answer: one taken while it ran still shows it running, which
    # the router cannot tell from another client's queued work (not what this test is about)
    answered = time.monotonic()
    (endpoint,) = [e for e in routed_.router.pool.endpoints() if e.address == address]
    await until(f"{address} scraped after the answer", lambda: endpoint.scraped_at > answered)
    return answer.json()["choices"][0]["message"]["content"] or "ok"


async def test_a_prefix_warmed_on_a_server_attracts_the_next_turn_until_its_reset(
    routed_pool: Routed,
) -> None:
    r = routed_pool
    salt = uuid.uuid4().hex[:8]
    attracted: list[bool] = []
    async with httpx.AsyncClient(timeout=60) as http:
        for i in range(CONVERSATIONS):
            warm = r.addresses[i % 3]
            first = conversation(salt, i)
            answer = await warm_directly(http, r, warm, first)
            attracted.append(await routed(r.stub, next_turn(first, answer)) == warm)
        tok = r.router.tokenization
        assert tok is not None
        assert sum(attracted) >= ATTRACTED_AT_LEAST, (
            attracted,
            f"tokenize: {tok.hits} hits, {tok.misses} misses, {tok.failures} failures",
        )
        assert r.router.kv_index is not None
        assert all(r.router.kv_index.known(a) for a in r.addresses)

        # reset one server: the router must forget what it held
        k = 2
        reset = r.addresses[k]
        index = r.router.kv_index
        assert index.blocks(reset) > 0
        assert (await http.post(f"http://{reset}/reset_prefix_cache")).status_code == 200
        # AllBlocksCleared goes out with the engine's next step
        nudge = await http.post(
            f"http://{reset}/v1/completions",
            json={"model": SERVED_MODEL, "prompt": "x", "max_tokens": 1},
        )
        assert nudge.status_code == 200, nudge.text
        await until(f"{reset}'s clear reaches the router", lambda: index.blocks(reset) == 0)
        theirs = [i for i in range(CONVERSATIONS) if i % 3 == k]
        tokenizer = r.router.tokenization
        assert tokenizer is not None
        other = r.addresses[(k + 1) % 3]
        for i in theirs:
            follow = next_turn(conversation(salt, i))
            body = json.dumps({"model": SERVED_MODEL, "messages": follow, "max_tokens": 4})
            await tokenizer.warm(body.encode(), r.router.pool.ready())
            ids = tokenizer.apply(RouteRequest(blocks=(), tokens=0), body.encode()).token_ids
            assert ids, "the router tokenized the turn"
            assert index.matched(reset, ids) == (0, 0)  # the router knows it holds none of it
            # warmed on another server too: the turn now follows it there, not to the reset one
            await warm_directly(http, r, other, conversation(salt, i))
            assert await routed(r.stub, follow) == other
        # ... while the third server's conversations are still attracted to it
        third = (k + 2) % 3
        kept = [
            await routed(r.stub, next_turn(conversation(salt, i)))
            for i in range(third, CONVERSATIONS, 3)
        ]
        assert kept.count(r.addresses[third]) >= len(kept) - 1, kept


async def _drive(url: str, bodies: Sequence[dict[str, Any]]) -> list[int]:
    async with httpx.AsyncClient(timeout=120) as http:
        answers = await asyncio.gather(
            *(http.post(f"{url}/v1/chat/completions", json=body) for body in bodies)
        )
    return [a.status_code for a in answers]


async def test_a_server_without_metrics_in_the_pool_gets_traffic(
    vllm_pool: list[VllmServer],
) -> None:
    """Three real vLLM servers and a plain OpenAI-compatible server whose ``/metrics`` is
    no model server's (the stand-in answers any GET with a JSON echo): it is ready and
    routed by load, so a burst of distinct prompts reaches it too."""
    servers = [await healthy(server) for server in vllm_pool]
    with FakeUpstream() as plain:
        addresses = [f"127.0.0.1:{s.port}" for s in servers] + [f"127.0.0.1:{plain.port}"]
        router = RouterServer(
            RouterConfig(
                grpc_listen=("127.0.0.1", 0), metrics_listen=None, endpoints=tuple(addresses)
            )
        )
        await router.start()
        gw = Gateway(picker=f"127.0.0.1:{router.grpc_port}", endpoints=addresses)
        runner, url = await routing_demo._serve_gateway(gw)
        try:
            await until("all four endpoints ready", lambda: len(router.pool.ready()) == 4)
            salt = uuid.uuid4().hex[:8]
            bodies = [
                {
                    "model": SERVED_MODEL,
                    "messages": conversation(salt, i),
                    "max_tokens": 8,
                    "ignore_eos": True,
                    "temperature": 0,
                }
                for i in range(16)
            ]
            statuses = await _drive(url, bodies)
        finally:
            await runner.cleanup()
            await gw.close()
            await router.stop(0)
        assert statuses == [200] * len(bodies)
        assert sum(gw.routed.values()) == len(bodies)
        assert plain.calls["/v1/chat/completions"] >= 1, gw.routed
        assert gw.routed.get(addresses[3], 0) == plain.calls["/v1/chat/completions"]
