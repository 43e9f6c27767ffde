"""The answers of one loop turn go out together (:class:`Outbox`): the first at
once, the rest when the turn ends, each connection's in order, and the
bookkeeping after them. Fake transports record every write; no sockets."""

from __future__ import annotations

import asyncio
from typing import Any

from cachefleet_sidecar.http.outbox import Outbox
from cachefleet_sidecar.http.server import Connection, Limiter, Request

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


def get(path: bytes, extra: bytes = b"") -> bytes:
    return b"GET %s HTTP/1.1\r\nHost: x\r\n%s\r\n" % (path, extra)


class Recording:
    """A transport that appends ``(name, bytes)`` to a log shared by several."""

    def __init__(self, name: str, log: list[tuple[str, bytes]]) -> None:
        self.name = name
        self.log = log
        self.closed = False

    @property
    def out(self) -> bytes:
        return b"".join(data for name, data in self.log if name == self.name)

    def get_extra_info(self, name: str) -> object:
        return ("127.0.0.1", 40000) if name == "peername" else None

    def write(self, data: bytes) -> None:
        assert not self.closed
        self.log.append((self.name, data))

    def close(self) -> None:
        self.closed = True
        self.log.append((self.name, b"<close>"))

    def abort(self) -> None:
        self.close()

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.log.append((self.name, b"<eof>"))

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class Fast:
    """Answers ``/fast/...`` at once (with its path), hands the rest to :meth:`handle`."""

    def fast(self, request: Request) -> bytes | None:
        if request.url.startswith(b"/fast"):
            body = request.url
            return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        return None

    def resume(self, request: Request) -> bytes | None:  # pragma: no cover
        raise AssertionError("nothing is deferred here")

    async def handle(self, request: Request, conn: Connection) -> None:
        conn.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nslow")


def connect(limiter: Limiter, name: str, log: list[tuple[str, bytes]]) -> Connection:
    conn = Connection(Fast(), limiter)
    conn.connection_made(Recording(name, log))  # type: ignore[arg-type]
    return conn


async def test_the_first_answer_goes_at_once_and_the_rest_of_the_turn_together() -> None:
    log: list[tuple[str, bytes]] = []
    limiter = Limiter()
    a, b, c = (connect(limiter, name, log) for name in "abc")
    a.data_received(get(b"/fast/a1"))
    b.data_received(get(b"/fast/b1") + get(b"/fast/b2"))
    c.data_received(get(b"/fast/c1"))
    limiter.outbox.later(log.append, ("later", b""))
    # Same turn: only the first answer is out.
    assert [name for name, _ in log] == ["a"]
    await asyncio.sleep(0)  # the turn ends: the held answers go out, one write each
    assert [name for name, _ in log] == ["a", "b", "c", "later"]  # then the bookkeeping
    assert log[1][1].count(b"HTTP/1.1 200") == 2
    assert log[1][1].index(b"/fast/b1") < log[1][1].index(b"/fast/b2")
    # The next turn starts afresh: its first answer goes at once again.
    c.data_received(get(b"/fast/c2"))
    assert log[-1][0] == "c"
    assert log[-1][1].endswith(b"/fast/c2")


async def test_bookkeeping_queued_first_does_not_hold_the_first_answer() -> None:
    log: list[tuple[str, bytes]] = []
    limiter = Limiter()
    a, b = connect(limiter, "a", log), connect(limiter, "b", log)
    # The sidecar queues a hit's bookkeeping before it hands the answer back.
    limiter.outbox.later(log.append, ("later", b""))
    a.data_received(get(b"/fast/a"))
    b.data_received(get(b"/fast/b"))
    assert [name for name, _ in log] == ["a"]
    await asyncio.sleep(0)
    assert [name for name, _ in log] == ["a", "b", "later"]


async def test_a_held_answer_goes_before_anything_written_after_it() -> None:
    log: list[tuple[str, bytes]] = []
    limiter = Limiter()
    first, conn = connect(limiter, "first", log), connect(limiter, "conn", log)
    first.data_received(get(b"/fast/open-the-turn"))
    # A fast answer (held), then a request the handler answers on the slow path.
    conn.data_received(get(b"/fast/1") + get(b"/slow"))
    # An interim 100 Continue, written at once, still comes after the held answer.
    conn.data_received(get(b"/fast/2", b"Expect: 100-continue\r\nContent-Length: 0\r\n"))
    for _ in range(5):
        await asyncio.sleep(0)
    out = conn.transport.out  # type: ignore[union-attr]
    assert out.index(b"/fast/1") < out.index(b"100 Continue")
    assert out.index(b"/fast/1") < out.index(b"slow") < out.index(b"/fast/2")


