"""Traces through a real sidecar (docs/tracing.md): the client's ``traceparent`` is the
parent of the request span and reaches the stand-in model server as a new hop of the
same trace; a request without one starts a trace; the spans of a miss, a hit and a
refusal carry what they should, and never the key or the prompt. Spans go to the SDK's
in-memory exporter; one test sends them to a loopback OTLP/HTTP receiver instead.

Needs the ``tracing`` extra (opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest

from cachefleet_e2e.fake_upstream import FakeUpstream
from cachefleet_sidecar.adapt.admission import AdmissionConfig
from cachefleet_sidecar.app import SidecarServer
from cachefleet_sidecar.compose import build
from cachefleet_sidecar.config import SidecarConfig

from .conftest import RunningSidecar, until

pytest.importorskip("opentelemetry.sdk.trace")

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)

from cachefleet_sidecar.observe.tracing import Tracing

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
PROMPT = "the secret prompt"


def base_config(upstream: FakeUpstream, **overrides: Any) -> SidecarConfig:
    base: dict[str, Any] = {
        "listen": ("127.0.0.1", 0),
        "admin_listen": ("127.0.0.1", 0),
        "upstream": upstream.url,
        "cache": "test/cache",
        "pod": "pod-a",
        "l1_bytes": 8 * 1024 * 1024,
        "trusted_proxies": ("127.0.0.1/32",),
    }
    return SidecarConfig.from_flat(**{**base, **overrides})


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


TracedFactory = Callable[..., Awaitable[RunningSidecar]]


@pytest.fixture
async def traced_factory(
    upstream: FakeUpstream, exporter: InMemorySpanExporter
) -> AsyncIterator[TracedFactory]:
    """Sidecars (config overrides as keywords) whose spans go to ``exporter``."""
    running: list[RunningSidecar] = []

    async def make(**overrides: Any) -> RunningSidecar:
        config = base_config(upstream, **overrides)
        server = SidecarServer(config, build(config, tracing=Tracing(exporter=exporter)))
        await server.start()
        running.append(sc := RunningSidecar(server))
        return sc

    yield make
    for sc in running:
        await sc.aclose()


@pytest.fixture
async def traced(traced_factory: TracedFactory) -> RunningSidecar:
    return await traced_factory()


def by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


async def request_spans(exporter: InMemorySpanExporter, n: int = 1) -> tuple[ReadableSpan, ...]:
    """The spans once ``n`` request spans have ended (the last ends after the answer)."""
    await until(
        lambda: len(by_name(exporter.get_finished_spans(), "cachefleet.request")) >= n,
        lambda: f"spans: {[s.name for s in exporter.get_finished_spans()]}",
    )
    return exporter.get_finished_spans()


def parent_of(traceparent: str) -> tuple[str, str]:
    version, trace_id, span_id, flags = traceparent.split("-")
    assert version == "00"
    assert int(flags, 16) & 1  # sampled (a fresh trace also says its id is random: 03)
    return trace_id, span_id


async def test_a_miss_is_traced_under_the_clients_traceparent_and_the_hop_reaches_upstream(
    traced: RunningSidecar, upstream: FakeUpstream, exporter: InMemorySpanExporter
) -> None:
    answer = await traced.chat(PROMPT, headers={"traceparent": TRACEPARENT})
    assert answer.status_code == 200
    assert answer.headers["x-cache"] == "MISS"
    spans = await request_spans(exporter)
    (root,) = by_name(spans, "cachefleet.request")
    # the client's span is the parent; every span is in the client's trace
    assert root.parent is not None
    assert f"{root.parent.span_id:016x}" == CLIENT_SPAN
    assert {f"{s.context.trace_id:032x}" for s in spans} == {TRACE_ID}
    names = [s.name for s in spans]
    for name in ("cachefleet.identity", "cachefleet.lookup", "cachefleet.upstream"):
        assert name in names, names
    assert "cachefleet.store" in names, names
    for span in spans:
        if span is not root:
            assert span.parent is not None
            assert span.parent.span_id == root.context.span_id
    attrs = dict(root.attributes or {})
    assert attrs["cachefleet.tenant"] == "acme"
    assert attrs["cachefleet.cache.outcome"] == "miss"
    assert attrs["cachefleet.key.digest"] == answer.headers["x-cache-key"]
    assert attrs["http.response.status_code"] == 200
    (lookup,) = by_name(spans, "cachefleet.lookup")
    assert dict(lookup.attributes or {}) == {
        "cachefleet.cache.tier": "l1",
        "cachefleet.cache.outcome": "miss",
    }
    (up,) = by_name(spans, "cachefleet.upstream")
    assert [e.name for e in up.events] == ["first_token"]
    assert dict(up.attributes or {})["http.response.status_code"] == 200
    # the model server got a new hop of the same trace, whose parent is the upstream span
    sent = upstream.seen_headers[-1]["traceparent"]
    trace_id, parent = parent_of(sent)
    assert trace_id == TRACE_ID
    assert parent == f"{up.context.span_id:016x}"
    assert parent != CLIENT_SPAN
    # never the key or the prompt
    for span in spans:
        for value in (span.attributes or {}).values():
            assert PROMPT not in str(value)


async def test_a_miss_sent_from_the_fast_path_is_traced_to_its_store(
    traced: RunningSidecar,
    upstream: FakeUpstream,
    exporter: InMemorySpanExporter,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = traced.sidecar.upstream
    pool.max_idle_age_s = 3600.0
    assert (await traced.chat("warm-up")).status_code == 200  # leaves an idle connection
    await request_spans(exporter)
    exporter.clear()
    begun: list[object] = []
    begin = pool.begin

    def counted(*args: Any, **kw: Any) -> Any:
        sent = begin(*args, **kw)
        begun.append(sent)
        return sent

    monkeypatch.setattr(pool, "begin", counted)
    miss = await traced.chat(PROMPT, headers={"traceparent": TRACEPARENT})
    assert miss.headers["x-cache"] == "MISS"
    assert [b is not None for b in begun] == [True]  # sent on the fast path
    spans = await request_spans(exporter)
    (up,) = by_name(spans, "cachefleet.upstream")
    assert [e.name for e in up.events] == ["first_token"]
    assert parent_of(upstream.seen_headers[-1]["traceparent"]) == (
        TRACE_ID,
        f"{up.context.span_id:016x}",
    )
    assert [
        dict(s.attributes or {})["cachefleet.cache.tier"]
        for s in by_name(spans, "cachefleet.store")
    ] == ["l1"]
    again = await traced.chat(PROMPT)
    assert again.headers["x-cache"] == "HIT-L1"
    assert again.content == miss.content


async def test_a_request_without_traceparent_starts_a_trace_and_sends_it_upstream(
    traced: RunningSidecar, upstream: FakeUpstream, exporter: InMemorySpanExporter
) -> None:
    assert (await traced.chat("no context")).status_code == 200
    spans = await request_spans(exporter)
    (root,) = by_name(spans, "cachefleet.request")
    assert root.parent is None
    trace_id, _ = parent_of(upstream.seen_headers[-1]["traceparent"])
    assert trace_id == f"{root.context.trace_id:032x}"


async def test_an_l1_hit_is_one_request_span_with_its_lookup_and_no_upstream(
    traced: RunningSidecar, upstream: FakeUpstream, exporter: InMemorySpanExporter
) -> None:
    first = await traced.chat("again")
    await request_spans(exporter)
    exporter.clear()
    hit = await traced.chat("again", headers={"traceparent": TRACEPARENT})
    assert hit.headers["x-cache"] == "HIT-L1"
    spans = await request_spans(exporter)
    assert sorted(s.name for s in spans) == [
        "cachefleet.identity",
        "cachefleet.lookup",
        "cachefleet.request",
    ]
    (root,) = by_name(spans, "cachefleet.request")
    attrs = dict(root.attributes or {})
    assert attrs["cachefleet.cache.outcome"] == "hit-l1"
    assert attrs["cachefleet.key.digest"] == first.headers["x-cache-key"]
    assert f"{root.context.trace_id:032x}" == TRACE_ID
    (lookup,) = by_name(spans, "cachefleet.lookup")
    assert dict(lookup.attributes or {})["cachefleet.cache.outcome"] == "hit"
    assert upstream.calls["/v1/chat/completions"] == 1


async def test_a_stream_gets_its_first_token_event_and_a_bypass_is_traced_too(
    traced: RunningSidecar, upstream: FakeUpstream, exporter: InMemorySpanExporter
) -> None:
    streamed = await traced.chat("stream me", body={"stream": True})
    assert streamed.status_code == 200
    spans = await request_spans(exporter)
    (up,) = by_name(spans, "cachefleet.upstream")
    assert [e.name for e in up.events] == ["first_token"]
    first, start, end = up.events[0].timestamp, up.start_time, up.end_time
    assert first is not None
    assert start is not None
    assert end is not None
    assert start <= first <= end
    exporter.clear()
    models = await traced.client.get(
        "/v1/models", headers={"traceparent": TRACEPARENT, "X-Tenant-ID": "acme"}
    )
    assert models.status_code == 200
    spans = await request_spans(exporter)
    (root,) = by_name(spans, "cachefleet.request")
    assert dict(root.attributes or {})["cachefleet.cache.outcome"] == "bypass"
    assert parent_of(upstream.seen_headers[-1]["traceparent"])[0] == TRACE_ID


async def test_a_trace_the_client_did_not_sample_is_not_recorded_but_goes_on(
    traced: RunningSidecar, upstream: FakeUpstream, exporter: InMemorySpanExporter
) -> None:
    unsampled = f"00-{TRACE_ID}-{CLIENT_SPAN}-00"
    assert (await traced.chat("quiet", headers={"traceparent": unsampled})).status_code == 200
    version, trace_id, parent, flags = upstream.seen_headers[-1]["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", TRACE_ID, "00")
    assert parent != CLIENT_SPAN  # a hop of this sidecar's, unrecorded
    await traced.chat("quiet")  # a sampled request after it: its spans are the only ones
    spans = await request_spans(exporter)
    assert all(f"{s.context.trace_id:032x}" != TRACE_ID for s in spans)


async def test_probes_and_scrapes_on_the_main_port_make_no_spans(
    traced_factory: TracedFactory, exporter: InMemorySpanExporter
) -> None:
    sc = await traced_factory(admin_listen=None)
    for path in ("/healthz", "/metrics", "/status"):
        assert (await sc.client.get(path)).status_code == 200
    assert (await sc.chat("after the probes")).status_code == 200
    spans = await request_spans(exporter)
    (root,) = by_name(spans, "cachefleet.request")
    assert dict(root.attributes or {})["url.path"] == "/v1/chat/completions"


async def test_an_l3_lookup_is_a_span(
    traced_factory: TracedFactory, exporter: InMemorySpanExporter
) -> None:
    sc = await traced_factory(semantic_source="hashed", semantic_default_on=True)
    assert (await sc.chat("what is a semantic cache?")).headers["x-cache"] == "MISS"
    spans = await request_spans(exporter)
    tiers = {
        dict(s.attributes or {})["cachefleet.cache.tier"]: dict(s.attributes or {})
        for s in by_name(spans, "cachefleet.lookup")
    }
    assert tiers["l3"]["cachefleet.cache.outcome"] in {"empty", "miss"}


async def test_the_admission_wait_is_a_span(
    traced_factory: TracedFactory, exporter: InMemorySpanExporter
) -> None:
    # a first miss has no warm upstream connection: it goes through admission (slow path)
    sc = await traced_factory(admission=AdmissionConfig(max_waiting=2))
    assert (await sc.chat("admitted")).status_code == 200
    spans = await request_spans(exporter)
    (admission,) = by_name(spans, "cachefleet.admission")
    assert dict(admission.attributes or {}) == {"cachefleet.admission.outcome": "admitted"}
    (up,) = by_name(spans, "cachefleet.upstream")
    assert admission.end_time is not None
    assert up.start_time is not None
    assert admission.end_time <= up.start_time


@pytest.mark.redis
async def test_l2_lookups_and_stores_are_spans(
    traced_factory: TracedFactory, exporter: InMemorySpanExporter, redis_url: str
) -> None:
    pod_a = (await traced_factory(redis_url=redis_url)).patient()
    await pod_a.confirmed()
    pod_a.steady()
    miss = await pod_a.chat("shared")
    assert miss.headers["x-cache"] == "MISS"
    await pod_a.stored(1)
    spans = await request_spans(exporter)
    lookups = {
        dict(s.attributes or {})["cachefleet.cache.tier"]: dict(s.attributes or {})
        for s in by_name(spans, "cachefleet.lookup")
    }
    assert lookups["l1"]["cachefleet.cache.outcome"] == "miss"
    assert lookups["l2"]["cachefleet.cache.outcome"] == "miss"
    stores = sorted(
        str(dict(s.attributes or {})["cachefleet.cache.tier"])
        for s in by_name(spans, "cachefleet.store")
    )
    assert stores == ["l1", "l2"]
    exporter.clear()
    pod_b = (await traced_factory(redis_url=redis_url, pod="pod-b")).patient()
    await pod_b.confirmed()
    pod_b.steady()
    hit = await pod_b.chat("shared", headers={"traceparent": TRACEPARENT})
    assert hit.headers["x-cache"] == "HIT-L2"
    spans = await request_spans(exporter)
    (root,) = by_name(spans, "cachefleet.request")
    assert dict(root.attributes or {})["cachefleet.cache.outcome"] == "hit-l2"
    assert f"{root.context.trace_id:032x}" == TRACE_ID
    outcomes = {
        dict(s.attributes or {})["cachefleet.cache.tier"]: dict(s.attributes or {})[
            "cachefleet.cache.outcome"
        ]
        for s in by_name(spans, "cachefleet.lookup")
    }
    assert outcomes == {"l1": "miss", "l2": "hit"}
    assert by_name(spans, "cachefleet.upstream") == []


async def test_tracing_off_passes_the_clients_traceparent_unchanged_and_invents_none(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    assert sidecar.sidecar.tracing is None
    assert sidecar.sidecar.front is sidecar.sidecar.handler
    await sidecar.chat("plain")
    assert "traceparent" not in upstream.seen_headers[-1]
    await sidecar.chat("with context", headers={"traceparent": TRACEPARENT})
    assert upstream.seen_headers[-1]["traceparent"] == TRACEPARENT


class _Receiver(http.server.BaseHTTPRequestHandler):
    posts: list[tuple[str, str, int]]

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        self.posts.append((self.path, self.headers.get("content-type") or "", length))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[tuple[str, str, int]]]]:
    posts: list[tuple[str, str, int]] = []
    handler = type("Receiver", (_Receiver,), {"posts": posts})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", posts
    finally:
        server.shutdown()
        server.server_close()


async def test_otlp_endpoint_exports_spans_to_a_collector_over_http(
    upstream: FakeUpstream, receiver: tuple[str, list[tuple[str, str, int]]]
) -> None:
    url, posts = receiver
    config = base_config(upstream, otlp_endpoint=url)
    server = SidecarServer(config)
    await server.start()
    sc = RunningSidecar(server)
    try:
        assert (await sc.chat("exported")).status_code == 200
    finally:
        await sc.aclose()  # shutting down flushes the batch
    assert posts, "no OTLP export reached the receiver"
    assert {p[0] for p in posts} == {"/v1/traces"}
    assert all(p[1] == "application/x-protobuf" and p[2] > 0 for p in posts)
