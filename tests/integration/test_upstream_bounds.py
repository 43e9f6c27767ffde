"""Spec: answers without a body end where HTTP says, upgrades are refused once, and the
sidecar holds at most ``--upstream-max-connections`` connections to the model server.

Issue 23, items 1, 2 and 4. The model server here is a raw asyncio server in the
test's own loop, so a test can say exactly how it answers (a HEAD's head with a
``Content-Length`` and no body, a ``100 Continue`` before the answer) and hold
answers until it releases them; it counts the connections it accepted. Every
assertion is on answers and counts; a timeout only turns a hang into a failure.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import pytest

from cachefleet_e2e.fake_upstream import FakeUpstream

from .conftest import RunningSidecar, SidecarFactory
from .test_limits import SAFETY_S, chat_request, connect, read_all, status
from .test_sidecar import metric

#: How the raw model server answers one request: (method, path, body) -> answer bytes.
Answer = Callable[[bytes, bytes, bytes], bytes]
#: Where an answer is split in two writes (the second waits for :attr:`RawUpstream.between`).
SPLIT = b"<split>"


def sized(status_line: bytes, body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n%s\r\n%s" % (
        status_line,
        len(body),
        extra,
        body,
    )


def default_answer(method: bytes, path: bytes, body: bytes) -> bytes:
    if method == b"HEAD":  # correct HTTP: the length of the body a GET would get, no body
        return b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 5\r\n\r\n"
    if path == b"/early-hints":
        hints = b"HTTP/1.1 103 Early Hints\r\nlink: </a.css>\r\n\r\n"
        return hints + SPLIT + sized(b"200 OK", b"final")
    if path == b"/continue":
        return b"HTTP/1.1 100 Continue\r\n\r\n" + SPLIT + sized(b"200 OK", b"after 100")
    if path == b"/stray":  # an answer, then (later) one nobody asked for
        return sized(b"200 OK", b"asked") + SPLIT + sized(b"200 OK", b"stray")
    if path == b"/no-content":
        return b"HTTP/1.1 204 No Content\r\ncontent-length: 7\r\n\r\n"
    if path == b"/not-modified":
        return b"HTTP/1.1 304 Not Modified\r\ncontent-length: 7\r\n\r\n"
    if path == b"/v1/chat/completions":
        answer = {
            "id": "x",
            "object": "chat.completion",
            "model": "m1",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": body.decode()[-40:]},
                    "finish_reason": "stop",
                }
            ],
        }
        data = json.dumps(answer).encode()
        return (
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (len(data), data)
        )
    return sized(b"200 OK", b"hello")


class RawUpstream:
    """A model server in the test's loop: counts connections, can hold its answers."""

    def __init__(self, answer: Answer = default_answer) -> None:
        self.answer = answer
        self.accepted = 0
        self.open = 0
        self.open_peak = 0
        self.requests: list[tuple[bytes, bytes]] = []
        #: Answers wait until this is set (it starts set: no holding).
        self.release = asyncio.Event()
        self.release.set()
        #: The second part of a split answer waits until this is set (it starts set).
        self.between = asyncio.Event()
        self.between.set()
        #: First parts of split answers written.
        self.first_parts = 0
        #: Requests read and not yet answered.
        self.held = 0
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)

    async def stop(self) -> None:
        self.release.set()
        self.between.set()
        if self.server is not None:
            self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.open += 1
        self.open_peak = max(self.open_peak, self.open)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                line, *fields = head.split(b"\r\n")
                method, path, _ = line.split(b" ", 2)
                length = 0
                for field in fields:
                    name, _, value = field.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length) if length else b""
                self.requests.append((method, path))
                self.held += 1
                await self.release.wait()
                self.held -= 1
                first, split, rest = self.answer(method, path, body).partition(SPLIT)
                writer.write(first)
                await writer.drain()
                if split:
                    self.first_parts += 1
                    await self.between.wait()
                    writer.write(rest)
                    await writer.drain()
        finally:
            self.open -= 1
            writer.close()


@pytest.fixture
async def raw_upstream() -> AsyncIterator[RawUpstream]:
    up = RawUpstream()
    await up.start()
    yield up
    await up.stop()


async def read_answer(reader: asyncio.StreamReader, *, head_only: bool = False) -> bytes:
    """One answer off a keep-alive connection: its head and its sized body."""
    async with asyncio.timeout(SAFETY_S):
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for field in head.lower().split(b"\r\n"):
            if field.startswith(b"content-length:"):
                length = int(field.split(b":", 1)[1])
        if head_only or status(head) in (204, 304):
            return head
        return head + await reader.readexactly(length)


