"""The ext_proc service under floods and odd gateways: memory budget, stream cap, fail-open
where it still works, a repeated final body chunk, and GIE's conformance hooks."""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from cachefleet_router.endpoints import Endpoint
from cachefleet_router.extproc import EndpointPickerService
from cachefleet_router.metrics import RouterMetrics
from cachefleet_router.picking import LeastLoadedPicker

from .conftest import GatewayFactory, Mode, body_message, headers_message

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
CHAT = {":method": "POST", ":path": "/v1/chat/completions"}
MiB = 1024 * 1024
DEADLINE_S = 20.0


def make(endpoints: tuple[str, ...] = (A, B), **kw: object) -> EndpointPickerService:
    pool = [Endpoint(a) for a in endpoints]
    return EndpointPickerService(LeastLoadedPicker(), lambda: pool, **kw)  # type: ignore[arg-type]


async def until(condition: Callable[[], bool]) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while not condition():
        assert loop.time() < deadline, "the service did not get there in time"
        await asyncio.sleep(0.02)


def refusals(metrics: RouterMetrics, reason: str) -> float:
    value = metrics.registry.get_sample_value(
        "cachefleet_router_refusals_total", {"reason": reason}
    )
    return value or 0.0


async def read_forwarded_body(call: object) -> tuple[bool, bytes]:
    """Answers until the request body's end: (headers answered, the body handed back)."""
    headers, body = False, b""
    async for piece in forwarded_pieces(call):
        if piece is None:
            headers = True
        else:
            body += piece
    return headers, body


async def forwarded_pieces(call: object) -> AsyncIterator[bytes | None]:
    """The answers up to the request body's end: None for the headers, else a body piece."""
    while True:
        answer = await call.read()  # type: ignore[attr-defined]
        kind = answer.WhichOneof("response")
        if kind == "request_headers":
            yield None
            continue
        assert kind == "request_body", answer
        piece = answer.request_body.response.body_mutation.streamed_response
        yield piece.body
        if piece.end_of_stream:
            return


async def summary(call: object) -> tuple[bool, int, set[int]]:
    """(headers answered, body length handed back, the byte values in it), holding nothing."""
    headers, length, values = False, 0, set()
    async for piece in forwarded_pieces(call):
        if piece is None:
            headers = True
        elif piece:
            length += len(piece)
            values |= {piece[0], piece[-1]}
    return headers, length, values


async def test_bodies_held_across_streams_stay_within_the_budget(
    gateway_factory: GatewayFactory,
) -> None:
    metrics = RouterMetrics()
    budget = 4 * MiB
    svc = make(metrics=metrics, max_body_memory=budget)  # per-stream limit: 16 MiB
    gw = await gateway_factory(svc)
    streams, chunks = 16, 4  # 64 MiB sent without end_of_stream: 16x the budget
    calls = [gw.open() for _ in range(streams)]
    tracemalloc.start()
    try:
        for call in calls:
            await call.write(headers_message(CHAT))
        for _ in range(chunks):
            for i, call in enumerate(calls):
                piece = bytes([65 + i]) * MiB  # distinct per stream: nothing gets mixed up
                await call.write(body_message(piece, end_of_stream=False))
                del piece
        await until(lambda: svc.body_bytes_read == streams * chunks * MiB)
        # every chunk has been read, none of the bodies has ended: what the router holds
        # now is what it would hold for ever from clients that never finish their bodies
        snapshot = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(True, "*/cachefleet_router/*")]
        )
        held_by_router = sum(stat.size for stat in snapshot.statistics("filename"))
    finally:
        tracemalloc.stop()
    assert svc.budget.peak <= budget
    assert svc.budget.held <= budget
    assert held_by_router <= budget + MiB, held_by_router  # not the 64 MiB sent
    assert refusals(metrics, "body-memory") > 0
    for call in calls:
        await call.write(body_message(b"", end_of_stream=True))
    for i, call in enumerate(calls):
        headers, length, values = await asyncio.wait_for(summary(call), DEADLINE_S)
        assert headers
        assert (length, values) == (chunks * MiB, {65 + i})  # routed early or not: all of it
        await call.done_writing()
    assert svc.budget.peak <= budget
    assert svc.budget.held == 0
    assert metrics.registry.get_sample_value("cachefleet_router_body_bytes_held") == 0.0


async def test_streams_beyond_the_cap_are_refused_cleanly_and_counted(
    gateway_factory: GatewayFactory,
) -> None:
    metrics = RouterMetrics()
    svc = make(metrics=metrics, max_streams=3)
    gw = await gateway_factory(svc)
    held = [gw.open() for _ in range(3)]
    for call in held:
        await call.write(headers_message(CHAT))  # full duplex: waits for its body
    await until(lambda: svc.streams == 3)
    extra = gw.open()
    await extra.write(headers_message(CHAT))
    answer = await asyncio.wait_for(extra.read(), DEADLINE_S)
    assert answer.immediate_response.status.code == 503
    assert await extra.read() == grpc.aio.EOF
    assert (await extra.code()) == grpc.StatusCode.OK
    assert refusals(metrics, "streams") == 1.0
    assert svc.streams == 3  # the refused one never counted
    # one ends: a new stream is served again
    await held[0].done_writing()
    held[0].cancel()
    await until(lambda: svc.streams == 2)
    [answer] = await gw.exchange([headers_message(CHAT, end_of_stream=True)], 1)
    assert answer.WhichOneof("response") == "request_headers"
    for call in held[1:]:
        call.cancel()
    await until(lambda: svc.streams == 0)
    assert metrics.registry.get_sample_value("cachefleet_router_streams") == 0.0


