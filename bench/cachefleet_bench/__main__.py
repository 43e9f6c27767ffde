"""``cachefleet bench``: one entry point for every benchmark in ``bench/``.

``cachefleet bench <name> [options]`` (or ``python -m cachefleet_bench``)
imports the benchmark's module only when it runs and calls its
``main(argv) -> int``. ``cachefleet bench all [--quick]`` runs every benchmark
that exists (with ``--quick``: with each one's short settings) and exits with
the worst exit code.
A benchmark whose module has not been written yet says so and exits 2.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence

#: benchmark -> (module with ``main(argv) -> int``, one-line description,
#: the arguments ``all --quick`` passes to it)
BENCHMARKS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "proxy": (
        "cachefleet_bench.proxy",
        "sidecar L1/L2 hit and miss vs nginx proxy_cache and a bare responder (wrk)",
        ("--quick",),
    ),
    "l1": (
        "cachefleet_bench.l1_micro",
        "L1 lookup micro-benchmark: lru / lirs / sits vs cachetools",
        (),
    ),
    "hit": (
        "cachefleet_bench.hit_micro",
        "L1 / L2 hit in one process: CPU per hit (parse, fast path, write, bookkeeping) vs floors",
        ("--requests", "2000", "--repeats", "1"),
    ),
    "l2": (
        "cachefleet_bench.l2_micro",
        "L2 read micro-benchmark: a versioned RedisL2.get vs one plain GET (own redis-server)",
        ("--reads", "2000", "--repeats", "1"),
    ),
    "policies": (
        "cachefleet_bench.policies",
        "policy miss ratios on a Mooncake trace: lru / lirs / sits vs libCacheSim",
        ("--sizes", "0.01,0.1"),
    ),
    "allocation": (
        "cachefleet_bench.allocation",
        "operator allocation time for many tenants",
        (),
    ),
    "gain": (
        "cachefleet_bench.gain",
        "allocation by measured gain: trace replays vs class-only / equal / oracle",
        ("--quick",),
    ),
    "invalidation": (
        "cachefleet_bench.invalidation",
        "invalidation propagation across sidecars, stale reads under faults",
        ("--quick",),
    ),
    "semantic": (
        "cachefleet_bench.semantic",
        "semantic tier (L3): hit ratio / false hits over a threshold sweep, lookup latency",
        ("--quick",),
    ),
    "routing": (
        "cachefleet_bench.routing",
        "KV-prefix-aware routing on a Mooncake trace: cachefleet vs round-robin / gie-like / ...",
        ("--quick",),
    ),
    "decision": (
        "cachefleet_bench.decision",
        "router decision latency incl. tokenization: 16 endpoints, precise KV index",
        ("--conversations", "16", "--turns", "4"),
    ),
}

#: Exit code of a benchmark that is not implemented yet (and of usage errors).
EXIT_UNAVAILABLE = 2


def _usage() -> str:
    lines = ["usage: cachefleet bench <benchmark> [options]", "", "benchmarks:"]
    for name, (_module, text, _quick) in BENCHMARKS.items():
        suffix = "" if available(name) else " (not implemented yet)"
        lines.append(f"  {name:<13} {text}{suffix}")
    lines.append(f"  {'all':<13} every benchmark that exists; [--quick]: short settings")
    lines += ["", "cachefleet bench <benchmark> --help shows its options."]
    return "\n".join(lines)


def available(name: str) -> bool:
    """True when the module of benchmark ``name`` exists (it is not imported)."""
    module = BENCHMARKS[name][0]
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def run(name: str, argv: Sequence[str]) -> int:
    """Run one benchmark; a missing module is reported, not raised."""
    if not available(name):
        print(f"cachefleet bench {name}: not implemented yet", file=sys.stderr)
        return EXIT_UNAVAILABLE
    module = importlib.import_module(BENCHMARKS[name][0])
    func: Callable[[list[str]], int] = module.main
    try:
        return int(func(list(argv)) or 0)
    except SystemExit as exc:  # argparse inside a benchmark
        return exc.code if isinstance(exc.code, int) else 1


def run_all(argv: Sequence[str]) -> int:
    """Every available benchmark in turn, with default settings or (``--quick``) short ones."""
    unknown = [a for a in argv if a != "--quick"]
    if unknown:
        print(f"cachefleet bench all: only --quick is accepted, not {unknown}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    codes: dict[str, int | None] = {}
    for name in BENCHMARKS:
        if not available(name):
            print(f"== cachefleet bench {name}: not implemented yet, skipped", flush=True)
            codes[name] = None
            continue
        args = list(BENCHMARKS[name][2]) if "--quick" in argv else []
        print(f"== cachefleet bench {name} {' '.join(args)}".rstrip(), flush=True)
        codes[name] = run(name, args)
    print("\n== summary")
    for name, code in codes.items():
        state = "skipped (not implemented yet)" if code is None else f"exit {code}"
        print(f"  {name:<13} {state}")
    ran = [code for code in codes.values() if code is not None]
    return max(ran, default=EXIT_UNAVAILABLE)


def main(argv: Sequence[str] | None = None) -> int:
    """``argv`` without the ``bench`` word: ``["proxy", "--quick"]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0 if args else EXIT_UNAVAILABLE
    name, rest = args[0], args[1:]
    if name == "all":
        return run_all(rest)
    if name not in BENCHMARKS:
        print(f"cachefleet bench: unknown benchmark {name!r}\n\n{_usage()}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    return run(name, rest)


if __name__ == "__main__":
    sys.exit(main())
