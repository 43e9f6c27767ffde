"""Traces: the W3C trace context of a request, its spans, and their OTLP export.

Off by default. The composition root imports this module only when tracing is
on (``--otlp-endpoint``, or an exporter a test hands in), and OpenTelemetry is
imported only when a :class:`Tracing` is made: a sidecar without tracing has
no module of OpenTelemetry loaded and its request path is the untraced one
(:mod:`cachefleet_sidecar.traced` holds the traced parts compose puts
in instead).

Each request gets a :class:`RequestTrace`: a server span ``cachefleet.request``
whose parent is the client's ``traceparent`` (a fresh trace when it sent none,
or an unreadable one), and children recorded with explicit start and end
times, so that they can be made where the request path already knows them
(its synchronous fast path included):

* ``cachefleet.identity`` (``cachefleet.tenant``),
* ``cachefleet.lookup`` per tier (``cachefleet.cache.tier``, ``cachefleet.cache.outcome``),
* ``cachefleet.admission`` (``cachefleet.admission.outcome``),
* ``cachefleet.upstream`` (client kind; the ``traceparent`` sent to the model
  server names it; a ``first_token`` event when its first body bytes come),
* ``cachefleet.store`` (``cachefleet.cache.tier``).

The request span carries the tenant, the cache outcome (the ``X-Cache`` value
the client got, lower case), the ``X-Cache-Key`` digest (a SHA-256 of the
key, never the key or the prompt), the method, path and status.

The request being traced is found through :data:`CURRENT`, a context variable
the traced handler sets around the synchronous fast path and inside the
request's task.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span

#: The request being traced (None outside a traced request).
CURRENT: ContextVar[RequestTrace | None] = ContextVar("cachefleet_trace", default=None)

#: Service name of the sidecar's spans (the resource's ``service.name``).
SERVICE_NAME = "cachefleet-sidecar"
#: The OTLP/HTTP path of traces, added to an ``--otlp-endpoint`` that names only a base URL.
TRACES_PATH = "/v1/traces"
#: The W3C trace-context request headers (a new hop replaces both).
TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})
#: Longest one OTLP export may take, retries included, seconds (OTEL_EXPORTER_OTLP_TIMEOUT
#: or OTEL_EXPORTER_OTLP_TRACES_TIMEOUT win): an unreachable collector must not hold a
#: stopping sidecar for the SDK's 10 s per batch.
EXPORT_TIMEOUT_S = 3.0

Attributes = Mapping[str, str | int | float | bool]


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of ``--otlp-endpoint`` (a base URL gets ``/v1/traces``)."""
    url = endpoint.rstrip("/")
    return url if url.endswith(TRACES_PATH) else url + TRACES_PATH


def export_timeout_s() -> float | None:
    """:data:`EXPORT_TIMEOUT_S`, unless the OpenTelemetry environment says (None: it does)."""
    said = ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")
    return None if any(os.environ.get(name) for name in said) else EXPORT_TIMEOUT_S


class Tracing:
    """The OpenTelemetry tracer of one process: its provider, exporter and propagator.

    ``exporter`` (tests: the SDK's ``InMemorySpanExporter``) is fed span by span;
    otherwise spans go to ``endpoint`` by OTLP/HTTP in batches. The provider is
    this object's own, never the process-wide one.
    """

    def __init__(
        self,
        *,
        endpoint: str = "",
        exporter: SpanExporter | None = None,
        service_name: str = SERVICE_NAME,
        attributes: Attributes | None = None,
        scope: str = "cachefleet.sidecar",
    ) -> None:
        # OpenTelemetry is imported here, only when tracing is on.
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace import SpanKind, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if exporter is None:
            if not endpoint:
                raise ValueError("tracing needs an OTLP endpoint or an exporter")
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            processor: Any = BatchSpanProcessor(
                OTLPSpanExporter(endpoint=traces_url(endpoint), timeout=export_timeout_s())
            )
        else:
            processor = SimpleSpanProcessor(exporter)
        resource = Resource.create({"service.name": service_name, **(attributes or {})})
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer(scope)
        self.propagator = TraceContextTextMapPropagator()
        self.in_context = set_span_in_context
        self.server = SpanKind.SERVER
        self.client = SpanKind.CLIENT
        #: perf_counter seconds -> epoch nanoseconds (the request path keeps perf_counter).
        self._offset_ns = time.time_ns() - int(time.perf_counter() * 1e9)

    def ns(self, perf: float) -> int:
        """Epoch nanoseconds of a ``time.perf_counter()`` reading."""
        return self._offset_ns + int(perf * 1e9)

    def extract(self, headers: Iterable[tuple[bytes, bytes]]) -> Any:
        """The parent context of the client's ``traceparent`` / ``tracestate`` (None: none)."""
        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in headers
            if name in TRACE_HEADERS
        }
        return self.propagator.extract(carrier) if carrier else None

    def inject(self, span: Span) -> list[tuple[bytes, bytes]]:
        """The ``traceparent`` (and ``tracestate``) headers naming ``span`` as the parent."""
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=self.in_context(span))
        return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in carrier.items()]

    def request(
        self, headers: Iterable[tuple[bytes, bytes]], started: float, attributes: Attributes
    ) -> RequestTrace:
        """The trace of a request whose head began at ``started`` (perf_counter)."""
        return RequestTrace(self, self.extract(headers), started, attributes)

    def shutdown(self) -> None:
        """Export what is pending (one export, bounded by its timeout) and stop."""
        self.provider.shutdown()