async def test_fail_open_refuses_past_the_cap_by_ending_the_stream(
    gateway_factory: GatewayFactory,
) -> None:
    svc = make(max_streams=1, fail_open=True)
    gw = await gateway_factory(svc)
    first = gw.open()
    await first.write(headers_message(CHAT))
    await until(lambda: svc.streams == 1)
    extra = gw.open()
    await extra.write(headers_message(CHAT))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await asyncio.wait_for(extra.read(), DEADLINE_S)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # the gateway picks itself
    first.cancel()


@pytest.mark.parametrize("mode", [None, Mode.BUFFERED])
async def test_fail_open_after_the_body_has_come_is_a_503(
    gateway_factory: GatewayFactory, mode: int | None
) -> None:
    svc = make(endpoints=(), fail_open=True)
    gw = await gateway_factory(svc)
    call = gw.open()
    await call.write(headers_message(CHAT, mode=mode))
    if mode == Mode.BUFFERED:
        answer = await call.read()
        assert answer.WhichOneof("response") == "request_headers"
    await call.write(body_message(b'{"model": "m", "prompt": "hi"}', end_of_stream=True))
    answer = await asyncio.wait_for(call.read(), DEADLINE_S)
    # the gateway no longer holds the body: failing open would give the client a 500
    assert answer.immediate_response.status.code == 503
    assert (await call.code()) == grpc.StatusCode.OK


async def test_a_repeated_final_body_chunk_is_dropped(gateway_factory: GatewayFactory) -> None:
    svc = make()
    gw = await gateway_factory(svc)
    body = b'{"model": "m", "prompt": "hello"}'
    for split in (False, True):  # decided at end_of_stream, or routed early (oversized)
        if split:
            svc.max_body_bytes = 4
        call = gw.open()
        await call.write(headers_message(CHAT))
        await call.write(body_message(body, end_of_stream=True))
        headers, forwarded = await asyncio.wait_for(read_forwarded_body(call), DEADLINE_S)
        assert headers
        assert forwarded == body
        await call.write(body_message(body, end_of_stream=True))  # Envoy's repeat
        await call.write(headers_message(status=200, response=True))
        answer = await asyncio.wait_for(call.read(), DEADLINE_S)
        assert answer.WhichOneof("response") == "response_headers"  # nothing echoed first
        await call.done_writing()


async def test_conformance_mode_follows_the_selection_header_and_reports_the_served(
    gateway_factory: GatewayFactory,
) -> None:
    svc = make(endpoints=(A, B, C), conformance=True)
    gw = await gateway_factory(svc)
    for value, expected in (
        ("10.0.0.2", B),
        ("10.0.0.3:8000", C),
        (" 10.0.0.9 , 10.0.0.3 ", C),
        ("", A),  # an empty header selects nothing: ignored
    ):
        headers = {**CHAT, "test-epp-endpoint-selection": value}
        [answer] = await gw.exchange([headers_message(headers, end_of_stream=True)], 1)
        sets = answer.request_headers.response.header_mutation.set_headers
        assert sets[0].header.raw_value.decode() == expected, value
    for value in ("256.256.256.256", "10.0.0.1:9999"):
        headers = {**CHAT, "test-epp-endpoint-selection": value}
        [answer] = await gw.exchange([headers_message(headers, end_of_stream=True)], 1)
        assert answer.immediate_response.status.code == 429, value  # as GIE's picker
    for served, expected_header in (
        (B, B),
        (None, "fail: missing envoy lb metadata"),
    ):
        answers = await gw.exchange(
            [
                headers_message(CHAT, end_of_stream=True),
                headers_message(status=200, served=served, response=True),
            ],
            2,
        )
        mutation = answers[1].response_headers.response.header_mutation
        got = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
        assert got == {"x-conformance-test-served-endpoint": expected_header}


async def test_without_conformance_mode_the_test_header_steers_nothing(
    gateway_factory: GatewayFactory,
) -> None:
    svc = make(endpoints=(A, B, C))
    gw = await gateway_factory(svc)
    headers = {**CHAT, "test-epp-endpoint-selection": "10.0.0.3"}
    answers = await gw.exchange(
        [
            headers_message(headers, end_of_stream=True),
            headers_message(status=200, served=A, response=True),
        ],
        2,
    )
    sets = answers[0].request_headers.response.header_mutation.set_headers
    assert sets[0].header.raw_value.decode() == A  # the client cannot pick its endpoint
    assert answers[1].response_headers == pb.HeadersResponse()
