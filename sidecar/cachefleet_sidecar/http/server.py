"""HTTP/1.1 server side: a raw asyncio protocol over ``httptools``.

This is the sidecar's hot loop. A connection parses requests with
``httptools`` callbacks and hands each complete request to a
:class:`Handler`. The handler first gets a synchronous chance
(:meth:`Handler.fast`): an L1 hit is answered inside ``data_received`` with
one ``transport.write`` of ready-made bytes, no task, no future. It may also
hand back a future it started (an L2 read in flight): when that is done the
connection calls :meth:`Handler.resume` from the future's callback, again
without a task, and the answer goes out the same way. Everything else
becomes one task per request (:meth:`Handler.handle`). Pipelined requests
are answered in order; keep-alive follows the client.

Answers of one loop turn go out together (:class:`Outbox`, in :mod:`.outbox`): the first one is
written at once, those that follow it in the same turn (hits parsed from the
same poll, the L2 replies of one read) at the turn's end, so a burst of
answers wakes each client once rather than once per answer. The bookkeeping
of fast-path answers (:meth:`Outbox.later`) runs after the turn's answers
are written.

Every resource a client can make the sidecar hold has a bound
(:class:`Limits`, enforced per connection and, for request bodies, across
connections by a :class:`Limiter`), and each bound has its own answer:
a request target over ``max_url_bytes`` gets 414, a header block over
``max_header_bytes`` 431, a body over ``max_body_bytes`` 413 (before it is
read when ``Content-Length`` says so), a body that would take the bodies held
by all connections over the memory budget 503, a head not complete within
``header_timeout_s`` or a body stalled for ``body_timeout_s`` 408. Trailer
fields of a chunked body are bounded and dropped (never request headers). A refused
connection is half-closed and drained for a moment so the client can read
its answer. Idle keep-alive connections close after ``idle_timeout_s``.
A request asking to switch protocols (``Connection: Upgrade``, ``CONNECT``)
gets one 501 before anything of it is handed on. An absolute-form target
(``POST http://host/v1/chat/completions``) is reduced to its path and query
before the handler sees it; any other target that is not a path (but
``OPTIONS *``) gets 400.
Back-pressure: a connection stops being read while ``max_pipelined``
requests wait, or while the client does not read its answers (the
transport's write buffer is full); a client that leaves answers unread for
``send_timeout_s`` is dropped. The checks on the hit path are integer
comparisons; time is a coarse clock kept by the limiter's sweeper (one timer
for all connections), so timeouts fire within a quarter of their length.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, cast

import httptools
import orjson
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from cachefleet_sidecar.http.outbox import Outbox
from cachefleet_sidecar.http.wire import reason_phrase

log = logging.getLogger("cachefleet.sidecar")

#: How long a refused connection is drained (so the client reads its answer), seconds.
LINGER_S = 2.0
#: Most bytes drained from a refused connection before it is closed.
LINGER_MAX_BYTES = 8 * 1024 * 1024
#: Most header fields in one request (each costs a Python object beyond its bytes).
MAX_HEADER_FIELDS = 256
#: Reads larger than this are parsed in slices of it, so a full request queue
#: stops parsing within one slice (bounds what a pipelining client can queue).
FEED_SLICE = 8192
#: Longest interval of the sweeper that enforces timeouts, seconds.
MAX_SWEEP_INTERVAL_S = 1.0

_IDLE, _HEAD, _BODY = 0, 1, 2
#: A body of at least this many bytes is charged to the body budget twice: besides the
#: request's own copy, the upstream connection's send buffer holds a second one until the
#: model server has read it (the upstream client writes such a body on its own). Smaller
#: bodies are charged their size.
LARGE_BODY_BYTES = 64 * 1024


def body_cost(nbytes: int) -> int:
    """What a body of ``nbytes`` is charged to the body memory budget."""
    return nbytes if nbytes < LARGE_BODY_BYTES else 2 * nbytes


BUDGET_EXHAUSTED = b"request bodies in flight exceed the sidecar's memory budget"
UPGRADE_REFUSED = (
    b"protocol upgrades (Connection: Upgrade, CONNECT) are not supported by the cachefleet sidecar"
)


def origin_form(target: bytes) -> bytes | None:
    """The path and query of an absolute-form request target (``http://host/p?q`` -> ``/p?q``);
    None when ``target`` is not an http(s) URL."""
    scheme, sep, rest = target.partition(b"://")
    if not sep or scheme.lower() not in (b"http", b"https"):
        return None
    cuts = [i for i in (rest.find(b"/"), rest.find(b"?")) if i >= 0]
    tail = rest[min(cuts) :] if cuts else b""
    return tail if tail.startswith(b"/") else b"/" + tail


@dataclass(frozen=True, slots=True)
class Limits:
    """What one client may make the sidecar hold; these defaults are the flags' defaults."""

    max_url_bytes: int = 16 * 1024
    max_header_bytes: int = 64 * 1024
    max_body_bytes: int = 32 * 1024 * 1024
    body_memory_bytes: int = 256 * 1024 * 1024
    max_pipelined: int = 32
    idle_timeout_s: float = 75.0
    header_timeout_s: float = 15.0
    body_timeout_s: float = 60.0
    send_timeout_s: float = 60.0


class Limiter:
    """Shared by a server's connections: the body memory budget, the registry, the clock,
    and the :class:`Outbox` of their answers.

    ``now`` is a coarse monotonic clock refreshed by :meth:`sweep`, which also
    enforces every connection's timeouts; :meth:`start` runs it every quarter
    of the shortest timeout (at most :data:`MAX_SWEEP_INTERVAL_S`).
    """

    def __init__(self, limits: Limits | None = None, outbox: Outbox | None = None) -> None:
        self.limits = limits or Limits()
        self.outbox = outbox or Outbox()
        self.connections: set[Connection] = set()
        self.body_bytes = 0
        #: Requests refused by a limit, by status (414, 431, 413, 503, 408, 400, 501).
        self.refused: dict[int, int] = {}
        #: Connections dropped for leaving their answers unread.
        self.dropped_unread = 0
        self.now = time.monotonic()
        lim = self.limits
        shortest = min(
            lim.idle_timeout_s, lim.header_timeout_s, lim.body_timeout_s, lim.send_timeout_s
        )
        self.interval = min(MAX_SWEEP_INTERVAL_S, shortest / 4)
        self._timer: asyncio.TimerHandle | None = None

    def take(self, nbytes: int) -> bool:
        """Charge request body bytes to the budget; False when it would overflow."""
        if self.body_bytes + nbytes > self.limits.body_memory_bytes:
            return False
        self.body_bytes += nbytes
        return True

    def give(self, nbytes: int) -> None:
        self.body_bytes -= nbytes

    def families(self, cache: str) -> Iterator[Metric]:
        """Client-side limits at scrape time (docs/limits.md)."""
        refused = CounterMetricFamily(
            "cachefleet_refused_requests",
            "Requests refused by a client-side limit, by HTTP status.",
            labels=["cache", "status"],
        )
        for code, count in sorted(self.refused.items()):
            refused.add_metric([cache, str(code)], count)
        dropped = CounterMetricFamily(
            "cachefleet_unread_dropped_connections",
            "Connections dropped for leaving their answers unread past --send-timeout.",
            labels=["cache"],
        )
        dropped.add_metric([cache], self.dropped_unread)
        held = GaugeMetricFamily(
            "cachefleet_request_body_bytes",
            "Request body bytes charged to --max-body-memory now (64 KiB+ bodies count twice).",
            labels=["cache"],
        )
        held.add_metric([cache], self.body_bytes)
        conns = GaugeMetricFamily(
            "cachefleet_client_connections", "Open client connections.", labels=["cache"]
        )
        conns.add_metric([cache], len(self.connections))
        yield from (refused, dropped, held, conns)

    def start(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.interval, self._tick)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self) -> None:
        self._timer = None
        self.sweep()
        self.start()

    def sweep(self) -> None:
        """Refresh the clock and enforce every connection's timeouts."""
        self.now = now = time.monotonic()
        for conn in list(self.connections):
            conn.check_timeouts(now)


