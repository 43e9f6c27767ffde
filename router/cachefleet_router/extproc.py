"""The endpoint-picker protocol: Envoy ``ext_proc`` (gRPC, grpc.aio) in front of a Picker.

The Gateway API Inference Extension's endpoint-picker protocol (proposal 004)
has the gateway open one ``ExternalProcessor.Process`` stream per HTTP
request. This servicer reads the request headers and body, reduces them to a
:class:`~cachefleet_router.endpoints.RouteRequest`
(:func:`cachefleet_router.prompt.reduce_request`), lets the
:class:`~cachefleet_router.endpoints.Picker` choose among the ready endpoints,
and answers as the protocol prescribes, with the same ``host:port`` in both
places:

* the request header ``x-gateway-destination-endpoint`` (set, overwriting
  anything a client sent), with the route cache cleared;
* the dynamic metadata ``envoy.lb`` -> ``{"x-gateway-destination-endpoint": host:port}``.

The body may come in one message or in several; it is gathered until
``end_of_stream``. How the answer is shaped follows the body mode the gateway
announces in ``protocol_config`` (first message):

* ``FULL_DUPLEX_STREAMED`` (what GIE gateways use; also assumed when the
  gateway says nothing): the headers answer waits for the whole body, then the
  body goes back unchanged as ``streamed_response`` messages, in the pieces it
  came in (a full-duplex processor must return the body it wants forwarded);
* ``BUFFERED`` / ``BUFFERED_PARTIAL``: headers are answered at once (no
  change), and the one body message's answer carries the header mutation and
  the metadata;
* ``STREAMED`` or ``NONE``, or a request without body: decided on the headers
  (the body would reach the upstream before a decision), so by load.

Response bodies, when the gateway sends them, go back unchanged: as
``streamed_response`` chunks in full-duplex mode (again assumed when the
gateway says nothing), as a plain continue otherwise.

A picker that raises is logged and the request placed by ``fallback`` (a
:class:`~cachefleet_router.picking.LeastLoadedPicker`). A body that is not
JSON or has no prompt is still routed: the picker sees a request with no
blocks and places it by load alone; so is a body past ``max_body_bytes``,
which is then passed through unread.

Memory: in full-duplex mode a body is held until its ``end_of_stream``. The
bytes held across all streams are kept under ``max_body_memory``
(:class:`BodyBudget`); a chunk that does not fit routes its request at once,
by load on what was read, and the body goes on unread (``body-memory``), as
past ``max_body_bytes`` for one request (``body-size``). At most
``max_streams`` streams are open at once; one more gets a 503 (or, with
``fail_open``, the stream ends with gRPC ``UNAVAILABLE`` before anything was
answered, so the gateway picks). Each is counted in
``cachefleet_router_refusals_total{reason}``.

A request body message after the body's ``end_of_stream`` (newer Envoy
re-sends the final chunk of a large body) is dropped, not forwarded twice.

The gateway may narrow the choice with the filter metadata
``envoy.lb.subset_hint`` -> ``x-gateway-destination-endpoint-subset`` (a list of
``ip:port``, or one comma-separated string); when none of them is ready the
answer is an ``ImmediateResponse`` 503, as the protocol requires.

When no endpoint is ready at all: ``fail_open=False`` (the default, as an
InferencePool's ``FailClose``) answers an ``ImmediateResponse`` 503 Service
Unavailable, the protocol's answer; ``fail_open=True`` ends the stream with
gRPC ``UNAVAILABLE`` instead, so a gateway whose InferencePool says
``failureMode: FailOpen`` sends the request to an endpoint of its own
choosing, but only while the gateway still holds the whole request (no body
message has come): after that a gateway cannot fail open (its client would
get a 500), so the answer is the 503.

Conformance mode (``conformance=True``, off by default: any client could steer
its request): GIE's conformance hooks. The request header
``test-epp-endpoint-selection`` (``ip`` or ``ip:port``, comma-separated)
narrows the choice to the ready endpoints it names, a 429 when it names none
(as GIE's own picker answers); the response headers get
``x-conformance-test-served-endpoint`` with the gateway's
``x-gateway-destination-endpoint-served`` report (or GIE's ``fail: ...`` text
when the gateway gave none).

Tracing (``tracer``, off by default): each pick is a span whose parent is the
request's ``traceparent``, and the answer's header mutation sets the
``traceparent`` of the next hop (:mod:`cachefleet_router.tracing`).

Response phase: the response headers' ``:status`` and the gateway's
``envoy.lb`` -> ``x-gateway-destination-endpoint-served`` report end the
request for the picker (``Picker.done``, ok unless 5xx); a stream that ends
without response headers is reported as failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import json_format, struct_pb2

from cachefleet_common.classes import OBJECTIVE_HEADER

from .endpoints import Decision, Endpoint, Picker, RouteRequest
from .metrics import RouterMetrics
from .picking import LeastLoadedPicker
from .prompt import ClassOf, header, reduce_request
from .tokens import Tokenization

if TYPE_CHECKING:
    from .tracing import PickTracer

log = logging.getLogger(__name__)

#: the header and the ``envoy.lb`` metadata key naming the picked endpoint
DESTINATION_ENDPOINT = "x-gateway-destination-endpoint"
#: the metadata namespace of the picked endpoint (request) and the served one (response)
DESTINATION_NAMESPACE = "envoy.lb"
#: the key under ``envoy.lb`` in the response phase: the endpoint that served the request
SERVED_ENDPOINT = "x-gateway-destination-endpoint-served"
#: the filter-metadata namespace and key of the gateway's subset hint
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"

#: body bytes read for routing; past this the request is routed by load, its body passed on
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
#: request body bytes held at once, all streams together (as the sidecar's --max-body-memory)
DEFAULT_MAX_BODY_MEMORY = 256 * 1024 * 1024
#: ext_proc streams (HTTP requests through the gateway) open at once
DEFAULT_MAX_STREAMS = 10_000
#: how long a stream refused by the cap waits for the gateway's first message, seconds
REFUSED_WAIT_S = 5.0
#: conformance mode (GIE's conformance suite): the request header naming the allowed
#: endpoints (``ip`` or ``ip:port``, comma-separated) and the response header reporting
#: the endpoint the gateway says served the request
CONFORMANCE_SELECTION = "test-epp-endpoint-selection"
CONFORMANCE_SERVED = "x-conformance-test-served-endpoint"
#: largest ext_proc message the server takes (a buffered body up to the limit, and headers)
MAX_MESSAGE_BYTES = DEFAULT_MAX_BODY_BYTES + 1024 * 1024

REASON_NO_ENDPOINT = "no-endpoint"
REASON_SUBSET_EMPTY = "subset-empty"
#: conformance mode: the selection header names no ready endpoint (GIE's EPP answers 429)
REASON_SELECTION_EMPTY = "selection-empty"
#: the stream cap refused a stream (``refusals_total{reason}``)
REFUSED_STREAMS = "streams"
#: a body routed by load on what was read: past the stream's limit, or past the global budget
REFUSED_BODY_SIZE = "body-size"
REFUSED_BODY_MEMORY = "body-memory"

_Mode = processing_mode_pb2.ProcessingMode
_DUPLEX = _Mode.FULL_DUPLEX_STREAMED
_BUFFERED = {_Mode.BUFFERED, _Mode.BUFFERED_PARTIAL}
_HEADERS_ONLY = {_Mode.STREAMED, _Mode.NONE}
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


class BodyBudget:
    """Request body bytes held across all streams, under one limit (the router's accounting)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        #: the most ever held at once (tests, and a sanity check)
        self.peak = 0

    def take(self, n: int) -> bool:
        """Hold ``n`` more bytes if the budget allows; False (nothing held) if not."""
        if self.held + n > self.limit:
            return False
        self.held += n
        self.peak = max(self.peak, self.held)
        return True

    def give(self, n: int) -> None:
        self.held = max(0, self.held - n)


class NoEndpoint(Exception):
    """No endpoint may take the request (``reason`` says why)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _header_map(headers: pb.HttpHeaders) -> dict[str, str]:
    """Headers by lowercased name; a repeated one keeps its last value, but GIE's
    objective keeps them all, comma-joined: each of them may lower the class."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        value = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        key = h.key.lower()
        if key == OBJECTIVE_HEADER and key in out:
            value = f"{out[key]},{value}"
        out[key] = value
    return out


def _metadata(request: pb.ProcessingRequest, namespace: str) -> dict[str, Any]:
    meta = request.metadata_context.filter_metadata
    if namespace not in meta:
        return {}
    value = json_format.MessageToDict(meta[namespace])
    return value if isinstance(value, dict) else {}


def subset_hint(request: pb.ProcessingRequest) -> frozenset[str] | None:
    """The gateway's endpoint subset for this request; None when it gave none."""
    hint = _metadata(request, SUBSET_NAMESPACE)
    if SUBSET_KEY not in hint:
        return None
    raw = hint[SUBSET_KEY]
    items = raw if isinstance(raw, list) else [raw]
    out: set[str] = set()
    for item in items:
        if isinstance(item, str):
            out.update(part.strip() for part in item.split(",") if part.strip())
    return frozenset(out)


def with_session(request: RouteRequest, session: str | None) -> RouteRequest:
    """``request`` carrying the session the client named (at most 1,024 characters kept)."""
    session = (session or "").strip()[:1024]
    return dataclasses.replace(request, session=session) if session else request


def _in_subset(endpoint: Endpoint, subset: frozenset[str]) -> bool:
    if endpoint.address in subset:
        return True
    host = endpoint.address.rsplit(":", 1)[0].strip("[]")
    return host in subset  # a bare IP allows every port of it


def destination_response(address: str, extra: Sequence[tuple[str, str]] = ()) -> pb.CommonResponse:
    """The header mutation naming ``address`` (overwrites a client's), route cache cleared;
    ``extra`` headers set too (the trace context of the next hop, when tracing)."""
    return pb.CommonResponse(
        header_mutation=pb.HeaderMutation(
            set_headers=[
                base_pb2.HeaderValueOption(
                    header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                    append_action=_OVERWRITE,
                )
                for key, value in ((DESTINATION_ENDPOINT, address), *extra)
            ]
        ),
        clear_route_cache=True,
    )


def destination_metadata(address: str) -> struct_pb2.Struct:
    meta = struct_pb2.Struct()
    meta.update({DESTINATION_NAMESPACE: {DESTINATION_ENDPOINT: address}})
    return meta


def unavailable(reason: str) -> pb.ProcessingResponse:
    """The protocol's answer when no endpoint may take the request: 503 Service Unavailable.

    In conformance mode a selection header that names no ready endpoint is a 429,
    as GIE's own picker answers (its conformance suite expects it).
    """
    if reason == REASON_SELECTION_EMPTY:
        code, text = http_status_pb2.TooManyRequests, f"no ready endpoint ({reason})"
    elif reason == REFUSED_STREAMS:
        code, text = http_status_pb2.ServiceUnavailable, "too many requests in flight"
    else:
        code, text = http_status_pb2.ServiceUnavailable, f"no ready endpoint ({reason})"
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=code),
            body=f"{text}\n".encode(),
            details=f"cachefleet_router_{reason}",
        )
    )