async def until(check: Callable[[], bool]) -> None:
    """Poll ``check`` (bounded) until it holds."""
    for _ in range(int(SAFETY_S / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


TENANT = b"X-Tenant-ID: acme\r\n"


# ------------------------------------------------------------ 1. no-body answers
async def test_pipelined_head_and_get_are_both_answered_at_once(
    sidecar_factory: SidecarFactory, raw_upstream: RawUpstream
) -> None:
    """The issue's reproduction: HEAD then GET in one write; both answered, the upstream
    connection reused (a HEAD answer ends with its head, whatever Content-Length says)."""
    sc = await sidecar_factory(upstream=raw_upstream.url)
    reader, writer = await connect(sc)
    writer.write(
        b"HEAD /v1/models HTTP/1.1\r\nHost: x\r\n" + TENANT + b"\r\n"
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + TENANT + b"\r\n"
    )
    head = await read_answer(reader, head_only=True)
    assert status(head) == 200
    assert b"content-length: 5\r\n" in head.lower()
    get = await read_answer(reader)
    assert status(get) == 200
    assert get.endswith(b"\r\n\r\nhello")
    writer.close()
    assert raw_upstream.requests == [(b"HEAD", b"/v1/models"), (b"GET", b"/v1/models")]
    assert raw_upstream.accepted == 1  # the HEAD's connection carried the GET


async def test_many_heads_hold_a_bounded_number_of_upstream_connections(
    sidecar_factory: SidecarFactory, raw_upstream: RawUpstream
) -> None:
    """HEADs never leave upstream connections waiting for a body: 200 of them, over 4
    client connections, open at most 4 upstream connections, all back in the pool."""
    sc = await sidecar_factory(upstream=raw_upstream.url)
    clients = [await connect(sc) for _ in range(4)]
    for _reader, writer in clients:
        writer.write(b"HEAD /v1/models HTTP/1.1\r\nHost: x\r\n" + TENANT + b"\r\n")
    for _ in range(50):
        for reader, writer in clients:
            assert status(await read_answer(reader, head_only=True)) == 200
            writer.write(b"HEAD /v1/models HTTP/1.1\r\nHost: x\r\n" + TENANT + b"\r\n")
    for reader, writer in clients:
        assert status(await read_answer(reader, head_only=True)) == 200
        writer.close()
    assert len(raw_upstream.requests) == 204
    assert raw_upstream.accepted <= 4
    pool = sc.sidecar.upstream
    assert pool.open_peak <= 4
    assert pool.open == raw_upstream.open <= 4


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        (b"/early-hints", b"final"),  # 103 then 200: the final answer is relayed
        (b"/continue", b"after 100"),  # an unasked-for 100 Continue is dropped too
    ],
)
async def test_interim_answers_are_dropped_and_the_final_one_relayed(
    sidecar_factory: SidecarFactory, raw_upstream: RawUpstream, path: bytes, expected: bytes
) -> None:
    """The interim answer arrives alone; the client gets only the final one, and the
    same upstream connection stays in step answer after answer."""
    sc = await sidecar_factory(upstream=raw_upstream.url)
    reader, writer = await connect(sc)
    for n in range(1, 4):
        raw_upstream.between.clear()
        writer.write(
            b"POST %s HTTP/1.1\r\nHost: x\r\n%scontent-length: 2\r\n\r\nhi" % (path, TENANT)
        )
        answering = asyncio.ensure_future(read_answer(reader))
        await until(lambda n=n: raw_upstream.first_parts == n)
        # A relayed interim answer would reach the client now (this only gives it the chance:
        # the test cannot fail for a slow machine, only miss a relay on one).
        await asyncio.sleep(0.2)
        raw_upstream.between.set()
        answer = await answering
        assert status(answer) == 200
        assert answer.endswith(b"\r\n\r\n" + expected)
    writer.close()
    assert raw_upstream.accepted == 1


@pytest.mark.parametrize("path", [b"/no-content", b"/not-modified"])
async def test_204_and_304_end_with_their_head(
    sidecar_factory: SidecarFactory, raw_upstream: RawUpstream, path: bytes
) -> None:
    sc = await sidecar_factory(upstream=raw_upstream.url)
    reader, writer = await connect(sc)
    writer.write(
        b"GET %s HTTP/1.1\r\nHost: x\r\n%s\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\n%s\r\n"
        % (path, TENANT, TENANT)
    )
    first = await read_answer(reader)
    assert status(first) in (204, 304)
    # A 304 says the length a GET would get; a 204 says none (it may not).
    assert (b"content-length: 7" in first.lower()) == (status(first) == 304)
    second = await read_answer(reader)
    assert second.endswith(b"\r\n\r\nhello")
    writer.close()
    assert raw_upstream.accepted == 1