class Request:
    """One parsed request; ``memo`` carries what the fast path already computed."""

    __slots__ = (
        "body",
        "charged",
        "headers",
        "http10",
        "keep_alive",
        "memo",
        "method",
        "peer",
        "started",
        "url",
    )

    def __init__(
        self,
        method: bytes,
        url: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        keep_alive: bool,
        started: float,
        peer: str | None = None,
        http10: bool = False,
    ) -> None:
        self.method = method
        self.url = url
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.started = started
        #: IP address of the client socket (the proxy in front, if any).
        self.peer = peer
        #: An HTTP/1.0 client: no chunked framing in its answers.
        self.http10 = http10
        self.memo: object = None
        #: Body bytes charged to the limiter's budget until the request is done.
        self.charged = 0

    def header(self, name: bytes) -> bytes | None:
        """First value of a header (``name`` in lower case)."""
        for key, value in self.headers:
            if key == name:
                return value
        return None


class Handler(Protocol):
    def fast(self, request: Request) -> bytes | asyncio.Future[Any] | None:
        """The answer now, a future to :meth:`resume` on, or None for :meth:`handle`."""
        ...

    def resume(self, request: Request) -> bytes | asyncio.Future[Any] | None:
        """Once :meth:`fast`'s (or the last :meth:`resume`'s) future is done: the
        answer, another future to resume on, or None for :meth:`handle`.

        None must be safe after the client left: :meth:`handle` then runs all
        the same (a handler may have work in flight for the request).
        """
        ...

    async def handle(self, request: Request, conn: Connection) -> None: ...


