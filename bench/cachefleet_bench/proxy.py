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
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from cachefleet_bench.responder import CHAT_COMPLETION_BODY
from cachefleet_e2e.services import RedisServer, ServiceError, redis_command

# ----------------------------------------------------------------- constants

HOST = "127.0.0.1"
#: The path every row requests.
REQUEST_PATH = "/v1/chat/completions"
#: Tenant header and value the sidecar rows send.
TENANT_HEADER = "X-Tenant-ID"
TENANT = "bench"
#: L1 size of the sidecar in the ``l1`` and ``miss`` rows.
SIDECAR_L1_BYTES = 64 * 1024 * 1024

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
#: wrk runs with one thread: the load generator takes one of the (few) cores.
WRK_THREADS = 1
#: wrk's per-request timeout; a request slower than this counts as an error.
WRK_REQUEST_TIMEOUT_S = 5
#: How long wrk may run past its ``-d`` before it is killed.
WRK_GRACE_S = 15.0
#: How long a started service may take to accept connections.
SERVICE_START_TIMEOUT_S = 20.0
#: How long a service gets between SIGTERM and SIGKILL.
STOP_TIMEOUT_S = 5.0
#: Timeout of the functional checks (single HTTP requests) before a row.
CHECK_TIMEOUT_S = 5.0
#: How long a written entry may take to show up as a hit (async L2 writes).
WARM_TIMEOUT_S = 5.0
#: Share of failed requests (socket errors, timeouts, non-2xx) that voids a run.
MAX_FAILED_FRACTION = 0.01
#: Pause between tries while waiting for a service or a warm cache.
POLL_INTERVAL_S = 0.05

#: Where nginx keeps its proxy_cache when it is a writable tmpfs: its miss then writes
#: to memory, as a tuned nginx would, and its miss overhead does not follow the disk.
MEMORY_FS = "/dev/shm"

#: 1-minute load average from which the report warns that the machine was busy.
BUSY_LOADAVG = 0.5

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

#: The Redis key the ``floor-l2`` responder reads (holds the upstream's answer).
FLOOR_REDIS_KEY = "cachefleet-bench:floor"

#: The deterministic chat request of the hit rows (``temperature`` 0).
CHAT_REQUEST: dict[str, Any] = {
    "model": "gpt-4o-mini",
    "messages": [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Explain in two sentences what an inference cache does."},
    ],
    "temperature": 0,
    "max_tokens": 128,
}

#: Marker of the line the wrk Lua ``done`` hook prints.
WRK_RESULT_MARK = "CFBENCH"


# ----------------------------------------------------------- pure: requests


def hit_body() -> bytes:
    """The body of the deterministic hit request (compact JSON)."""
    return json.dumps(CHAT_REQUEST, separators=(",", ":")).encode()


def unique_body(nonce: str, counter: int) -> bytes:
    """The ``counter``-th unique request of run ``nonce`` (what the Lua script sends)."""
    request = json.loads(hit_body())
    request["messages"][1]["content"] += f" [{nonce}-{counter}]"
    return json.dumps(request, separators=(",", ":")).encode()


def _lua_long_string(text: str) -> str:
    """``text`` as a Lua long-bracket literal that cannot be closed early."""
    level = 0
    while f"]{'=' * level}]" in text:
        level += 1
    eq = "=" * level
    return f"[{eq}[{text}]{eq}]"


def render_wrk_script(*, unique: bool, nonce: str, tenant: bool) -> str:
    """The wrk Lua script: POST :data:`REQUEST_PATH`, and a ``done`` hook that
    prints one machine-readable result line.

    With ``unique`` every request carries a body made unique by a counter (and
    ``nonce``, so that two runs never repeat each other's bodies); otherwise
    wrk sends one pre-built request over and over (its fastest mode).
    """
    lines = [
        'wrk.method = "POST"',
        f'wrk.path = "{REQUEST_PATH}"',
        'wrk.headers["Content-Type"] = "application/json"',
    ]
    if tenant:
        lines.append(f'wrk.headers["{TENANT_HEADER}"] = "{TENANT}"')
    if unique:
        marker = "@@COUNTER@@"
        template = unique_body(nonce, 0).decode().replace("-0]", f"-{marker}]")
        head, tail = template.split(marker)
        lines += [
            f"local head = {_lua_long_string(head)}",
            f"local tail = {_lua_long_string(tail)}",
            "local counter = 0",
            "request = function()",
            "  counter = counter + 1",
            "  return wrk.format(nil, nil, nil, head .. counter .. tail)",
            "end",
        ]
    else:
        lines.append(f"wrk.body = {_lua_long_string(hit_body().decode())}")
    lines += [
        "done = function(summary, latency, requests)",
        "  local e = summary.errors",
        "  io.write(string.format(",
        f'    "{WRK_RESULT_MARK} requests=%d duration_us=%d p50_us=%.1f p90_us=%.1f "',
        '    .. "p99_us=%.1f max_us=%.1f mean_us=%.1f connect=%d read=%d write=%d "',
        '    .. "status=%d timeout=%d\\n",',
        "    summary.requests, summary.duration, latency:percentile(50),",
        "    latency:percentile(90), latency:percentile(99), latency.max, latency.mean,",
        "    e.connect, e.read, e.write, e.status, e.timeout))",
        "end",
    ]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------- pure: results