class RequestTrace:
    """The spans of one request (children made with explicit times; see the module doc)."""

    __slots__ = (
        "_context",
        "_tracing",
        "first_token_at",
        "identified_at",
        "l2",
        "l2_hit",
        "next_step_at",
        "recording",
        "root",
        "upstream",
    )

    def __init__(
        self, tracing: Tracing, parent: Any, started: float, attributes: Attributes
    ) -> None:
        self._tracing = tracing
        self.root = tracing.tracer.start_span(
            "cachefleet.request",
            context=parent,
            kind=tracing.server,
            start_time=tracing.ns(started),
            attributes=attributes,
        )
        self._context = tracing.in_context(self.root)
        #: False when the sampler dropped this trace: no child spans are made (the
        #: model server still gets the trace context, flagged not sampled).
        self.recording = self.root.is_recording()
        #: When identity was decided (perf_counter; None: not yet).
        self.identified_at: float | None = None
        #: When the fast path moved past L1 (to L2 or upstream).
        self.next_step_at: float | None = None
        #: The fast path's L2 read: its start, and whether it found an entry.
        self.l2: float | None = None
        self.l2_hit = False
        #: The upstream call's span while it is open.
        self.upstream: Span | None = None
        self.first_token_at: float | None = None

    @property
    def trace_id(self) -> int:
        return int(self.root.get_span_context().trace_id)

    def set(self, name: str, value: str | int | float | bool) -> None:
        """An attribute of the request span."""
        self.root.set_attribute(name, value)

    def span(self, name: str, start: float, end: float, attributes: Attributes) -> None:
        """A finished child span of the request, ``start`` to ``end`` (perf_counter)."""
        if not self.recording:
            return
        tracing = self._tracing
        child = tracing.tracer.start_span(
            name, context=self._context, start_time=tracing.ns(start), attributes=attributes
        )
        child.end(end_time=tracing.ns(end))

    def identified(self, tenant: str, start: float, end: float) -> None:
        self.identified_at = end
        self.set("cachefleet.tenant", tenant)
        self.span("cachefleet.identity", start, end, {"cachefleet.tenant": tenant})

    def lookup(self, tier: str, outcome: str, start: float, end: float) -> None:
        self.span(
            "cachefleet.lookup",
            start,
            end,
            {"cachefleet.cache.tier": tier, "cachefleet.cache.outcome": outcome},
        )

    def upstream_begins(
        self, headers: list[tuple[bytes, bytes]], method: bytes, path: bytes
    ) -> list[tuple[bytes, bytes]]:
        """Open the upstream span; ``headers`` with the ``traceparent`` that names it."""
        self.upstream_ends(None, error="superseded")  # a begin that found no connection
        now = time.perf_counter()
        if self.next_step_at is None:
            self.next_step_at = now
        tracing = self._tracing
        kept = [(n, v) for n, v in headers if n not in TRACE_HEADERS]
        if not self.recording:  # not sampled: the hop goes on in this trace, unrecorded
            return kept + tracing.inject(self.root)
        self.upstream = span = tracing.tracer.start_span(
            "cachefleet.upstream",
            context=self._context,
            kind=tracing.client,
            start_time=tracing.ns(now),
            attributes={
                "http.request.method": method.decode("latin-1"),
                "url.path": path.partition(b"?")[0].decode("latin-1"),
            },
        )
        return kept + tracing.inject(span)

    def upstream_abandoned(self) -> None:
        """The upstream call just begun was not sent after all: its span is dropped."""
        self.upstream = None

    def first_token(self) -> None:
        """The upstream answer's first body bytes (time to first token) came."""
        span = self.upstream
        if span is not None and self.first_token_at is None:
            self.first_token_at = now = time.perf_counter()
            span.add_event("first_token", timestamp=self._tracing.ns(now))

    def upstream_ends(self, status: int | None, *, error: str = "") -> None:
        """Close the upstream span (no-op when none is open)."""
        span = self.upstream
        if span is None:
            return
        self.upstream = None
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if error:
            span.set_attribute("error.type", error)
        span.end(end_time=self._tracing.ns(time.perf_counter()))

    def finish(self, end: float, head: bytes | None) -> None:
        """End the request span at ``end``; ``head``: the answer's head, when known."""
        if head is not None and self.recording:
            self._answer(head)
        self.upstream_ends(None, error="unfinished")
        self.root.end(end_time=self._tracing.ns(end))

    def _answer(self, head: bytes) -> None:
        """Status, ``X-Cache`` and ``X-Cache-Key`` of the answer, as request attributes."""
        end = head.find(b"\r\n\r\n")
        lines = (head if end < 0 else head[:end]).split(b"\r\n")
        found: dict[str, str | int] = {}
        parts = lines[0].split(b" ", 2)
        if len(parts) >= 2 and parts[1].isdigit():
            found["http.response.status_code"] = int(parts[1])
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"x-cache":
                found["cachefleet.cache.outcome"] = value.strip().decode("latin-1").lower()
            elif name == b"x-cache-key":
                found["cachefleet.key.digest"] = value.strip().decode("latin-1")
        self.root.set_attributes(found)  # one lock, not one per attribute
