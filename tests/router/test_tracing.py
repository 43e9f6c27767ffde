"""The router's traces (docs/tracing.md), with a real gRPC client playing the gateway:
a pick is a span under the request's ``traceparent`` (a new trace without one), its
attributes name the picker, the endpoint and the score parts, and the answer's header
mutation hands the next hop's ``traceparent`` on; with tracing off the mutation is the
destination alone and nothing of OpenTelemetry's SDK is loaded."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cachefleet_router.cli import parse_args
from cachefleet_router.endpoints import Endpoint
from cachefleet_router.extproc import EndpointPickerService
from cachefleet_router.picking import LeastLoadedPicker
from cachefleet_router.tracing import traces_url

from .conftest import GatewayFactory, Mode, body_message, headers_message
from .test_extproc import CHAT_HEADERS, A, B, chat_body

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
GATEWAY_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{GATEWAY_SPAN}-01"


def set_headers(answer: object) -> dict[str, str]:
    sets = answer.header_mutation.set_headers  # type: ignore[attr-defined]
    return {h.header.key: h.header.raw_value.decode() for h in sets}


def traced_service(exporter: object) -> EndpointPickerService:
    from cachefleet_router.tracing import PickTracer

    pool = [Endpoint(A), Endpoint(B)]
    return EndpointPickerService(
        LeastLoadedPicker(),
        lambda: pool,
        tracer=PickTracer(exporter=exporter),  # type: ignore[arg-type]
    )


@pytest.fixture
def exporter() -> object:
    memory = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter")
    return memory.InMemorySpanExporter()


async def test_a_pick_is_a_span_under_the_gateways_traceparent_and_hands_the_next_hop_on(
    gateway_factory: GatewayFactory, exporter: object
) -> None:
    gw = await gateway_factory(traced_service(exporter))
    headers = {**CHAT_HEADERS, "traceparent": TRACEPARENT}
    head, _ = await gw.exchange(
        [headers_message(headers), body_message(chat_body("x" * 200), end_of_stream=True)], 2
    )
    mutation = set_headers(head.request_headers.response)
    assert mutation["x-gateway-destination-endpoint"] == A
    [span] = exporter.get_finished_spans()  # type: ignore[attr-defined]
    assert span.name == "cachefleet.router.pick"
    assert f"{span.context.trace_id:032x}" == TRACE_ID
    assert f"{span.parent.span_id:016x}" == GATEWAY_SPAN
    attrs = dict(span.attributes)
    assert attrs["cachefleet.endpoint"] == A
    assert attrs["cachefleet.pick.picker"] == "LeastLoadedPicker"
    assert attrs["cachefleet.pick.candidates"] == 2
    assert attrs["cachefleet.tenant"] == "acme"
    assert attrs["cachefleet.model"] == "m1"
    assert "cachefleet.pick.expected_ttft_s" in attrs
    assert "cachefleet.pick.matched_blocks" in attrs
    # the next hop: same trace, the pick span as its parent
    version, trace_id, parent, flags = mutation["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", TRACE_ID, "01")
    assert parent == f"{span.context.span_id:016x}"


async def test_without_traceparent_a_pick_starts_a_trace_and_buffered_mode_carries_it(
    gateway_factory: GatewayFactory, exporter: object
) -> None:
    gw = await gateway_factory(traced_service(exporter))
    head, body = await gw.exchange(
        [
            headers_message(CHAT_HEADERS, mode=Mode.BUFFERED),
            body_message(chat_body("hello"), end_of_stream=True),
        ],
        2,
    )
    assert set_headers(head.request_headers.response) == {}
    mutation = set_headers(body.request_body.response)
    [span] = exporter.get_finished_spans()  # type: ignore[attr-defined]
    assert span.parent is None
    assert mutation["traceparent"].split("-")[1] == f"{span.context.trace_id:032x}"


async def test_no_endpoint_is_an_error_span_and_sets_no_header(
    gateway_factory: GatewayFactory, exporter: object
) -> None:
    from cachefleet_router.tracing import PickTracer

    svc = EndpointPickerService(
        LeastLoadedPicker(),
        lambda: [],
        tracer=PickTracer(exporter=exporter),  # type: ignore[arg-type]
    )
    gw = await gateway_factory(svc)
    [answer] = await gw.exchange(
        [headers_message({**CHAT_HEADERS, "traceparent": TRACEPARENT}, end_of_stream=True)], 1
    )
    assert answer.WhichOneof("response") == "immediate_response"
    [span] = exporter.get_finished_spans()  # type: ignore[attr-defined]
    assert dict(span.attributes)["error.type"] == "no-endpoint"
    assert not span.status.is_ok


async def test_tracing_off_sets_only_the_destination(gateway_factory: GatewayFactory) -> None:
    pool = [Endpoint(A)]
    gw = await gateway_factory(EndpointPickerService(LeastLoadedPicker(), lambda: pool))
    [answer] = await gw.exchange(
        [headers_message({**CHAT_HEADERS, "traceparent": TRACEPARENT}, end_of_stream=True)], 1
    )
    # the gateway's own traceparent goes on untouched: nothing is set over it
    assert set_headers(answer.request_headers.response) == {"x-gateway-destination-endpoint": A}


# redis-py 8 imports OpenTelemetry's metrics SDK (and the trace API) on its own whenever
# it is installed: what counts is what the router adds to what ``import redis`` loads.
OFF_PROBE = """
import sys

def otel():
    return {m for m in sys.modules if m == "opentelemetry" or m.startswith("opentelemetry.")}

import redis
baseline = otel()
from cachefleet_router.server import RouterServer, RouterConfig
server = RouterServer(RouterConfig(endpoints=("10.0.0.1:8000",)))
assert server.tracer is None and server.service.tracer is None
added = otel() - baseline
ours = ("opentelemetry.sdk.trace", "opentelemetry.exporter", "cachefleet_router.tracing")
added |= {m for m in sys.modules if m.startswith(ours)}
print(",".join(sorted(added)))
"""


def test_tracing_off_loads_no_tracer() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEFLEET_")}
    done = subprocess.run(
        [sys.executable, "-c", OFF_PROBE],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


def test_otlp_endpoint_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CACHEFLEET_OTLP_ENDPOINT", raising=False)
    assert parse_args(["--endpoints", A])[0].otlp_endpoint == ""
    monkeypatch.setenv("CACHEFLEET_OTLP_ENDPOINT", "http://collector:4318")
    assert parse_args(["--endpoints", A])[0].otlp_endpoint == "http://collector:4318"
    with pytest.raises(SystemExit):
        parse_args(["--endpoints", A, "--otlp-endpoint", "collector:4317"])
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"


def test_without_the_tracing_extra_the_router_routes_untraced(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.resources", None)
    from cachefleet_router.server import RouterConfig, RouterServer

    server = RouterServer(RouterConfig(endpoints=(A,), otlp_endpoint="http://collector:4318"))
    assert server.tracer is None
    assert server.service.tracer is None
    assert "install cachefleet[tracing]" in caplog.text