@dataclass(frozen=True)
class WrkStats:
    """What one wrk run reports (latencies in microseconds)."""

    requests: int
    duration_s: float
    p50_us: float
    p90_us: float
    p99_us: float
    max_us: float
    mean_us: float
    socket_errors: int
    non_2xx: int
    timeouts: int

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s > 0 else 0.0


class BenchError(RuntimeError):
    """A row could not be measured (a service did not start, a check failed)."""


#: Prefix of the errors of the functional checks made before measuring.
_CHECK_FAILED = "check failed: "


def parse_wrk_output(text: str) -> WrkStats:
    """Read the result line of :func:`render_wrk_script`'s ``done`` hook."""
    for line in text.splitlines():
        if line.startswith(WRK_RESULT_MARK + " "):
            fields = dict(part.split("=", 1) for part in line.split()[1:])
            return WrkStats(
                requests=int(fields["requests"]),
                duration_s=int(fields["duration_us"]) / 1e6,
                p50_us=float(fields["p50_us"]),
                p90_us=float(fields["p90_us"]),
                p99_us=float(fields["p99_us"]),
                max_us=float(fields["max_us"]),
                mean_us=float(fields["mean_us"]),
                socket_errors=int(fields["connect"]) + int(fields["read"]) + int(fields["write"]),
                non_2xx=int(fields["status"]),
                timeouts=int(fields["timeout"]),
            )
    raise BenchError(f"wrk printed no {WRK_RESULT_MARK} line; output was:\n{text[-2000:]}")


@dataclass(frozen=True)
class Measurement:
    """One series at one concurrency."""

    concurrency: int
    requests: int
    duration_s: float
    rps: float
    p50_us: float
    p90_us: float
    p99_us: float
    max_us: float
    errors: int
    non_2xx: int
    #: CPU seconds of the server under test (process tree) over the run.
    server_cpu_s: float | None
    #: ``server_cpu_s`` per request, microseconds.
    cpu_us_per_req: float | None
    #: CPU per request of helpers that are not the server (e.g. redis), microseconds.
    aux_cpu_us_per_req: dict[str, float] = field(default_factory=dict)
    #: CPU per request of the load generator itself, microseconds.
    wrk_cpu_us_per_req: float | None = None
    #: Context switches per request, the whole machine (``ctxt`` of /proc/stat): how often
    #: a process went to sleep and had to be woken, the costliest part of a loopback
    #: exchange on a virtual machine. Steadier from run to run than req/s.
    switches_per_req: float | None = None
    #: Runs this measurement is the median of (interleaved with the other series).
    rounds: int = 1
    #: req/s and p50 of each run, in run order: the spread behind the medians.
    rps_rounds: tuple[float, ...] = ()
    p50_us_rounds: tuple[float, ...] = ()


def make_measurement(
    concurrency: int,
    stats: WrkStats,
    server_cpu_s: float | None,
    aux_cpu_s: dict[str, float],
    wrk_cpu_s: float | None,
    switches: int | None = None,
) -> Measurement:
    """Combine wrk's numbers with the CPU seconds (and context switches) sampled around the run."""

    def per_req(seconds: float | None) -> float | None:
        if seconds is None or stats.requests <= 0:
            return None
        return seconds / stats.requests * 1e6

    aux: dict[str, float] = {}
    for name, seconds in aux_cpu_s.items():
        value = per_req(seconds)
        if value is not None:
            aux[name] = value
    return Measurement(
        concurrency=concurrency,
        requests=stats.requests,
        duration_s=stats.duration_s,
        rps=stats.rps,
        rps_rounds=(stats.rps,),
        p50_us_rounds=(stats.p50_us,),
        p50_us=stats.p50_us,
        p90_us=stats.p90_us,
        p99_us=stats.p99_us,
        max_us=stats.max_us,
        errors=stats.socket_errors + stats.timeouts,
        non_2xx=stats.non_2xx,
        server_cpu_s=server_cpu_s,
        cpu_us_per_req=per_req(server_cpu_s),
        aux_cpu_us_per_req=aux,
        wrk_cpu_us_per_req=per_req(wrk_cpu_s),
        switches_per_req=(
            None if switches is None or stats.requests <= 0 else switches / stats.requests
        ),
    )


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def combine_rounds(runs: Sequence[Measurement]) -> Measurement:
    """One series' runs at one concurrency as one measurement: medians of the
    per-run values (req/s, latencies, per-request CPU and context switches),
    sums of the counts, the largest maximum latency."""
    if not runs:
        raise ValueError("no runs to combine")
    if len({m.concurrency for m in runs}) != 1:
        raise ValueError("runs at different concurrencies")
    if len(runs) == 1:
        return runs[0]
    aux_names = dict.fromkeys(name for m in runs for name in m.aux_cpu_us_per_req)
    aux: dict[str, float] = {}
    for name in aux_names:
        value = _median([m.aux_cpu_us_per_req.get(name) for m in runs])
        if value is not None:
            aux[name] = value
    cpu = [m.server_cpu_s for m in runs]
    return Measurement(
        concurrency=runs[0].concurrency,
        requests=sum(m.requests for m in runs),
        duration_s=sum(m.duration_s for m in runs),
        rps=statistics.median(m.rps for m in runs),
        p50_us=statistics.median(m.p50_us for m in runs),
        p90_us=statistics.median(m.p90_us for m in runs),
        p99_us=statistics.median(m.p99_us for m in runs),
        max_us=max(m.max_us for m in runs),
        errors=sum(m.errors for m in runs),
        non_2xx=sum(m.non_2xx for m in runs),
        server_cpu_s=None if None in cpu else sum(c for c in cpu if c is not None),
        cpu_us_per_req=_median([m.cpu_us_per_req for m in runs]),
        aux_cpu_us_per_req=aux,
        wrk_cpu_us_per_req=_median([m.wrk_cpu_us_per_req for m in runs]),
        switches_per_req=_median([m.switches_per_req for m in runs]),
        rounds=sum(m.rounds for m in runs),
        rps_rounds=tuple(v for m in runs for v in m.rps_rounds),
        p50_us_rounds=tuple(v for m in runs for v in m.p50_us_rounds),
    )


