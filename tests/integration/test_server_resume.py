"""The HTTP server's deferred fast path: a handler's ``fast`` may hand back a
future (the sidecar: an L2 read in flight) and answer from ``resume`` when it
is done, without a task. Loopback sockets only, a scripted handler."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cachefleet_sidecar.http.server import Connection, Limiter, Request, simple_response

#: Safety net of every wait below, seconds (outcomes are asserted, not timing).
SAFETY_S = 10.0


class Scripted:
    """``/defer/<n>`` waits for the n-th future, ``/fast`` answers at once, the rest: a task."""

    def __init__(self) -> None:
        self.futures: list[asyncio.Future[Any]] = []
        self.resumed: list[bytes] = []
        self.handled: list[bytes] = []
        self.slow_after_resume: set[bytes] = set()

    def fast(self, request: Request) -> bytes | asyncio.Future[Any] | None:
        if request.url == b"/fast":
            return simple_response(200, b"fast")
        if request.url.startswith(b"/defer"):
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self.futures.append(future)
            return future
        return None

    def resume(self, request: Request) -> bytes | asyncio.Future[Any] | None:
        self.resumed.append(request.url)
        if request.url in self.slow_after_resume:
            return None
        if request.url.startswith(b"/defer-twice") and self.resumed.count(request.url) == 1:
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self.futures.append(future)
            return future  # wait once more (the sidecar: an upstream call after an L2 miss)
        return simple_response(200, b"resumed " + request.url)

    async def handle(self, request: Request, conn: Connection) -> None:
        self.handled.append(request.url)
        conn.write(simple_response(200, b"slow " + request.url))


@pytest.fixture
async def served() -> AsyncIterator[tuple[Scripted, Limiter, int]]:
    handler, limiter = Scripted(), Limiter()
    server = await asyncio.get_running_loop().create_server(
        lambda: Connection(handler, limiter), "127.0.0.1", 0
    )
    limiter.start()
    yield handler, limiter, server.sockets[0].getsockname()[1]
    limiter.stop()
    server.close()
    await server.wait_closed()


def get(path: bytes) -> bytes:
    return b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path


async def answers(reader: asyncio.StreamReader, n: int) -> list[bytes]:
    out = []
    async with asyncio.timeout(SAFETY_S):
        for _ in range(n):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
            out.append(await reader.readexactly(length))
    return out


async def until(check: Any) -> None:
    deadline = time.monotonic() + SAFETY_S
    while time.monotonic() < deadline:
        if check():
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"not reached within {SAFETY_S}s")


async def test_requests_pipelined_behind_a_deferred_one_wait_for_it_in_order(
    served: tuple[Scripted, Limiter, int],
) -> None:
    handler, _, port = served
    handler.slow_after_resume.add(b"/defer/2")
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(get(b"/defer/1") + get(b"/fast") + get(b"/defer/2") + get(b"/other"))
    await until(lambda: len(handler.futures) == 1)
    # nothing is answered, and the next requests are not started, until it is done
    await asyncio.sleep(0.05)
    assert handler.resumed == []
    handler.futures[0].set_result(None)
    await until(lambda: len(handler.futures) == 2)
    handler.futures[1].set_result(None)  # resume decides: this one goes the slow way
    got = await answers(reader, 4)
    assert got == [b"resumed /defer/1", b"fast", b"slow /defer/2", b"slow /other"]
    assert handler.resumed == [b"/defer/1", b"/defer/2"]
    assert handler.handled == [b"/defer/2", b"/other"]  # resume said None: the slow path
    writer.close()


async def test_a_client_gone_while_deferred_is_still_resumed_and_released(
    served: tuple[Scripted, Limiter, int],
) -> None:
    handler, limiter, port = served
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    body = b"x" * 1000
    writer.write(
        b"POST /defer/1 HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    await until(lambda: len(handler.futures) == 1)
    writer.close()
    await until(lambda: not limiter.connections)  # the server saw the client leave
    handler.futures[0].set_result(None)
    await until(lambda: handler.resumed == [b"/defer/1"])  # its bookkeeping still runs
    assert handler.handled == []
    assert limiter.body_bytes == 0


async def test_a_resume_may_hand_back_another_future_to_wait_on(
    served: tuple[Scripted, Limiter, int],
) -> None:
    handler, _, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(get(b"/defer-twice") + get(b"/fast"))
    await until(lambda: len(handler.futures) == 1)
    handler.futures[0].set_result(None)
    await until(lambda: len(handler.futures) == 2)  # resumed once: it waits again
    await asyncio.sleep(0.05)
    assert handler.resumed == [b"/defer-twice"]  # nothing more until the second is done
    handler.futures[1].set_result(None)
    got = await answers(reader, 2)
    assert got == [b"resumed /defer-twice", b"fast"]
    assert handler.resumed == [b"/defer-twice", b"/defer-twice"]
    assert handler.handled == []
    writer.close()


async def test_a_client_gone_before_a_resume_that_says_slow_still_gets_the_slow_path(
    served: tuple[Scripted, Limiter, int],
) -> None:
    # The handler may have work in flight for the request (the sidecar: an upstream
    # call whose answer it stores): handle runs all the same, and the budget is freed.
    handler, limiter, port = served
    handler.slow_after_resume.add(b"/defer/1")
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    body = b"x" * 1000
    writer.write(
        b"POST /defer/1 HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    await until(lambda: len(handler.futures) == 1)
    writer.close()
    await until(lambda: not limiter.connections)
    handler.futures[0].set_result(None)
    await until(lambda: handler.handled == [b"/defer/1"])
    await until(lambda: limiter.body_bytes == 0)
