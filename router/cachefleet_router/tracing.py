"""Traces of the router's picks, and the W3C trace context it hands on (docs/tracing.md).

Off by default (``--otlp-endpoint`` empty): the service then has no tracer, this
module is not imported, and nothing of OpenTelemetry is loaded by the router.

On, each routed request gets a span ``cachefleet.router.pick`` whose parent is
the ``traceparent`` the gateway passed in the request headers (a fresh trace
when there is none), as GIE's endpoint picker does. Its attributes: the picker
(profile), the chosen endpoint, the decision's score parts (every number or
string field of :class:`~cachefleet_router.endpoints.Decision`: expected TTFT,
matched blocks, reason...), the model, tenant, class and prompt size (blocks
and tokens; never the prompt), the number of candidates. The ext_proc answer then sets
``traceparent`` (and ``tracestate``) on the request by header mutation,
naming the pick span as the parent of the next hop (the pod's sidecar).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from .endpoints import Decision, RouteRequest

SERVICE_NAME = "cachefleet-router"
TRACES_PATH = "/v1/traces"
#: Longest one OTLP export may take, retries included, seconds (unless the OpenTelemetry
#: environment says): an unreachable collector must not hold a stopping router long.
EXPORT_TIMEOUT_S = 3.0


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of ``--otlp-endpoint`` (a base URL gets ``/v1/traces``)."""
    url = endpoint.rstrip("/")
    return url if url.endswith(TRACES_PATH) else url + TRACES_PATH


class PickTracer:
    """Spans of the router's picks, exported by OTLP/HTTP (or to ``exporter``: tests)."""

    def __init__(
        self,
        *,
        endpoint: str = "",
        exporter: SpanExporter | None = None,
        service_name: str = SERVICE_NAME,
    ) -> None:
        # OpenTelemetry is imported here, only when tracing is on.
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if exporter is None:
            if not endpoint:
                raise ValueError("tracing needs an OTLP endpoint or an exporter")
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            said = ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")
            timeout = None if any(os.environ.get(n) for n in said) else EXPORT_TIMEOUT_S
            exporter = OTLPSpanExporter(endpoint=traces_url(endpoint), timeout=timeout)
            processor: Any = BatchSpanProcessor(exporter)
        else:
            processor = SimpleSpanProcessor(exporter)
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("cachefleet.router")
        self.propagator = TraceContextTextMapPropagator()
        self._in_context = set_span_in_context
        self._server = SpanKind.SERVER
        self._error = Status(StatusCode.ERROR)
        self._offset_ns = time.time_ns() - int(time.perf_counter() * 1e9)

    def picked(
        self,
        headers: Mapping[str, str],
        request: RouteRequest,
        decision: Decision | None,
        *,
        picker: str,
        candidates: int,
        started: float,
        ended: float,
        refused: str = "",
    ) -> list[tuple[str, str]]:
        """Record one pick (``started``/``ended``: perf_counter); the trace headers to set.

        ``decision`` None: no endpoint could take the request (``refused`` says why);
        the span is an error and no header is set (the answer is the 503).
        """
        carrier = {k: v for k, v in headers.items() if k in ("traceparent", "tracestate")}
        parent = self.propagator.extract(carrier) if carrier else None
        attributes: dict[str, str | int | float | bool] = {
            "cachefleet.pick.picker": picker,
            "cachefleet.pick.candidates": candidates,
            "cachefleet.pick.prompt_blocks": len(request.blocks),
            "cachefleet.pick.prompt_tokens": request.tokens,
        }
        for name, value in (
            ("cachefleet.model", request.model),
            ("cachefleet.tenant", request.tenant),
            ("cachefleet.class", request.priority_class),
        ):
            if value:
                attributes[name] = value
        if decision is not None:
            attributes["cachefleet.endpoint"] = decision.address
            for field in dataclasses.fields(decision):
                value = getattr(decision, field.name)
                if field.name != "address" and isinstance(value, (str, int, float, bool)):
                    attributes[f"cachefleet.pick.{field.name}"] = value
        span = self.tracer.start_span(
            "cachefleet.router.pick",
            context=parent,
            kind=self._server,
            start_time=self._offset_ns + int(started * 1e9),
            attributes=attributes,
        )
        out: list[tuple[str, str]] = []
        if decision is None:
            span.set_attribute("error.type", refused or "no-endpoint")
            span.set_status(self._error)
        else:
            hop: dict[str, str] = {}
            self.propagator.inject(hop, context=self._in_context(span))
            out = list(hop.items())
        span.end(end_time=self._offset_ns + int(ended * 1e9))
        return out

    def shutdown(self) -> None:
        """Export what is pending (one export, bounded by its timeout) and stop."""
        self.provider.shutdown()
