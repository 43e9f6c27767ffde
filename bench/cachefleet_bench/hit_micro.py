"""In-process cost of an L1 or L2 hit, from the bytes of the request to the bytes of the answer.

The ``l1`` and ``l2`` rows of ``cachefleet bench proxy`` measure the hit paths through
sockets and wrk, which share the machine's cores; this measures the same
path in one process, without sockets, so that it does not move with the
load of the machine. A sidecar is built from the flags the proxy benchmark
gives it, filled with the benchmark's hit request by one real request to an
in-process responder, and then one connection (whose transport only counts
what it is given) is fed the request wrk sends, over and over, one request
per turn of a uvloop event loop: httptools parses it, :meth:`Handler.fast`
answers it, the outbox writes the answer, and at the turn's end runs the
hit's bookkeeping, as in the server.

Each series is measured with one request per loop turn (a lone client) and
with ``--per-turn`` connections each giving one request per turn (a busy
server: the hits of one poll share a turn, and its bookkeeping); figures are
CPU time per request, so that a busy machine disturbs them little. Series,
measured in interleaved turns (each figure is the best turn):

``floor``
    the same connection in front of a handler that answers every request with
    a ready-made response: the parsing and the write, nothing of the cache.
``l1``
    the sidecar's L1 hit, miss-ratio curves on (the default).
``l1-nocurves``
    the same with ``--mrc-samples 0``.
``floor-l2``
    the floor's handler sending one pipelined ``GET`` to a loopback
    ``redis-server`` per request (the sidecar's own RESP client) and answering
    from its reply: the least an L2 hit can cost this process.
``l2``
    the sidecar's L2 hit: ``--l1-bytes 0`` and ``--redis-url`` (the ``l2`` row of
    ``cachefleet bench proxy``): a versioned read per request, answered from its
    reply's callback.

The Redis rows start their own ``redis-server`` (skipped with ``--no-redis``);
a turn of theirs ends when every connection of the turn has its answer, and
Redis's own CPU is not counted: what is measured is this process's.

    python -m cachefleet_bench.hit_micro [--requests N] [--repeats R] [--per-turn K]
        [--no-redis] [--profile [l1|l2]]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import pstats
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from cachefleet_bench.proxy_load import HOST, REQUEST_PATH, TENANT, TENANT_HEADER, hit_body
from cachefleet_bench.proxy_servers import FLOOR_REDIS_KEY, SIDECAR_L1_BYTES
from cachefleet_bench.responder import (
    CHAT_COMPLETION_BODY,
    REDIS_HEAD,
    RESPONSE,
    ResponderProtocol,
)
from cachefleet_common import resp
from cachefleet_common.contract.clients import resp_client
from cachefleet_e2e.services import RedisServer, ServiceError, redis_command
from cachefleet_sidecar.app import SidecarServer
from cachefleet_sidecar.compose import Sidecar
from cachefleet_sidecar.config import parse_args
from cachefleet_sidecar.http.server import Connection, Limiter, Request

DEFAULT_REQUESTS = 50_000
DEFAULT_REPEATS = 5
#: Connections with a request in each loop turn for the wide rows (a busy server's poll).
DEFAULT_PER_TURN = 16
#: What the answers of each cache series must carry (checked after the warm-up).
HIT_MARKS = {"l1": b"x-cache: hit-l1", "l1-nocurves": b"x-cache: hit-l1", "l2": b"x-cache: hit-l2"}
#: The peer address the connection reports (a trusted proxy: the tenant header counts).
PEER = ("127.0.0.1", 40000)

Row = dict[str, Any]
T = TypeVar("T")


def wire_request() -> bytes:
    """The hit request as wrk sends it (its script in :mod:`cachefleet_bench.proxy_load`)."""
    body = hit_body()
    return (
        b"POST %s HTTP/1.1\r\nHost: %s:8080\r\nContent-Type: application/json\r\n"
        b"%s: %s\r\nContent-Length: %d\r\n\r\n%s"
        % (
            REQUEST_PATH.encode(),
            HOST.encode(),
            TENANT_HEADER.encode(),
            TENANT.encode(),
            len(body),
            body,
        )
    )


class _Tally:
    """The answers a turn of the Redis rows waits for: its future is done at the last one."""

    def __init__(self) -> None:
        self.remaining = 0
        self.done: asyncio.Future[None] | None = None

    def expect(self, n: int) -> asyncio.Future[None]:
        self.remaining = n
        self.done = asyncio.get_running_loop().create_future()
        return self.done

    def answered(self) -> None:
        self.remaining -= 1
        if self.remaining == 0 and self.done is not None:
            self.done.set_result(None)


class _Sink:
    """A transport that keeps the last answer and counts the writes (and tells ``tally``)."""

    def __init__(self, tally: _Tally | None = None) -> None:
        self.writes = 0
        self.last = b""
        self.tally = tally

    def write(self, data: bytes) -> None:
        self.writes += 1
        self.last = data
        if self.tally is not None:
            self.tally.answered()

    def get_extra_info(self, name: str, default: object = None) -> object:
        return PEER if name == "peername" else default

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        raise RuntimeError("the benchmark connection was closed: the request was refused")


class _Constant:
    """The floor's handler: every request gets the responder's ready-made answer."""

    def fast(self, request: Request) -> bytes:
        return RESPONSE

    def resume(self, request: Request) -> None:
        return None

    async def handle(self, request: Request, conn: Connection) -> None:
        raise RuntimeError("the floor answers every request on the fast path")


class _RedisConstant:
    """The floor-l2 handler: every request waits for one pipelined ``GET`` of
    :data:`FLOOR_REDIS_KEY` (the sidecar's RESP client) and is answered with its value."""

    def __init__(self, client: resp.RespClient) -> None:
        self.client = client
        self.packed = resp.pack_command(("GET", FLOOR_REDIS_KEY))

    def fast(self, request: Request) -> asyncio.Future[Any]:
        futures = self.client.send_now(self.packed, 1, 1.0)
        if futures is None:
            raise RuntimeError("floor-l2: the Redis connection is not open")
        request.memo = futures[0]
        future: asyncio.Future[Any] = futures[0]
        return future

    def resume(self, request: Request) -> bytes:
        future = request.memo
        assert isinstance(future, asyncio.Future)
        value = future.result()
        if not isinstance(value, bytes):
            raise RuntimeError(f"floor-l2: GET {FLOOR_REDIS_KEY} answered {value!r}")
        return REDIS_HEAD % (len(value), b"keep-alive") + value

    async def handle(self, request: Request, conn: Connection) -> None:
        raise RuntimeError("the floor-l2 answers every request from its GET's callback")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


async def _started(
    extra: Sequence[str], l1_bytes: int = SIDECAR_L1_BYTES
) -> tuple[SidecarServer, asyncio.Server]:
    """A sidecar as the proxy benchmark starts it (and its in-process responder), answering
    the hit request from its cache: one miss fills it, then a hit is checked."""
    loop = asyncio.get_running_loop()
    responder = await loop.create_server(ResponderProtocol, HOST, 0)
    upstream = responder.sockets[0].getsockname()[1]
    port = _free_port()
    config = parse_args(
        [
            "--listen",
            f"{HOST}:{port}",
            "--upstream",
            f"http://{HOST}:{upstream}",
            "--trusted-proxies",
            f"{HOST}/32",
            "--l1-bytes",
            str(l1_bytes),
            *extra,
        ]
    )
    server = SidecarServer(config)
    await server.start()
    want = b"x-cache: hit-l2" if l1_bytes == 0 else b"x-cache: hit-l1"
    try:
        answer = b""
        for _ in range(100):  # the miss's L2 write is in the background: a few tries
            reader, writer = await asyncio.open_connection(HOST, port)
            writer.write(
                wire_request().replace(b"HTTP/1.1\r\n", b"HTTP/1.1\r\nConnection: close\r\n", 1)
            )
            answer = (await reader.read()).lower()
            writer.close()
            if want in answer:
                return server, responder
            await asyncio.sleep(0.01)
        raise RuntimeError(f"expected {want!r} from the sidecar, got {answer[:300]!r}")
    except BaseException:
        await server.stop()
        responder.close()
        raise


async def _filled(extra: Sequence[str]) -> Sidecar:
    """A sidecar holding the hit request's answer in L1, stopped (an L1 hit needs no loop)."""
    server, responder = await _started(extra)
    await server.stop()
    responder.close()
    return server.sidecar


def _connections(
    handler: Any, count: int, tally: _Tally | None = None
) -> list[tuple[Connection, _Sink]]:
    """``count`` connections to ``handler`` sharing one limiter, as a server's do (their
    answers told to ``tally`` when they come later than their turn)."""
    # The sidecar's bookkeeping goes to its own outbox, which the server shares with its limiter.
    limiter = Limiter(outbox=getattr(handler, "outbox", None))
    out = []
    for _ in range(count):
        sink = _Sink(tally)
        conn = Connection(handler, limiter)
        conn.connection_made(sink)  # type: ignore[arg-type]
        out.append((conn, sink))
    return out


async def _turns(conns: list[tuple[Connection, _Sink]], n: int) -> int:
    """CPU ns to answer ``n`` requests on each of ``conns``: one request on every
    connection per loop turn, as when that many clients' requests arrive
    within one poll (checked: every request answered)."""
    data = wire_request()
    feeds = [conn.data_received for conn, _ in conns]
    before = sum(sink.writes for _, sink in conns)
    pause = asyncio.sleep
    clock = time.process_time_ns  # CPU time: what a neighbour on the machine disturbs least
    tally = conns[0][1].tally
    start = clock()
    if tally is None:
        for _ in range(n):
            for feed in feeds:
                feed(data)
            await pause(0)  # the turn ends: the outbox writes and runs the bookkeeping
    else:  # answered from Redis's replies: the turn ends when the last answer is written
        width = len(feeds)
        for _ in range(n):
            done = tally.expect(width)
            for feed in feeds:
                feed(data)
            await done
        await pause(0)  # the last turn's bookkeeping
    took = clock() - start
    answered = sum(sink.writes for _, sink in conns) - before
    if answered != n * len(conns):
        raise RuntimeError(f"{n * len(conns)} requests got {answered} answers")
    return took


def _run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on uvloop, as the sidecar runs (asyncio's loop without it)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(main)
    return uvloop.run(main)


def run(
    n: int = DEFAULT_REQUESTS,
    repeats: int = DEFAULT_REPEATS,
    per_turn: int = DEFAULT_PER_TURN,
    redis: bool = True,
) -> list[Row]:
    """One row per series and requests per turn (1 and ``per_turn``): µs of CPU per
    request and the ratios to the floor and the L1 hit with as many per turn
    (``redis``: with the floor-l2 and l2 series, on a redis-server of its own)."""
    if n < 1 or repeats < 1 or per_turn < 1:
        raise ValueError("requests, repeats and per_turn must be >= 1")
    sidecars = {
        "l1": _run(_filled(())),
        "l1-nocurves": _run(_filled(("--mrc-samples", "0"))),
    }
    handlers: dict[str, Any] = {"floor": _Constant()}
    handlers.update((name, sc.handler) for name, sc in sidecars.items())
    # The Redis rows are measured apart, after the others: their live sidecar's
    # background loops would otherwise run (and count) during the L1 rows' turns.
    best = _run(_measure(handlers, (), n, repeats, per_turn))
    if redis:
        with _redis_server() as url:
            best.update(
                _run(_with_redis(url, lambda live: _measure(live, live, n, repeats, per_turn)))
            )
    return [
        {
            "series": name,
            "per_turn": width,
            "us_per_request": took / 1000,
            "requests_per_cpu_s": 1e9 / took,
            "vs_floor": took / best[("floor", width)],
            "vs_l1": took / best[("l1", width)],
        }
        for (name, width), took in sorted(best.items(), key=lambda item: item[0][1])
    ]


@contextlib.contextmanager
def _redis_server() -> Iterator[str]:
    """A loopback redis-server for the Redis rows (holding the floor-l2's value); its URL."""
    try:
        server = RedisServer().start()
    except ServiceError as exc:
        why = f"redis-server did not start (--no-redis skips its rows): {exc}"
        raise RuntimeError(why) from exc
    try:
        reply = redis_command(server.port, "SET", FLOOR_REDIS_KEY, CHAT_COMPLETION_BODY.decode())
        if reply != b"+OK\r\n":
            raise RuntimeError(f"redis SET {FLOOR_REDIS_KEY} answered {reply[:100]!r}")
        yield server.url
    finally:
        server.stop()


async def _with_redis(url: str, then: Callable[[dict[str, Any]], Awaitable[T]]) -> T:
    """``then(handlers)`` with the Redis rows' handlers, live on this loop: floor-l2's
    (its own RESP client) and a running sidecar's with ``--l1-bytes 0 --redis-url``."""
    client = resp_client(url, command_timeout_s=1.0)
    await client.connect(5.0)
    server, responder = await _started(("--redis-url", url), l1_bytes=0)
    try:
        return await then({"floor-l2": _RedisConstant(client), "l2": server.sidecar.handler})
    finally:
        await server.stop()
        responder.close()
        await client.aclose()


async def _measure(
    handlers: dict[str, Any], live: Iterable[str], n: int, repeats: int, per_turn: int
) -> dict[tuple[str, int], float]:
    """The best CPU ns per request of each handler at 1 and ``per_turn`` requests a
    turn, in interleaved turns (``live``: the handlers that answer from Redis)."""
    live = frozenset(live)
    widths = sorted({1, per_turn})
    groups = {
        (name, width): _connections(handler, width, _Tally() if name in live else None)
        for width in widths
        for name, handler in handlers.items()
    }
    for (name, _), conns in groups.items():
        await _turns(conns, 100)  # warm up (and check the answer is the hit)
        last = conns[-1][1].last.lower()
        want = HIT_MARKS.get(name)
        if want is not None and want not in last:
            raise RuntimeError(f"{name}: not the expected hit ({want!r}): {last[:300]!r}")
    best = dict.fromkeys(groups, float("inf"))
    for _ in range(repeats):
        for (name, width), conns in groups.items():
            turns = max(1, n // width)
            took = await _turns(conns, turns) / turns / width
            best[(name, width)] = min(best[(name, width)], took)
    return best


def profile(n: int, per_turn: int = 1, top: int = 25, series: str = "l1") -> str:
    """cProfile of ``n`` hits of ``series`` (``l1``: curves on; ``l2``: on a redis-server
    of its own), ``per_turn`` a turn: the ``top`` functions by own time."""
    profiler = cProfile.Profile()

    async def measured(handler: Any, live: bool) -> None:
        conns = _connections(handler, per_turn, _Tally() if live else None)
        await _turns(conns, 100)
        profiler.enable()
        await _turns(conns, max(1, n // per_turn))
        profiler.disable()

    if series == "l2":
        with _redis_server() as url:

            async def l2(handlers: dict[str, Any]) -> None:
                await measured(handlers["l2"], True)

            _run(_with_redis(url, l2))
    else:
        _run(measured(_run(_filled(())).handler, False))
    out = _Writer()
    stats = pstats.Stats(profiler, stream=out)  # type: ignore[arg-type]
    stats.sort_stats("tottime").print_stats(top)
    return out.text


class _Writer:
    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> None:
        self.text += text


def format_table(rows: Sequence[Row]) -> str:
    header = (
        f"{'series':<14}{'per turn':>9}{'CPU µs/req':>12}{'req/CPU-s':>12}{'vs floor':>10}"
        f"{'vs l1':>8}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row['series']:<14}{row['per_turn']:>9}{row['us_per_request']:>12.2f}"
            f"{row['requests_per_cpu_s']:>12,.0f}{row['vs_floor']:>10.2f}{row['vs_l1']:>8.2f}"
        )
    lines.append(
        "(one process, no sockets; CPU time, best of the interleaved turns; "
        "'vs' at the same requests per turn)"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, out: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cachefleet_bench.hit_micro", description=__doc__
    )
    parser.add_argument("--requests", type=int, default=DEFAULT_REQUESTS)
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    parser.add_argument(
        "--per-turn",
        type=int,
        default=DEFAULT_PER_TURN,
        help="connections with a request in each loop turn, for the wide rows",
    )
    parser.add_argument(
        "--no-redis", action="store_true", help="without the floor-l2 and l2 rows (no redis-server)"
    )
    parser.add_argument(
        "--profile",
        nargs="?",
        const="l1",
        choices=("l1", "l2"),
        help="cProfile the L1 (default) or L2 hit instead",
    )
    args = parser.parse_args(argv)
    if args.profile:
        out(profile(args.requests, args.per_turn, series=args.profile))
    else:
        out(format_table(run(args.requests, args.repeats, args.per_turn, not args.no_redis)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