def selection(value: str) -> frozenset[str]:
    """The items of a conformance selection header (``ip`` or ``ip:port``), brackets dropped."""
    out: set[str] = set()
    for item in value.split(","):
        item = item.strip()
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if sep and port.isdigit() and (host.startswith("[") or ":" not in host):
            out.add(f"{host.strip('[]')}:{port}")
        else:
            out.add(item.strip("[]"))  # a bare IP (v4, or v6 with or without brackets)
    return frozenset(out)


def _selected(endpoint: Endpoint, chosen: frozenset[str]) -> bool:
    """An endpoint named by ``ip:port``, or by its bare IP (every port of it)."""
    host, _, port = endpoint.address.rpartition(":")
    host = host.strip("[]")
    return f"{host}:{port}" in chosen or host in chosen


def _streamed_body(body: bytes, end_of_stream: bool, *, request: bool) -> pb.ProcessingResponse:
    answer = pb.BodyResponse(
        response=pb.CommonResponse(
            body_mutation=pb.BodyMutation(
                streamed_response=pb.StreamedBodyResponse(body=body, end_of_stream=end_of_stream)
            )
        )
    )
    if request:
        return pb.ProcessingResponse(request_body=answer)
    return pb.ProcessingResponse(response_body=answer)


@dataclass
class _Stream:
    """One HTTP request's state across its ext_proc messages."""

    request_mode: int | None = None
    response_mode: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    subset: frozenset[str] | None = None
    #: the body's chunks as they came (handed back in the same pieces in full-duplex mode)
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0
    truncated: bool = False
    routed: bool = False
    decision: Decision | None = None
    request: RouteRequest | None = None
    picker: Picker | None = None
    finished: bool = False
    #: a request body message has arrived (the gateway no longer holds the whole body)
    body_seen: bool = False
    #: the request body's end_of_stream has been handed back (a repeat is dropped)
    body_ended: bool = False
    #: body bytes charged to the global budget
    held: int = 0
    #: conformance mode: the endpoints the selection header allows (None: no header)
    selected: frozenset[str] | None = None
    #: the stream was counted against the stream cap
    counted: bool = False
    #: headers the answer sets besides the destination (tracing: ``traceparent``)
    trace_headers: list[tuple[str, str]] = field(default_factory=list)

    @property
    def duplex(self) -> bool:
        return self.request_mode is None or self.request_mode == _DUPLEX


