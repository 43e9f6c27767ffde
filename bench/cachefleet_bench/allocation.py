"""Benchmark: time of one allocation for 10, 1,000 and 10,000 tenants.

``python -m cachefleet_bench.allocation`` (or ``cachefleet bench allocation``)
prints the median and the best of several runs per size, for a first
allocation and for a rebalance with previous shares (smoothing and hysteresis
on). Target: 10,000 tenants in under 50 ms.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from cachefleet_operator.allocation import (
    PriorityClass,
    TenantDemand,
    TenantMetrics,
    allocate,
)

SIZES = (10, 1_000, 10_000)
#: Target for 10,000 tenants, seconds.
TARGET_10K_S = 0.050
L1_BYTES = 8 * 2**30
L2_BYTES = 256 * 2**30


def workload(n: int, seed: int = 7) -> tuple[list[TenantDemand], dict[str, TenantMetrics]]:
    """``n`` tenants of mixed classes and SLAs with metrics around their targets."""
    rng = random.Random(seed)
    classes = list(PriorityClass)
    floor_each = 0.5 / n
    tenants, metrics = [], {}
    for i in range(n):
        cls = rng.choice(classes)
        target = rng.choice((0.2, 0.5, 1.0, 2.0))
        tenants.append(
            TenantDemand(
                name=f"tenant-{i}",
                priority_class=cls,
                min_share=0.0 if cls is PriorityClass.BEST_EFFORT else floor_each,
                max_share=rng.choice((0.2, 0.5, 1.0)),
                p95_target_s=target,
                min_hit_ratio=rng.choice((None, 0.3, 0.6)),
                min_rps=rng.choice((None, 10.0)),
            )
        )
        metrics[f"tenant-{i}"] = TenantMetrics(
            p95_s=target * rng.uniform(0.3, 2.5),
            hit_ratio=rng.uniform(0.0, 0.95),
            rps=rng.uniform(0.1, 500.0),
        )
    return tenants, metrics


def measure(n: int, repeats: int) -> tuple[float, float, float]:
    """(median first allocation, best first allocation, median rebalance) in seconds."""
    tenants, metrics = workload(n)
    first, again = [], []
    previous = allocate(tenants, metrics, None, L1_BYTES, L2_BYTES).shares()
    for _ in range(repeats):
        start = time.perf_counter()
        allocate(tenants, metrics, None, L1_BYTES, L2_BYTES)
        first.append(time.perf_counter() - start)
        start = time.perf_counter()
        allocate(tenants, metrics, previous, L1_BYTES, L2_BYTES)
        again.append(time.perf_counter() - start)
    return statistics.median(first), min(first), statistics.median(again)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cachefleet bench allocation", description=__doc__)
    parser.add_argument("--repeats", type=int, default=15, help="runs per size")
    args = parser.parse_args(argv)
    print(f"{'tenants':>8} {'first p50':>11} {'first min':>11} {'rebalance p50':>14}")
    ok = True
    for n in SIZES:
        med, best, rebalance = measure(n, args.repeats)
        print(f"{n:>8} {med * 1e3:>9.2f}ms {best * 1e3:>9.2f}ms {rebalance * 1e3:>12.2f}ms")
        if n == 10_000:
            ok = max(med, rebalance) < TARGET_10K_S
    verdict = "meets" if ok else "MISSES"
    print(f"target: 10,000 tenants < {TARGET_10K_S * 1e3:.0f} ms -> {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