def round_order(names: Sequence[str], round_index: int) -> list[str]:
    """The series of one round in run order: as given in even rounds, reversed in odd
    ones, so that no series always runs right after the same neighbour."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))


@dataclass
class SeriesResult:
    """One series of the table: its measurements, or why there are none."""

    name: str
    title: str
    measurements: dict[int, Measurement] = field(default_factory=dict)
    error: str | None = None
    #: What was verified before measuring (e.g. ``X-Cache: HIT-L1``).
    checked: str | None = None


@dataclass(frozen=True)
class Target:
    """A goal of issues 2/5; ``passed`` is None when a series it needs is missing."""

    name: str
    description: str
    value: float | None
    limit: float
    unit: str
    passed: bool | None


@dataclass
class BenchResult:
    """Everything one run measured."""

    config: dict[str, Any]
    environment: dict[str, Any]
    series: list[SeriesResult]
    targets: list[Target]

    def get(self, name: str) -> SeriesResult | None:
        return next((s for s in self.series if s.name == name), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "environment": self.environment,
            "series": [
                {
                    "name": s.name,
                    "title": s.title,
                    "error": s.error,
                    "checked": s.checked,
                    "measurements": {str(c): asdict(m) for c, m in s.measurements.items()},
                }
                for s in self.series
            ],
            "targets": [asdict(t) for t in self.targets],
        }


def _metric(series: Sequence[SeriesResult], name: str, concurrency: int, attr: str) -> float | None:
    for s in series:
        if s.name == name and concurrency in s.measurements:
            value = getattr(s.measurements[concurrency], attr)
            return float(value) if value is not None else None
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def compute_targets(series: Sequence[SeriesResult], low: int, high: int) -> list[Target]:
    """The pass/fail goals of issues 2, 5, 8 and 10 from the measured series."""

    def at_least(name: str, desc: str, value: float | None, limit: float, unit: str) -> Target:
        return Target(name, desc, value, limit, unit, None if value is None else value >= limit)

    def at_most(name: str, desc: str, value: float | None, limit: float, unit: str) -> Target:
        return Target(name, desc, value, limit, unit, None if value is None else value <= limit)

    l1_rps = _metric(series, "l1", high, "rps")
    l1_p50 = _metric(series, "l1", low, "p50_us")
    miss = _metric(series, "miss-sidecar", low, "p50_us")
    direct = _metric(series, "miss-direct", low, "p50_us")
    overhead = None if miss is None or direct is None else miss - direct
    reference = miss_reference(series, low)
    l2_p50 = _metric(series, "l2", low, "p50_us")
    return [
        at_least(
            "l1_rps_vs_nginx",
            f"L1 hit req/s at c={high} >= 50% of nginx's",
            _ratio(l1_rps, _metric(series, "nginx", high, "rps")),
            0.5,
            "x",
        ),
        at_most(
            "l1_p50_vs_nginx",
            f"L1 hit p50 at c={low} <= 1.3x nginx's",
            _ratio(l1_p50, _metric(series, "nginx", low, "p50_us")),
            1.3,
            "x",
        ),
        at_most(
            "l1_p50_vs_floor",
            f"L1 hit p50 at c={low} <= 1.5x the floor's",
            _ratio(l1_p50, _metric(series, "floor", low, "p50_us")),
            1.5,
            "x",
        ),
        at_least(
            "l1_rps_vs_floor",
            f"L1 hit req/s at c={high} >= 60% of the floor's",
            _ratio(l1_rps, _metric(series, "floor", high, "rps")),
            0.6,
            "x",
        ),
        at_most(
            "miss_overhead",
            f"miss overhead (p50 at c={low}, sidecar - direct) <= 100 us",
            overhead,
            100.0,
            "us",
        ),
        at_least(
            "curves_cost",
            f"L1 hit req/s at c={high} with miss-ratio curves >= 97% of without",
            _ratio(l1_rps, _metric(series, "l1-nocurves", high, "rps")),
            0.97,
            "x",
        ),
        at_least(
            "l2_rps_vs_l1",
            f"L2 hit req/s at c={high} >= 40% of the L1 hit's",
            _ratio(_metric(series, "l2", high, "rps"), l1_rps),
            0.4,
            "x",
        ),
        at_most(
            "l2_p50_vs_l1",
            f"L2 hit p50 at c={low} - the L1 hit's <= 100 us",
            None if l2_p50 is None or l1_p50 is None else l2_p50 - l1_p50,
            100.0,
            "us",
        ),
        at_most(
            "miss_overhead_vs_nginx",
            f"miss overhead (p50 at c={low}) - nginx proxy_cache's own <= 0 us",
            None if overhead is None or reference is None else overhead - reference,
            0.0,
            "us",
        ),
    ]


def miss_reference(
    series: Sequence[SeriesResult], low: int, through: str = "miss-nginx"
) -> float | None:
    """The miss overhead of another proxy (p50 at ``low``, ``through`` - direct),
    for context: nginx's own by default, or the bare relay's (``miss-relay``)."""
    via = _metric(series, through, low, "p50_us")
    direct = _metric(series, "miss-direct", low, "p50_us")
    return None if via is None or direct is None else via - direct


#: The proxies of the miss rows, as the CPU reference line names them.
MISS_PROXIES: dict[str, str] = {
    "miss-sidecar": "the sidecar",
    "miss-nginx": "nginx",
    "miss-relay": "the relay",
}


def miss_cpu_reference(series: Sequence[SeriesResult], low: int) -> list[tuple[str, float]]:
    """CPU per request of each measured miss proxy at ``low`` concurrency: at c=1 the
    miss overhead is mostly the proxy's own CPU on the way (nothing else runs)."""
    found = []
    for name, label in MISS_PROXIES.items():
        cpu = _metric(series, name, low, "cpu_us_per_req")
        if cpu is not None:
            found.append((label, cpu))
    return found


