"""``cachefleet bench proxy``: the sidecar's hit path against nginx and a bare responder.

One run, one load generator (``wrk`` with one thread and a Lua script that
sends POST bodies), all on loopback. Rows:

``floor``
    the raw uvloop responder of :mod:`cachefleet_bench.responder`, directly;
``nginx``
    nginx ``proxy_cache`` (1 worker, POST keyed by the request body, its cache
    on the ``/dev/shm`` tmpfs when there is one) in front of the responder, warm;
``l1``
    ``cachefleet sidecar`` with a 64 MiB L1 in front of the responder, warm,
    a deterministic chat request; ``X-Cache: HIT-L1`` is checked first;
``l2``
    the sidecar with ``--l1-bytes 0`` and a Redis L2, warm (``HIT-L2``), and
    its floor, ``floor-l2``: the raw responder answering each request with a
    value it reads from the same Redis (one ``GET``, ``X-Cache: HIT-REDIS``);
``miss``
    unique requests (a counter in the Lua script) through the L1 sidecar and
    directly to the responder: the sidecar's overhead on a miss; through
    nginx (its own miss, the reference of issue 10); and through
    ``miss-relay``, the responder relaying bytes both ways with no parsing,
    the least any Python proxy adds to a miss.

For each row and concurrency (1 and 64): req/s, p50/p99 latency (wrk
``--latency``) and the CPU time per request of the server process(es) under
test (utime + stime from ``/proc/<pid>/stat`` over the run, the process and
its descendants; the upstream responder is excluded, Redis is reported
separately for the L2 row), and the whole machine's context switches per
request (``ctxt`` of ``/proc/stat``). Ratios to nginx and to the floor and the targets
of issues 2 and 5 are printed as a table; ``--json`` and ``--plot`` write
them out.

Each series is measured in ``--rounds`` runs per concurrency, interleaved: round
1 runs every selected series once, round 2 again in reverse order, and so on,
and the table shows each series' medians over its rounds. A row's numbers are
then never minutes older than the row they are compared with: on a shared
virtual machine whose speed drifts by 2-4x within minutes, two rows measured
one after the other can differ by more than anything the benchmark is meant
to show.

Everything the benchmark starts runs in its own process group and is stopped
in ``finally`` blocks; its files live in one temporary directory removed at
the end. Only 127.0.0.1 is used.

This module is the command and the run (series, checks, rounds); its parts are
:mod:`cachefleet_bench.proxy_servers` (the servers under test),
:mod:`cachefleet_bench.proxy_load` (the requests, wrk and the CPU counted) and
:mod:`cachefleet_bench.proxy_report` (the rows, the targets, the table and the plot).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cachefleet_bench.proxy_load import (
    CHECK_FAILED,
    CHECK_TIMEOUT_S,
    POLL_INTERVAL_S,
    TENANT,
    TENANT_HEADER,
    WRK_THREADS,
    BenchError,
    WrkStats,
    context_switches,
    hit_body,
    http_post,
    process_tree_cpu_s,
    render_wrk_script,
    run_wrk,
    unique_body,
)
from cachefleet_bench.proxy_report import (
    BUSY_LOADAVG,
    BenchResult,
    Measurement,
    SeriesResult,
    combine_rounds,
    compute_targets,
    fmt,
    format_table,
    make_measurement,
    round_order,
    write_plot,
)
from cachefleet_bench.proxy_servers import SIDECAR_L1_BYTES, Services
from cachefleet_bench.responder import CHAT_COMPLETION_BODY

#: Seconds per measured wrk run (wrk takes whole seconds).
DEFAULT_DURATION_S = 4
QUICK_DURATION_S = 2
#: Interleaved runs per series and concurrency (medians are reported).
DEFAULT_ROUNDS = 3
QUICK_ROUNDS = 1
#: Unmeasured load before each series (connections, allocators and CPU caches warm up).
WARMUP_S = 1
LOW_CONCURRENCY = 1
HIGH_CONCURRENCY = 64
#: How long a written entry may take to show up as a hit (async L2 writes).
WARM_TIMEOUT_S = 5.0
#: Share of failed requests (socket errors, timeouts, non-2xx) that voids a run.
MAX_FAILED_FRACTION = 0.01

#: Rows the command line accepts for ``--only``, in run order.
ROWS: tuple[str, ...] = ("floor", "nginx", "l1", "l2", "miss", "limits")

#: Series measured: name -> (row of ``--only`` it belongs to, description).
SERIES: dict[str, tuple[str, str]] = {
    "floor": ("floor", "raw uvloop responder (the floor)"),
    "nginx": ("nginx", "nginx proxy_cache, 1 worker, warm"),
    "l1": ("l1", "sidecar L1 hit"),
    "l1-nocurves": ("l1", "sidecar L1 hit, miss-ratio curves off (--mrc-samples 0)"),
    "floor-l2": ("l2", "raw uvloop responder, one Redis GET per request (the L2 hit's floor)"),
    "l2": ("l2", "sidecar L2 hit (Redis, --l1-bytes 0)"),
    "miss-direct": ("miss", "unique requests, responder directly"),
    "miss-sidecar": ("miss", "unique requests through the sidecar (miss)"),
    "miss-nginx": ("miss", "unique requests through nginx proxy_cache (its miss, for reference)"),
    "miss-relay": ("miss", "unique requests through a bare byte relay (a Python proxy's floor)"),
    # the rate limiter's cost (docs/rate-limits.md): one sidecar with Redis, tenant unlimited,
    # beside the same sidecar whose tenant is limited (limits it never reaches)
    "miss-redis": ("limits", "unique requests through a sidecar with Redis, tenant unlimited"),
    "miss-limited": ("limits", "unique requests, same sidecar build, tenant limited"),
    "l1-redis": ("limits", "L1 hit, the sidecar with Redis, tenant unlimited"),
    "l1-limited": ("limits", "L1 hit of a limited tenant (hits never reach the limiter)"),
}

#: --tenant-limits of the ``limits`` row: limits the bench's load never reaches, so every
#: request passes through the limiter's Lua call and none is refused.
BENCH_TENANT_LIMITS = {
    "requestsPerMinute": 1_000_000_000,
    "tokensPerMinute": 1_000_000_000_000,
    "tokensPerDay": 1_000_000_000_000,
}

#: The series of the ``limits`` row (each sends the tenant header).
_LIMITS_SERIES = frozenset({"miss-redis", "miss-limited", "l1-redis", "l1-limited"})


# ------------------------------------------------------------------ the run


@dataclass(frozen=True)
class BenchConfig:
    """What to run and for how long."""

    duration_s: int = DEFAULT_DURATION_S
    warmup_s: int = WARMUP_S
    rounds: int = DEFAULT_ROUNDS
    low_concurrency: int = LOW_CONCURRENCY
    high_concurrency: int = HIGH_CONCURRENCY
    only: tuple[str, ...] = ROWS

    @property
    def concurrencies(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys((self.low_concurrency, self.high_concurrency)))


def _headers(tenant: bool) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if tenant:
        headers[TENANT_HEADER] = TENANT
    return headers


def _warm_until(port: int, body: bytes, tenant: bool, header: str, expected: str) -> str:
    """POST ``body`` until response header ``header`` equals ``expected``; return it."""
    deadline = time.monotonic() + WARM_TIMEOUT_S
    seen: list[str] = []
    while True:
        status, headers, data = http_post(port, body, _headers(tenant))
        if status != 200:
            raise BenchError(f"{CHECK_FAILED}answered {status}: {data[:200]!r}")
        if data != CHAT_COMPLETION_BODY:
            raise BenchError(f"{CHECK_FAILED}a different body came back: {data[:200]!r}")
        value = headers.get(header.lower(), "<absent>")
        if value == expected:
            return f"{header}: {value}"
        if not seen or seen[-1] != value:
            seen.append(value)
        if time.monotonic() >= deadline:
            raise BenchError(
                f"{CHECK_FAILED}expected {header}: {expected} within {WARM_TIMEOUT_S:g} s, "
                f"got {' then '.join(seen)}"
            )
        time.sleep(POLL_INTERVAL_S)


def _check_miss(port: int, tenant: bool = True, limited: bool = False) -> str:
    """A fresh unique request through the proxy must be a MISS with the upstream's body
    (``limited``: and the limiter's headers, so the Lua call was made)."""
    body = unique_body(f"check{uuid.uuid4().hex[:8]}", 0)
    status, headers, data = http_post(port, body, _headers(tenant))
    value = headers.get("x-cache", "<absent>")
    if limited and "x-ratelimit-remaining-requests" not in headers:
        raise BenchError(f"{CHECK_FAILED}a limited tenant's miss has no x-ratelimit-* header")
    if status != 200 or data != CHAT_COMPLETION_BODY or value != "MISS":
        raise BenchError(f"{CHECK_FAILED}a unique request got status {status}, X-Cache {value}")
    return "X-Cache: MISS"


def _check_relayed(port: int) -> str:
    """A unique request through the relay must come back with the upstream's answer."""
    status, _, data = http_post(port, unique_body(f"check{uuid.uuid4().hex[:8]}", 0), {})
    if status != 200 or data != CHAT_COMPLETION_BODY:
        raise BenchError(f"{CHECK_FAILED}a relayed request got status {status}: {data[:200]!r}")
    return "the responder's answer"


@dataclass
class _Series:
    """A series being measured: where its server listens and its runs so far."""

    result: SeriesResult
    port: int = 0
    server: str | None = None
    aux: tuple[str, ...] = ()
    unique: bool = False
    tenant: bool = False
    runs: dict[int, list[Measurement]] = field(default_factory=dict)

    def fail(self, exc: BenchError, services: Services, progress: Callable[[str], None]) -> None:
        """Void the series: its error replaces its numbers (with the server's output
        when a functional check failed)."""
        self.result.error = str(exc)
        self.result.measurements = {}
        self.runs = {}
        if self.server is not None and self.result.error.startswith(CHECK_FAILED):
            tail = services.log_tail(self.server)
            if tail:
                self.result.error += f"\n--- end of the {self.server} output:\n{tail}"
        progress(f"{self.result.name}: NOT MEASURED: {self.result.error}")


def _prepare_series(
    services: Services, config: BenchConfig, name: str, progress: Callable[[str], None]
) -> _Series:
    """Start what a series needs, check it answers as it should, and warm it up."""
    series = _Series(
        SeriesResult(name=name, title=SERIES[name][1]),
        unique=name.startswith("miss"),
        tenant=name in {"l1", "l1-nocurves", "l2", "miss-sidecar", *_LIMITS_SERIES},
    )
    result = series.result
    try:
        if name in {"floor", "miss-direct"}:
            series.port, series.server = services.responder(), "responder"
        elif name == "nginx":
            series.port, series.server = services.nginx(), "nginx"
            result.checked = _warm_until(series.port, hit_body(), False, "X-Cache", "HIT")
        elif name == "miss-nginx":
            series.port, series.server = services.nginx(), "nginx"
            result.checked = _check_miss(series.port, tenant=False)
        elif name == "miss-relay":
            series.port, series.server = services.relay(), "relay"
            result.checked = _check_relayed(series.port)
        elif name in {"l1", "miss-sidecar"}:
            series.server = "sidecar-l1"
            series.port = services.sidecar(series.server, SIDECAR_L1_BYTES, False)
            if name == "l1":
                result.checked = _warm_until(series.port, hit_body(), True, "X-Cache", "HIT-L1")
            else:
                result.checked = _check_miss(series.port)
        elif name == "l1-nocurves":
            series.server = "sidecar-l1-nocurves"
            series.port = services.sidecar(
                series.server, SIDECAR_L1_BYTES, False, ("--mrc-samples", "0")
            )
            result.checked = _warm_until(series.port, hit_body(), True, "X-Cache", "HIT-L1")
        elif name == "floor-l2":
            series.port, series.server = services.responder_redis(), "responder-redis"
            series.aux = ("redis",)
            result.checked = _warm_until(series.port, hit_body(), False, "X-Cache", "HIT-REDIS")
        elif name == "l2":
            series.port, series.server = services.sidecar("sidecar-l2", 0, True), "sidecar-l2"
            series.aux = ("redis",)
            result.checked = _warm_until(series.port, hit_body(), True, "X-Cache", "HIT-L2")
        elif name in _LIMITS_SERIES:
            limited = name in {"miss-limited", "l1-limited"}
            series.server = "sidecar-limited" if limited else "sidecar-redis"
            extra = (
                ("--tenant-limits", json.dumps({TENANT: BENCH_TENANT_LIMITS})) if limited else ()
            )
            series.port = services.sidecar(series.server, SIDECAR_L1_BYTES, True, extra)
            series.aux = ("redis",)
            if name.startswith("l1"):
                result.checked = _warm_until(series.port, hit_body(), True, "X-Cache", "HIT-L1")
            else:
                result.checked = _check_miss(series.port, limited=limited)
        else:  # pragma: no cover - SERIES and this function go together
            raise BenchError(f"unknown series {name}")
        if config.warmup_s > 0:
            progress(f"{name}: warm-up, c={config.high_concurrency}, {config.warmup_s:g} s")
            script = _script(services, series)
            run_wrk(series.port, script, config.high_concurrency, config.warmup_s)
    except BenchError as exc:
        series.fail(exc, services, progress)
    return series


def _script(services: Services, series: _Series) -> Path:
    """A fresh wrk script for one run (unique bodies never repeat an earlier run's)."""
    script = services.workdir / f"{series.result.name}.lua"
    script.write_text(render_wrk_script(unique=series.unique, nonce=_nonce(), tenant=series.tenant))
    return script


def _measure_run(
    services: Services,
    config: BenchConfig,
    series: _Series,
    concurrency: int,
    progress: Callable[[str], None],
    label: str = "",
) -> None:
    """One wrk run of a series at one concurrency, with the CPU and context switches
    around it; a failed run voids the series."""
    name = series.result.name
    try:
        assert series.server is not None
        progress(f"{label}{name}: c={concurrency}, {config.duration_s:g} s")
        script = _script(services, series)
        server_pid = services.pid(series.server)
        aux_pids = {a: services.pid(a) for a in series.aux}
        cpu0 = process_tree_cpu_s(server_pid)
        aux0 = {a: process_tree_cpu_s(p) for a, p in aux_pids.items()}
        switches0 = context_switches()
        stats, wrk_cpu = run_wrk(series.port, script, concurrency, config.duration_s)
        switches1 = context_switches()
        _check_stats(stats)
        cpu1 = process_tree_cpu_s(server_pid)
        aux1 = {a: process_tree_cpu_s(p) - aux0[a] for a, p in aux_pids.items()}
        switches = None if switches0 is None or switches1 is None else switches1 - switches0
        m = make_measurement(concurrency, stats, cpu1 - cpu0, aux1, wrk_cpu, switches)
    except BenchError as exc:
        series.fail(exc, services, progress)
        return
    series.runs.setdefault(concurrency, []).append(m)
    progress(
        f"{label}{name}: c={concurrency}: {m.rps:,.0f} req/s, p50 {m.p50_us:.0f} us,"
        f" p99 {m.p99_us:.0f} us, {fmt(m.cpu_us_per_req, '.1f')} us CPU/req"
    )


def _check_stats(stats: WrkStats) -> None:
    """Refuse numbers from a run where requests failed (they would flatter the server)."""
    failed = stats.socket_errors + stats.timeouts + stats.non_2xx
    if stats.requests == 0 or failed > MAX_FAILED_FRACTION * stats.requests:
        raise BenchError(
            f"{stats.requests} requests, {stats.socket_errors} socket errors, "
            f"{stats.timeouts} timeouts, {stats.non_2xx} non-2xx answers"
        )


def _nonce() -> str:
    return uuid.uuid4().hex[:12]


def _tool_version(argv: Sequence[str]) -> str:
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=CHECK_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unavailable"
    text = (done.stdout + done.stderr).strip().splitlines()
    return text[0] if text else "unknown"


def environment() -> dict[str, Any]:
    """The machine and tools the numbers were measured with."""
    return {
        "cpus": os.cpu_count(),
        "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "wrk": _tool_version(["wrk", "-v"]),
        "nginx": _tool_version([shutil.which("nginx") or "/usr/sbin/nginx", "-v"]),
    }


def run_benchmark(
    config: BenchConfig, progress: Callable[[str], None] | None = None
) -> BenchResult:
    """Run the series selected by ``config.only`` in interleaved rounds (see the module
    docstring); every service is stopped on return."""
    say = progress or (lambda _msg: None)
    names = [name for name, (row, _) in SERIES.items() if row in config.only]
    env = environment()
    if env["loadavg_1m_at_start"] >= BUSY_LOADAVG:
        say(f"note: load average {env['loadavg_1m_at_start']:g}: the machine is busy")
    with (
        tempfile.TemporaryDirectory(prefix="cachefleet-bench-") as tmp,
        Services(Path(tmp), say) as services,
    ):
        prepared = {name: _prepare_series(services, config, name, say) for name in names}
        for concurrency in config.concurrencies:
            for index in range(config.rounds):
                label = f"round {index + 1}/{config.rounds}: " if config.rounds > 1 else ""
                for name in round_order(names, index):
                    series = prepared[name]
                    if series.result.error is None:
                        _measure_run(services, config, series, concurrency, say, label)
    for series in prepared.values():
        if series.result.error is None:
            series.result.measurements = {
                c: combine_rounds(runs) for c, runs in series.runs.items()
            }
    results = [prepared[name].result for name in names]
    return BenchResult(
        config={**asdict(config), "only": list(config.only), "wrk_threads": WRK_THREADS},
        environment={**env, "loadavg_1m_at_end": round(os.getloadavg()[0], 2)},
        series=results,
        targets=compute_targets(results, config.low_concurrency, config.high_concurrency),
    )


def _parse_only(text: str) -> tuple[str, ...]:
    rows = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [r for r in rows if r not in ROWS]
    if unknown or not rows:
        raise argparse.ArgumentTypeError(
            f"unknown rows {', '.join(unknown) or '(none given)'}; choose from {', '.join(ROWS)}"
        )
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cachefleet bench proxy",
        description=(
            "Measure the sidecar's hit path against nginx proxy_cache and a bare uvloop "
            "responder with wrk on loopback: req/s at c=64, p50/p99 at c=1 and c=64, "
            "CPU per request, ratios and the targets of issues 2, 5, 8 and 10."
        ),
    )
    parser.add_argument(
        "--duration",
        type=int,
        default=None,
        metavar="S",
        help=f"whole seconds per measured run (default {DEFAULT_DURATION_S})",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_DURATION_S} s per run, {QUICK_ROUNDS} round (CI smoke)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        metavar="R",
        help=(
            "interleaved runs per series and concurrency; the table shows medians"
            f" (default {DEFAULT_ROUNDS})"
        ),
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", type=Path, metavar="PATH", help="write a PNG bar chart")
    parser.add_argument(
        "--only",
        type=_parse_only,
        default=ROWS,
        metavar="ROWS",
        help=f"comma-separated rows to run, of {','.join(ROWS)} (default all)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=HIGH_CONCURRENCY,
        metavar="N",
        help=f"the high concurrency (default {HIGH_CONCURRENCY}); the low one is 1",
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when a measured target fails")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0 when every selected row was measured (and, with ``--check``, every
    target passed); 1 otherwise; 2 on a usage error."""
    args = build_parser().parse_args(argv)
    if args.concurrency < WRK_THREADS:
        print(f"--concurrency must be at least {WRK_THREADS}", file=sys.stderr)
        return 2
    if args.rounds is not None and args.rounds < 1:
        print("--rounds must be at least 1", file=sys.stderr)
        return 2
    duration = args.duration or (QUICK_DURATION_S if args.quick else DEFAULT_DURATION_S)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS)
    config = BenchConfig(
        duration_s=duration,
        rounds=rounds,
        high_concurrency=args.concurrency,
        only=args.only,
    )

    def progress(message: str) -> None:
        print(f"[bench proxy] {message}", flush=True)

    result = run_benchmark(config, progress)
    print()
    print(format_table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result.to_json(), indent=2) + "\n")
        print(f"\nresults written to {args.json}")
    if args.plot:
        write_plot(result, args.plot)
        print(f"plot written to {args.plot}")
    failed_rows = any(s.error is not None for s in result.series)
    failed_targets = args.check and any(t.passed is False for t in result.targets)
    return 1 if failed_rows or failed_targets else 0


if __name__ == "__main__":
    sys.exit(main())