class EndpointPickerService(pb_grpc.ExternalProcessorServicer):
    """``envoy.service.ext_proc.v3.ExternalProcessor`` answering with the picker's choice."""

    def __init__(
        self,
        picker: Picker,
        ready: Callable[[], Sequence[Endpoint]],
        *,
        fallback: Picker | None = None,
        tenant_header: str = "X-Tenant-ID",
        class_of: ClassOf | None = None,
        objective_class: ClassOf | None = None,
        fail_open: bool = False,
        metrics: RouterMetrics | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_body_memory: int = DEFAULT_MAX_BODY_MEMORY,
        max_streams: int = DEFAULT_MAX_STREAMS,
        conformance: bool = False,
        tokenizer: Tokenization | None = None,
        tracer: PickTracer | None = None,
        session_header: str | None = None,
    ) -> None:
        #: the request header naming a session (the session-affinity filter); None: off
        self.session_header = session_header
        self.tokenizer = tokenizer  # precise routing: real token ids (cachefleet_router.tokens)
        self.picker = picker
        self.fallback: Picker = fallback if fallback is not None else LeastLoadedPicker()
        self.ready = ready
        self.tenant_header = tenant_header
        self.class_of = class_of
        #: GIE objective name -> the class it lowers a request to (None: objectives unread)
        self.objective_class = objective_class
        self.fail_open = fail_open
        self.metrics = metrics if metrics is not None else RouterMetrics()
        self.max_body_bytes = max_body_bytes
        self.budget = BodyBudget(max_body_memory)
        self.max_streams = max_streams
        #: streams open now
        self.streams = 0
        #: request body bytes received, all streams together (for tests and logs)
        self.body_bytes_read = 0
        self.conformance = conformance
        #: spans of the picks and the trace context handed on (None: tracing off)
        self.tracer = tracer

    # ------------------------------------------------------------------ deciding

    def _route(self, st: _Stream) -> Decision:
        """Reduce, pick and record; raises :class:`NoEndpoint`."""
        started = time.perf_counter()
        st.routed = True
        body = b"".join(st.chunks)
        request = reduce_request(
            body,
            st.headers,
            tenant_header=self.tenant_header,
            class_of=self.class_of,
            objective_class=self.objective_class,
            truncated=st.truncated,
        )
        if self.tokenizer is not None and not st.truncated:  # precise routing: cached tokens
            request = self.tokenizer.apply(request, body)
        if self.session_header is not None:  # --session-header: the session-affinity filter
            request = with_session(request, header(st.headers, self.session_header))
        st.request = request
        candidates = list(self.ready())
        reason = REASON_NO_ENDPOINT
        if st.subset is not None:
            subset = st.subset
            candidates = [e for e in candidates if _in_subset(e, subset)]
            reason = REASON_SUBSET_EMPTY
        if st.selected is not None:
            chosen = st.selected
            candidates = [e for e in candidates if _selected(e, chosen)]
            reason = REASON_SELECTION_EMPTY
        # A body that could not be read has no blocks and no token count: the picker places
        # it by load alone, and still counts it (its own bookkeeping sees every request).
        picker = self.picker
        decision = None
        if candidates:
            try:
                decision = picker.pick(request, candidates)
            except Exception:  # a scoring fault must not fail the request: place it by load
                if picker is self.fallback:
                    raise
                log.exception("picker failed; placing the request by load")
                picker = self.fallback
                decision = picker.pick(request, candidates)
        self.metrics.decision_seconds.observe(time.perf_counter() - started)
        if self.tracer is not None:
            st.trace_headers = self.tracer.picked(
                st.headers,
                request,
                decision,
                picker=type(picker).__name__,
                candidates=len(candidates),
                started=started,
                ended=time.perf_counter(),
                refused=reason,
            )
        if decision is None:
            self.metrics.decisions.labels("", reason).inc()
            raise NoEndpoint(reason)
        st.decision, st.picker = decision, picker
        self.metrics.decisions.labels(decision.address, decision.reason or "picked").inc()
        log.debug(
            "request (model %s, tenant %s, %d blocks) -> %s (%s)",
            request.model,
            request.tenant,
            len(request.blocks),
            decision.address,
            decision.reason,
        )
        return decision

    def _finish(self, st: _Stream, *, ok: bool) -> None:
        if st.finished or st.decision is None or st.picker is None or st.request is None:
            return
        st.finished = True
        try:
            st.picker.done(st.decision, st.request, ok=ok)
        except Exception:  # the picker's bookkeeping must not fail the gateway's request
            log.exception("picker.done failed")

    async def _refuse(self, reason: str, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """fail-open: end the stream so that the gateway picks; subset faults are always a 503."""
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"no ready endpoint ({reason})")

    def _fails_open(self, st: _Stream, reason: str) -> bool:
        """End the stream (the gateway then picks) rather than answer 503?

        Only with ``fail_open``, only when no endpoint is ready (or the stream cap
        refused the stream), and only while the gateway still holds the whole
        request: once a body message has come, the gateway cannot fail open any
        more (the client would get a 500), so the answer is the 503.
        """
        return (
            self.fail_open and reason in {REASON_NO_ENDPOINT, REFUSED_STREAMS} and not st.body_seen
        )

    def _release(self, st: _Stream) -> None:
        """The stream's body is no longer held: give its bytes back to the budget."""
        if st.held:
            self.budget.give(st.held)
            st.held = 0
            self.metrics.body_bytes_held.set(self.budget.held)

    # ------------------------------------------------------------------ the stream

    async def Process(  # the gRPC method's name
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        st = _Stream()
        try:
            if self.streams >= self.max_streams:
                self.metrics.refusals.labels(REFUSED_STREAMS).inc()
                log.debug("stream refused: %d streams open", self.streams)
                if self._fails_open(st, REFUSED_STREAMS):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "too many streams")
                # answer the gateway's first message (bounded: a refused stream holds nothing)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(REFUSED_WAIT_S):
                        async for _ in request_iterator:
                            break
                yield unavailable(REFUSED_STREAMS)
                return
            self.streams += 1
            st.counted = True
            self.metrics.streams.set(self.streams)
            async for message in request_iterator:
                if message.HasField("protocol_config"):
                    st.request_mode = message.protocol_config.request_body_mode
                    st.response_mode = message.protocol_config.response_body_mode
                if self.tokenizer is not None:  # precise routing: tokenize before the pick
                    await self._tokenize(st, message)
                try:
                    answers = self._handle(st, message)
                except NoEndpoint as exc:
                    if self._fails_open(st, exc.reason):
                        await self._refuse(exc.reason, context)
                    yield unavailable(exc.reason)
                    return
                for answer in answers:
                    yield answer
        finally:
            self._release(st)
            if st.counted:
                self.streams -= 1
                self.metrics.streams.set(self.streams)
            self._finish(st, ok=False)

    async def _tokenize(self, st: _Stream, message: pb.ProcessingRequest) -> None:
        """Precise routing: the whole body's prompt tokenized (bounded) before ``_route``."""
        if st.routed or st.truncated or self.tokenizer is None:
            return
        if not message.HasField("request_body"):
            return
        chunk = message.request_body
        if not (chunk.end_of_stream or st.request_mode in _BUFFERED):
            return
        if st.size + len(chunk.body) > self.max_body_bytes:
            return
        await self.tokenizer.warm(b"".join([*st.chunks, chunk.body]), self.ready())

    def _handle(self, st: _Stream, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            return self._request_headers(st, message)
        if kind == "request_body":
            return self._request_body(st, message.request_body)
        if kind == "request_trailers":
            out = self._decide_now(st, end_of_stream=False) if not st.routed else []
            return [*out, pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind == "response_headers":
            return self._response_headers(st, message)
        if kind == "response_body":
            chunk = message.response_body
            if st.response_mode is None or st.response_mode == _DUPLEX:
                return [_streamed_body(chunk.body, chunk.end_of_stream, request=False)]
            return [pb.ProcessingResponse(response_body=pb.BodyResponse())]
        if kind == "response_trailers":
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    def _headers_answer(self, st: _Stream, decision: Decision) -> pb.ProcessingResponse:
        response = destination_response(decision.address, st.trace_headers)
        return pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=response),
            dynamic_metadata=destination_metadata(decision.address),
        )

    def _request_headers(
        self, st: _Stream, message: pb.ProcessingRequest
    ) -> list[pb.ProcessingResponse]:
        st.headers = _header_map(message.request_headers)
        st.subset = subset_hint(message)
        if self.conformance and CONFORMANCE_SELECTION in st.headers:
            named = selection(st.headers[CONFORMANCE_SELECTION])
            st.selected = named or None  # an empty header selects nothing: ignored, as GIE's
        if message.request_headers.end_of_stream or st.request_mode in _HEADERS_ONLY:
            return [self._headers_answer(st, self._route(st))]
        if st.request_mode in _BUFFERED:
            return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]
        return []  # full duplex: the headers answer waits for the body

    def _decide_now(self, st: _Stream, *, end_of_stream: bool) -> list[pb.ProcessingResponse]:
        """Route on what has come; in duplex mode, answer the headers and hand the body back."""
        decision = self._route(st)
        held, st.chunks = st.chunks, []
        self._release(st)
        st.body_ended = end_of_stream
        if st.request_mode in _BUFFERED:
            return [
                pb.ProcessingResponse(
                    request_body=pb.BodyResponse(
                        response=destination_response(decision.address, st.trace_headers)
                    ),
                    dynamic_metadata=destination_metadata(decision.address),
                )
            ]
        out = [self._headers_answer(st, decision)]
        for i, piece in enumerate(held):
            last = i == len(held) - 1
            out.append(_streamed_body(piece, end_of_stream and last, request=True))
        if end_of_stream and not held:
            out.append(_streamed_body(b"", True, request=True))
        return out

    def _request_body(self, st: _Stream, chunk: pb.HttpBody) -> list[pb.ProcessingResponse]:
        st.body_seen = True
        self.body_bytes_read += len(chunk.body)
        if st.routed:  # decided already: pass the body on
            if st.duplex:
                if st.body_ended:
                    # the body has ended already: a repeated final chunk (newer Envoy
                    # re-sends it on large bodies) is dropped, not forwarded twice
                    log.debug("request body chunk after end_of_stream dropped")
                    return []
                st.body_ended = chunk.end_of_stream
                return [_streamed_body(chunk.body, chunk.end_of_stream, request=True)]
            return [pb.ProcessingResponse(request_body=pb.BodyResponse())]
        st.chunks.append(chunk.body)
        st.size += len(chunk.body)
        final = chunk.end_of_stream or st.request_mode in _BUFFERED
        if st.size > self.max_body_bytes:
            st.truncated = True
            self.metrics.refusals.labels(REFUSED_BODY_SIZE).inc()
        elif not final:
            # full duplex: hold the chunk until the body is complete, within the budget
            if self.budget.take(len(chunk.body)):
                st.held += len(chunk.body)
                self.metrics.body_bytes_held.set(self.budget.held)
                return []
            st.truncated = True  # no room: route by load on what was read, hold nothing
            self.metrics.refusals.labels(REFUSED_BODY_MEMORY).inc()
        return self._decide_now(st, end_of_stream=chunk.end_of_stream)

    def _response_headers(
        self, st: _Stream, message: pb.ProcessingRequest
    ) -> list[pb.ProcessingResponse]:
        headers = _header_map(message.response_headers)
        try:
            status = int(headers.get(":status", "200"))
        except ValueError:
            status = 500
        served = _metadata(message, DESTINATION_NAMESPACE).get(SERVED_ENDPOINT)
        if (
            isinstance(served, str)
            and st.decision is not None
            and served.split(",")[0].strip() != st.decision.address
        ):
            self.metrics.served_mismatch.inc()
            log.info("picked %s, the gateway says %s served", st.decision.address, served)
        self._finish(st, ok=status < 500)
        if self.conformance:
            return [_served_header(message)]
        return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]


def _served_header(message: pb.ProcessingRequest) -> pb.ProcessingResponse:
    """Conformance mode: the gateway's served endpoint as a response header (GIE's wording
    when it did not say)."""
    if DESTINATION_NAMESPACE not in message.metadata_context.filter_metadata:
        value = "fail: missing envoy lb metadata"
    else:
        served = _metadata(message, DESTINATION_NAMESPACE).get(SERVED_ENDPOINT)
        value = (
            served
            if isinstance(served, str)
            else "fail: missing destination endpoint served metadata"
        )
    mutation = pb.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=CONFORMANCE_SERVED, raw_value=value.encode()),
                append_action=_OVERWRITE,
            )
        ]
    )
    return pb.ProcessingResponse(
        response_headers=pb.HeadersResponse(response=pb.CommonResponse(header_mutation=mutation))
    )
