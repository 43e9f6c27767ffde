"""L2 read micro-benchmark: a versioned ``RedisL2.get`` against one plain ``GET``.

Starts its own ``redis-server`` on loopback, stores one entry (``--value-bytes``,
under a 3-scope epoch vector, as a sidecar does) and reads it in one process
on uvloop, in two ways on the same client and connection:

* ``plain GET``: one ``GET`` of the entry key through the lean RESP client
  (:meth:`~cachefleet_common.resp.RespClient.execute`): the floor of any
  L2 read, one round trip and Redis's cheapest command;
* ``versioned get``: :meth:`~cachefleet_sidecar.cache.l2.RedisL2.get` with the
  vector, what an L2 hit costs the sidecar (fence check, head check, breaker,
  the batched LRU touch).

At c=1 (one read at a time) and at c=64 (64 reads in flight): wall time per
read, this process's CPU per read and Redis's CPU per read (``INFO cpu``),
best of ``--repeats``. Ratios against the plain ``GET`` of the same run are
the figures to compare across machines.

    cachefleet bench l2 [--reads N] [--repeats R] [--value-bytes B] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import resource
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import uvloop

from cachefleet_common.contract.names import entry_key
from cachefleet_common.epochs import EpochVector
from cachefleet_e2e.services import RedisServer, ServiceError, redis_command
from cachefleet_sidecar.cache.l2 import RedisL2

DEFAULT_READS = 20_000
DEFAULT_REPEATS = 3
DEFAULT_VALUE_BYTES = 600
CONCURRENCIES = (1, 64)
CACHE = "bench/l2"
TENANT = "acme"
VECTOR: EpochVector = (("cache", 0), ("tenant:acme", 0), ("model:m1", 0))


@dataclass(frozen=True)
class Row:
    """One way of reading at one concurrency (best of the repetitions)."""

    read: str
    concurrency: int
    wall_us: float
    client_cpu_us: float
    redis_cpu_us: float


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _redis_cpu_s(port: int) -> float:
    info = redis_command(port, "INFO", "cpu").decode(errors="replace")
    total = 0.0
    for line in info.splitlines():
        if line.startswith(("used_cpu_sys:", "used_cpu_user:")):
            total += float(line.split(":", 1)[1])
    return total


async def _measure(
    read: Callable[[], Awaitable[object]], reads: int, concurrency: int, port: int
) -> tuple[float, float, float]:
    """(wall, client CPU, Redis CPU) per read, in µs, over ``reads`` reads."""
    rounds = max(1, reads // concurrency)
    done = rounds * concurrency
    redis0, cpu0, wall0 = _redis_cpu_s(port), _own_cpu_s(), time.perf_counter()
    if concurrency == 1:
        for _ in range(rounds):
            await read()
    else:
        for _ in range(rounds):
            await asyncio.gather(*(read() for _ in range(concurrency)))
    wall, cpu, redis = time.perf_counter() - wall0, _own_cpu_s() - cpu0, _redis_cpu_s(port) - redis0
    return wall / done * 1e6, cpu / done * 1e6, redis / done * 1e6


async def _run(url: str, port: int, reads: int, repeats: int, value_bytes: int) -> list[Row]:
    l2 = RedisL2.from_url(url, CACHE, op_timeout_s=1.0)
    try:
        if not await l2.connect():
            raise SystemExit(f"cachefleet bench l2: Redis at {url} did not answer")
        digest = hashlib.sha256(b"the benchmarked entry").hexdigest()
        if not await l2.put(TENANT, digest, b"x" * value_bytes, VECTOR):
            raise SystemExit("cachefleet bench l2: the entry was not stored")
        key = entry_key(CACHE, TENANT, digest)
        client = l2._client  # the tier's own connection: the same path, one command

        async def plain() -> object:
            return await client.execute("GET", key, key=key)

        async def versioned() -> object:
            value = await l2.get(TENANT, digest, VECTOR)
            if value is None or len(value) != value_bytes:
                raise SystemExit("cachefleet bench l2: a versioned read missed")
            return value

        rows: list[Row] = []
        for concurrency in CONCURRENCIES:
            for name, read in (("plain GET", plain), ("versioned get", versioned)):
                await _measure(read, min(reads, 2_000), concurrency, port)  # warm-up
                best = min(
                    [await _measure(read, reads, concurrency, port) for _ in range(repeats)],
                    key=lambda m: m[0],
                )
                rows.append(Row(name, concurrency, *best))
                print(
                    f"[bench l2] {name}, c={concurrency}: {best[0]:.1f} us/read",
                    file=sys.stderr,
                    flush=True,
                )
        return rows
    finally:
        await l2.aclose()


def format_table(rows: Sequence[Row]) -> str:
    base = {r.concurrency: r for r in rows if r.read == "plain GET"}
    lines = [
        "cachefleet bench l2: one entry read in a loop, best of the repetitions (µs per read)",
        f"{'read':<15}{'c':>4}{'wall':>9}{'vs GET':>9}{'client CPU':>12}{'Redis CPU':>11}",
    ]
    for r in rows:
        ratio = r.wall_us / base[r.concurrency].wall_us
        lines.append(
            f"{r.read:<15}{r.concurrency:>4}{r.wall_us:>9.1f}{ratio:>8.2f}x"
            f"{r.client_cpu_us:>12.1f}{r.redis_cpu_us:>11.1f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cachefleet bench l2", description=__doc__)
    parser.add_argument("--reads", type=int, default=DEFAULT_READS, help="reads per measurement")
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="best of this many")
    parser.add_argument("--value-bytes", type=int, default=DEFAULT_VALUE_BYTES)
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    if args.reads < 64 or args.repeats < 1 or args.value_bytes < 1:
        parser.error("--reads must be >= 64, --repeats and --value-bytes >= 1")
    try:
        server = RedisServer().start()
    except ServiceError as exc:
        print(f"cachefleet bench l2: redis-server did not start: {exc}", file=sys.stderr)
        return 2
    try:
        rows = uvloop.run(_run(server.url, server.port, args.reads, args.repeats, args.value_bytes))
    finally:
        server.stop()
    print(format_table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps({"results": [asdict(r) for r in rows]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
