"""Synthetic multi-tenant workloads for ``cachefleet simulate`` (deterministic, seeded).

Each workload is a list of requests in time order plus the InferenceCache
its tenants run under, written as the two files ``simulate`` reads. They
cover what one sample cannot: different popularity skews and working sets,
a scanning tenant, a working set that moves mid-trace, a working set that
pays off only once it fits whole (a cliff).

``python -m cachefleet_bench.workloads OUT_DIR`` writes them all.
"""

from __future__ import annotations

import bisect
import itertools
import json
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

#: Trace length, seconds.
DURATION_S = 600.0


@dataclass(frozen=True)
class TenantSpec:
    name: str
    priority_class: str
    rps: float
    keys: Callable[[random.Random], Iterator[str]]
    size: int
    upstream_s: float
    sla: dict[str, float]
    min_share: float = 0.0
    max_share: float = 1.0


def zipf(
    prefix: str, n: int, alpha: float, shift_at: int | None = None
) -> Callable[[random.Random], Iterator[str]]:
    """Keys from a Zipf(alpha) popularity over ``n`` items; a new item set after ``shift_at``."""

    def gen(rng: random.Random) -> Iterator[str]:
        weights = list(itertools.accumulate(1.0 / (i + 1) ** alpha for i in range(n)))
        order = list(range(n))
        rng.shuffle(order)
        for count in itertools.count():
            rank = bisect.bisect_left(weights, rng.random() * weights[-1])
            epoch = 0 if shift_at is None or count < shift_at else 1
            yield f"{prefix}-{epoch}-{order[rank]}"

    return gen


def scan(prefix: str) -> Callable[[random.Random], Iterator[str]]:
    """Never the same key twice."""

    def gen(_: random.Random) -> Iterator[str]:
        for n in itertools.count():
            yield f"{prefix}-{n}"

    return gen


def loop(prefix: str, n: int) -> Callable[[random.Random], Iterator[str]]:
    """A working set of ``n`` keys read round and round (LRU hits only once it all fits)."""

    def gen(_: random.Random) -> Iterator[str]:
        for i in itertools.count():
            yield f"{prefix}-{i % n}"

    return gen


KIB = 1024
WORKLOADS: dict[str, tuple[TenantSpec, ...]] = {
    # three skews and working sets, and a scan with the most traffic
    "skews": (
        TenantSpec(
            "chat",
            "Guaranteed",
            20,
            zipf("chat", 4000, 0.9),
            4 * KIB,
            0.8,
            {"p95LatencySeconds": 2.0, "minHitRatio": 0.3},
            0.1,
            0.9,
        ),
        TenantSpec(
            "faq",
            "Standard",
            15,
            zipf("faq", 800, 1.2),
            2 * KIB,
            0.5,
            {"p95LatencySeconds": 1.0},
            0.05,
            0.8,
        ),
        TenantSpec(
            "code",
            "Standard",
            10,
            zipf("code", 6000, 0.7),
            8 * KIB,
            1.5,
            {"p95LatencySeconds": 4.0},
            0.05,
            0.8,
        ),
        TenantSpec(
            "crawl",
            "BestEffort",
            40,
            scan("crawl"),
            4 * KIB,
            0.4,
            {"p95LatencySeconds": 10.0},
            0.0,
            0.5,
        ),
    ),
    # one tenant's working set moves half-way
    "shift": (
        TenantSpec(
            "support",
            "Guaranteed",
            20,
            zipf("support", 3000, 1.0),
            4 * KIB,
            0.9,
            {"p95LatencySeconds": 2.0, "minHitRatio": 0.4},
            0.2,
            0.9,
        ),
        TenantSpec(
            "search",
            "Standard",
            20,
            zipf("search", 2000, 1.0, shift_at=6000),
            4 * KIB,
            0.7,
            {"p95LatencySeconds": 2.0},
            0.05,
            0.8,
        ),
        TenantSpec(
            "batch",
            "BestEffort",
            30,
            scan("batch"),
            4 * KIB,
            0.5,
            {"p95LatencySeconds": 10.0},
            0.0,
            0.5,
        ),
    ),
    # a working set that is worth nothing until it fits whole
    "cliff": (
        TenantSpec(
            "reports",
            "Standard",
            20,
            loop("reports", 1500),
            4 * KIB,
            1.0,
            {"p95LatencySeconds": 4.0},
            0.05,
            0.9,
        ),
        TenantSpec(
            "chat",
            "Guaranteed",
            20,
            zipf("chat", 3000, 0.8),
            4 * KIB,
            0.8,
            {"p95LatencySeconds": 2.0},
            0.2,
            0.9,
        ),
        TenantSpec(
            "scan",
            "BestEffort",
            20,
            scan("scan"),
            4 * KIB,
            0.5,
            {"p95LatencySeconds": 10.0},
            0.0,
            0.5,
        ),
    ),
}


def requests(tenants: tuple[TenantSpec, ...], seed: int = 7) -> list[dict[str, Any]]:
    """Poisson arrivals per tenant, merged in time order."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    for spec in tenants:
        keys = spec.keys(random.Random(rng.random()))
        t = 0.0
        while True:
            t += rng.expovariate(spec.rps)
            if t >= DURATION_S:
                break
            out.append(
                {
                    "ts": round(t, 4),
                    "tenant": spec.name,
                    "key": next(keys),
                    "bytes": spec.size,
                    "upstream_s": round(spec.upstream_s * rng.uniform(0.7, 1.3), 4),
                }
            )
    out.sort(key=lambda r: (r["ts"], r["tenant"]))
    return out


def inference_cache(name: str, tenants: tuple[TenantSpec, ...]) -> dict[str, Any]:
    return {
        "apiVersion": "cachefleet.io/v1alpha1",
        "kind": "InferenceCache",
        "metadata": {"name": name, "namespace": "sim"},
        "spec": {
            "selector": {"matchLabels": {"cachefleet.io/cache": name}},
            "model": {"name": "sim-llm", "version": "v1"},
            "capacity": {"l1BytesPerPod": 16 * 1024 * 1024, "l2Bytes": 0},
            "redis": {"url": "redis://127.0.0.1:6379/0"},
            "tenants": [
                {
                    "name": t.name,
                    "priorityClass": t.priority_class,
                    "sla": t.sla,
                    "minShare": t.min_share,
                    "maxShare": t.max_share,
                }
                for t in tenants
            ],
        },
    }


def write(name: str, out_dir: Path, seed: int = 7) -> tuple[Path, Path]:
    """Write ``NAME.jsonl`` and ``NAME.yaml`` into ``out_dir``; their paths."""
    tenants = WORKLOADS[name]
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = out_dir / f"{name}.jsonl"
    with trace.open("w") as fh:
        for req in requests(tenants, seed):
            fh.write(json.dumps(req, separators=(",", ":")) + "\n")
    cache = out_dir / f"{name}.yaml"
    cache.write_text(yaml.safe_dump(inference_cache(name, tenants), sort_keys=False))
    return trace, cache


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m cachefleet_bench.workloads OUT_DIR", file=sys.stderr)
        return 2
    for name in WORKLOADS:
        trace, cache = write(name, Path(argv[0]))
        print(f"{trace} {cache}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