_LIMITS_SERIES = frozenset({"miss-redis", "miss-limited", "l1-redis", "l1-limited"})


def limiter_reference(
    series: Sequence[SeriesResult], low: int, high: int
) -> tuple[float, float, float | None] | None:
    """The limiter's cost, same run: (miss p50 limited - unlimited at ``low``, miss req/s
    limited / unlimited at ``high``, L1 hit req/s limited / unlimited at ``high``)."""
    limited = _metric(series, "miss-limited", low, "p50_us")
    plain = _metric(series, "miss-redis", low, "p50_us")
    rps = _ratio(
        _metric(series, "miss-limited", high, "rps"), _metric(series, "miss-redis", high, "rps")
    )
    if limited is None or plain is None or rps is None:
        return None
    hit = _ratio(
        _metric(series, "l1-limited", high, "rps"), _metric(series, "l1-redis", high, "rps")
    )
    return limited - plain, rps, hit


def l2_floor_reference(
    series: Sequence[SeriesResult], low: int, high: int
) -> tuple[float, float] | None:
    """What one Redis round trip costs the bare responder, same run: its p50 gap
    at ``low`` (floor-l2 - floor) and its req/s ratio at ``high`` (floor-l2 / floor)."""
    with_redis = _metric(series, "floor-l2", low, "p50_us")
    bare = _metric(series, "floor", low, "p50_us")
    ratio = _ratio(_metric(series, "floor-l2", high, "rps"), _metric(series, "floor", high, "rps"))
    if with_redis is None or bare is None or ratio is None:
        return None
    return with_redis - bare, ratio


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def format_table(result: BenchResult) -> str:
    """The human-readable report: one line per series, then the targets."""
    low, high = result.config["low_concurrency"], result.config["high_concurrency"]
    header = (
        f"{'series':<13}{'req/s c=' + str(high):>13}{'p50 c=' + str(low):>11}"
        f"{'p99 c=' + str(low):>11}{'p50 c=' + str(high):>11}{'p99 c=' + str(high):>11}"
        f"{'CPU/req c=' + str(high):>15}{'wrk CPU/req':>13}{'cs/req c=' + str(high):>13}"
        f"{'vs nginx':>17}{'vs floor':>17}  notes"
    )
    env = result.environment
    rounds = result.config.get("rounds", 1)
    per_run = f"{result.config['duration_s']:g} s per run"
    if rounds > 1:
        per_run += f", medians of {rounds} interleaved runs per series"
    lines = [
        f"cachefleet bench proxy: wrk -t{WRK_THREADS}, {per_run},"
        f" {env.get('cpus', '?')} CPUs; latency in us, ratios = req/s c={high} | p50 c={low}",
    ]
    load = env.get("loadavg_1m_at_start")
    if isinstance(load, int | float) and load >= BUSY_LOADAVG:
        lines.append(
            f"note: the machine was busy (load average {load:g} at the start): every row "
            "competes with other work, so absolute numbers are pessimistic; compare ratios"
        )
    lines += [
        header,
        "-" * len(header),
    ]
    series = result.series
    for s in series:
        if s.error is not None:
            first_line = s.error.splitlines()[0] if s.error else ""
            lines.append(f"{s.name:<13}NOT MEASURED: {first_line}")
            continue
        lo, hi = s.measurements.get(low), s.measurements.get(high)
        rps = hi.rps if hi else None
        p50 = lo.p50_us if lo else None
        ratios = []
        for base in ("nginx", "floor"):
            r_rps = _ratio(rps, _metric(series, base, high, "rps"))
            r_p50 = _ratio(p50, _metric(series, base, low, "p50_us"))
            ratios.append(f"{_fmt(r_rps, '.2f', 'x')} | {_fmt(r_p50, '.2f', 'x')}")
        notes = [f"{s.title}"]
        if s.checked:
            notes.append(f"checked {s.checked}")
        for m in s.measurements.values():
            for aux, value in m.aux_cpu_us_per_req.items():
                notes.append(f"+{aux} {value:.1f} us CPU/req at c={m.concurrency}")
            if m.errors or m.non_2xx:
                notes.append(f"c={m.concurrency}: {m.errors} socket errors, {m.non_2xx} non-2xx")
        lines.append(
            f"{s.name:<13}{_fmt(rps, ',.0f'):>13}{_fmt(p50, '.0f'):>11}"
            f"{_fmt(lo.p99_us if lo else None, '.0f'):>11}"
            f"{_fmt(hi.p50_us if hi else None, '.0f'):>11}"
            f"{_fmt(hi.p99_us if hi else None, '.0f'):>11}"
            f"{_fmt(hi.cpu_us_per_req if hi else None, '.1f', ' us'):>15}"
            f"{_fmt(hi.wrk_cpu_us_per_req if hi else None, '.1f', ' us'):>13}"
            f"{_fmt(hi.switches_per_req if hi else None, '.2f'):>13}"
            f"{ratios[0]:>17}{ratios[1]:>17}  {'; '.join(notes)}"
        )
    lines += ["", "targets:"]
    for t in result.targets:
        verdict = {True: "PASS", False: "FAIL", None: "n/a "}[t.passed]
        if t.value is None:
            shown = "not measured"
        elif t.unit == "x":
            shown = f"{t.value:.2f}x (limit {t.limit:g}x)"
        else:
            shown = f"{t.value:.0f} {t.unit} (limit {t.limit:g} {t.unit})"
        lines.append(f"  [{verdict}] {t.description}: {shown}")
    reference = miss_reference(result.series, low)
    if reference is not None:
        lines.append(
            "  (for reference: nginx proxy_cache's own miss overhead, same run: "
            f"{reference:.0f} us)"
        )
    relay = miss_reference(result.series, low, "miss-relay")
    if relay is not None:
        lines.append(
            "  (for reference: the floor of a proxied miss, a bare Python relay of bytes with"
            f" no parsing, same run: its own miss overhead {relay:.0f} us)"
        )
    miss_cpu = miss_cpu_reference(result.series, low)
    if miss_cpu:
        listed = ", ".join(f"{label} {cpu:.0f} us" for label, cpu in miss_cpu)
        lines.append(f"  (for reference: CPU per miss at c={low}, same run: {listed})")
    limiter = limiter_reference(result.series, low, high)
    if limiter is not None:
        lines.append(
            f"  (the rate limiter, same run: a limited tenant's miss p50 {limiter[0]:+.0f} us at"
            f" c={low}, {limiter[1]:.2f}x req/s at c={high} against the unlimited tenant's;"
            f" its L1 hit {limiter[2]:.2f}x the unlimited tenant's L1 hit req/s at c={high})"
            if limiter[2] is not None
            else f"  (the rate limiter, same run: a limited tenant's miss p50 {limiter[0]:+.0f} us"
            f" at c={low}, {limiter[1]:.2f}x req/s at c={high} against the unlimited tenant's)"
        )
    floor_l2 = l2_floor_reference(result.series, low, high)
    if floor_l2 is not None:
        lines.append(
            "  (for reference: the floor of an L2 hit, the bare responder with one Redis GET"
            f" per request, same run: p50 +{floor_l2[0]:.0f} us at c={low},"
            f" {floor_l2[1]:.2f}x req/s at c={high})"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------ I/O: processes


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


class ManagedProcess:
    """A child process in its own process group, with its output in a log file."""

    def __init__(self, name: str, argv: Sequence[str], log_dir: Path, **popen: Any) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log: IO[bytes] = self.log_path.open("wb")
        try:
            self.proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **popen,
            )
        except BaseException:
            self._log.close()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, limit: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:].strip()
        except OSError:
            return ""

    def wait_for_port(self, port: int, timeout_s: float = SERVICE_START_TIMEOUT_S) -> None:
        """Wait until ``port`` accepts connections; fail early if the process dies."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise BenchError(
                    f"{self.name} exited with code {code} before listening; "
                    f"its output:\n{self.log_tail()}"
                )
            with contextlib.suppress(OSError), socket.create_connection((HOST, port), 0.2):
                return
            time.sleep(POLL_INTERVAL_S)
        raise BenchError(
            f"{self.name} did not listen on {HOST}:{port} within {timeout_s:g} s; "
            f"its output:\n{self.log_tail()}"
        )

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after :data:`STOP_TIMEOUT_S`."""
        try:
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(STOP_TIMEOUT_S)
            # Leftovers of the group (e.g. nginx workers) go too.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        finally:
            self._log.close()


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _read_stat(pid: int) -> tuple[int, float] | None:
    """(ppid, own + reaped children's CPU seconds) of ``pid``, or None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces: split after its ")".
    rest = raw[raw.rindex(")") + 2 :].split()
    ppid = int(rest[1])
    utime, stime, cutime, cstime = (int(v) for v in rest[11:15])
    return ppid, (utime + stime + cutime + cstime) / _CLK_TCK


def parse_context_switches(proc_stat: str) -> int | None:
    """The machine's context switches since boot, from the text of /proc/stat."""
    for line in proc_stat.splitlines():
        name, _, value = line.partition(" ")
        if name == "ctxt" and value.strip().isdigit():
            return int(value)
    return None


