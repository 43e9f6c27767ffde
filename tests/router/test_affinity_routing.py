"""The whole router with the affinity parts: LoRA adapters from /metrics, sessions from a header.

Three vLLM-like /metrics servers on loopback (one runs the ``sql`` adapter, one
has a free adapter slot, one has every slot taken) and the router started
from its command line (``--session-header x-session-id``). A request naming
the adapter goes where it is loaded, and elsewhere once that server's queue is
over the bounded-load cap; a session stays where it went, until that server
is over the cap; then it stays where it moved.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest

from cachefleet_router.cli import parse_args
from cachefleet_router.server import RouterServer

from .conftest import Gateway, MetricsServer, Mode, body_message, headers_message

DEADLINE_S = 10.0
HEADERS = {":method": "POST", ":path": "/v1/chat/completions"}


def vllm_metrics(adapters: str, *, waiting: int = 0, max_lora: int = 2) -> str:
    """A vLLM /metrics answer with LoRA enabled, ``adapters`` running (comma-separated)."""
    return (
        f'vllm:num_requests_waiting{{model_name="base"}} {waiting}\n'
        'vllm:num_requests_running{model_name="base"} 0\n'
        'vllm:kv_cache_usage_perc{model_name="base"} 0.1\n'
        f'vllm:lora_requests_info{{max_lora="{max_lora}",running_lora_adapters="{adapters}",'
        'waiting_lora_adapters=""} 1.7e9\n'
    )


@pytest.fixture
async def router(
    metrics_servers: Callable[..., Awaitable[MetricsServer]],
) -> AsyncIterator[tuple[RouterServer, Gateway, list[MetricsServer]]]:
    servers = sorted([await metrics_servers() for _ in range(3)], key=lambda s: s.port)
    full, free, holder = servers  # ties go to the lowest address: the full one
    full.body = vllm_metrics("chat,math")
    free.body = vllm_metrics("chat")
    holder.body = vllm_metrics("sql")
    config, _level = parse_args(
        [
            "--endpoints",
            ",".join(s.address for s in servers),
            "--grpc-listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "off",
            "--scrape-interval",
            "0.1",
            "--kv-events",
            "off",
            "--tokenizer",
            "approx",
            "--session-header",
            "x-session-id",
        ]
    )
    server = RouterServer(config)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    try:
        await scraped(server, lambda: len(server.pool.ready()) == 3)
        yield server, Gateway(channel), servers
    finally:
        await channel.close()
        await server.stop(0)


async def scraped(server: RouterServer, check: Callable[[], bool]) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + DEADLINE_S
    while not check():
        assert loop.time() < end, "timed out waiting for the router's scrapes"
        await asyncio.sleep(0.05)


def waiting_on(server: RouterServer, address: str, n: float) -> Callable[[], bool]:
    def check() -> bool:
        endpoint = server.pool.get(address)
        return (
            endpoint is not None
            and endpoint.metrics is not None
            and (endpoint.metrics.waiting == n)
        )

    return check


async def routed(gateway: Gateway, model: str, text: str, session: str | None = None) -> str:
    headers = dict(HEADERS)
    if session is not None:
        headers["x-session-id"] = session
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": text}]})
    head, _passed = await gateway.exchange(
        [
            headers_message(headers, mode=Mode.FULL_DUPLEX_STREAMED),
            body_message(body.encode(), end_of_stream=True),
        ],
        2,
    )
    sets = head.request_headers.response.header_mutation.set_headers
    return sets[0].header.raw_value.decode()


async def test_an_adapter_goes_where_it_is_loaded_while_that_server_is_not_overloaded(
    router: tuple[RouterServer, Gateway, list[MetricsServer]],
) -> None:
    server, gateway, (full, free, holder) = router
    assert await routed(gateway, "sql", "select the rows") == holder.address
    assert await routed(gateway, "base", "hello there") == full.address  # no adapter: by address
    holder.body = vllm_metrics("sql", waiting=60)
    await scraped(server, waiting_on(server, holder.address, 60))
    # over the cap: the server with a free adapter slot, not the one with every slot taken
    assert await routed(gateway, "sql", "select more rows") == free.address


async def test_a_session_sticks_until_its_server_is_over_the_cap(
    router: tuple[RouterServer, Gateway, list[MetricsServer]],
) -> None:
    server, gateway, (full, _free, holder) = router
    # the session's first request goes where its adapter is; its next ones name the base
    # model, which alone would go to the lowest address
    assert await routed(gateway, "sql", "first", session="alice") == holder.address
    for turn in range(3):
        assert await routed(gateway, "base", f"turn {turn}", session="alice") == holder.address
    assert await routed(gateway, "base", "turn 0") == full.address  # no session
    holder.body = vllm_metrics("sql", waiting=60)
    await scraped(server, waiting_on(server, holder.address, 60))
    moved = await routed(gateway, "base", "turn 4", session="alice")
    assert moved != holder.address
    holder.body = vllm_metrics("sql")
    await scraped(server, waiting_on(server, holder.address, 0))
    assert await routed(gateway, "sql", "turn 5", session="alice") == moved