class Connection(asyncio.Protocol):
    """One client connection."""

    # Slots: the parser callbacks read and write these on every request.
    __slots__ = (
        "__weakref__",
        "_body",
        "_body_len",
        "_body_rx",
        "_charged",
        "_drain_waiter",
        "_drained",
        "_error",
        "_final",
        "_head_rx",
        "_headers",
        "_http10",
        "_max_body",
        "_max_body_rx",
        "_max_header",
        "_max_url",
        "_phase",
        "_precharged",
        "_read_len",
        "_read_paused",
        "_refused",
        "_since",
        "_started",
        "_stash",
        "_trailer_len",
        "_unread",
        "_url",
        "_url_len",
        "_write_paused",
        "_write_paused_at",
        "busy",
        "closing",
        "handler",
        "held",
        "limiter",
        "limits",
        "outbox",
        "parser",
        "peer",
        "pending",
        "transport",
    )

    def __init__(self, handler: Handler, limiter: Limiter) -> None:
        self.handler = handler
        self.limiter = limiter
        self.limits = lim = limiter.limits
        self.outbox = limiter.outbox
        #: Answers the :class:`Outbox` holds for the end of this loop turn.
        self.held: list[bytes] = []
        # Plain attributes: the parser callbacks compare against them on every request.
        self._max_url = lim.max_url_bytes
        self._max_header = lim.max_header_bytes
        self._max_body = lim.max_body_bytes
        # Wire bytes a body may take: chunk framing and trailers on top of the data.
        self._max_body_rx = 2 * lim.max_body_bytes + lim.max_header_bytes
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.pending: deque[Request] = deque()
        self.busy = False
        self.closing = False
        self._url: list[bytes] = []
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._body_len = 0
        self._started = 0.0
        self.peer: str | None = None
        # limits
        self._phase = _IDLE
        self._since = limiter.now
        self._head_rx = 0
        self._body_rx = 0
        self._trailer_len = 0
        self._url_len = 0
        self._charged = 0
        self._precharged = False
        self._error: tuple[int, bytes] | None = None
        self._final: bytes | None = None
        self._refused = False
        self._drained = 0
        self._read_paused = False
        self._write_paused = False
        self._write_paused_at = 0.0
        self._unread = 0
        self._drain_waiter: asyncio.Future[None] | None = None
        self._stash: list[bytes] = []
        self._read_len = 0
        self._http10: bool | None = None

    # --- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; same interface.
        self.transport = cast(asyncio.Transport, transport)
        peername = transport.get_extra_info("peername")
        if isinstance(peername, tuple) and peername:
            self.peer = str(peername[0])
        self.limiter.connections.add(self)
        self._since = self.limiter.now

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.limiter.connections.discard(self)
        if self._charged:
            self.limiter.give(self._charged)
            self._charged = 0
        while self.pending:
            self._release(self.pending.popleft())
        self._stash.clear()
        self.held.clear()
        self._wake_drain()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            self._drained += len(data)
            if self._drained > LINGER_MAX_BYTES:
                self.close()
            return
        if self._stash:
            self._stash.append(data)  # the queue is full: parse it once it drains
            return
        if len(data) > FEED_SLICE:
            self._feed(data)
            return
        # One read, one request or a few: the common case, without _feed's loop.
        self._read_len = size = len(data)
        if self._phase == _BODY:
            self._since = self.limiter.now
            self._body_rx += size
        else:
            self._head_rx += size
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._parse_error(exc)
            return
        if self._phase != _IDLE:
            self._check_head()

    def _feed(self, data: bytes) -> None:
        """Parse ``data``; a large read is parsed in slices so a full queue stops it."""
        size = len(data)
        pos = 0
        while pos < size:
            piece = data if size <= FEED_SLICE else data[pos : pos + FEED_SLICE]
            pos += len(piece)
            self._read_len = len(piece)
            if self._phase == _BODY:
                self._since = self.limiter.now
                self._body_rx += len(piece)
            else:
                self._head_rx += len(piece)
            try:
                self.parser.feed_data(piece)
            except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
                self._parse_error(exc)
                return
            if self._phase != _IDLE and self._check_head():
                return
            if pos < size and len(self.pending) >= self.limits.max_pipelined:
                self._stash.append(data[pos:])
                self._update_reading()
                return

    def _parse_error(self, exc: Exception) -> None:
        if isinstance(exc, httptools.HttpParserUpgrade):
            self.reject(501, UPGRADE_REFUSED)
        elif self._error is not None:
            self.reject(*self._error)
        else:
            self.reject(400, b"malformed HTTP request: " + str(exc).encode())

    def _check_head(self) -> bool:
        """Refuse a message still unfinished past its bound; True when refused.

        httptools holds an unfinished header line (or trailer) itself, so the
        bytes received for the head, and for the body with its framing and
        trailers, are bounded here, after each read.
        """
        lim = self.limits
        if self._phase == _BODY:
            if self._body_rx <= self._max_body_rx:
                return False
            self.reject(413, b"request body framing larger than %d bytes" % self._max_body_rx)
            return True
        if self._head_rx <= lim.max_url_bytes + lim.max_header_bytes:
            return False
        if self._url_len > lim.max_url_bytes:
            self.reject(414, b"request target longer than %d bytes" % lim.max_url_bytes)
        else:
            self.reject(431, b"request header block larger than %d bytes" % lim.max_header_bytes)
        return True

    def _unstash(self) -> None:
        """The queue has room again: parse what was held back."""
        if self._stash and len(self.pending) < self.limits.max_pipelined and not self.closing:
            data = b"".join(self._stash)
            self._stash.clear()
            self._feed(data)
            self._update_reading()

    def pause_writing(self) -> None:
        """The client is not reading its answers: stop reading its requests."""
        self._write_paused = True
        self._write_paused_at = self.limiter.now
        self._unread = self.transport.get_write_buffer_size() if self.transport else 0
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_drain()
        self._update_reading()
        if not self.busy and self.pending and not self.closing:
            self._dispatch(self.pending.popleft())
        self._unstash()

    # --- httptools callbacks
    def on_message_begin(self) -> None:
        self._started = time.perf_counter()
        self._phase = _HEAD
        self._since = self.limiter.now
        self._url.clear()
        self._headers = []
        self._body.clear()
        self._body_len = 0
        self._url_len = 0
        self._precharged = False

    def on_url(self, url: bytes) -> None:
        self._url_len += len(url)
        if self._url_len > self._max_url:
            self._fail(414, b"request target longer than %d bytes" % self._max_url)
        self._url.append(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._phase == _BODY:
            # A trailer field of a chunked body: bounded, and never a request
            # header (nothing, the tenant least of all, may come from trailers).
            self._trailer_len += len(name) + len(value) + 4
            if self._trailer_len > self._max_header:
                self._fail(431, b"trailer fields larger than %d bytes" % self._max_header)
            return
        # Head sizes are checked per read (_check_head) and once the head is complete.
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self._phase = _BODY
        self._body_rx = 0
        self._trailer_len = 0
        limiter = self.limiter
        self._since = limiter.now
        headers = self._headers
        if len(headers) > MAX_HEADER_FIELDS:
            self._fail(431, b"more than %d header fields" % MAX_HEADER_FIELDS)
        # The head arrived within the reads counted in _head_rx plus the current
        # one (a pipelined head may have started in it after _head_rx was reset):
        # only a head that may be too large is measured exactly.
        if self._head_rx + self._read_len > self._max_header and (
            sum(len(n) + len(v) + 4 for n, v in headers) > self._max_header
        ):
            self._fail(431, b"request header block larger than %d bytes" % self._max_header)
        expect = False
        for name, value in headers:
            if name == b"content-length":
                length = int(value) if value.isdigit() else 0
                if length > self._max_body:
                    self._fail(413, b"request body larger than %d bytes" % self._max_body)
                if length:  # reserve the whole body now (inline: this is the hit path)
                    if length >= LARGE_BODY_BYTES:
                        length = body_cost(length)
                    if limiter.body_bytes + length > self.limits.body_memory_bytes:
                        self._fail(503, BUDGET_EXHAUSTED)
                    limiter.body_bytes += length
                    self._charged += length
                    self._precharged = True
            elif name == b"expect" and value.lower() == b"100-continue":
                expect = True
        if self.parser.should_upgrade():
            # Refused before the request is handed on: one answer, nothing sent upstream.
            self._fail(501, UPGRADE_REFUSED)
        if expect and self.transport and not self._is_http10():
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # after any answer held

    def on_body(self, body: bytes) -> None:
        self._body_len += len(body)
        if self._body_len > self._max_body:
            self._fail(413, b"request body larger than %d bytes" % self._max_body)
        if not self._precharged:
            n = self._body_len
            self._charge(body_cost(n) - body_cost(n - len(body)))
        self._body.append(body)

    def on_message_complete(self) -> None:
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        # The chunks are dropped now, not when the connection's next request
        # begins: kept, an idle keep-alive connection would hold its last body twice.
        self._body.clear()
        url = self._url[0] if len(self._url) == 1 else b"".join(self._url)
        method = self.parser.get_method()
        if url[:1] != b"/" and not (url == b"*" and method == b"OPTIONS"):
            origin = origin_form(url)
            if origin is None:
                self._fail(400, b"request target is neither a path nor an http(s) URL")
            url = origin
        request = Request(
            method,
            url,
            self._headers,
            body,
            self.parser.should_keep_alive(),
            self._started,
            self.peer,
            self._http10 if self._http10 is not None else self._is_http10(),
        )
        if self._charged:
            request.charged = self._charged
            self._charged = 0
        self._phase = _IDLE  # idle from the head's start: a hit is answered right now
        self._head_rx = 0
        if self.busy or self._write_paused:
            self.pending.append(request)
            if len(self.pending) >= self.limits.max_pipelined:
                self._update_reading()
        else:
            self._dispatch(request)

    # --- limits
    def _fail(self, status: int, reason: bytes) -> NoReturn:
        """Stop parsing this connection with ``status`` (raised through httptools)."""
        self._error = (status, reason)
        raise httptools.HttpParserError(reason.decode())

    def _charge(self, nbytes: int) -> None:
        if not self.limiter.take(nbytes):
            self._fail(503, BUDGET_EXHAUSTED)
        self._charged += nbytes

    def _is_http10(self) -> bool:
        """Whether the client speaks HTTP/1.0, read from its first request.

        Asking the parser is a call into C on every request that shows in an
        L1 hit's cost, so it is asked once per connection (a client does not change its version
        between requests on one connection).
        """
        http10 = self._http10
        if http10 is None:
            http10 = self._http10 = self.parser.get_http_version() == "1.0"
        return http10

    def _release(self, request: Request) -> None:
        if request.charged:
            self.limiter.give(request.charged)
            request.charged = 0

    def _update_reading(self) -> None:
        if self.transport is None or self.closing:
            return
        pause = (
            self._write_paused
            or bool(self._stash)
            or len(self.pending) >= self.limits.max_pipelined
        )
        if pause and not self._read_paused and not self._refused:
            self._read_paused = True
            self.transport.pause_reading()
        elif not pause and self._read_paused:
            self._read_paused = False
            self.transport.resume_reading()

    def check_timeouts(self, now: float) -> None:
        """Called by the limiter's sweeper: close what has waited too long."""
        if self.closing:
            return
        lim = self.limits
        if self._write_paused:
            size = self.transport.get_write_buffer_size() if self.transport else 0
            if size < self._unread:  # the client reads, slowly: that is progress
                self._unread = size
                self._write_paused_at = now
            elif now - self._write_paused_at > lim.send_timeout_s:
                log.info("dropping a client that left its answers unread")
                self.limiter.dropped_unread += 1
                self.abort()
        elif self._refused:
            if self._final is None and now - self._since > LINGER_S:
                self.close()
        elif self.busy or self.pending:
            return
        elif self._phase == _IDLE:
            if now - self._since > lim.idle_timeout_s:
                self.close()
        elif self._phase == _HEAD:
            if now - self._since > lim.header_timeout_s:
                self.reject(408, b"request head not complete within %gs" % lim.header_timeout_s)
        elif now - self._since > lim.body_timeout_s:
            self.reject(408, b"request body stalled for %gs" % lim.body_timeout_s)

    async def drain(self) -> None:
        """Wait while the client is not reading (bounded by the send timeout's sweeper)."""
        if not self._write_paused or self.closing:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._drain_waiter = waiter
        try:
            await waiter
        finally:
            self._drain_waiter = None

    def _wake_drain(self) -> None:
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # --- dispatch
    def _dispatch(self, request: Request) -> None:
        while True:
            response = self.handler.fast(request)
            if response is None:
                break
            if not isinstance(response, bytes):  # in flight: resumed from its callback
                self.busy = True
                response.add_done_callback(functools.partial(self._resume, request=request))
                return
            if request.charged:
                self.limiter.body_bytes -= request.charged
                request.charged = 0
            if not self.closing:
                self.outbox.answer(self, response)
            if not request.keep_alive:
                self.close()
                return
            if not self.pending or self._write_paused:
                if self._final is not None and not self.pending:
                    self._send_final()
                if self._read_paused:
                    self._update_reading()
                return
            request = self.pending.popleft()
        self.busy = True
        task = asyncio.get_running_loop().create_task(self.handler.handle(request, self))
        task.add_done_callback(functools.partial(self._done, request=request))

    def _resume(self, _future: asyncio.Future[Any], *, request: Request) -> None:
        """:meth:`Handler.fast`'s future is done: answer now, wait again, or go the slow way."""
        try:
            response = self.handler.resume(request)
        except Exception:
            log.exception("request handler failed")
            response = None
        if response is None:  # even for a client that left: what is in flight is finished
            task = asyncio.get_running_loop().create_task(self.handler.handle(request, self))
            task.add_done_callback(functools.partial(self._done, request=request))
            return
        if not isinstance(response, bytes):
            response.add_done_callback(functools.partial(self._resume, request=request))
            return
        if self.closing:  # the client left meanwhile
            self.busy = False
            self._release(request)
            return
        self.outbox.answer(self, response)
        self._next(request)

    def _done(self, task: asyncio.Task[None], *, request: Request) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.busy = False
            self._release(request)
            self._since = self.limiter.now
            log.error("request handler failed", exc_info=task.exception())
            self.close()
            return
        self._next(request)

    def _next(self, request: Request) -> None:
        """``request`` is answered: release it, then go on with the connection."""
        self.busy = False
        self._release(request)
        self._since = self.limiter.now
        if not request.keep_alive or self.closing:
            self.close()
        elif self.pending:
            if not self._write_paused:
                self._dispatch(self.pending.popleft())
                self._unstash()
        elif self._stash:
            self._unstash()
        elif self._final is not None:
            self._send_final()
        else:
            self._update_reading()

    # --- output
    def write(self, data: bytes) -> None:
        """Write now (the slow path), after the answers this connection holds."""
        if self.held:
            self.flush_held()
        if self.transport is not None and not self.closing:
            self.transport.write(data)

    def flush_held(self) -> None:
        """Write the answers held for the end of the loop turn (:class:`Outbox`)."""
        held = self.held
        if not held:
            return
        data = held[0] if len(held) == 1 else b"".join(held)
        held.clear()
        if self.transport is not None and not self.closing:
            self.transport.write(data)

    def reject(self, status: int, reason: bytes) -> None:
        """Answer ``status`` after the requests already queued, then close."""
        self.limiter.refused[status] = self.limiter.refused.get(status, 0) + 1
        extra = b"retry-after: 1\r\n" if status == 503 else b""
        self._final = simple_response(status, reason, extra=extra, close=True)
        self._refused = True
        self._since = self.limiter.now
        if self.transport is not None and self._read_paused:
            self._read_paused = False
            self.transport.resume_reading()  # drain what the client still sends
        if not self.busy and not self.pending:
            self._send_final()

    def _send_final(self) -> None:
        if self.held:
            self.flush_held()
        final, self._final = self._final, None
        if final is None or self.transport is None or self.closing:
            return
        self.transport.write(final)
        self._since = self.limiter.now
        if self.transport.can_write_eof():
            # Half-close: the client still gets to send (drained, LINGER_S) and read the answer.
            self.transport.write_eof()
        else:
            self.close()

    def close(self) -> None:
        if self.held:
            self.flush_held()
        self.closing = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Drop the connection at once (a response that cannot be completed)."""
        self.closing = True
        if self.transport is not None:
            self.transport.abort()


def simple_response(
    status: int,
    body: bytes,
    *,
    content_type: bytes = b"text/plain; charset=utf-8",
    extra: bytes = b"",
    close: bool = False,
) -> bytes:
    """A complete small response."""
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s%s\r\n"
        % (
            status,
            reason_phrase(status),
            content_type,
            len(body),
            extra,
            b"connection: close\r\n" if close else b"",
        )
        + body
    )


def error_response(
    status: int,
    message: str,
    kind: str,
    *,
    code: bool = True,
    extra: bytes = b"",
    **fields: object,
) -> bytes:
    """A JSON error answer in the OpenAI shape: ``{"error": {"message", "type", "code",
    ...fields}}`` (``code`` is the status; left out when ``code`` is False)."""
    error: dict[str, object] = {"message": message, "type": kind}
    if code:
        error["code"] = status
    error.update(fields)
    body = orjson.dumps({"error": error})
    return simple_response(status, body, content_type=b"application/json", extra=extra)


class Refusal(Exception):
    """A request the sidecar must refuse, with a status and a reason."""

    def __init__(self, status: int, reason: str, *, extra: bytes = b"") -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.extra = extra

    def response(self) -> bytes:
        return error_response(
            self.status,
            self.reason,
            "cachefleet_refused",
            extra=b"x-cache: BYPASS\r\n" + self.extra,
        )
