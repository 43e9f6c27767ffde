"""What a real vLLM server says that cachefleet reads: its metrics, its tokenizer and its KV
events. These are the facts the router's precise routing rests on (docs/testing.md), checked
against the server rather than against the simulator or the captured files.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgpack
import pytest
import zmq
import zmq.asyncio

from cachefleet_e2e.vllm_server import DEFAULT_BLOCK_SIZE, KV_EVENTS_TOPIC, SERVED_MODEL, VllmServer
from cachefleet_sidecar.adapt.modelserver import parse_metrics
from tests.vllm.conftest import finished, healthy, until_finished, vllm_metric

#: Bound on waiting for KV events, seconds (generous: a loaded machine only waits longer).
EVENTS_BOUND_S = 60.0
_unique = itertools.count()


@pytest.fixture
async def server(vllm_pool: list[VllmServer]) -> VllmServer:
    """The pool's third server: these tests clear its prefix cache."""
    return await healthy(vllm_pool[2])


def words(n: int) -> str:
    """A prompt of ``n`` words, unique to this call (so its blocks are new to the server)."""
    tag = f"run{next(_unique)}x{time.monotonic_ns()}"
    return " ".join([tag, *(f"word{i % 17}" for i in range(n))])


class Events:
    """A subscriber to one server's KV events, decoded (vLLM 0.32 sends maps with "type")."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.seqs: list[int] = []

    async def next(self, deadline: float) -> list[dict[str, Any]]:
        timeout_ms = max(1, int((deadline - time.monotonic()) * 1000))
        if not await self.sock.poll(timeout_ms):
            raise AssertionError("no KV event frame before the deadline")
        topic, seq, payload = await self.sock.recv_multipart()
        assert topic == KV_EVENTS_TOPIC.encode()
        self.seqs.append(int.from_bytes(seq, "big"))
        _ts, events, _rank = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        return list(events)

    async def until(self, wanted: Any, what: str) -> list[dict[str, Any]]:
        """Events (all frames read) up to the first frame holding an event ``wanted`` accepts."""
        deadline = time.monotonic() + EVENTS_BOUND_S
        seen: list[dict[str, Any]] = []
        while True:
            assert time.monotonic() < deadline, f"never saw {what}"
            events = await self.next(deadline)
            seen += events
            if any(wanted(e) for e in events):
                return seen

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


async def complete(http: httpx.AsyncClient, prompt: str) -> dict[str, Any]:
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    resp = await http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer


async def tokenize(http: httpx.AsyncClient, **request: Any) -> list[int]:
    resp = await http.post("/tokenize", json={"model": SERVED_MODEL, **request})
    assert resp.status_code == 200, resp.text
    tokens: list[int] = resp.json()["tokens"]
    assert resp.json()["count"] == len(tokens)
    return tokens


@contextlib.asynccontextmanager
async def subscribed(server: VllmServer) -> AsyncIterator[tuple[Events, httpx.AsyncClient]]:
    """A subscriber known to receive: ZMQ drops what a publisher sends before the
    subscription reaches it, so warm-up prompts go out until one's event comes back."""
    events = Events(server.kv_events_endpoint)
    http = httpx.AsyncClient(base_url=server.url, timeout=60)
    try:
        deadline = time.monotonic() + EVENTS_BOUND_S
        while True:
            assert time.monotonic() < deadline, "the subscription never received an event"
            await complete(http, words(2 * DEFAULT_BLOCK_SIZE))
            with contextlib.suppress(AssertionError):
                await events.next(min(deadline, time.monotonic() + 1.0))
                break
        # Drain what the warm-ups still publish.
        with contextlib.suppress(AssertionError):
            while True:
                await events.next(time.monotonic() + 0.5)
        yield events, http
    finally:
        events.close()
        await http.aclose()


async def test_kv_event_sources_names_the_configured_publisher(server: VllmServer) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        sources = (await http.get("/kv_event_sources")).json()
    (source,) = sources.values()
    assert source["publisher"] == "zmq"
    assert source["topic"] == KV_EVENTS_TOPIC
    assert source["endpoint"] == f"tcp://*:{server.kv_events_port}"  # "*": vLLM binds


