"""Helpers of the `vllm` tier for what a real vLLM server publishes and tokenizes: a KV-event
subscriber that is known to receive, unique prompts, ``/tokenize`` and a short completion.

vLLM 0.32 publishes each engine step's KV events as one ZMQ multipart message (topic,
8-byte big-endian sequence number, msgpack ``[ts, events, dp_rank]``), every event a map
with a ``"type"``; tests/data/vllm/README.md has captured examples.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgpack
import zmq
import zmq.asyncio

from cachefleet_e2e.vllm_server import DEFAULT_BLOCK_SIZE, KV_EVENTS_TOPIC, SERVED_MODEL, VllmServer

#: Bound on waiting for KV events, seconds (generous: a loaded machine only waits longer).
EVENTS_BOUND_S = 60.0
_unique = itertools.count()


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
