"""A bare loopback HTTP/1.1 responder: the floor of the proxy benchmark.

It answers every request, whatever its method, path or body, with the same
ready-made bytes: a realistic OpenAI chat-completion JSON response. It is a raw
``asyncio.Protocol`` on uvloop with httptools' parser and keep-alive, i.e. the
least work a Python HTTP server can do per request. The proxy benchmark uses
it twice: measured directly (the floor) and as the upstream behind nginx and
the sidecar.

With ``--redis-port`` it is the floor of an L2 hit instead: every request
costs one ``GET`` of ``--redis-key`` on that loopback Redis (one pipelined
connection, parsed by hiredis, the commands of one loop turn sent in one
write) and is answered with the value read, marked ``X-Cache: HIT-REDIS``.
That is the least a Python server can do to answer from Redis.

With ``--relay-port`` it is the floor of a proxied miss: each client
connection gets a connection of its own to that loopback port, and bytes are
relayed both ways as they come, with no parsing at all. No HTTP proxy can
add less to a request (it must at least find where requests end).

Run it in its own process::

    python -m cachefleet_bench.responder --port 8000
    python -m cachefleet_bench.responder --port 8001 --redis-port 6379
    python -m cachefleet_bench.responder --port 8002 --relay-port 8000

``--port 0`` picks a free port; the first line on stdout names the address.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import signal
import sys
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

import hiredis
import httptools
import uvloop

from cachefleet_common.resp import pack_command

#: The answer to every request: an OpenAI ``chat.completion`` object (~600 bytes).
CHAT_COMPLETION_BODY: bytes = (
    b'{"id":"chatcmpl-9x3Yb7c2QhTqQ6bR8eWm1nLkZpAe","object":"chat.completion",'
    b'"created":1731974400,"model":"gpt-4o-mini-2024-07-18",'
    b'"system_fingerprint":"fp_0ba0d124f1","choices":[{"index":0,"message":'
    b'{"role":"assistant","content":"A cache in front of a model server answers '
    b"repeated deterministic requests from memory instead of the GPU. Keys are "
    b"built from the canonical request, scoped by tenant and model version, so "
    b'one tenant never sees another tenant\'s answers.","refusal":null},'
    b'"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":42,'
    b'"completion_tokens":48,"total_tokens":90,"prompt_tokens_details":'
    b'{"cached_tokens":0},"completion_tokens_details":{"reasoning_tokens":0}}}'
)

#: Status line and headers sent before :data:`CHAT_COMPLETION_BODY`.
RESPONSE_HEAD: bytes = (
    b"HTTP/1.1 200 OK\r\n"
    b"Content-Type: application/json\r\n"
    b"Content-Length: " + str(len(CHAT_COMPLETION_BODY)).encode() + b"\r\n"
    b"Connection: keep-alive\r\n"
    b"\r\n"
)

#: Status line and headers of an answer read from Redis (length, connection).
REDIS_HEAD: bytes = (
    b"HTTP/1.1 200 OK\r\n"
    b"Content-Type: application/json\r\n"
    b"X-Cache: HIT-REDIS\r\n"
    b"Content-Length: %d\r\n"
    b"Connection: %s\r\n"
    b"\r\n"
)

#: The complete response written for every request on a keep-alive connection.
RESPONSE: bytes = RESPONSE_HEAD + CHAT_COMPLETION_BODY
#: The response to a request that asked to close the connection.
RESPONSE_CLOSE: bytes = RESPONSE.replace(b"Connection: keep-alive", b"Connection: close")

_BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
_BAD_GATEWAY = b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"

#: The key the Redis floor reads when none is named.
DEFAULT_REDIS_KEY = "cachefleet-bench:floor"

#: Seconds granted to open connections to finish after SIGTERM.
SHUTDOWN_GRACE_S = 2.0


class RedisLink(asyncio.Protocol):
    """One pipelined connection to Redis: a fixed command, its replies handed out in order."""

    def __init__(self, command: bytes) -> None:
        self._command = command
        self._reader = hiredis.Reader()
        self._waiting: deque[Callable[[Any], None]] = deque()
        self._queued = 0
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        while self._waiting:
            self._waiting.popleft()(None)

    def ask(self, callback: Callable[[Any], None]) -> None:
        """Send the command, then ``callback(reply)``: the value (bytes), or None
        when the key is missing or the connection is gone.

        On an idle connection it goes out at once; otherwise with the other
        commands of this loop turn, in one write.
        """
        if self._transport is None:
            callback(None)
            return
        idle = not self._waiting
        self._waiting.append(callback)
        if idle:
            self._transport.write(self._command)
            return
        self._queued += 1
        if self._queued == 1:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        if self._transport is not None and self._queued:
            self._transport.write(self._command * self._queued)
        self._queued = 0

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        while (reply := self._reader.gets()) is not False:
            self._waiting.popleft()(reply if isinstance(reply, bytes) else None)


class ResponderProtocol(asyncio.Protocol):
    """One client connection: parse requests, answer each with :data:`RESPONSE`
    (or, with a :class:`RedisLink`, with the value it reads)."""

    __slots__ = ("_keep_alive", "_parser", "_redis", "_transport")

    def __init__(self, redis: RedisLink | None = None) -> None:
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._keep_alive = True
        self._redis = redis

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._close(_BAD_REQUEST)
        except httptools.HttpParserError:
            self._close(_BAD_REQUEST)

    # httptools callbacks -------------------------------------------------------

    def on_headers_complete(self) -> None:
        self._keep_alive = bool(self._parser.should_keep_alive())

    def on_message_complete(self) -> None:
        transport = self._transport
        if transport is None:
            return
        if self._redis is not None:
            self._redis.ask(functools.partial(self._answer, keep_alive=self._keep_alive))
        elif self._keep_alive:
            transport.write(RESPONSE)
        else:
            self._close(RESPONSE_CLOSE)

    def _answer(self, value: bytes | None, *, keep_alive: bool) -> None:
        """The Redis reply for one request: write it as the answer."""
        transport = self._transport
        if transport is None:
            return
        if value is None:
            self._close(_BAD_GATEWAY)
            return
        head = REDIS_HEAD % (len(value), b"keep-alive" if keep_alive else b"close")
        transport.write(head + value)
        if not keep_alive:
            transport.close()

    def _close(self, last: bytes) -> None:
        transport = self._transport
        if transport is not None:
            transport.write(last)
            transport.close()


class _RelayBack(asyncio.Protocol):
    """The upstream side of a relayed connection: what comes back goes to the client."""

    def __init__(self, client: asyncio.Transport) -> None:
        self._client = client

    def data_received(self, data: bytes) -> None:
        self._client.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._client.close()


class RelayProtocol(asyncio.Protocol):
    """One client connection relayed byte for byte to ``127.0.0.1:port``, on a
    connection of its own (no parsing, no flow control: a benchmark floor)."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._client: asyncio.Transport | None = None
        self._upstream: asyncio.Transport | None = None
        self._early: list[bytes] = []
        self._connecting: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._client = cast(asyncio.Transport, transport)
        self._connecting = asyncio.get_running_loop().create_task(self._connect(self._client))

    async def _connect(self, client: asyncio.Transport) -> None:
        loop = asyncio.get_running_loop()
        try:
            upstream, _ = await loop.create_connection(
                lambda: _RelayBack(client), "127.0.0.1", self._port
            )
        except OSError:
            client.close()
            return
        self._upstream = upstream
        if self._early:
            self._upstream.write(b"".join(self._early))
            self._early.clear()
        if client.is_closing():
            self._upstream.close()

    def data_received(self, data: bytes) -> None:
        if self._upstream is None:
            self._early.append(data)
        else:
            self._upstream.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._upstream is not None:
            self._upstream.close()


