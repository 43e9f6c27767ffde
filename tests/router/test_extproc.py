"""The endpoint-picker protocol, with a real gRPC client playing the gateway.

Names checked against the Gateway API Inference Extension's protocol (proposal
004): the ``x-gateway-destination-endpoint`` header and ``envoy.lb`` metadata
on the request path, ``envoy.lb.subset_hint`` /
``x-gateway-destination-endpoint-subset`` from the gateway,
``x-gateway-destination-endpoint-served`` in the response phase, and an
ImmediateResponse 503 when no endpoint is ready.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import json_format

from cachefleet_router.endpoints import Decision, Endpoint, RouteRequest
from cachefleet_router.extproc import EndpointPickerService
from cachefleet_router.metrics import RouterMetrics
from cachefleet_router.picking import LeastLoadedPicker
from cachefleet_router.prompt import BLOCK_CHARS

from .conftest import GatewayFactory, Mode, body_message, headers_message

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
CHAT_HEADERS = {":method": "POST", ":path": "/v1/chat/completions", "x-tenant-id": "acme"}


class RecordingPicker(LeastLoadedPicker):
    """The load picker, keeping what it was asked and told (the service's view of the seam)."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[RouteRequest] = []
        self.done_calls: list[tuple[str, bool]] = []

    def pick(self, request: RouteRequest, endpoints: Sequence[Endpoint]) -> Decision | None:
        self.requests.append(request)
        decision = super().pick(request, endpoints)
        return None if decision is None else replace(decision, reason="recorded")

    def done(self, decision: Decision, request: RouteRequest, *, ok: bool) -> None:
        self.done_calls.append((decision.address, ok))
        super().done(decision, request, ok=ok)


def chat_body(text: str) -> bytes:
    return json.dumps({"model": "m1", "messages": [{"role": "user", "content": text}]}).encode()


def service(
    endpoints: Sequence[str] = (A, B),
    **kw: object,
) -> tuple[EndpointPickerService, RecordingPicker, RecordingPicker]:
    picker, fallback = RecordingPicker(), RecordingPicker()
    pool = [Endpoint(address) for address in endpoints]
    svc = EndpointPickerService(picker, lambda: pool, fallback=fallback, **kw)  # type: ignore[arg-type]
    return svc, picker, fallback


def destination(answer: pb.CommonResponse) -> str:
    """The picked endpoint in a header mutation; checks it overwrites and clears the route."""
    sets = answer.header_mutation.set_headers
    assert [h.header.key for h in sets] == ["x-gateway-destination-endpoint"]
    assert sets[0].append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    assert answer.clear_route_cache
    return sets[0].header.raw_value.decode()


def metadata_endpoint(answer: pb.ProcessingResponse) -> str:
    meta = json_format.MessageToDict(answer.dynamic_metadata)
    assert list(meta) == ["envoy.lb"]
    value = meta["envoy.lb"]["x-gateway-destination-endpoint"]
    assert isinstance(value, str)
    return value


async def test_headers_only_request_is_answered_on_the_headers(
    gateway_factory: GatewayFactory,
) -> None:
    svc, picker, _ = service()
    gw = await gateway_factory(svc)
    [answer] = await gw.exchange(
        [headers_message({":method": "GET", ":path": "/v1/models"}, end_of_stream=True)], 1
    )
    assert answer.WhichOneof("response") == "request_headers"
    address = destination(answer.request_headers.response)
    assert address == A  # both idle: the lowest address
    assert metadata_endpoint(answer) == address  # the same value in both places
    assert picker.requests[0].blocks == ()
    assert picker.requests[0].extra == {"body": "empty"}


async def test_body_in_one_chunk_full_duplex(gateway_factory: GatewayFactory) -> None:
    svc, picker, fallback = service()
    gw = await gateway_factory(svc)
    body = chat_body("z" * (BLOCK_CHARS * 2))
    answers = await gw.exchange(
        [headers_message(CHAT_HEADERS), body_message(body, end_of_stream=True)], 2
    )
    head, passed = answers
    assert head.WhichOneof("response") == "request_headers"  # deferred until the body ended
    address = destination(head.request_headers.response)
    assert metadata_endpoint(head) == address
    streamed = passed.request_body.response.body_mutation.streamed_response
    assert streamed.body == body
    assert streamed.end_of_stream
    [seen] = picker.requests
    assert len(seen.blocks) == 2
    assert seen.model == "m1"
    assert seen.tenant == "acme"
    assert fallback.requests == []


async def test_body_in_several_chunks_is_gathered_until_end_of_stream(
    gateway_factory: GatewayFactory,
) -> None:
    svc, picker, _ = service()
    gw = await gateway_factory(svc)
    body = chat_body("w" * (BLOCK_CHARS * 3))
    cut = [body[:100], body[100:5000], body[5000:]]
    answers = await gw.exchange(
        [
            headers_message(CHAT_HEADERS, mode=Mode.FULL_DUPLEX_STREAMED),
            body_message(cut[0], end_of_stream=False),
            body_message(cut[1], end_of_stream=False),
            body_message(cut[2], end_of_stream=True),
        ],
        4,
    )
    # The first answer is the headers' (nothing was answered per chunk), after the last chunk:
    assert answers[0].WhichOneof("response") == "request_headers"
    back = [a.request_body.response.body_mutation.streamed_response for a in answers[1:]]
    assert [p.body for p in back] == cut  # handed back unchanged, in the same pieces
    assert [p.end_of_stream for p in back] == [False, False, True]
    [seen] = picker.requests
    assert len(seen.blocks) == 3  # the whole prompt, not the first chunk's


async def test_buffered_mode_answers_headers_first_and_routes_on_the_body(
    gateway_factory: GatewayFactory,
) -> None:
    svc, picker, _ = service()
    gw = await gateway_factory(svc)
    body = chat_body("v" * BLOCK_CHARS)
    call = gw.open()
    await call.write(headers_message(CHAT_HEADERS, mode=Mode.BUFFERED))
    first = await call.read()  # Envoy waits for this before it sends the buffered body
    assert first.WhichOneof("response") == "request_headers"
    assert not first.request_headers.response.header_mutation.set_headers
    await call.write(body_message(body, end_of_stream=True))
    second = await call.read()
    assert second.WhichOneof("response") == "request_body"
    address = destination(second.request_body.response)
    assert metadata_endpoint(second) == address
    assert not second.request_body.response.HasField("body_mutation")  # the body is unchanged
    await call.done_writing()
    assert len(picker.requests[0].blocks) == 1


async def test_streamed_mode_is_decided_on_the_headers(gateway_factory: GatewayFactory) -> None:
    svc, picker, _ = service()
    gw = await gateway_factory(svc)
    call = gw.open()
    await call.write(headers_message(CHAT_HEADERS, mode=Mode.STREAMED))
    head = await call.read()
    assert destination(head.request_headers.response) == A
    await call.write(body_message(chat_body("x"), end_of_stream=True))
    passed = await call.read()
    assert passed.WhichOneof("response") == "request_body"
    assert not passed.request_body.response.HasField("body_mutation")
    await call.done_writing()
    assert picker.requests[0].extra == {"body": "empty"}


async def test_body_ended_by_trailers(gateway_factory: GatewayFactory) -> None:
    svc, picker, _ = service()
    gw = await gateway_factory(svc)
    body = chat_body("t" * BLOCK_CHARS)
    trailers = pb.ProcessingRequest(request_trailers=pb.HttpTrailers())
    answers = await gw.exchange(
        [headers_message(CHAT_HEADERS), body_message(body, end_of_stream=False), trailers], 3
    )
    assert [a.WhichOneof("response") for a in answers] == [
        "request_headers",
        "request_body",
        "request_trailers",
    ]
    streamed = answers[1].request_body.response.body_mutation.streamed_response
    assert streamed.body == body
    assert not streamed.end_of_stream
    assert len(picker.requests[0].blocks) == 1


async def test_unparseable_body_still_gets_an_endpoint_by_load(
    gateway_factory: GatewayFactory,
) -> None:
    metrics = RouterMetrics()
    svc, picker, fallback = service(metrics=metrics)
    gw = await gateway_factory(svc)
    for body in (b"this is not json", b'{"messages": [', b"\x00\xff"):
        head, passed = await gw.exchange(
            [headers_message(CHAT_HEADERS), body_message(body, end_of_stream=True)], 2
        )
        assert destination(head.request_headers.response) in {A, B}
        assert passed.request_body.response.body_mutation.streamed_response.body == body
    # the picker is asked all the same, about a request with nothing to match: by load
    assert fallback.requests == []
    assert [r.extra["body"] for r in picker.requests] == ["unparseable"] * 3
    assert all(r.blocks == () and r.tokens == 0 for r in picker.requests)
    counted = metrics.registry.get_sample_value(
        "cachefleet_router_decisions_total", {"endpoint": A, "reason": "recorded"}
    )
    assert counted is not None
    assert counted >= 1


async def test_body_over_the_limit_is_routed_by_load_and_passed_through(
    gateway_factory: GatewayFactory,
) -> None:
    svc, picker, fallback = service(max_body_bytes=1000)
    gw = await gateway_factory(svc)
    body = chat_body("u" * 3000)
    answers = await gw.exchange(
        [
            headers_message(CHAT_HEADERS),
            body_message(body[:600], end_of_stream=False),
            body_message(body[600:1200], end_of_stream=False),  # past the limit: decide now
            body_message(body[1200:], end_of_stream=True),
        ],
        4,
    )
    assert answers[0].WhichOneof("response") == "request_headers"
    parts = [a.request_body.response.body_mutation.streamed_response for a in answers[1:]]
    assert b"".join(p.body for p in parts) == body
    assert [p.end_of_stream for p in parts] == [False, False, True]
    assert fallback.requests == []
    assert picker.requests[0].extra == {"body": "oversized"}
    assert picker.requests[0].blocks == ()


async def test_no_ready_endpoint_fail_closed_is_a_503(gateway_factory: GatewayFactory) -> None:
    metrics = RouterMetrics()
    svc, _, _ = service(endpoints=(), metrics=metrics)
    gw = await gateway_factory(svc)
    call = gw.open()
    await call.write(headers_message(CHAT_HEADERS))
    await call.write(body_message(chat_body("hi"), end_of_stream=True))
    answer = await call.read()
    assert answer.WhichOneof("response") == "immediate_response"
    assert answer.immediate_response.status.code == 503
    assert await call.read() == grpc.aio.EOF  # the stream ends with the answer
    assert (await call.code()) == grpc.StatusCode.OK
    assert (
        metrics.registry.get_sample_value(
            "cachefleet_router_decisions_total", {"endpoint": "", "reason": "no-endpoint"}
        )
        == 1.0
    )


async def test_no_ready_endpoint_fail_open_lets_the_gateway_pick(
    gateway_factory: GatewayFactory,
) -> None:
    svc, _, _ = service(endpoints=(), fail_open=True)
    gw = await gateway_factory(svc)
    call = gw.open()
    await call.write(headers_message(CHAT_HEADERS, end_of_stream=True))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call.read()
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_subset_hint_narrows_the_choice(gateway_factory: GatewayFactory) -> None:
    svc, _, _ = service(endpoints=(A, B, C))
    gw = await gateway_factory(svc)
    for subset, expected in (([C], C), ([f"{B},{C}"], B), (C, C), (["10.0.0.2"], B)):
        [answer] = await gw.exchange(
            [headers_message(CHAT_HEADERS, end_of_stream=True, subset=subset)], 1
        )
        assert destination(answer.request_headers.response) == expected, subset


async def test_subset_with_nothing_ready_is_a_503_even_fail_open(
    gateway_factory: GatewayFactory,
) -> None:
    svc, _, _ = service(endpoints=(A, B), fail_open=True)
    gw = await gateway_factory(svc)
    for subset in (["10.9.9.9:8000"], []):
        [answer] = await gw.exchange(
            [headers_message(CHAT_HEADERS, end_of_stream=True, subset=subset)], 1
        )
        assert answer.immediate_response.status.code == 503


async def test_response_phase_reports_to_the_picker(gateway_factory: GatewayFactory) -> None:
    metrics = RouterMetrics()
    svc, picker, _ = service(metrics=metrics)
    gw = await gateway_factory(svc)
    for status, served in ((200, None), (503, None), (200, "10.0.0.9:8000")):
        call = gw.open()
        await call.write(headers_message(CHAT_HEADERS, end_of_stream=True))
        head = await call.read()
        picked = destination(head.request_headers.response)
        await call.write(
            headers_message(
                {"content-type": "application/json"},
                status=status,
                served=served or picked,
                response=True,
            )
        )
        answer = await call.read()
        assert answer.WhichOneof("response") == "response_headers"
        await call.write(body_message(b'{"ok": true}', end_of_stream=True, response=True))
        echoed = (await call.read()).response_body.response.body_mutation.streamed_response
        assert echoed.body == b'{"ok": true}'  # full duplex (assumed): handed back unchanged
        assert echoed.end_of_stream
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
    assert [ok for _, ok in picker.done_calls] == [True, False, True]
    assert metrics.registry.get_sample_value("cachefleet_router_served_mismatch_total") == 1.0
    assert picker.outstanding(A) == 0
    assert picker.outstanding(B) == 0


async def test_stream_that_ends_before_the_response_releases_the_pick(
    gateway_factory: GatewayFactory,
) -> None:
    svc, picker, _ = service()
    gw = await gateway_factory(svc)
    call = gw.open()
    await call.write(headers_message(CHAT_HEADERS, end_of_stream=True))
    await call.read()
    await call.done_writing()  # the gateway gave up (client gone, upstream reset)
    assert await call.read() == grpc.aio.EOF
    assert picker.done_calls == [(A, False)]
    assert picker.outstanding(A) == 0


async def test_load_spreads_across_concurrent_requests(gateway_factory: GatewayFactory) -> None:
    svc, _, _ = service(endpoints=(A, B, C))
    gw = await gateway_factory(svc)
    calls, picked = [], []
    for _ in range(6):  # six requests in flight at once
        call = gw.open()
        await call.write(headers_message(CHAT_HEADERS, end_of_stream=True))
        picked.append(destination((await call.read()).request_headers.response))
        calls.append(call)
    assert sorted(picked) == sorted([A, B, C] * 2)
    for call in calls:
        await call.done_writing()


class BrokenPicker(RecordingPicker):
    def pick(self, request: RouteRequest, endpoints: Sequence[Endpoint]) -> Decision | None:
        raise RuntimeError("a bug in the scoring")


async def test_a_picker_fault_places_the_request_by_load(gateway_factory: GatewayFactory) -> None:
    fallback = RecordingPicker()
    svc = EndpointPickerService(BrokenPicker(), lambda: [Endpoint(B)], fallback=fallback)
    gw = await gateway_factory(svc)
    [answer] = await gw.exchange([headers_message(CHAT_HEADERS, end_of_stream=True)], 1)
    assert destination(answer.request_headers.response) == B
    assert len(fallback.requests) == 1


async def test_buffered_response_bodies_are_continued_unchanged(
    gateway_factory: GatewayFactory,
) -> None:
    svc, picker, _ = service()
    gw = await gateway_factory(svc)
    call = gw.open()
    await call.write(headers_message(CHAT_HEADERS, end_of_stream=True, mode=Mode.BUFFERED))
    await call.read()
    await call.write(headers_message(status=200, response=True))
    await call.read()
    await call.write(body_message(b"answer", end_of_stream=True, response=True))
    answer = await call.read()
    assert answer.WhichOneof("response") == "response_body"
    assert not answer.response_body.response.HasField("body_mutation")
    await call.done_writing()
    assert picker.done_calls == [(A, True)]
