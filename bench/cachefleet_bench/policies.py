"""Policy benchmark: replay a Mooncake-format trace through L1 policies.

``cachefleet bench policies`` replays a trace of LLM requests (one JSON object
a line with ``hash_ids``: the request's prompt as KV-block hashes, equal
prefixes sharing leading hashes) as block accesses, in order, each block of
unit size, through cachefleet's ``lru``, ``lirs`` and ``sits`` and, when the
``libcachesim`` package is installed, through libCacheSim's LRU, ARC, LIRS,
S3-FIFO, W-TinyLFU, GDSF and Belady (OPT, offline). The cache size is a
fraction of the number of distinct blocks (the footprint). The replay is the
standard one: a block access is a hit if the block is cached, else a miss
that loads it (for cachefleet's policies: ``get``, then ``put`` on a miss).

Figures per policy and size: block miss ratio (misses / block accesses) and
prefix-hit ratio (per request, only the leading run of cached blocks counts:
what a KV-cache reuse of a prefix can use). Hit ratios are deterministic, so
this measures quality independent of the machine's speed.

    cachefleet bench policies [--trace FILE|synthetic|conversation] [--sizes 0.01,0.05,0.1,0.2]
                              [--json OUT] [--plot OUT.png] [--policies a,b]
    cachefleet bench policies --workload tenants_sample.jsonl [--l1-mib 4,8,16,32]
    cachefleet bench policies --synthetic [--sizes ...] [--json OUT]

``--workload`` replays a multi-tenant response-cache workload (one request a
line: tenant, key, bytes, upstream_s) through cachefleet's policies with
equal per-tenant shares and reports the upstream seconds the misses paid.
``--synthetic`` replays five synthetic traces of other shapes (Zipf, scans,
a shifting working set, a loop) through every policy: the traces the
design was not tuned on.

libCacheSim 0.3.5 caveats (TESTING.md): its ``LFU`` behaves like SIEVE and
its ``ClockPro`` is worse than FIFO, so neither is compared.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import xxhash

from cachefleet_bench.mooncake import (
    DEFAULT_TRACE,
    NAMED_TRACES,
    TraceError,
    hash_ids,
    read_records,
    trace_path,
)
from cachefleet_sidecar.policies import (
    ReplacementPolicy,
    SITSPolicy,
    available_policies,
    make_policy,
)

DEFAULT_SIZES = (0.01, 0.05, 0.1, 0.2)
#: Total L1 sizes for a multi-tenant workload (``--workload``), MiB.
DEFAULT_L1_MIB = "4,8,16,32"
#: cachefleet's policies, by their names in ``make_policy``.
OURS = tuple(available_policies())
#: libCacheSim's policies compared (name in the output -> class name).
LIBCACHESIM = {
    "lcs-LRU": "LRU",
    "lcs-ARC": "ARC",
    "lcs-LIRS": "LIRS",
    "lcs-S3FIFO": "S3FIFO",
    "lcs-WTinyLFU": "WTinyLFU",
    "lcs-GDSF": "GDSF",
    "lcs-Belady": "Belady",
}
#: Offline policies (know the future): reported, never "the best online".
OFFLINE = frozenset({"lcs-Belady"})


@dataclass(frozen=True, slots=True)
class Result:
    policy: str
    size_fraction: float
    cache_size: int
    miss_ratio: float
    prefix_hit_ratio: float


def load_trace(path: Path) -> list[list[int]]:
    """The ``hash_ids`` of every request, in file order (plain or ``.gz``).

    Only ``hash_ids`` is needed (and checked); raises :class:`TraceError`.
    """
    requests = [hash_ids(path, number, record) for number, record in read_records(path)]
    if not requests:
        raise TraceError(f"{path}: no requests")
    return requests


def footprint(requests: Iterable[Sequence[int]]) -> int:
    """Number of distinct blocks."""
    return len({block for request in requests for block in request})


def cache_size(fraction: float, blocks: int) -> int:
    """Cache size in blocks for ``fraction`` of the footprint (at least 1)."""
    return max(1, int(fraction * blocks))


def _score(requests: Sequence[Sequence[int]], access: Callable[[int], bool]) -> tuple[float, float]:
    """(miss ratio, prefix-hit ratio) of replaying ``requests`` through ``access``."""
    accesses = misses = prefix_hits = 0
    for request in requests:
        leading = True
        for block in request:
            hit = access(block)
            if hit:
                if leading:
                    prefix_hits += 1
            else:
                misses += 1
                leading = False
        accesses += len(request)
    return misses / accesses, prefix_hits / accesses


def replay_ours(requests: Sequence[Sequence[int]], policy: str, size: int) -> tuple[float, float]:
    """Replay through a cachefleet policy of ``size`` unit-size blocks."""
    cache: ReplacementPolicy[int, bool] = make_policy(policy, size)
    get = cache.get
    put = cache.put

    def access(block: int) -> bool:
        if get(block) is not None:
            return True
        put(block, True, 1)
        return False

    return _score(requests, access)


def replay_libcachesim(
    requests: Sequence[Sequence[int]], policy: str, size: int
) -> tuple[float, float]:
    """Replay through libCacheSim's ``policy`` (a class name) of ``size`` blocks."""
    import libcachesim as lcs

    cache = getattr(lcs, policy)(cache_size=size)
    flat = [block for request in requests for block in request]
    # Belady needs each access's next access time (virtual: access index).
    next_use = [0] * len(flat)
    seen: dict[int, int] = {}
    never = 2**62
    for i in range(len(flat) - 1, -1, -1):
        next_use[i] = seen.get(flat[i], never)
        seen[flat[i]] = i
    req = lcs.Request()
    req.obj_size = 1
    position = 0

    def access(block: int) -> bool:
        nonlocal position
        req.obj_id = block
        req.clock_time = position
        req.next_access_vtime = next_use[position]
        position += 1
        return bool(cache.get(req))

    return _score(requests, access)