async def test_bytes_nobody_asked_for_never_answer_the_next_request(
    sidecar_factory: SidecarFactory, raw_upstream: RawUpstream
) -> None:
    """An answer arriving on an idle upstream connection closes it; it is never taken
    for the answer to the request that uses the connection next."""
    sc = await sidecar_factory(upstream=raw_upstream.url)
    raw_upstream.between.clear()
    reader, writer = await connect(sc)
    writer.write(b"GET /stray HTTP/1.1\r\nHost: x\r\n%s\r\n" % TENANT)
    assert (await read_answer(reader)).endswith(b"\r\n\r\nasked")
    await until(lambda: raw_upstream.first_parts == 1)
    raw_upstream.between.set()  # the stray answer goes out on the idle connection
    await until(lambda: sc.sidecar.upstream.open == 0)  # ... which the sidecar closes
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n%s\r\n" % TENANT)
    assert (await read_answer(reader)).endswith(b"\r\n\r\nhello")
    writer.close()
    assert raw_upstream.accepted == 2


# ------------------------------------------------------------------ 2. upgrade
@pytest.mark.parametrize("path", [b"/v1/chat/completions", b"/echo"])
async def test_an_upgrade_is_refused_once_and_nothing_goes_upstream(
    sidecar: RunningSidecar, upstream: FakeUpstream, path: bytes
) -> None:
    body = b'{"model": "m1", "messages": [{"role": "user", "content": "up"}]}'
    reader, writer = await connect(sidecar)
    writer.write(
        b"POST %s HTTP/1.1\r\nHost: x\r\n%sConnection: Upgrade\r\nUpgrade: websocket\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (path, TENANT, len(body), body)
    )
    await writer.drain()
    raw = await read_all(reader)
    writer.close()
    assert raw.count(b"HTTP/1.1 ") == 1, raw  # exactly one answer
    assert status(raw) == 501
    assert b"upgrade" in raw.lower()
    assert sum(upstream.calls.values()) == 0


# --------------------------------------------------------- 4. connection bound
async def test_upstream_connections_are_bounded_and_the_overflow_gets_503(
    sidecar_factory: SidecarFactory, raw_upstream: RawUpstream
) -> None:
    """10 concurrent distinct misses, 4 connections, 2 may wait: the model server sees
    4 connections at most, 2 requests wait and are served later, 4 get 503 at once."""
    sc = await sidecar_factory(
        upstream=raw_upstream.url, upstream_max_connections=4, upstream_max_queued=2
    )
    raw_upstream.release.clear()
    clients = [await connect(sc) for _ in range(10)]
    for i, (_reader, writer) in enumerate(clients):
        writer.write(chat_request(f"distinct question {i}", temperature=0))
    reads = [asyncio.ensure_future(read_answer(reader)) for reader, _ in clients]
    # 4 requests are held by the model server and 2 wait for a connection: those 6
    # cannot be answered before the release, so the 4 answers that come are the refusals.
    await until(lambda: raw_upstream.held == 4 and sum(r.done() for r in reads) == 4)
    assert sc.sidecar.upstream.refused == 4
    for read in reads:
        if read.done():
            answer = read.result()
            assert status(answer) == 503
            assert b"--upstream-max-connections" in answer
            assert b"retry-after: 1" in answer.lower()
    waiting = [read for read in reads if not read.done()]
    raw_upstream.release.set()
    for answer in await asyncio.gather(*waiting):
        assert status(answer) == 200
    for _reader, writer in clients:
        writer.close()
    assert raw_upstream.open_peak == 4
    assert raw_upstream.accepted == 4  # waiters took released connections, none new
    assert len(raw_upstream.requests) == 6
    assert sc.sidecar.upstream.open_peak == 4
    text = (await sc.admin.get("/metrics")).text
    assert metric(text, "cachefleet_upstream_refused_total", cache="test/cache") == 4
    assert metric(text, "cachefleet_upstream_connections", cache="test/cache") == raw_upstream.open