async def test_closing_writes_the_held_answers_first() -> None:
    log: list[tuple[str, bytes]] = []
    limiter = Limiter()
    connect(limiter, "first", log).data_received(get(b"/fast/open-the-turn"))
    conn = connect(limiter, "conn", log)
    conn.data_received(get(b"/fast/last", b"Connection: close\r\n"))
    assert [data for name, data in log if name == "conn"][-1] == b"<close>"
    assert b"/fast/last" in conn.transport.out  # type: ignore[union-attr]
    await asyncio.sleep(0)
    assert conn.transport.out.count(b"/fast/last") == 1  # type: ignore[union-attr]


async def test_a_connection_lost_meanwhile_drops_its_held_answers() -> None:
    log: list[tuple[str, bytes]] = []
    limiter = Limiter()
    connect(limiter, "first", log).data_received(get(b"/fast/open-the-turn"))
    gone = connect(limiter, "gone", log)
    gone.data_received(get(b"/fast/never"))
    gone.connection_lost(None)
    await asyncio.sleep(0)
    assert [name for name, _ in log] == ["first"]


async def test_a_failing_bookkeeping_step_is_logged_and_the_others_run() -> None:
    outbox = Outbox()
    ran: list[int] = []

    def boom() -> None:
        raise RuntimeError("bookkeeping bug")

    outbox.later(boom)
    outbox.later(ran.append, 1)
    for _ in range(3):
        await asyncio.sleep(0)
    assert ran == [1]


def test_without_a_running_loop_everything_goes_at_once() -> None:
    log: list[tuple[str, bytes]] = []
    limiter = Limiter()
    a, b = connect(limiter, "a", log), connect(limiter, "b", log)
    a.data_received(get(b"/fast/a"))
    b.data_received(get(b"/fast/b"))
    ran: list[str] = []
    limiter.outbox.later(ran.append, "now")
    assert [name for name, _ in log] == ["a", "b"]
    assert ran == ["now"]


def test_a_turn_its_loop_never_ended_does_not_hold_answers_on_the_next_loop() -> None:
    log: list[tuple[str, bytes]] = []
    limiter = Limiter()
    conn = connect(limiter, "conn", log)

    async def stopped() -> None:
        asyncio.get_running_loop().stop()  # this turn's callbacks will never run
        limiter.outbox.answer(conn, b"one")
        limiter.outbox.answer(conn, b"two (held, its loop gone)")

    async def later_loop(ran: list[Any]) -> None:
        limiter.outbox.answer(conn, b"three")
        limiter.outbox.later(ran.append, True)
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(stopped())
    finally:
        loop.close()
    ran: list[Any] = []
    asyncio.run(later_loop(ran))
    assert [data for _, data in log] == [b"one", b"three"]
    assert ran == [True]


async def test_every_turn_runs_at_each_turn_end_after_the_answers_and_a_failure_is_logged() -> None:
    log: list[tuple[str, bytes]] = []
    limiter = Limiter()
    outbox = limiter.outbox
    a, b = connect(limiter, "a", log), connect(limiter, "b", log)

    def boom() -> None:
        raise RuntimeError("bookkeeping bug")

    outbox.every_turn(boom)
    outbox.every_turn(lambda: log.append(("every", b"")))
    # The book opens the turn before the hit's answer is handed back: it still goes at once.
    assert outbox.turn()
    assert outbox.turn()  # already open: nothing more scheduled
    a.data_received(get(b"/fast/a"))
    b.data_received(get(b"/fast/b"))
    outbox.later(log.append, ("later", b""))
    assert [name for name, _ in log] == ["a"]
    await asyncio.sleep(0)
    assert [name for name, _ in log] == ["a", "b", "every", "later"]
    a.data_received(get(b"/fast/a2"))  # the next turn, opened by its answer
    await asyncio.sleep(0)
    assert [name for name, _ in log] == ["a", "b", "every", "later", "a", "every"]


def test_without_a_running_loop_no_turn_opens() -> None:
    assert not Outbox().turn()