def _zipf_keys(rng: random.Random, n: int, keys: int, alpha: float) -> list[int]:
    weights = [1.0 / (rank**alpha) for rank in range(1, keys + 1)]
    order = list(range(keys))
    rng.shuffle(order)  # popularity unrelated to the key's value
    return [order[i] for i in rng.choices(range(keys), weights=weights, k=n)]


def synthetic_traces(n: int = 200_000, seed: int = 1) -> dict[str, list[list[int]]]:
    """Traces of other shapes than Mooncake, one block per request, deterministic.

    * ``zipf-0.8``, ``zipf-1.0``: independent draws, 50,000 keys.
    * ``zipf+scans``: Zipf 0.9 with a one-time scan of 20 new keys every 50 accesses.
    * ``shifting``: Zipf 0.9 over a working set replaced every 50,000 accesses.
    * ``loop``: 20,000 keys visited over and over, reshuffled each round.
    """
    rng = random.Random(seed)
    out: dict[str, list[int]] = {
        "zipf-0.8": _zipf_keys(rng, n, 50_000, 0.8),
        "zipf-1.0": _zipf_keys(rng, n, 50_000, 1.0),
    }
    mixed: list[int] = []
    scan = 1_000_000
    for i, key in enumerate(_zipf_keys(rng, n, 50_000, 0.9)):
        mixed.append(key)
        if i % 50 == 0:
            mixed.extend(range(scan, scan + 20))
            scan += 20
    out["zipf+scans"] = mixed
    phase = 50_000
    out["shifting"] = [
        key + (i // phase) * 1_000_000 for i, key in enumerate(_zipf_keys(rng, n, 20_000, 0.9))
    ]
    loop: list[int] = []
    keys = list(range(20_000))
    while len(loop) < n:
        rng.shuffle(keys)
        loop.extend(keys)
    out["loop"] = loop[:n]
    return {name: [[k] for k in keys_] for name, keys_ in out.items()}


def libcachesim_available() -> bool:
    try:
        import libcachesim  # noqa: F401
    except ImportError:
        return False
    return True


def run(
    requests: Sequence[Sequence[int]],
    sizes: Sequence[float] = DEFAULT_SIZES,
    policies: Sequence[str] | None = None,
) -> list[Result]:
    """Every policy at every size; libCacheSim's only when it is installed."""
    if policies is None:
        policies = [*OURS, *(LIBCACHESIM if libcachesim_available() else ())]
    blocks = footprint(requests)
    results = []
    for name in policies:
        for fraction in sizes:
            size = cache_size(fraction, blocks)
            if name in LIBCACHESIM:
                miss, prefix = replay_libcachesim(requests, LIBCACHESIM[name], size)
            elif name in OURS:
                miss, prefix = replay_ours(requests, name, size)
            else:
                raise ValueError(
                    f"unknown policy {name!r}; known: {', '.join([*OURS, *LIBCACHESIM])}"
                )
            results.append(Result(name, fraction, size, miss, prefix))
    return results


def best_online(results: Iterable[Result], exclude: Iterable[str] = ()) -> dict[float, Result]:
    """Per size, the online policy (not in ``exclude``) with the lowest miss ratio."""
    skip = OFFLINE | set(exclude)
    best: dict[float, Result] = {}
    for r in results:
        if r.policy in skip:
            continue
        if r.size_fraction not in best or r.miss_ratio < best[r.size_fraction].miss_ratio:
            best[r.size_fraction] = r
    return best


def table(results: Sequence[Result]) -> str:
    """Miss ratio (and prefix-hit ratio) per policy and size, plus SITS's gap to the best."""
    sizes = sorted({r.size_fraction for r in results})
    policies = list(dict.fromkeys(r.policy for r in results))
    by = {(r.policy, r.size_fraction): r for r in results}
    head = f"{'policy':<14}" + "".join(f"{f'{s:.0%} miss/prefix':>22}" for s in sizes)
    lines = [head, "-" * len(head)]
    for name in policies:
        cells = []
        for s in sizes:
            r = by.get((name, s))
            cells.append(f"{r.miss_ratio:>13.4f} / {r.prefix_hit_ratio:.3f}" if r else " " * 22)
        lines.append(f"{name:<14}" + "".join(f"{c:>22}" for c in cells))
    best = best_online(results, exclude=["sits"])
    if any(("sits", s) in by for s in sizes) and best:
        gaps = []
        for s in sizes:
            if ("sits", s) in by and s in best:
                gap = (by[("sits", s)].miss_ratio - best[s].miss_ratio) * 100
                gaps.append(f"{s:.0%}: {gap:+.2f} pt vs {best[s].policy}")
        lines += ["", "sits - best other online policy (miss ratio, points): " + "; ".join(gaps)]
    return "\n".join(lines)


def plot(results: Sequence[Result], out: Path, title: str) -> None:
    """Miss ratio against cache size, one line per policy (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r.policy for r in results):
        rows = sorted((r for r in results if r.policy == name), key=lambda r: r.size_fraction)
        style: dict[str, Any] = {"marker": "o"}
        if name in OURS:
            style.update(linewidth=2.5)
        else:
            style.update(linestyle="--", linewidth=1, alpha=0.8)
        ax.plot(
            [r.size_fraction * 100 for r in rows],
            [r.miss_ratio for r in rows],
            label=name,
            **style,
        )
    ax.set_xlabel("cache size (% of distinct blocks)")
    ax.set_ylabel("block miss ratio")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


@dataclass(frozen=True, slots=True)
class TenantRequest:
    """One request of a multi-tenant response-cache workload."""

    tenant: str
    #: The key's 128-bit digest, as the sidecar keys L1 (and as ``simulate``
    #: does): SITS samples its shadows by ``hash(key)``, which is stable for an
    #: int and salted per process for a str, so str keys made the figures vary
    #: from run to run.
    key: int
    size: int
    upstream_s: float


@dataclass(frozen=True, slots=True)
class CostResult:
    policy: str
    l1_bytes: int
    hit_ratio: float
    byte_hit_ratio: float
    upstream_s_paid: float
    upstream_s_saved: float


def load_workload(path: Path) -> list[TenantRequest]:
    """``{"tenant", "key", "bytes", "upstream_s"}`` lines; raises :class:`TraceError`."""
    out: list[TenantRequest] = []
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                req = TenantRequest(
                    str(r["tenant"]),
                    xxhash.xxh3_128_intdigest(str(r["key"]).encode()),
                    int(r["bytes"]),
                    float(r["upstream_s"]),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceError(
                    f"{path}:{number}: expected tenant, key, bytes, upstream_s ({exc!r})"
                ) from None
            if req.size < 0 or req.upstream_s < 0:
                raise TraceError(f"{path}:{number}: bytes and upstream_s must be >= 0")
            out.append(req)
    if not out:
        raise TraceError(f"{path}: no requests")
    return out


def replay_workload(
    requests: Sequence[TenantRequest], policy: str, l1_bytes: int, pressure: float = 0.0
) -> CostResult:
    """Equal shares of ``l1_bytes`` per tenant; each miss pays its upstream seconds.

    A miss stores the answer with its measured cost (the request's
    ``upstream_s``), as the sidecar does.
    """
    tenants = sorted({r.tenant for r in requests})
    share = l1_bytes // len(tenants)
    parts: dict[str, ReplacementPolicy[int, bool]] = {}
    for t in tenants:
        part: ReplacementPolicy[int, bool] = make_policy(policy, share)
        if pressure and isinstance(part, SITSPolicy):
            part.pressure = pressure
        parts[t] = part
    hits = hit_bytes = total_bytes = 0
    paid = saved = 0.0
    for r in requests:
        part = parts[r.tenant]
        total_bytes += r.size
        if part.get(r.key) is not None:
            hits += 1
            hit_bytes += r.size
            saved += r.upstream_s
        else:
            paid += r.upstream_s
            part.put(r.key, True, r.size, r.upstream_s)
    n = len(requests)
    label = f"{policy} p={pressure:g}" if pressure else policy
    return CostResult(label, l1_bytes, hits / n, hit_bytes / max(1, total_bytes), paid, saved)


def cost_table(results: Sequence[CostResult]) -> str:
    sizes = sorted({r.l1_bytes for r in results})
    policies = list(dict.fromkeys(r.policy for r in results))
    by = {(r.policy, r.l1_bytes): r for r in results}
    head = f"{'policy':<14}" + "".join(f"{f'{b / 2**20:g} MiB: s paid / hit':>28}" for b in sizes)
    lines = [head, "-" * len(head)]
    for name in policies:
        cells = [
            f"{by[(name, b)].upstream_s_paid:>14,.1f} / {by[(name, b)].hit_ratio:.3f}"
            for b in sizes
        ]
        lines.append(f"{name:<14}" + "".join(f"{c:>28}" for c in cells))
    lines.append("(upstream seconds paid by the misses, and request hit ratio; equal shares)")
    return "\n".join(lines)


def _parse_mib(text: str) -> list[int]:
    try:
        sizes = [int(float(part) * 2**20) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--l1-mib: not a list of numbers: {text!r}") from None
    if not sizes or not all(s > 0 for s in sizes):
        raise argparse.ArgumentTypeError(f"--l1-mib: positive sizes expected, got {text!r}")
    return sizes


def main_workload(
    path: Path, sizes: Sequence[int], policies: Sequence[str], out: Path | None
) -> int:
    try:
        requests = load_workload(path)
    except (OSError, TraceError) as exc:
        print(f"cachefleet bench policies: {exc}", file=sys.stderr)
        return 2
    unknown = [p for p in policies if p not in OURS]
    if unknown:
        print(
            f"cachefleet bench policies: --workload replays cachefleet's policies only "
            f"({', '.join(OURS)}), not {unknown}",
            file=sys.stderr,
        )
        return 2
    results = [replay_workload(requests, name, size) for name in policies for size in sizes]
    if "sits" in policies:
        # The same with a saturated GPU: cost weighs more.
        results += [replay_workload(requests, "sits", size, pressure=1.0) for size in sizes]
    tenants = len({r.tenant for r in requests})
    print(
        f"workload {path.name}: {len(requests)} requests, {tenants} tenants, "
        f"{sum(r.upstream_s for r in requests):,.1f} upstream s if nothing were cached\n"
    )
    print(cost_table(results))
    if out:
        doc = {"workload": str(path), "results": [asdict(r) for r in results]}
        out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"\nwrote {out}")
    return 0


def _parse_sizes(text: str) -> list[float]:
    try:
        sizes = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes: not a list of numbers: {text!r}") from None
    if not sizes or not all(0.0 < s <= 1.0 for s in sizes):
        raise argparse.ArgumentTypeError(f"--sizes: fractions in (0, 1] expected, got {text!r}")
    return sizes


def main_synthetic(sizes: Sequence[float], policies: str | None, out: Path | None) -> int:
    chosen = policies.split(",") if policies else None
    doc: dict[str, Any] = {"synthetic": {}}
    for name, requests in synthetic_traces().items():
        try:
            results = run(requests, sizes, chosen)
        except (ValueError, ImportError) as exc:
            print(f"cachefleet bench policies: {exc}", file=sys.stderr)
            return 2
        print(f"== {name}: {len(requests)} accesses, {footprint(requests)} distinct keys")
        print(table(results) + "\n")
        doc["synthetic"][name] = [asdict(r) for r in results]
    if out:
        out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="cachefleet bench policies", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--trace",
        type=trace_path,
        default=DEFAULT_TRACE,
        help="Mooncake-format JSONL trace, plain or .gz, or a name: "
        + ", ".join(f"{name} ({path.name})" for name, path in NAMED_TRACES.items())
        + " (default: synthetic)",
    )
    parser.add_argument("--sizes", type=_parse_sizes, default=list(DEFAULT_SIZES))
    parser.add_argument("--policies", help="comma-separated subset (default: all available)")
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    parser.add_argument("--plot", type=Path, help="write a PNG plot here (needs matplotlib)")
    parser.add_argument(
        "--workload",
        type=Path,
        help="instead of a Mooncake trace: a multi-tenant response-cache workload "
        "(tenant, key, bytes, upstream_s per line), replayed with equal shares",
    )
    parser.add_argument(
        "--l1-mib",
        type=_parse_mib,
        default=_parse_mib(DEFAULT_L1_MIB),
        help=f"total L1 sizes for --workload, MiB (default {DEFAULT_L1_MIB})",
    )
    parser.add_argument(
        "--synthetic",
        action="store_true",
        help="instead of a trace: synthetic traces of other shapes (Zipf, scans, "
        "a shifting working set, a loop), the best-policy gap of sits on each",
    )
    args = parser.parse_args(argv)
    if args.synthetic:
        return main_synthetic(args.sizes, args.policies, args.json)
    if args.workload is not None:
        chosen = args.policies.split(",") if args.policies else list(OURS)
        return main_workload(args.workload, args.l1_mib, chosen, args.json)
    if not args.trace.is_file():
        print(
            f"cachefleet bench policies: no trace at {args.trace} (give one with --trace FILE)",
            file=sys.stderr,
        )
        return 2
    try:
        requests = load_trace(args.trace)
    except (OSError, TraceError) as exc:
        print(f"cachefleet bench policies: {exc}", file=sys.stderr)
        return 2
    policies = args.policies.split(",") if args.policies else None
    if not libcachesim_available() and policies is None:
        print("libcachesim is not installed: only cachefleet's policies are replayed")
    started = time.perf_counter()
    try:
        results = run(requests, args.sizes, policies)
    except (ValueError, ImportError) as exc:
        print(f"cachefleet bench policies: {exc}", file=sys.stderr)
        return 2
    blocks = footprint(requests)
    accesses = sum(len(r) for r in requests)
    print(
        f"trace {args.trace.name}: {len(requests)} requests, {accesses} block accesses, "
        f"{blocks} distinct blocks ({time.perf_counter() - started:.1f} s)\n"
    )
    print(table(results))
    if args.json:
        doc = {
            "trace": str(args.trace),
            "requests": len(requests),
            "block_accesses": accesses,
            "distinct_blocks": blocks,
            "results": [asdict(r) for r in results],
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    if args.plot:
        plot(results, args.plot, f"{args.trace.name}: block miss ratio by cache size")
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
