"""Relaying to the model server: forwarded headers, passthrough, streaming relay, readiness.

:class:`Relay` sends a request upstream (or finishes one the fast path sent),
relays the answer as it comes (sized answers in one write, anything else as
it arrives), and counts it. The answer of the model server is never changed.

A model answer (``model`` given: a POST; the model's name when the request was
read, "" otherwise) is also timed for the tenant's SLO: a streamed one
(``text/event-stream``, relayed as it comes) by its SSE data events
(:class:`~cachefleet_sidecar.observe.tokentimes.EventTimes`: time to first
token and the mean inter-token gap), any other by the whole answer
(:meth:`Relay.answered`). Only 2xx answers are timed: an error carries no token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from cachefleet_sidecar.http.gate import AdmissionGate
from cachefleet_sidecar.http.server import Connection, Request, error_response
from cachefleet_sidecar.http.upstream import Begun, UpstreamError, UpstreamPool
from cachefleet_sidecar.http.wire import FORWARD_DROP, reason_phrase
from cachefleet_sidecar.observe.metrics import SidecarMetrics
from cachefleet_sidecar.observe.tokentimes import EventTimes

log = logging.getLogger("cachefleet.sidecar")

#: Largest sized upstream answer sent in one write once complete; larger ones stream.
MAX_BUFFERED_BYTES = 1024 * 1024
#: How long a successful upstream answer keeps /readyz green without a probe.
READY_FRESH_S = 5.0


# ----------------------------------------------------------------- rate limits
#: Largest answer held to read its ``usage`` when a rate-limited bypass is relayed.
USAGE_CAPTURE_BYTES = 256 * 1024


class RateTicket(Protocol):
    """One admission by the :class:`RateGate` (tenancy.limits_redis.Ticket)."""

    @property
    def refusal(self) -> bytes | None: ...
    @property
    def x_cache_tail(self) -> bytes: ...


class RateGate(Protocol):
    """Per-tenant request and token limits (tenancy.limits_redis.RateLimiter), asked only
    for requests that reach the model server, and for cache hits when ``count_hits``."""

    count_hits: bool

    def limited(self, tenant: str) -> bool: ...
    async def admit(
        self, tenant: str, body: bytes, *, request: bool = True, tokens: bool = True
    ) -> RateTicket: ...
    def settle(self, ticket: RateTicket, status: int | None, body: bytes | None) -> None: ...


# -----------------------------------------------------------------------------


class Relay:
    """Forwards requests to the model server and relays its answers to the client."""

    def __init__(
        self,
        *,
        tenant_header: str,
        upstream: UpstreamPool,
        metrics: SidecarMetrics,
        gate: AdmissionGate | None,
        priority_class: Callable[[str], str | None],
        rates: RateGate | None = None,
    ) -> None:
        #: Per-tenant rate limits (None: none configured).
        self.rates = rates
        self.upstream = upstream
        self.metrics = metrics
        self.gate = gate
        self._priority_class = priority_class
        self.tenant_header = tenant_header.lower().encode()
        self._last_upstream_ok = 0.0

    async def admit(self, tenant: str, headers: list[tuple[bytes, bytes]]) -> bytes | None:
        """Admission's refusal of a request about to go upstream (None: it may go)."""
        assert self.gate is not None
        return await self.gate.admit(tenant, self._priority_class(tenant), headers=headers)

    async def ready(self) -> bool:
        """Whether the model server answers (a recent answer counts; else a probe)."""
        if time.monotonic() - self._last_upstream_ok < READY_FRESH_S:
            return True
        ok = await self.upstream.probe()
        if ok:
            self._last_upstream_ok = time.monotonic()
        return ok

    def upstream_headers(
        self, headers: list[tuple[bytes, bytes]], tenant: str, drop: bytes = b""
    ) -> list[tuple[bytes, bytes]]:
        """Request headers for upstream, the tenant header saying the tenant that was decided.

        Names that read as the tenant header to a server that folds ``_`` into ``-``
        (``X_Tenant_ID``) are dropped too.
        """
        name = self.tenant_header
        out = [
            (n, v)
            for n, v in headers
            if n != name and n != drop and (b"_" not in n or n.replace(b"_", b"-") != name)
        ]
        out.append((name, tenant.encode()))
        return out

    async def passthrough(
        self,
        request: Request,
        conn: Connection,
        *,
        tenant: str | None,
        reason: str | None,
        counted: bool = False,
        model: str = "",
    ) -> None:
        """Relay a request the cache does not answer (``counted``: the rate limits have
        counted it already, as a hit would be with ``--limits-count-hits``)."""
        headers = request.headers
        ticket: RateTicket | None = None
        x_cache = b"BYPASS"
        if tenant is not None:
            headers = self.upstream_headers(headers, tenant)
            # only a POST is model work worth holding back (a GET /v1/models costs no GPU)
            rates = self.rates
            if rates is not None and request.method == b"POST" and rates.limited(tenant):
                ticket = await rates.admit(tenant, request.body, request=not counted)
                if ticket.refusal is not None:
                    conn.write(ticket.refusal)
                    return
                x_cache += ticket.x_cache_tail
            if (
                self.gate is not None
                and request.method == b"POST"
                and (refused := await self.admit(tenant, request.headers)) is not None
            ):
                if ticket is not None and self.rates is not None:
                    self.rates.settle(ticket, None, None)
                conn.write(refused)
                return
        captured = await self.forward(
            request,
            conn,
            headers,
            x_cache,
            tenant=tenant,
            capture=0 if ticket is None else USAGE_CAPTURE_BYTES,
            model=model if request.method == b"POST" else None,
        )
        if ticket is not None and self.rates is not None:
            # no answer (None): the tokens go back; else the answer's usage corrects them
            if captured is None:
                self.rates.settle(ticket, None, None)
            else:
                self.rates.settle(ticket, captured[0], captured[2])
        if tenant is not None:
            result = "bypass" if captured is not None else "error"
            self.metrics.tenant(tenant).request(
                "upstream", result, time.perf_counter() - request.started
            )
        if reason is not None:
            log.debug("bypass %s: %s", request.url, reason)

    async def forward(
        self,
        request: Request,
        conn: Connection,
        headers: list[tuple[bytes, bytes]],
        x_cache: bytes,
        *,
        tenant: str | None,
        capture: int,
        begun: Begun | None = None,
        started: float | None = None,
        model: str | None = None,
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes | None] | None:
        """Forward to upstream (or finish ``begun``, sent at ``started``) and relay the
        answer; None when it broke.

        Returns the status, the headers and the body when the body is at most
        ``capture`` bytes (else None in its place: nothing larger is held).
        An HTTP/1.0 client never sees chunked framing: an answer of unknown
        length is relayed as it comes and ended by closing the connection.
        ``model`` (None: not a model answer) names the model the answer is timed for.
        """
        t0 = time.perf_counter() if started is None else started
        try:
            if begun is not None:
                resp = await self.upstream.finish(begun)
            else:
                resp = await self.upstream.request(
                    request.method, request.url, headers, request.body
                )
        except UpstreamError as exc:
            conn.write(
                error_response(
                    503 if exc.overloaded else 504 if exc.timed_out else 502,
                    f"upstream unavailable: {exc}",
                    "cachefleet_upstream",
                    code=False,
                    extra=b"x-cache: %s\r\n%s"
                    % (x_cache, b"retry-after: 1\r\n" if exc.overloaded else b""),
                )
            )
            if tenant is not None:
                self.metrics.tenant(tenant).request(
                    "upstream", "error", time.perf_counter() - request.started
                )
            return None
        # A 204 has no body and may not say a length (RFC 9110 8.6); a 304's is the GET's.
        length = resp.content_length if resp.status != 204 else None
        no_body = request.method == b"HEAD" or resp.status in (204, 304) or 100 <= resp.status < 200
        unsized = length is None and not no_body
        chunked = unsized and not request.http10
        pending = self.relay_head(request, resp.status, resp.headers, length, x_cache, chunked)
        if unsized and not chunked:  # HTTP/1.0: the end of the body is the end of the connection
            request.keep_alive = False
        # A sized answer that fits is sent in one write once complete (one syscall,
        # and a truncated body can still become a clean 502); anything else
        # (SSE, chunked, large) is relayed as it arrives, the head with the first bytes.
        buffered = length is not None and length <= MAX_BUFFERED_BYTES
        keep = capture if not buffered else max(capture, length or 0)
        parts: list[bytes] = []
        held: int | None = 0
        timed = model is not None and tenant is not None and 200 <= resp.status < 300
        events = EventTimes() if timed and not buffered and _event_stream(resp.headers) else None
        try:
            async for chunk in resp.chunks():
                if events is not None:
                    events.feed(chunk, time.perf_counter())
                if held is not None:
                    held += len(chunk)
                    if held <= keep:
                        parts.append(chunk)
                    else:
                        parts.clear()
                        held = None  # too large to keep: relay only
                if buffered:
                    continue
                data = b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk
                conn.write(pending + data if pending else data)
                pending = b""
                await conn.drain()
        except UpstreamError as exc:
            log.warning("upstream broke mid-response for %s: %s", request.url, exc)
            if buffered:
                conn.write(
                    error_response(
                        502,
                        f"upstream answer incomplete: {exc}",
                        "cachefleet_upstream",
                        code=False,
                        extra=b"x-cache: %s\r\n" % x_cache,
                    )
                )
            else:
                conn.abort()
            if tenant is not None:
                self.metrics.tenant(tenant).request(
                    "upstream", "error", time.perf_counter() - request.started
                )
                if events is not None and events.first is not None:  # its first token came
                    self.answered(tenant, model or "", events.first - request.started, None)
            return None
        whole = b"".join(parts) if held is not None else None
        if buffered or pending:
            conn.write(pending + (whole or b"") if buffered else pending)
        if chunked:
            conn.write(b"0\r\n\r\n")
        if tenant is None:
            self._last_upstream_ok = time.monotonic()
        else:
            now = time.perf_counter()
            self.forwarded(tenant, x_cache, now - t0, now - request.started)
            if timed:
                first = now if events is None or events.first is None else events.first
                gap = None if events is None else events.mean_gap()
                self.answered(tenant, model or "", first - request.started, gap)
        return resp.status, resp.headers, whole if held is not None and held <= capture else None

    def relay_head(
        self,
        request: Request,
        status: int,
        resp_headers: list[tuple[bytes, bytes]],
        length: int | None,
        x_cache: bytes,
        chunked: bool = False,
    ) -> bytes:
        """The head relayed to the client for an upstream answer (``length`` None: unsized)."""
        head = [b"HTTP/1.1 %d %s\r\n" % (status, reason_phrase(status))]
        head += [n + b": " + v + b"\r\n" for n, v in resp_headers if n not in FORWARD_DROP]
        if length is not None:
            head.append(b"content-length: %d\r\n" % length)
        elif chunked:
            head.append(b"transfer-encoding: chunked\r\n")
        elif request.method != b"HEAD" and not (status in (204, 304) or 100 <= status < 200):
            head.append(b"connection: close\r\n")
        head.append(b"x-cache: %s\r\n\r\n" % x_cache)
        return b"".join(head)

    def answered(self, tenant: str, model: str, ttft_s: float, itl_s: float | None) -> None:
        """Count a model answer's time to first token (and mean inter-token gap)."""
        self.metrics.tenant(tenant).answered(model, ttft_s, itl_s)

    def forwarded(self, tenant: str, x_cache: bytes, upstream_s: float, seconds: float) -> None:
        """Count an answer relayed from upstream (its upstream time, and a miss's latency)."""
        self._last_upstream_ok = time.monotonic()
        tm = self.metrics.tenant(tenant)
        tm.upstream.observe(upstream_s)
        if x_cache.startswith(b"MISS"):
            tm.request("upstream", "miss", seconds)


def _event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether an answer is a server-sent event stream (by its content-type)."""
    return any(n == b"content-type" and b"text/event-stream" in v.lower() for n, v in headers)