async def serve(
    host: str,
    port: int,
    *,
    announce: bool = True,
    redis_port: int | None = None,
    redis_key: str = DEFAULT_REDIS_KEY,
    relay_port: int | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT; print the bound address first if ``announce``.

    With ``redis_port`` every answer is ``redis_key``'s value on that Redis;
    with ``relay_port`` every connection is relayed to that port (127.0.0.1).
    """
    loop = asyncio.get_running_loop()
    factory: Callable[[], asyncio.Protocol]
    if relay_port is not None:
        factory = functools.partial(RelayProtocol, relay_port)
    elif redis_port is not None:
        command = pack_command(("GET", redis_key))
        _, redis = await loop.create_connection(lambda: RedisLink(command), "127.0.0.1", redis_port)
        factory = functools.partial(ResponderProtocol, redis)
    else:
        factory = ResponderProtocol
    server = await loop.create_server(factory, host, port, backlog=1024)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    bound_port = server.sockets[0].getsockname()[1]
    if announce:
        print(f"cachefleet-bench responder listening on http://{host}:{bound_port}", flush=True)
    async with server:
        await stop.wait()
        server.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.wait_closed(), SHUTDOWN_GRACE_S)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``--host`` (loopback only by default), ``--port``, and the
    floors' ``--redis-port`` (``--redis-key``) or ``--relay-port``."""
    parser = argparse.ArgumentParser(
        prog="python -m cachefleet_bench.responder",
        description="Answer every HTTP request with a fixed chat-completion JSON body"
        " (or with a value read from Redis: the floor of an L2 hit; or relay"
        " connections to another port: the floor of a proxied miss).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one")
    parser.add_argument(
        "--redis-port",
        type=int,
        help="answer with a value read from this loopback Redis, one GET per request",
    )
    parser.add_argument(
        "--redis-key", default=DEFAULT_REDIS_KEY, help=f"the key read ({DEFAULT_REDIS_KEY})"
    )
    parser.add_argument(
        "--relay-port",
        type=int,
        help="relay every connection, byte for byte, to this loopback port instead",
    )
    args = parser.parse_args(argv)
    if args.relay_port is not None and args.redis_port is not None:
        parser.error("--relay-port and --redis-port are two different floors: give one")
    floors = {"redis_port": args.redis_port, "redis_key": args.redis_key}
    uvloop.run(serve(args.host, args.port, relay_port=args.relay_port, **floors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