async def test_single_flight_followers_take_no_connection(
    sidecar_factory: SidecarFactory, raw_upstream: RawUpstream
) -> None:
    """One connection, no queue: 6 identical concurrent misses share the leader's call."""
    sc = await sidecar_factory(
        upstream=raw_upstream.url, upstream_max_connections=1, upstream_max_queued=0
    )
    raw_upstream.release.clear()
    clients = [await connect(sc) for _ in range(6)]
    clients[0][1].write(chat_request("the same question", temperature=0))
    await until(lambda: raw_upstream.held == 1)
    for _reader, writer in clients[1:]:
        writer.write(chat_request("the same question", temperature=0))
    await until(lambda: sc.sidecar.metrics.single_flight_joins == 5)
    raw_upstream.release.set()
    for reader, writer in clients:
        assert status(await read_answer(reader)) == 200
        writer.close()
    assert raw_upstream.accepted == 1
    assert len(raw_upstream.requests) == 1


def test_the_pool_flags_and_their_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from cachefleet_sidecar.config import parse_args

    defaults = parse_args([])
    assert (defaults.http.upstream_max_connections, defaults.http.upstream_max_queued) == (
        256,
        1024,
    )
    assert defaults.observe.status_peers == ("127.0.0.1/32", "::1/128")
    cfg = parse_args(
        ["--upstream-max-connections=8", "--upstream-max-queued=0", "--status-peers=10.0.0.1"]
    )
    assert (cfg.http.upstream_max_connections, cfg.http.upstream_max_queued) == (8, 0)
    assert cfg.observe.status_peers == ("10.0.0.1/32",)
    for bad, flag in [
        ("--upstream-max-connections=0", "--upstream-max-connections"),
        ("--upstream-max-queued=-1", "--upstream-max-queued"),
        ("--status-peers=nowhere", "--status-peers"),
    ]:
        with pytest.raises(SystemExit):
            parse_args([bad])
        assert flag in capsys.readouterr().err


async def test_the_pool_hands_connections_over_and_never_leaks_a_slot(
    raw_upstream: RawUpstream,
) -> None:
    """The pool alone: first come first served, a waiter that gives up (cancelled even as
    it is handed a connection) passes it on, and a full queue refuses at once."""
    from cachefleet_sidecar.http.upstream import UpstreamError, UpstreamPool

    pool = UpstreamPool(raw_upstream.url, max_connections=1, max_waiting=2)
    raw_upstream.release.clear()
    first = asyncio.ensure_future(pool.request(b"GET", b"/a", []))
    await until(lambda: raw_upstream.held == 1)
    second = asyncio.ensure_future(pool.request(b"GET", b"/b", []))
    third = asyncio.ensure_future(pool.request(b"GET", b"/c", []))
    await until(lambda: len(pool._waiters) == 2)
    with pytest.raises(UpstreamError) as refused:
        await pool.request(b"GET", b"/d", [])
    assert refused.value.overloaded
    assert pool.refused == 1
    assert await pool.probe()  # /readyz's probe connects outside the pool ...
    await asyncio.sleep(0.05)  # (its close has run)
    assert pool.open == 1  # ... taking no slot and handing none to a waiter
    assert len(pool._waiters) == 2
    raw_upstream.release.set()
    assert await (await first).read() == b"hello"  # its connection is handed to /b ...
    second.cancel()  # ... which gives up before it runs: /c gets the connection
    with pytest.raises(asyncio.CancelledError):
        await second
    assert await (await third).read() == b"hello"
    assert [path for _, path in raw_upstream.requests] == [b"/a", b"/c"]
    assert raw_upstream.accepted == 2  # the one pooled connection, and the probe's
    assert pool.open == 1
    assert not pool._waiters
    await pool.aclose()


async def test_a_request_that_waits_out_its_deadline_gets_a_busy_error(
    raw_upstream: RawUpstream,
) -> None:
    from cachefleet_sidecar.http.upstream import UpstreamError, UpstreamPool

    pool = UpstreamPool(raw_upstream.url, max_connections=1, max_waiting=1)
    raw_upstream.release.clear()
    held = asyncio.ensure_future(pool.request(b"GET", b"/a", []))  # deadline: 600 s
    await until(lambda: raw_upstream.held == 1)
    pool.read_timeout_s = 0.3  # the next request's deadline only
    with pytest.raises(UpstreamError) as waited:
        await pool.request(b"GET", b"/b", [])  # the only connection never comes back in time
    assert waited.value.overloaded
    assert "no connection free" in str(waited.value)
    assert not pool._waiters
    raw_upstream.release.set()
    assert await (await held).read() == b"hello"
    assert [path for _, path in raw_upstream.requests] == [b"/a"]  # /b never went out
    assert pool.open == 1
    await pool.aclose()