def context_switches() -> int | None:
    """The machine's context switches since boot (None where /proc/stat does not say)."""
    try:
        return parse_context_switches(Path("/proc/stat").read_text())
    except OSError:
        return None


def process_tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) used so far by ``root`` and its descendants."""
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            stat = _read_stat(int(entry.name))
            if stat is not None:
                stats[int(entry.name)] = stat
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo, seen = 0.0, [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen or pid not in stats:
            continue
        seen.add(pid)
        total += stats[pid][1]
        todo.extend(children.get(pid, ()))
    return total


def http_post(port: int, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    """One POST to :data:`REQUEST_PATH` on ``port``: (status, headers, body)."""
    conn = http.client.HTTPConnection(HOST, port, timeout=CHECK_TIMEOUT_S)
    try:
        conn.request("POST", REQUEST_PATH, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, data
    except (OSError, http.client.HTTPException) as exc:
        raise BenchError(f"{_CHECK_FAILED}POST to {HOST}:{port}: {exc!r}") from exc
    finally:
        conn.close()


def run_wrk(
    port: int, script: Path, concurrency: int, duration_s: int
) -> tuple[WrkStats, float | None]:
    """Run wrk once; return its stats and its own CPU seconds (from wait4)."""
    wrk = shutil.which("wrk")
    if wrk is None:
        raise BenchError("wrk is not installed (Debian package 'wrk')")
    argv = [
        wrk,
        f"-t{WRK_THREADS}",
        f"-c{concurrency}",
        f"-d{max(1, duration_s)}s",
        f"--timeout={WRK_REQUEST_TIMEOUT_S}s",
        "--latency",
        "-s",
        str(script),
        f"http://{HOST}:{port}{REQUEST_PATH}",
    ]
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
        )
        rusage = None
        deadline = time.monotonic() + duration_s + WRK_GRACE_S
        try:
            while time.monotonic() < deadline:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid == proc.pid:
                    proc.returncode = os.waitstatus_to_exitcode(status)
                    rusage = usage
                    break
                time.sleep(POLL_INTERVAL_S)
        finally:
            if proc.returncode is None:
                proc.kill()
                proc.wait()
        out.seek(0)
        text = out.read().decode(errors="replace")
    if rusage is None:
        raise BenchError(f"wrk did not finish within {duration_s + WRK_GRACE_S:g} s")
    if proc.returncode != 0:
        raise BenchError(f"wrk exited with code {proc.returncode}:\n{text[-2000:]}")
    return parse_wrk_output(text), rusage.ru_utime + rusage.ru_stime


# ------------------------------------------------------------------ I/O: services


def _nginx_conf(prefix: Path, port: int, upstream_port: int, cache: Path) -> str:
    user = "user root;\n" if os.geteuid() == 0 else ""
    return f"""{user}worker_processes 1;
