"""The answers and the bookkeeping of one event-loop turn (:class:`Outbox`).

The connections of a server (:mod:`cachefleet_sidecar.http.server`) give
their answers to its one :class:`Outbox`, which writes the first answer of a
loop turn at once and those that follow in the same turn at its end, then
runs the bookkeeping queued for after the answers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger("cachefleet.sidecar")


class Connection(Protocol):
    """What the outbox needs of a connection (the server's :class:`Connection` is one)."""

    #: Answers held back until the turn's end (the first answer of a turn goes at once).
    held: list[bytes]

    @property
    def transport(self) -> asyncio.WriteTransport | None: ...

    def flush_held(self) -> None: ...


class Outbox:
    """The answers and the bookkeeping of one event-loop turn, shared by a server's connections.

    A turn opens with its first answer or bookkeeping (one ``call_soon``, its
    end). The first answer of a turn is written at once. Answers given later
    in the same turn are held, each connection's in order, and written when
    the turn ends: the clients of a burst are woken once, when their answers
    are all out, instead of once per answer while the others are still being
    made. Waking a client that sleeps in ``epoll_wait`` costs more than the
    write itself (an inter-processor interrupt, a VM exit on a virtual
    machine), and a client that handles one answer faster than the sidecar
    makes the next one sleeps between any two of them.

    :meth:`later` queues bookkeeping (metrics, stores, promotions): it runs
    at the turn's end too, in the same callback, once the turn's answers are
    written. A failure is logged, never raised: the answer is already given.
    What batches a turn's work itself (the L1 hits' book) registers once with
    :meth:`every_turn` instead, and opens the turn with :meth:`turn`: nothing
    queued per turn.

    Without a running loop (synchronous callers) answers are written and
    bookkeeping runs at once.
    """

    __slots__ = ("_answered", "_every", "_held", "_later", "_turn")

    def __init__(self) -> None:
        #: The loop the open turn's end is scheduled on (None: no turn is open).
        self._turn: asyncio.AbstractEventLoop | None = None
        #: Whether this turn's first answer is written (the next ones are held).
        self._answered = False
        self._held: list[Connection] = []
        self._later: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        self._every: list[Callable[[], None]] = []

    def _current(self) -> bool:
        """Whether a turn is open."""
        turn = self._turn
        if turn is None:
            return False
        if turn.is_running():
            return True
        # The loop stopped before the turn ended (its callbacks are dropped): start afresh.
        self._turn = None
        self._answered = False
        held, self._held = self._held, []
        for conn in held:
            conn.held.clear()
        return False

    def _open(self) -> bool:
        """Open a turn (schedule its end); False without a running loop."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        loop.call_soon(self._end)
        self._turn = loop
        return True

    def answer(self, conn: Connection, data: bytes) -> None:
        """Write ``data`` to ``conn`` now, or at the end of this turn (after its other answers)."""
        turn = self._turn
        # _current() inline for an open turn (the common case): a call less per answer
        if turn is not None and turn.is_running():
            if self._answered:
                if not conn.held:
                    self._held.append(conn)
                conn.held.append(data)
                return
            self._answered = True
        elif not self._current() and self._open():
            self._answered = True
        transport = conn.transport
        if transport is not None:
            transport.write(data)

    def later(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` at the end of this turn, once its answers are written."""
        self._later.append((fn, args))
        if not self._current() and not self._open():
            self._run(self._take_later())

    def every_turn(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` at the end of every turn, once its answers are written (before
        what :meth:`later` queued)."""
        self._every.append(fn)

    def turn(self) -> bool:
        """Open a turn unless one is open (its end runs :meth:`every_turn`'s callables);
        False without a running loop."""
        turn = self._turn
        if turn is not None and turn.is_running():
            return True
        return self._current() or self._open()

    def _take_later(self) -> list[tuple[Callable[..., None], tuple[Any, ...]]]:
        later, self._later = self._later, []
        return later

    def _end(self) -> None:
        self._turn = None
        self._answered = False
        held, self._held = self._held, []
        for conn in held:
            conn.flush_held()
        for fn in self._every:
            try:
                fn()
            except Exception:  # bookkeeping never fails an answer already given
                log.exception("bookkeeping after an answer failed")
        if self._later:
            self._run(self._take_later())

    @staticmethod
    def _run(later: list[tuple[Callable[..., None], tuple[Any, ...]]]) -> None:
        for fn, args in later:
            try:
                fn(*args)
            except Exception:  # bookkeeping never fails an answer already given
                log.exception("bookkeeping after an answer failed")
