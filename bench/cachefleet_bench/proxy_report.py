"""The rows and the report of ``cachefleet bench proxy``: pure, from wrk's numbers.

A run's :class:`Measurement` (wrk's numbers with the CPU and context switches
around it), the medians of interleaved rounds, the series and the targets of
issues 2, 5, 8 and 10, the same-run references (nginx's and the relay's miss,
the limiter, the L2 floor), the text table and the PNG plot.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cachefleet_bench.proxy_load import WRK_THREADS, WrkStats

#: 1-minute load average from which the report warns that the machine was busy.
BUSY_LOADAVG = 0.5


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


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
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
            ratios.append(f"{fmt(r_rps, '.2f', 'x')} | {fmt(r_p50, '.2f', 'x')}")
        notes = [f"{s.title}"]
        if s.checked:
            notes.append(f"checked {s.checked}")
        for m in s.measurements.values():
            for aux, value in m.aux_cpu_us_per_req.items():
                notes.append(f"+{aux} {value:.1f} us CPU/req at c={m.concurrency}")
            if m.errors or m.non_2xx:
                notes.append(f"c={m.concurrency}: {m.errors} socket errors, {m.non_2xx} non-2xx")
        lines.append(
            f"{s.name:<13}{fmt(rps, ',.0f'):>13}{fmt(p50, '.0f'):>11}"
            f"{fmt(lo.p99_us if lo else None, '.0f'):>11}"
            f"{fmt(hi.p50_us if hi else None, '.0f'):>11}"
            f"{fmt(hi.p99_us if hi else None, '.0f'):>11}"
            f"{fmt(hi.cpu_us_per_req if hi else None, '.1f', ' us'):>15}"
            f"{fmt(hi.wrk_cpu_us_per_req if hi else None, '.1f', ' us'):>13}"
            f"{fmt(hi.switches_per_req if hi else None, '.2f'):>13}"
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
