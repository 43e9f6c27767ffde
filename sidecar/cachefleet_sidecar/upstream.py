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
"""

from __future__ import annotations

import asyncio
import base64
import math
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import cast
from urllib.parse import unquote, urlsplit

import httptools

from .protocol import redact_url

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
#: Methods that may be sent again when a reused connection fails before answering.
IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS"})

#: Request headers that describe the client connection, not the request.
REQUEST_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"content-length",
        b"host",
        b"expect",
    }
)


class UpstreamError(Exception):
    """The upstream could not give a complete answer."""

    def __init__(self, message: str, *, started: bool = False, timed_out: bool = False) -> None:
        super().__init__(message)
        self.started = started
        self.timed_out = timed_out


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
        #: monotonic time after which a silent upstream is given up (set per request)
        self.deadline = math.inf

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; same interface.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
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

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.buffer.append(body)
        self.buffered += len(body)
        if self.buffered > MAX_BUFFERED_BYTES and not self.read_paused and self.transport:
            self.read_paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
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
        self.max_idle = max_idle
        self.max_idle_age_s = max_idle_age_s
        self._idle: deque[_Connection] = deque()
        self._busy: set[_Connection] = set()
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed = False

    async def _connect(self, deadline: float = math.inf) -> _Connection:
        loop = asyncio.get_running_loop()
        timeout = min(self.connect_timeout_s, max(0.0, deadline - time.monotonic()))
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(_Connection, self.host, self.port)
        except TimeoutError as exc:
            raise UpstreamError(
                f"cannot connect to upstream {self.host}:{self.port}: timeout", timed_out=True
            ) from exc
        except OSError as exc:
            raise UpstreamError(
                f"cannot connect to upstream {self.host}:{self.port}: {exc}"
            ) from exc
        return conn

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
        if (
            conn.complete
            and conn.keep_alive
            and not conn.closed
            and not self._closed
            and len(self._idle) < self.max_idle
        ):
            conn._reset()
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
            if name not in REQUEST_HOP_BY_HOP and not (auth and name == b"authorization"):
                lines += [b"\r\n", name, b": ", value]
        if auth:
            lines += [b"\r\nauthorization: ", auth]
        lines.append(b"\r\ncontent-length: %d\r\n\r\n" % len(body))
        return b"".join(lines)

    def _send(self, conn: _Connection, head: bytes, body: bytes, deadline: float) -> None:
        assert conn.transport is not None
        conn.timeout_s = self.read_timeout_s
        conn.deadline = deadline
        self._busy.add(conn)
        self._arm_sweeper()
        conn.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
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
            conn = self._take_idle()
            reused = conn is not None
            if conn is None:
                conn = await self._connect(deadline)
            self._send(conn, head, body, deadline)
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
        self._send(conn, self._head(method, path, headers, body), body, deadline)
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
            return UpstreamResponse(conn, self)
        self._release(conn)
        conn._close()
        return None

    async def probe(self) -> bool:
        """True when a TCP connection to the upstream can be opened."""
        try:
            conn = await self._connect()
        except UpstreamError:
            return False
        conn._close()
        return True

    async def aclose(self) -> None:
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        while self._idle:
            self._idle.pop()._close()
