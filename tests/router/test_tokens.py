"""Real token ids before the pick: the endpoints' /tokenize, a local tokenizer, the cache."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from cachefleet_router.endpoints import Endpoint, RouteRequest
from cachefleet_router.tokens import (
    LocalBackend,
    RemoteBackend,
    Tokenization,
    TokenizerError,
    make_tokenization,
)

DATA = Path(__file__).parents[1] / "data" / "vllm"
CHAT = json.loads((DATA / "tokenize_messages.json").read_text())
PROMPT = json.loads((DATA / "tokenize_prompt.json").read_text())


def test_the_local_tokenizer_makes_the_tokens_vllm_made() -> None:
    """The tiny model's tokenizer.json and chat template give what vLLM's /tokenize gave."""
    local = LocalBackend(DATA / "tiny")
    messages = CHAT["request"]["messages"]
    # vLLM's /tokenize adds the generation prompt unless told not to, as a chat request does
    assert local.encode("chat", messages, True) == CHAT["response"]["tokens"]
    assert (
        local.encode("prompt", PROMPT["request"]["prompt"], False) == PROMPT["response"]["tokens"]
    )
    without = local.encode("chat", messages, False)
    assert without is not None
    assert CHAT["response"]["tokens"][: len(without)] == without
    assert len(without) < len(CHAT["response"]["tokens"])


def test_bad_tokenizer_values_are_refused(tmp_path: Path) -> None:
    assert make_tokenization("approx") is None
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json"):
        make_tokenization(f"local:{tmp_path}")
    with pytest.raises(TokenizerError, match="auto, approx or local:PATH"):
        make_tokenization("remote")


def body(**doc: Any) -> bytes:
    return orjson.dumps({"model": "tiny", **doc})


async def test_remote_tokenize_asks_the_endpoint_and_caches_by_prompt() -> None:
    asked: list[tuple[str, dict[str, Any]]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        doc = json.loads(request.content)
        asked.append((request.url.host, doc))
        if request.url.host == "10.0.0.2":
            return httpx.Response(404)
        tokens = CHAT["response"]["tokens"] if "messages" in doc else [7, 8, 9]
        return httpx.Response(200, json={"tokens": tokens, "count": len(tokens)})

    client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    tok = Tokenization(RemoteBackend(client, timeout_s=5.0), timeout_s=5.0)
    ready = [Endpoint("10.0.0.1:8000"), Endpoint("10.0.0.2:8000")]
    chat = body(messages=CHAT["request"]["messages"], max_tokens=3)
    await tok.warm(chat, ready)
    assert asked[0][1] == {
        "model": "tiny",
        "messages": CHAT["request"]["messages"],
        "add_generation_prompt": True,
    }
    routed = tok.apply(RouteRequest(tokens=5), chat)
    assert list(routed.token_ids) == CHAT["response"]["tokens"]
    assert routed.tokens == len(CHAT["response"]["tokens"])
    # the same prompt with other sampling settings: cached, nobody asked
    again = body(messages=CHAT["request"]["messages"], max_tokens=99, stream=True)
    await tok.warm(again, ready)
    assert len(asked) == 1
    assert list(tok.apply(RouteRequest(), again).token_ids) == CHAT["response"]["tokens"]
    # a completions prompt: the next endpoint, which has no /tokenize: the estimate stays
    plain = body(prompt="hello")
    await tok.warm(plain, ready)
    assert asked[-1] == ("10.0.0.2", {"model": "tiny", "prompt": "hello"})
    assert tok.apply(RouteRequest(tokens=2), plain) == RouteRequest(tokens=2)
    # ... and the failed endpoint is left alone for a while
    await tok.warm(plain, ready)
    assert asked[-1][0] == "10.0.0.1"
    assert list(tok.apply(RouteRequest(), plain).token_ids) == [7, 8, 9]
    await client.aclose()


async def test_a_slow_tokenize_falls_back_to_the_estimate() -> None:
    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(5.0)
        return httpx.Response(200, json={"tokens": [1]})

    client = httpx.AsyncClient(transport=httpx.MockTransport(slow))
    tok = Tokenization(RemoteBackend(client, timeout_s=0.05), timeout_s=0.05)
    plain = body(prompt="hello")
    await asyncio.wait_for(tok.warm(plain, [Endpoint("10.0.0.1:8000")]), 3.0)
    assert tok.apply(RouteRequest(tokens=2), plain).token_ids == ()
    assert tok.failures == 1
    await client.aclose()


async def test_the_cache_is_bounded_in_tokens() -> None:
    local = LocalBackend(DATA / "tiny")
    texts = ("hello world " * 4, "tell me about the cache " * 4)
    sizes = [len(local.encode("prompt", t, False) or ()) for t in texts]
    tok = Tokenization(local, cache_tokens=max(sizes) + min(sizes) - 1)  # one fits, not both
    first, second = body(prompt=texts[0]), body(prompt=texts[1])
    await tok.warm(first, [])
    assert tok.apply(RouteRequest(), first).token_ids
    await tok.warm(second, [])
    assert tok.apply(RouteRequest(), second).token_ids
    assert tok.apply(RouteRequest(), first).token_ids == ()  # evicted: the bound in tokens


async def test_bodies_without_a_prompt_are_left_alone() -> None:
    tok = Tokenization(LocalBackend(DATA / "tiny"))
    for raw in (b"", b"not json", b"[1]", body(input="x")):
        await tok.warm(raw, [])
        assert tok.apply(RouteRequest(tokens=3), raw) == RouteRequest(tokens=3)


async def test_a_tokenizer_that_breaks_leaves_the_estimate() -> None:
    class Broken:
        async def tokenize(self, *args: Any) -> list[int]:
            raise RuntimeError("template exploded")

    tok = Tokenization(Broken())
    plain = body(prompt="hello")
    await tok.warm(plain, [])
    assert tok.apply(RouteRequest(tokens=2), plain) == RouteRequest(tokens=2)
    assert tok.failures == 1
