"""What a real vLLM server says that cachefleet reads: its metrics, its tokenizer and its KV
events. These are the facts the router's precise routing rests on (docs/testing.md), checked
against the server rather than against the simulator or the captured files.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from cachefleet_common.modelserver import parse_metrics
from cachefleet_e2e.vllm_server import DEFAULT_BLOCK_SIZE, KV_EVENTS_TOPIC, SERVED_MODEL, VllmServer
from tests.vllm.conftest import finished, healthy, until_finished, vllm_metric
from tests.vllm.kvevents import EVENTS_BOUND_S, complete, subscribed, tokenize, words


@pytest.fixture
async def server(vllm_pool: list[VllmServer]) -> VllmServer:
    """The pool's third server: these tests clear its prefix cache."""
    return await healthy(vllm_pool[2])


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
