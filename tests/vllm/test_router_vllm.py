"""``cachefleet router`` (defaults, ``--endpoints`` only) over the tier's three real vLLM
servers, behind the stand-in gateway: what a multi-turn conversation experiences."""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from cachefleet_e2e import routing_demo
from cachefleet_e2e.gateway import Gateway
from cachefleet_e2e.routing_demo import _text
from cachefleet_e2e.vllm_server import SERVED_MODEL, VllmServer
from tests.vllm.conftest import healthy

TURNS = 12


@pytest.fixture
async def gateway(
    vllm_pool: list[VllmServer], tmp_path: Path
) -> AsyncIterator[tuple[str, Gateway]]:
    """The stand-in gateway asking a fresh ``cachefleet router`` over the pool; its URL."""
    servers = [await healthy(server) for server in vllm_pool]
    addresses = [f"127.0.0.1:{server.port}" for server in servers]
    with routing_demo.router(addresses, tmp_path) as picker:
        gw = Gateway(picker=picker, endpoints=addresses)
        runner, url = await routing_demo._serve_gateway(gw)
        try:
            yield url, gw
        finally:
            await runner.cleanup()
            await gw.close()


async def test_a_conversations_turns_stay_on_the_server_holding_its_prefix(
    gateway: tuple[str, Gateway],
) -> None:
    """One conversation, turn after turn (each prompt the whole history, as chat clients
    send it), on an otherwise idle pool: every turn but perhaps the first should go where
    the previous turns' KV blocks are."""
    url, gw = gateway
    messages = [{"role": "system", "content": _text("a long shared system prompt", 1500)}]
    picked: collections.Counter[str] = collections.Counter()
    async with httpx.AsyncClient(timeout=60) as http:
        for turn in range(TURNS):
            messages.append({"role": "user", "content": _text(f"turn {turn}", 100)})
            body = {
                "model": SERVED_MODEL,
                "messages": messages,
                "temperature": 0,
                "max_tokens": 8,
                "ignore_eos": True,
            }
            before = dict(gw.routed)
            resp = await http.post(f"{url}/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            (address,) = [a for a, n in gw.routed.items() if n != before.get(a, 0)]
            picked[address] += 1
            messages.append({"role": "assistant", "content": "ok"})
    assert sum(picked.values()) == TURNS
    assert max(picked.values()) >= TURNS - 1, dict(picked)
