"""A lean HTTP/1.1 client for the model server next to the sidecar.

The model server sits on loopback in the same pod, so the client keeps a
pool of keep-alive connections and speaks HTTP/1.1 through ``httptools``
directly: a miss costs one write and the parser's callbacks, not a general
purpose client's machinery. Bodies arrive as they are produced (SSE streams
are forwarded chunk by chunk) and a response knows whether it completed, so
a truncated body or a broken stream is never mistaken for an answer.

Errors: every failure is an :class:`UpstreamError` (connect refused, timeout,
protocol error, connection lost mid-response); ``.started`` tells whether any
response byte had arrived.

Timeouts: ``read_timeout_s`` is a deadline for the response head, counted
once from the moment the request is issued (connecting and any retry
included); after the head, the body may not stall longer than that between
two reads (a long generation keeps streaming). Resending: a request is sent
again only when it is idempotent (``GET``, ``HEAD``, ``OPTIONS``), went out
on a reused keep-alive connection that failed before any response byte, and
did not time out. A ``POST`` that may have reached the model server is never
resent (it would duplicate GPU work); idle connections older than
``max_idle_age_s`` are not reused, which keeps the keep-alive race (the
server closing an idle connection as a request goes out) rare.
Back-pressure: a connection stops reading from the model server while more
than :data:`MAX_BUFFERED_BYTES` of its answer wait to be relayed.

Answers without a body: the answer to a ``HEAD`` is complete with its head,
whatever its ``Content-Length`` says (the parser is told the request was
``HEAD``); so are 204 and 304 answers. Interim 1xx answers (``100 Continue``,
``103 Early Hints``) are dropped and the final answer is read after them; a
``101`` is a protocol error (the sidecar never asks the model server to
upgrade).

Bound: at most ``max_connections`` connections are open or opening at once
(each holds a descriptor); a request that finds none free waits in a queue of
at most ``max_waiting`` requests, first come first served, within its head
deadline; past the queue, or past the deadline while queued, it fails at once
with an :class:`UpstreamError` whose ``overloaded`` is set (the sidecar
answers 503 with the reason).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from typing import cast
from urllib.parse import unquote, urlsplit

import httptools
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from cachefleet_common import defaults
from cachefleet_common.contract.urls import redact_url
from cachefleet_sidecar.http.wire import REQUEST_DROP

#: Seconds to open a connection to the upstream.
DEFAULT_CONNECT_TIMEOUT_S = 5.0
#: Seconds the upstream may stay silent while we wait for headers or body.
DEFAULT_READ_TIMEOUT_S = 600.0
#: How often silent upstream connections are looked for, seconds (at most).
SWEEP_INTERVAL_S = 0.5
#: Idle keep-alive connections kept for reuse.
DEFAULT_MAX_IDLE = 128
#: Idle connections older than this are closed, not reused, seconds (below the
#: usual model-server keep-alive timeout: uvicorn's default is 5 s).
DEFAULT_MAX_IDLE_AGE_S = 4.0
#: Answer bytes buffered from the model server before it is no longer read.
MAX_BUFFERED_BYTES = 1024 * 1024
#: A body smaller than this is copied behind its head and sent in one write; a larger
#: one is written apart (a copy of it would cost more than the second write).
JOIN_BODY_BELOW = 64 * 1024
DEFAULT_MAX_CONNECTIONS = defaults.UPSTREAM_MAX_CONNECTIONS
DEFAULT_MAX_WAITING = defaults.UPSTREAM_MAX_WAITING
#: Methods that may be sent again when a reused connection fails before answering.
IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS"})


class UpstreamError(Exception):
    """The upstream could not give a complete answer."""

    def __init__(
        self,
        message: str,
        *,
        started: bool = False,
        timed_out: bool = False,
        overloaded: bool = False,
    ) -> None:
        super().__init__(message)
        self.started = started
        self.timed_out = timed_out
        #: No connection was free and the wait queue was full (or the wait ran out):
        #: nothing was sent, the client may retry.
        self.overloaded = overloaded


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.timeout_s = DEFAULT_READ_TIMEOUT_S
        self.closed = False
        self.idle_since = 0.0
        self.buffered = 0
        self.read_paused = False
        #: Called once when the connection is gone (the pool frees its slot).
        self.on_lost: Callable[[], None] | None = None
        #: The request in flight is a HEAD: its answer ends with its head.
        self.head_request = False
        #: The parser was left mid-message (a HEAD answer it took for sized): a new one is
        #: needed before the connection is used again.
        self.stale_parser = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.buffer: list[bytes] = []
        self.buffered = 0
        self.error: str | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.received_any = False
        self.timed_out = False
        #: An interim 1xx answer is being read (dropped: the final answer follows).
        self.interim = False
        #: A request went out on this connection and its answer is not complete yet.
        self.asked = False
        if self.stale_parser:
            self.parser = httptools.HttpResponseParser(self)
            self.stale_parser = False
        #: monotonic time after which a silent upstream is given up (set per request)
        self.deadline = math.inf

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; same interface.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.complete or self.stale_parser or not self.asked:
            # Bytes after a complete answer, or on an idle connection: nothing was asked
            # for, so the stream is out of step; the connection is not used again.
            self.error = "upstream sent bytes after its answer"
            self._close()
            return
        self.received_any = True
        if self.headers_done and self.deadline != math.inf:
            # The head had one deadline; the body may not stall longer than the timeout.
            self.deadline = time.monotonic() + self.timeout_s
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = f"bad response from upstream: {exc}"
            self._wake()
            self._close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and self.error is None:
            self.error = "upstream closed the connection" + (f": {exc}" if exc else "")
        self._wake()
        on_lost, self.on_lost = self.on_lost, None
        if on_lost is not None:
            on_lost()

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            if status == 101:  # the sidecar never asks to upgrade: the stream is not HTTP now
                raise httptools.HttpParserError("101 Switching Protocols was not asked for")
            self.interim = True  # 100 Continue, 103 Early Hints: the final answer follows
            self.headers = []
            return
        self.status = status
        self.headers_done = True
        if self.head_request:
            # No body follows, whatever Content-Length says; the parser expects one, so
            # it is replaced before the connection carries another request.
            self.stale_parser = True
            self.complete = True
            self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.stale_parser:
            raise httptools.HttpParserError("a body after the answer to a HEAD")
        self.buffer.append(body)
        self.buffered += len(body)
        if self.buffered > MAX_BUFFERED_BYTES and not self.read_paused and self.transport:
            self.read_paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def wait(self) -> None:
        """Until the parser has news (headers, body, end) or the connection failed.

        There is no timer per wait: the pool's sweeper fails connections whose
        :attr:`deadline` has passed (see :meth:`UpstreamPool._sweep`).
        """
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def expire(self) -> None:
        """Give up on a silent upstream (called by the sweeper)."""
        self.error = f"upstream silent for {self.timeout_s:g}s (upstream timeout)"
        self.timed_out = True
        self._wake()
        self._close()

    def _close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class UpstreamResponse:
    """Status and headers of an upstream answer; the body is read with :meth:`chunks`."""

    def __init__(self, conn: _Connection, pool: UpstreamPool) -> None:
        self._conn = conn
        self._pool = pool
        self.status = conn.status
        self.headers = conn.headers
        self.complete = False

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    @property
    def content_length(self) -> int | None:
        value = self.header(b"content-length")
        return int(value) if value is not None and value.isdigit() else None

    async def chunks(self) -> AsyncIterator[bytes]:
        """Yield the body as it arrives; raise :class:`UpstreamError` if it breaks."""
        conn = self._conn
        try:
            while True:
                if conn.buffer:
                    data = b"".join(conn.buffer)
                    conn.buffer.clear()
                    conn.buffered = 0
                    if conn.read_paused and conn.transport is not None and not conn.closed:
                        conn.read_paused = False
                        conn.transport.resume_reading()
                    yield data
                    continue
                if conn.complete:
                    self.complete = True
                    return
                if conn.error is not None:
                    raise UpstreamError(conn.error, started=True)
                await conn.wait()
        finally:
            self._pool._release(conn)

    async def read(self) -> bytes:
        """The whole body (raises :class:`UpstreamError` when incomplete)."""
        parts = [chunk async for chunk in self.chunks()]
        return b"".join(parts)


def _failure(conn: _Connection) -> UpstreamError:
    """Why a request on ``conn`` got no response head."""
    return UpstreamError(
        conn.error or "no response", started=conn.received_any, timed_out=conn.timed_out
    )


class Begun:
    """A request :meth:`UpstreamPool.begin` sent: its connection and a future for its head."""

    __slots__ = ("conn", "future", "pool")

    def __init__(self, conn: _Connection, pool: UpstreamPool, future: asyncio.Future[None]) -> None:
        self.conn = conn
        self.pool = pool
        self.future = future

    def complete_body(self, max_bytes: int) -> tuple[int, list[tuple[bytes, bytes]], bytes] | None:
        """Status, headers and body when the whole answer is in, sized and at most
        ``max_bytes``, else None. Nothing is consumed: :meth:`release` once it is
        used, or :meth:`UpstreamPool.finish` and the response's chunks go on.
        """
        conn = self.conn
        if not conn.complete or conn.error is not None or conn.buffered > max_bytes:
            return None
        value = None
        for name, v in conn.headers:
            if name == b"content-length":
                value = v
        if value is None or not value.isdigit() or int(value) != conn.buffered:
            return None
        body = conn.buffer[0] if len(conn.buffer) == 1 else b"".join(conn.buffer)
        return conn.status, conn.headers, body

    def release(self) -> None:
        """The answer :meth:`complete_body` gave is used: the connection goes back to the pool."""
        self.pool._release(self.conn)


class UpstreamPool:
    """Keep-alive connections to one upstream ``http://host:port``."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        max_idle: int = DEFAULT_MAX_IDLE,
        max_idle_age_s: float = DEFAULT_MAX_IDLE_AGE_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_waiting: int = DEFAULT_MAX_WAITING,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"--upstream must be http://HOST:PORT, got {redact_url(url)!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.base_path = parts.path.rstrip("/").encode()
        userinfo, at, hostport = parts.netloc.rpartition("@")
        # Credentials in the URL never reach the Host header: they become Basic auth.
        self.host_header = (hostport or self.host).encode()
        self.authorization: bytes | None = None
        if at:
            user, _, password = userinfo.partition(":")
            token = f"{unquote(user)}:{unquote(password)}".encode()
            self.authorization = b"Basic " + base64.b64encode(token)
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        if max_connections < 1 or max_waiting < 0:
            raise ValueError("--upstream-max-connections must be >= 1, --upstream-max-queued >= 0")
        self.max_idle = min(max_idle, max_connections)
        self.max_idle_age_s = max_idle_age_s
        self.max_connections = max_connections
        self.max_waiting = max_waiting
        #: Connections open or opening (each holds a descriptor until it is gone).
        self.open = 0
        #: Most connections open at once so far.
        self.open_peak = 0
        #: Requests refused because no connection was free and the queue was full.
        self.refused = 0
        #: Requests waiting for a connection: each gets one (or a free slot, None).
        self._waiters: deque[asyncio.Future[_Connection | None]] = deque()
        self._idle: deque[_Connection] = deque()
        self._busy: set[_Connection] = set()
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed = False

    async def _connect(self, deadline: float = math.inf, *, counted: bool = False) -> _Connection:
        """A new connection; ``counted``: its slot in :attr:`open` is already taken."""
        if not counted:
            self.open += 1
            self.open_peak = max(self.open_peak, self.open)
        loop = asyncio.get_running_loop()
        timeout = min(self.connect_timeout_s, max(0.0, deadline - time.monotonic()))
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(_Connection, self.host, self.port)
        except TimeoutError as exc:
            self._slot_freed()
            raise UpstreamError(
                f"cannot connect to upstream {self.host}:{self.port}: timeout", timed_out=True
            ) from exc
        except BaseException as exc:
            self._slot_freed()
            if not isinstance(exc, OSError):
                raise
            raise UpstreamError(
                f"cannot connect to upstream {self.host}:{self.port}: {exc}"
            ) from exc
        if conn.closed:  # lost before we got it
            self._slot_freed()
        else:
            conn.on_lost = self._slot_freed
        return conn

    def _slot_freed(self) -> None:
        """A connection is gone: its slot goes to the first waiter (which connects), if any."""
        self.open -= 1
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.open += 1  # the waiter's now
                waiter.set_result(None)
                return

    async def _acquire(self, deadline: float) -> tuple[_Connection, bool]:
        """An idle connection, a new one within the bound, or one a waiter is handed;
        and whether it was used before (a keep-alive connection the server may be closing)."""
        conn = self._take_idle()
        if conn is not None:
            return conn, True
        if self.open < self.max_connections and not self._waiters:
            return await self._connect(deadline), False
        if len(self._waiters) >= self.max_waiting:
            self.refused += 1
            raise UpstreamError(
                f"upstream busy: all {self.max_connections} connections in use and "
                f"{len(self._waiters)} requests waiting (--upstream-max-connections, "
                "--upstream-max-queued)",
                overloaded=True,
            )
        waiter: asyncio.Future[_Connection | None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                given = await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self._give_back(waiter.result())  # handed over as we stopped waiting
            else:
                waiter.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                self.refused += 1
                raise UpstreamError(
                    f"upstream busy: no connection free within the upstream timeout "
                    f"({self.max_connections} in use)",
                    overloaded=True,
                ) from exc
            raise
        if given is None:  # a slot: connect on it
            return await self._connect(deadline, counted=True), False
        return given, True

    def _give_back(self, given: _Connection | None) -> None:
        """What a waiter was handed and cannot use: the next waiter's, or the pool's."""
        if given is None:
            self._slot_freed()
        else:
            given.complete = given.keep_alive = True  # a clean idle connection
            self._release(given)

    def _take_idle(self) -> _Connection | None:
        too_old = time.monotonic() - self.max_idle_age_s
        while self._idle:
            conn = self._idle.pop()
            if conn.closed:
                continue
            if conn.idle_since < too_old:
                conn._close()  # the server may be closing it right now: do not race it
                continue
            return conn
        return None

    def _sweep(self) -> None:
        """Fail requests whose upstream stayed silent past the read timeout."""
        self._sweeper = None
        now = time.monotonic()
        for conn in list(self._busy):
            if now > conn.deadline:
                self._busy.discard(conn)
                conn.expire()
        self._arm_sweeper()

    def _arm_sweeper(self) -> None:
        if self._busy and self._sweeper is None and not self._closed:
            interval = min(SWEEP_INTERVAL_S, self.read_timeout_s / 4)
            self._sweeper = asyncio.get_running_loop().call_later(interval, self._sweep)

    def _release(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        conn.deadline = math.inf
        reusable = conn.complete and conn.keep_alive and not conn.closed and not self._closed
        if reusable:
            conn._reset()
            while self._waiters:  # a waiting request takes it as it is
                waiter = self._waiters.popleft()
                if not waiter.done():
                    waiter.set_result(conn)
                    return
        if reusable and len(self._idle) < self.max_idle:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn._close()

    def _head(
        self, method: bytes, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> bytes:
        lines = [method, b" ", self.base_path + path, b" HTTP/1.1\r\nhost: ", self.host_header]
        auth = self.authorization
        for name, value in headers:
            if name not in REQUEST_DROP and not (auth and name == b"authorization"):
                lines += [b"\r\n", name, b": ", value]
        if auth:
            lines += [b"\r\nauthorization: ", auth]
        lines.append(b"\r\ncontent-length: %d\r\n\r\n" % len(body))
        return b"".join(lines)

    def _send(
        self, conn: _Connection, head: bytes, body: bytes, deadline: float, *, head_only: bool
    ) -> None:
        assert conn.transport is not None
        conn.head_request = head_only
        conn.asked = True
        conn.timeout_s = self.read_timeout_s
        conn.deadline = deadline
        self._busy.add(conn)
        self._arm_sweeper()
        if len(body) < JOIN_BODY_BELOW:
            conn.transport.write(head + body)
        else:
            conn.transport.write(head)
            conn.transport.write(body)

    async def request(
        self,
        method: bytes,
        path: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes = b"",
    ) -> UpstreamResponse:
        """Send a request; return once the response headers are in.

        The head must arrive within ``read_timeout_s`` of this call (one
        deadline across connecting and any retry); see the module docstring
        for when a request is sent a second time (never for a ``POST``).
        """
        head = self._head(method, path, headers, body)
        deadline = time.monotonic() + self.read_timeout_s
        for attempt in (0, 1):
            conn, reused = await self._acquire(deadline)
            self._send(conn, head, body, deadline, head_only=method == b"HEAD")
            resp = await self._response(conn)
            if resp is not None:
                return resp
            # Only a reused keep-alive connection that failed before any response
            # byte, for a request that is safe to repeat, is tried once more.
            retry = (
                attempt == 0
                and reused
                and method in IDEMPOTENT
                and not conn.received_any
                and not conn.timed_out
                and time.monotonic() < deadline
            )
            if not retry:
                raise _failure(conn)
        raise UpstreamError("no usable connection to upstream")

    def begin(
        self,
        method: bytes,
        path: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes = b"",
    ) -> Begun | None:
        """Send a request now, without a task, on an idle keep-alive connection.

        None when no connection is idle (then :meth:`request` connects).
        The returned :class:`Begun`'s ``future`` is done once the response
        head is in or the connection failed; :meth:`finish` or
        :meth:`Begun.complete_body` take it from there. A begun request is
        never sent a second time (it is meant for ``POST``).
        """
        conn = self._take_idle()
        if conn is None:
            return None
        deadline = time.monotonic() + self.read_timeout_s
        head = self._head(method, path, headers, body)
        self._send(conn, head, body, deadline, head_only=method == b"HEAD")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        conn.waiter = future
        return Begun(conn, self, future)

    async def finish(self, begun: Begun) -> UpstreamResponse:
        """The response to a :meth:`begin` request once its head is in (or UpstreamError)."""
        resp = await self._response(begun.conn)
        if resp is None:
            raise _failure(begun.conn)
        return resp

    async def _response(self, conn: _Connection) -> UpstreamResponse | None:
        """The response once its head is in; None when the connection failed first
        (it is then released and closed)."""
        while not conn.headers_done and conn.error is None:
            await conn.wait()
        if conn.headers_done:
            return self.make_response(conn)
        self._release(conn)
        conn._close()
        return None

    def make_response(self, conn: _Connection) -> UpstreamResponse:
        """The response of ``conn``, whose head is in: the one place responses are made.

        Both :meth:`request` and :meth:`finish` get theirs here. Override it to
        hand out a subclass of :class:`UpstreamResponse` (made with the same
        ``conn`` and pool), e.g. one that watches its body as it is read
        (``traced.TracedUpstream`` does).
        """
        return UpstreamResponse(conn, self)

    async def probe(self) -> bool:
        """True when a TCP connection to the upstream can be opened (outside the pool:
        a probe takes no slot and hands none to a waiter)."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                transport, _ = await loop.create_connection(asyncio.Protocol, self.host, self.port)
        except (OSError, TimeoutError):
            return False
        transport.close()
        return True

    def families(self, cache: str) -> Iterator[Metric]:
        """The pool's connections and refusals at scrape time."""
        upstream_conns = GaugeMetricFamily(
            "cachefleet_upstream_connections",
            "Connections open or opening to the model server (bounded by "
            "--upstream-max-connections).",
            labels=["cache"],
        )
        upstream_conns.add_metric([cache], self.open)
        upstream_refused = CounterMetricFamily(
            "cachefleet_upstream_refused",
            "Requests answered 503 because no upstream connection was free and the wait "
            "queue was full (or the wait ran out).",
            labels=["cache"],
        )
        upstream_refused.add_metric([cache], self.refused)
        yield from (upstream_conns, upstream_refused)

    async def aclose(self) -> None:
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        while self._idle:
            self._idle.pop()._close()
