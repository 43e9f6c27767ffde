"""HTTP/1.1 server side: a raw asyncio protocol over ``httptools``.

This is the sidecar's hot loop. A connection parses requests with
``httptools`` callbacks and hands each complete request to a
:class:`Handler`. The handler first gets a synchronous chance
(:meth:`Handler.fast`): an L1 hit is answered inside ``data_received`` with
one ``transport.write`` of ready-made bytes, no task, no future. Everything
else becomes one task per request (:meth:`Handler.handle`). Pipelined
requests are answered in order; keep-alive follows the client.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from typing import Protocol, cast

import httptools

from .entry import reason_phrase

log = logging.getLogger("cachefleet.sidecar")

#: Largest request body accepted (LLM requests with long contexts fit easily).
MAX_BODY_BYTES = 32 * 1024 * 1024


class Request:
    """One parsed request; ``memo`` carries what the fast path already computed."""

    __slots__ = ("body", "headers", "keep_alive", "memo", "method", "peer", "started", "url")

    def __init__(
        self,
        method: bytes,
        url: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        keep_alive: bool,
        started: float,
        peer: str | None = None,
    ) -> None:
        self.method = method
        self.url = url
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.started = started
        #: IP address of the client socket (the proxy in front, if any).
        self.peer = peer
        self.memo: object = None

    def header(self, name: bytes) -> bytes | None:
        """First value of a header (``name`` in lower case)."""
        for key, value in self.headers:
            if key == name:
                return value
        return None


class Handler(Protocol):
    def fast(self, request: Request) -> bytes | None: ...

    async def handle(self, request: Request, conn: Connection) -> None: ...


class Connection(asyncio.Protocol):
    """One client connection."""

    def __init__(self, handler: Handler, registry: set[Connection]) -> None:
        self.handler = handler
        self.registry = registry
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
        # Header fields after the head are chunked-body trailers: never request headers.
        self._in_body = False
        self.peer: str | None = None

    # --- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; same interface.
        self.transport = cast(asyncio.Transport, transport)
        peername = transport.get_extra_info("peername")
        if isinstance(peername, tuple) and peername:
            self.peer = str(peername[0])
        self.registry.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.registry.discard(self)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.reject(501, b"protocol upgrades are not supported by the cachefleet sidecar")
        except httptools.HttpParserError as exc:
            self.reject(400, b"malformed HTTP request: " + str(exc).encode())

    # --- httptools callbacks
    def on_message_begin(self) -> None:
        self._started = time.perf_counter()
        self._url.clear()
        self._headers = []
        self._body.clear()
        self._body_len = 0
        self._in_body = False

    def on_url(self, url: bytes) -> None:
        self._url.append(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._in_body:
            return  # a trailer: dropped, so it can neither name a tenant nor reach upstream
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self._in_body = True
        for name, value in self._headers:
            if name == b"expect" and value.lower() == b"100-continue" and self.transport:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_len += len(body)
        if self._body_len > MAX_BODY_BYTES:
            raise httptools.HttpParserError("request body too large")
        self._body.append(body)

    def on_message_complete(self) -> None:
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request = Request(
            self.parser.get_method(),
            self._url[0] if len(self._url) == 1 else b"".join(self._url),
            self._headers,
            body,
            self.parser.should_keep_alive(),
            self._started,
            self.peer,
        )
        if self.busy:
            self.pending.append(request)
        else:
            self._dispatch(request)

    # --- dispatch
    def _dispatch(self, request: Request) -> None:
        while True:
            response = self.handler.fast(request)
            if response is None:
                break
            self.write(response)
            if not request.keep_alive:
                self.close()
                return
            if not self.pending:
                return
            request = self.pending.popleft()
        self.busy = True
        task = asyncio.get_running_loop().create_task(self.handler.handle(request, self))
        task.add_done_callback(functools.partial(self._done, request=request))

    def _done(self, task: asyncio.Task[None], *, request: Request) -> None:
        self.busy = False
        if not task.cancelled() and task.exception() is not None:
            log.error("request handler failed", exc_info=task.exception())
            self.close()
            return
        if not request.keep_alive or self.closing:
            self.close()
        elif self.pending:
            self._dispatch(self.pending.popleft())

    # --- output
    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closing:
            self.transport.write(data)

    def reject(self, status: int, reason: bytes) -> None:
        self.write(simple_response(status, reason, close=True))
        self.close()

    def close(self) -> None:
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
