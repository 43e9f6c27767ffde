"""L1 lookup micro-benchmark: our LRU, LIRS and SITS against ``cachetools.LRUCache``.

Measures, in one process and one run, the cost of an L1 hit (``get`` of a
resident key) and of a ``put`` of a new key into a full cache (each put
evicts), per operation in nanoseconds. ``cachetools.LRUCache`` is bounded by
bytes the same way (``getsizeof`` returns the entry's size), so all three do
the same work. Every figure is the best of a few repetitions (the least
disturbed by the rest of the machine).

    python -m cachefleet_bench.l1_micro [--ops N] [--repeats R] [--seed S]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from cachefleet_sidecar.policies import ReplacementPolicy, make_policy

DEFAULT_OPS = 200_000
DEFAULT_REPEATS = 5
DEFAULT_SEED = 20020601
#: Entries resident in the benchmarked cache.
RESIDENT_ENTRIES = 10_000
#: Entry sizes are drawn uniformly from this range (bytes).
ENTRY_SIZE_RANGE = (512, 8192)

BASELINE = "cachetools.LRUCache"

Row = dict[str, Any]


class _Adapter:
    """One cache behind two closures: ``get(key)`` and ``put(key, value, size)``."""

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        if name == BASELINE:
            import cachetools

            cache: cachetools.LRUCache[int, bytes] = cachetools.LRUCache(capacity, getsizeof=len)

            def put(key: int, value: bytes, size: int) -> None:
                cache[key] = value

            self.get: Callable[[int], object] = cache.get
            self.put: Callable[[int, bytes, int], object] = put
        else:
            policy: ReplacementPolicy[int, bytes] = make_policy(name, capacity)
            self.get = policy.get
            self.put = policy.put


def _time_ns(fn: Callable[[], None]) -> int:
    start = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - start


def run(
    n_ops: int = DEFAULT_OPS, seed: int = DEFAULT_SEED, repeats: int = DEFAULT_REPEATS
) -> list[Row]:
    """One row per cache: ns per get (hit) and per put, and ratios to cachetools.

    The caches take turns within every repetition, so a noisy neighbour on
    the machine disturbs all of them alike; each figure is the best turn.
    """
    if n_ops < 1 or repeats < 1:
        raise ValueError("n_ops and repeats must be >= 1")
    rng = random.Random(seed)
    sizes = [rng.randint(*ENTRY_SIZE_RANGE) for _ in range(RESIDENT_ENTRIES)]
    capacity = sum(sizes)
    # A value's len() is its size: what cachetools' getsizeof reads.
    payloads = {size: bytes(size) for size in set(sizes)}
    resident = range(RESIDENT_ENTRIES)
    hits = [rng.randrange(RESIDENT_ENTRIES) for _ in range(n_ops)]
    put_sizes = [sizes[rng.randrange(RESIDENT_ENTRIES)] for _ in range(n_ops)]
    put_values = [payloads[size] for size in put_sizes]

    names = (BASELINE, "lru", "lirs", "sits")
    caches = {name: _Adapter(name, capacity) for name in names}
    for cache in caches.values():
        for key in resident:
            cache.put(key, payloads[sizes[key]], sizes[key])
        missing = sum(cache.get(key) is None for key in resident)
        if missing:
            raise RuntimeError(f"{cache.name}: {missing} of the filled keys are not resident")

    def gets(cache: _Adapter) -> Callable[[], None]:
        get = cache.get

        def loop() -> None:
            for key in hits:
                get(key)

        return loop

    def puts(cache: _Adapter, base: int) -> Callable[[], None]:
        put = cache.put

        def loop() -> None:
            for i in range(n_ops):
                put(base + i, put_values[i], put_sizes[i])

        return loop

    best_get = dict.fromkeys(names, float("inf"))
    for _ in range(repeats):
        for name in names:
            best_get[name] = min(best_get[name], _time_ns(gets(caches[name])))
    # Puts of new keys into the full cache (each evicts); fresh keys every turn.
    best_put = dict.fromkeys(names, float("inf"))
    for rep in range(repeats):
        base = RESIDENT_ENTRIES + rep * n_ops
        for name in names:
            best_put[name] = min(best_put[name], _time_ns(puts(caches[name], base)))

    rows: list[Row] = []
    for name in names:
        rows.append(
            {
                "cache": name,
                "get_hit_ns": best_get[name] / n_ops,
                "get_hits_per_s": n_ops * 1e9 / best_get[name],
                "put_ns": best_put[name] / n_ops,
                "get_ratio": best_get[name] / best_get[BASELINE],
                "put_ratio": best_put[name] / best_put[BASELINE],
                "capacity_bytes": capacity,
            }
        )
    return rows


def format_table(rows: Sequence[Row]) -> str:
    """The rows as a fixed-width text table."""
    header = f"{'cache':<22}{'get hit ns':>12}{'hits/s':>12}{'vs ct':>8}{'put ns':>10}{'vs ct':>8}"
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row['cache']:<22}{row['get_hit_ns']:>12.0f}{row['get_hits_per_s']:>12,.0f}"
            f"{row['get_ratio']:>8.2f}"
            f"{row['put_ns']:>10.0f}{row['put_ratio']:>8.2f}"
        )
    lines.append(
        "(ns per operation, best of the repetitions; 'vs ct' = ratio to cachetools; "
        "target: >= 1,000,000 get hits/s for every policy, issue 9)"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cachefleet_bench.l1_micro", description=__doc__
    )
    parser.add_argument("--ops", type=int, default=DEFAULT_OPS, help="operations per measurement")
    parser.add_argument(
        "--repeats", type=int, default=DEFAULT_REPEATS, help="repetitions (best kept)"
    )
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="random seed")
    args = parser.parse_args(argv)
    rows = run(n_ops=args.ops, seed=args.seed, repeats=args.repeats)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
