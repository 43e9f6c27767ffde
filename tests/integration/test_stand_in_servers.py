"""The stand-in model servers take a burst of new connections the way a model server does.

The demo's first 2 s showed a p95 of about 1.1 s for some tenants in every run: at
the start every sidecar opens its upstream connections at once, and the stand-in
(stdlib ``ThreadingHTTPServer``) listened with a backlog of 5, so Linux dropped the
handshakes beyond its accept queue and those requests waited for the SYN's (or
SYN-ACK's) retransmission, one second later (measured: 3-6 ``TcpExtListenOverflows``
and 2-4 requests of 1.04-1.09 s per demo start; none of either with the fix). Here a
burst of connections reaches a stand-in that is not accepting yet, as when its accept
thread is busy: every one must complete its handshake and sit in the accept queue,
none left to a retransmission.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from cachefleet_e2e.fake_upstream import FakeUpstream
from cachefleet_e2e.modelserver_sim import ModelServerSim

#: Connections opened at once: the demo's first second opens about a dozen per stand-in.
BURST = 64
#: Generous bound for the kernel to finish loopback handshakes (it takes microseconds);
#: a dropped SYN is retried after 1 s and 3 s and, with nothing accepting, dropped again.
HANDSHAKE_DEADLINE_S = 5.0


@contextlib.contextmanager
def burst(port: int, n: int) -> Iterator[list[socket.socket]]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            socks.append(s)
            s.connect_ex(("127.0.0.1", port))
        yield socks
    finally:
        for s in socks:
            s.close()


def established(socks: list[socket.socket]) -> int:
    """How many of ``socks`` completed their handshake within the deadline."""
    pending = set(socks)
    done = 0
    deadline = time.monotonic() + HANDSHAKE_DEADLINE_S
    while pending and time.monotonic() < deadline:
        _, writable, _ = select.select([], list(pending), [], 0.2)
        for s in writable:
            pending.discard(s)
            done += s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
    return done


def accepted(server: Any) -> int:
    """Drain the listening socket's accept queue; how many connections it held."""
    listener = server.socket
    listener.setblocking(False)
    n = 0
    while True:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return n
        conn.close()
        n += 1


@pytest.mark.parametrize(
    "make",
    [FakeUpstream, ModelServerSim],
    ids=["fake-upstream", "modelserver-sim"],
)
def test_a_burst_of_connections_waits_on_no_dropped_handshake(make: Callable[[], Any]) -> None:
    stand_in = make()  # listening, not serving: nothing accepts until the burst is in
    server = stand_in.server
    try:
        with burst(stand_in.port, BURST) as socks:
            assert established(socks) == BURST
            assert accepted(server) == BURST
    finally:
        server.server_close()
