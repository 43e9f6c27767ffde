"""A bare loopback HTTP/1.1 responder: the floor of the proxy benchmark.

It answers every request, whatever its method, path or body, with the same
ready-made bytes: a realistic OpenAI chat-completion JSON response. It is a raw
``asyncio.Protocol`` on uvloop with httptools' parser and keep-alive, i.e. the
least work a Python HTTP server can do per request. The proxy benchmark uses
it twice: measured directly (the floor) and as the upstream behind nginx and
the sidecar.

Run it in its own process::

    python -m cachefleet_bench.responder --port 8000

``--port 0`` picks a free port; the first line on stdout names the address.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence
from typing import cast

import httptools
import uvloop

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

#: The complete response written for every request on a keep-alive connection.
RESPONSE: bytes = RESPONSE_HEAD + CHAT_COMPLETION_BODY
#: The response to a request that asked to close the connection.
RESPONSE_CLOSE: bytes = RESPONSE.replace(b"Connection: keep-alive", b"Connection: close")

_BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"

#: Seconds granted to open connections to finish after SIGTERM.
SHUTDOWN_GRACE_S = 2.0


class ResponderProtocol(asyncio.Protocol):
    """One client connection: parse requests, answer each with :data:`RESPONSE`."""

    __slots__ = ("_keep_alive", "_parser", "_transport")

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._keep_alive = True

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
        if self._keep_alive:
            transport.write(RESPONSE)
        else:
            self._close(RESPONSE_CLOSE)

    def _close(self, last: bytes) -> None:
        transport = self._transport
        if transport is not None:
            transport.write(last)
            transport.close()


async def serve(host: str, port: int, *, announce: bool = True) -> None:
    """Serve until SIGTERM or SIGINT; print the bound address first if ``announce``."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(ResponderProtocol, host, port, backlog=1024)
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
    """Command line: ``--host`` (loopback only by default) and ``--port``."""
    parser = argparse.ArgumentParser(
        prog="python -m cachefleet_bench.responder",
        description="Answer every HTTP request with a fixed chat-completion JSON body.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one")
    args = parser.parse_args(argv)
    uvloop.run(serve(args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