async def test_stored_blocks_carry_the_tokenizers_ids_chained_by_parent(server: VllmServer) -> None:
    async with subscribed(server) as (events, http):
        prompt = words(3 * DEFAULT_BLOCK_SIZE)
        tokens = await tokenize(http, prompt=prompt)
        full = len(tokens) // DEFAULT_BLOCK_SIZE
        assert full >= 3
        await complete(http, prompt)
        head = tokens[:DEFAULT_BLOCK_SIZE]

        def ours(event: dict[str, Any]) -> bool:
            return event["type"] == "BlockStored" and event["token_ids"][: len(head)] == head

        seen = await events.until(ours, "the prompt's BlockStored")
    stored = [e for e in seen if ours(e)]
    assert len(stored) == 1
    (event,) = stored
    assert event["block_size"] == DEFAULT_BLOCK_SIZE
    assert event["parent_block_hash"] is None  # the prompt starts a chain
    assert len(event["block_hashes"]) == full
    assert event["token_ids"] == tokens[: full * DEFAULT_BLOCK_SIZE]
    assert events.seqs == sorted(events.seqs)
    assert events.seqs == list(range(events.seqs[0], events.seqs[0] + len(events.seqs)))


async def test_reset_prefix_cache_clears_and_the_next_request_misses(server: VllmServer) -> None:
    async with subscribed(server) as (events, http):
        prompt = words(3 * DEFAULT_BLOCK_SIZE)
        await complete(http, prompt)
        hits = await vllm_metric(server, "vllm:prefix_cache_hits_total")
        await complete(http, prompt)
        deadline = time.monotonic() + EVENTS_BOUND_S
        while (now := await vllm_metric(server, "vllm:prefix_cache_hits_total")) <= hits:
            assert time.monotonic() < deadline, "the repeat was no prefix hit"
            await asyncio.sleep(0.05)
        assert now - hits >= 2 * DEFAULT_BLOCK_SIZE  # the prompt's full blocks, in tokens

        assert (await http.post("/reset_prefix_cache")).status_code == 200
        hits = now
        done = await finished(server)
        await complete(http, prompt)  # the clear goes out with the engine's next step
        await events.until(lambda e: e["type"] == "AllBlocksCleared", "AllBlocksCleared")
        await until_finished(server, done + 1)  # the repeat is in the counters now
        assert await vllm_metric(server, "vllm:prefix_cache_hits_total") == hits


async def test_tokenize_applies_the_chat_template(server: VllmServer) -> None:
    """With ``messages`` /tokenize applies the chat template and, by default, the
    generation prompt: the ids a chat completion's prompt has."""
    messages = [{"role": "user", "content": "hello world"}]
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        chat = await tokenize(http, messages=messages)
        bare = await tokenize(http, messages=messages, add_generation_prompt=False)
        prompt = await tokenize(http, prompt="hello world")
        answer = await http.post(
            "/v1/chat/completions",
            json={"model": SERVED_MODEL, "messages": messages, "max_tokens": 1},
        )
    bos, eos = 1, 2
    assert chat[0] == bos
    assert eos in chat
    assert prompt[0] != bos  # a plain prompt gets no template
    assert chat[: len(bare)] == bare
    assert len(chat) > len(bare)  # "<|assistant|>\n" appended
    assert answer.json()["usage"]["prompt_tokens"] == len(chat)


async def test_metrics_parse_as_vllm_with_the_kv_capacity(server: VllmServer) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        text = (await http.get(f"{server.url}/metrics")).text
    reading = parse_metrics(text)
    assert reading.server == "vllm"
    assert reading.prefix_queries_total is not None
    assert reading.prefix_hits_total is not None
    assert reading.kv_capacity_tokens is not None
    assert reading.kv_capacity_tokens % DEFAULT_BLOCK_SIZE == 0
    assert reading.kv_capacity_tokens >= 1024 + DEFAULT_BLOCK_SIZE  # max-model-len + a block