daemon off;
master_process on;
pid {prefix}/nginx.pid;
error_log {prefix}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy-temp;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    proxy_cache_path {cache} levels=1:2 keys_zone=cf:16m max_size=256m
                     inactive=60m use_temp_path=off;
    upstream responder {{
        server {HOST}:{upstream_port};
        keepalive 64;
    }}
    server {{
        listen {HOST}:{port} backlog=1024;
        # The cache key is the body, so the body must be in memory.
        client_body_buffer_size 64k;
        client_max_body_size 64k;
        location / {{
            proxy_pass http://responder;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_cache cf;
            proxy_cache_methods POST;
            proxy_cache_key "$request_body";
            proxy_cache_valid 200 60m;
            add_header X-Cache $upstream_cache_status;
        }}
    }}
}}
"""


def _clean_env() -> dict[str, str]:
    """The environment for children: without CACHEFLEET_* settings of the caller."""
    return {k: v for k, v in os.environ.items() if not k.startswith("CACHEFLEET_")}


class Services:
    """Starts the benchmark's services on demand and stops them all on close."""

    def __init__(self, workdir: Path, progress: Callable[[str], None]) -> None:
        self.workdir = workdir
        self.progress = progress
        self._stack = contextlib.ExitStack()
        self._ports: dict[str, int] = {}
        self._pids: dict[str, int] = {}
        self._procs: dict[str, ManagedProcess] = {}
        self._failures: dict[str, BenchError] = {}

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> Services:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self, name: str, argv: Sequence[str], port: int, **popen: Any) -> None:
        proc = ManagedProcess(name, argv, self.workdir, **popen)
        self._stack.callback(proc.stop)
        proc.wait_for_port(port)
        self._ports[name], self._pids[name], self._procs[name] = port, proc.pid, proc

    def _get(self, name: str, starter: Callable[[], None]) -> int:
        """The port of service ``name``, started by ``starter`` the first time."""
        if name in self._failures:
            raise self._failures[name]
        if name not in self._ports:
            try:
                starter()
            except BenchError as exc:
                self._failures[name] = exc
                raise
        return self._ports[name]

    def pid(self, name: str) -> int:
        return self._pids[name]

    def _memory_dir(self, name: str) -> Path | None:
        """A fresh directory on a tmpfs (removed on close), or None when there is none."""
        if not os.access(MEMORY_FS, os.W_OK):
            return None
        path = Path(tempfile.mkdtemp(prefix=f"cachefleet-bench-{name}-", dir=MEMORY_FS))
        self._stack.callback(shutil.rmtree, path, True)
        return path

    def log_tail(self, name: str, limit: int = 1200) -> str:
        """The end of a started service's output ('' if it never started)."""
        proc = self._procs.get(name)
        return proc.log_tail(limit) if proc is not None else ""

    def _start_responder(self, name: str, what: str, extra: Sequence[str] = ()) -> None:
        """Start ``cachefleet_bench.responder`` (``extra``: its flags) as service ``name``."""
        port = free_port()
        argv = [sys.executable, "-m", "cachefleet_bench.responder", "--port", str(port), *extra]
        self.progress(f"starting {what} on {HOST}:{port}")
        self._start(name, argv, port, env=_clean_env())

    def responder(self) -> int:
        return self._get("responder", lambda: self._start_responder("responder", "the responder"))

    def responder_redis(self) -> int:
        """The responder answering from Redis, one GET per request: the L2 hit's floor."""

        def start() -> None:
            redis = self.redis()
            body = CHAT_COMPLETION_BODY.decode()
            reply = redis_command(redis, "SET", FLOOR_REDIS_KEY, body)
            if reply != b"+OK\r\n":
                raise BenchError(f"redis SET {FLOOR_REDIS_KEY} answered {reply[:100]!r}")
            extra = ["--redis-port", str(redis), "--redis-key", FLOOR_REDIS_KEY]
            what = "the responder with one Redis GET per request"
            self._start_responder("responder-redis", what, extra)

        return self._get("responder-redis", start)

    def relay(self) -> int:
        """The responder relaying bytes to the responder: a proxied miss's floor."""

        def start() -> None:
            extra = ["--relay-port", str(self.responder())]
            self._start_responder("relay", "the byte relay to the responder", extra)

        return self._get("relay", start)

    def nginx(self) -> int:
        def start() -> None:
            binary = shutil.which("nginx") or (
                "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
            )
            if binary is None:
                raise BenchError("nginx is not installed (Debian package 'nginx-light')")
            upstream = self.responder()
            prefix = self.workdir / "nginx"
            prefix.mkdir()
            port = free_port()
            cache = self._memory_dir("nginx-cache") or prefix / "cache"
            conf = prefix / "nginx.conf"
            conf.write_text(_nginx_conf(prefix, port, upstream, cache))
            self.progress(f"starting nginx (1 worker, proxy_cache in {cache}) on {HOST}:{port}")
            argv = [binary, "-p", str(prefix), "-e", str(prefix / "nginx-error.log"), "-c"]
            self._start("nginx", [*argv, str(conf)], port)

        return self._get("nginx", start)

    def redis(self) -> int:
        """A redis-server for the L2 row (the e2e launcher; its pid from INFO)."""

        def start() -> None:
            try:
                server = RedisServer().start()
            except ServiceError as exc:
                raise BenchError(f"redis-server did not start: {exc}") from exc
            self._stack.callback(server.stop)
            self.progress(f"started redis-server on {server.host}:{server.port}")
            info = redis_command(server.port, "INFO", "server").decode(errors="replace")
            pid = next(
                (
                    int(line.split(":", 1)[1])
                    for line in info.splitlines()
                    if line.startswith("process_id:")
                ),
                None,
            )
            if pid is None:
                raise BenchError(f"redis INFO named no process_id: {info[:200]!r}")
            self._ports["redis"], self._pids["redis"] = server.port, pid

        return self._get("redis", start)

    def sidecar(self, name: str, l1_bytes: int, with_redis: bool, extra: Sequence[str] = ()) -> int:
        """A ``cachefleet sidecar`` in front of the responder (``extra``: more flags)."""

        def start() -> None:
            upstream = self.responder()
            port = free_port()
            argv = [sys.executable, "-m", "cachefleet_operator.cli", "sidecar"]
            argv += ["--listen", f"{HOST}:{port}", "--upstream", f"http://{HOST}:{upstream}"]
            argv += ["--admin-listen", f"{HOST}:{free_port()}"]
            argv += ["--trusted-proxies", f"{HOST}/32"]  # wrk names the tenant by header
            argv += ["--l1-bytes", str(l1_bytes)]
            if with_redis:
                argv += ["--redis-url", f"redis://{HOST}:{self.redis()}/0"]
            argv += list(extra)
            self.progress(f"starting {name}: cachefleet {' '.join(argv[3:])}")
            try:
                self._start(name, argv, port, env=_clean_env())
            except BenchError as exc:
                raise BenchError(f"the sidecar is not runnable: {exc}") from exc

        return self._get(name, start)


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
            raise BenchError(f"{_CHECK_FAILED}answered {status}: {data[:200]!r}")
        if data != CHAT_COMPLETION_BODY:
            raise BenchError(f"{_CHECK_FAILED}a different body came back: {data[:200]!r}")
        value = headers.get(header.lower(), "<absent>")
        if value == expected:
            return f"{header}: {value}"
        if not seen or seen[-1] != value:
            seen.append(value)
        if time.monotonic() >= deadline:
            raise BenchError(
                f"{_CHECK_FAILED}expected {header}: {expected} within {WARM_TIMEOUT_S:g} s, "
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
        raise BenchError(f"{_CHECK_FAILED}a limited tenant's miss has no x-ratelimit-* header")
    if status != 200 or data != CHAT_COMPLETION_BODY or value != "MISS":
        raise BenchError(f"{_CHECK_FAILED}a unique request got status {status}, X-Cache {value}")
    return "X-Cache: MISS"


def _check_relayed(port: int) -> str:
    """A unique request through the relay must come back with the upstream's answer."""
    status, _, data = http_post(port, unique_body(f"check{uuid.uuid4().hex[:8]}", 0), {})
    if status != 200 or data != CHAT_COMPLETION_BODY:
        raise BenchError(f"{_CHECK_FAILED}a relayed request got status {status}: {data[:200]!r}")
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
        if self.server is not None and self.result.error.startswith(_CHECK_FAILED):
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
        f" p99 {m.p99_us:.0f} us, {_fmt(m.cpu_us_per_req, '.1f')} us CPU/req"
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


# ------------------------------------------------------------------ outputs


def write_plot(result: BenchResult, path: Path) -> None:
    """A PNG with three bar charts: req/s, p50 at low concurrency, CPU per request."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    low, high = result.config["low_concurrency"], result.config["high_concurrency"]
    measured = [s for s in result.series if s.measurements]
    names = [s.name for s in measured]
    panels = [
        (f"req/s at c={high}", [_metric(measured, n, high, "rps") for n in names]),
        (f"p50 latency at c={low} (us)", [_metric(measured, n, low, "p50_us") for n in names]),
        (
            f"server CPU per request at c={high} (us)",
            [_metric(measured, n, high, "cpu_us_per_req") for n in names],
        ),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4.5))
    for ax, (title, values) in zip(axes, panels, strict=True):
        heights = [v if v is not None else 0.0 for v in values]
        bars = ax.bar(names, heights, color="#4c72b0")
        for bar, value in zip(bars, values, strict=True):
            label = "-" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:.1f}"
            ax.annotate(
                label,
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=30)
    rounds = result.config.get("rounds", 1)
    fig.suptitle(
        f"cachefleet bench proxy (wrk -t{WRK_THREADS}, {result.config['duration_s']:g} s per run,"
        + (f" medians of {rounds} runs," if rounds > 1 else "")
        + f" {result.environment.get('cpus')} CPUs)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
