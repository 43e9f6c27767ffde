"""``cachefleet simulate``: deterministic trace replay with the allocator in the loop.

A workload (one request a line: ``{"ts", "tenant", "key", "bytes",
"upstream_s"}``, in time order) is replayed through the sidecar's real
:class:`~cachefleet_sidecar.cache.l1.TenantL1` and policies, one pod of
``--capacity-bytes``. Every ``--interval`` seconds of trace time the
allocator reads exactly what the sidecars would export over the
InferenceCache's metrics window (hit and miss counts, latency histograms,
the SHARDS reuse-distance histograms of :mod:`cachefleet_sidecar.adapt.mrc`)
and its quotas are applied. No wall clock, no sockets: the same input gives
the same output.

Allocators compared on the same trace:

* ``cachefleet``: :func:`cachefleet_operator.allocation.allocate`, re-run every interval;
* ``class-only``: the operator's split without metrics (floors, then class weight);
* ``equal``: every tenant the same share;
* ``oracle``: the best static split within the tenants' min/max shares, from
  the exact (unsampled) byte-weighted LRU curves of the whole trace, by
  dynamic programming over 1/200ths of the capacity.

A hit costs ``--hit-latency`` seconds, a miss the request's ``upstream_s``.
``sla_windows_met`` is the fraction of intervals with requests in which the
tenant met both its p95 target and ``minHitRatio`` on that interval's requests.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash
import yaml

from cachefleet_common.sampling import BUCKETS as REUSE_BUCKETS
from cachefleet_common.sampling import DEFAULT_MAX_RATE, DEFAULT_MAX_SAMPLES, ShardsSampler
from cachefleet_operator.allocation import (
    AllocationParams,
    PriorityClass,
    TenantDemand,
    TenantMetrics,
    allocate,
)
from cachefleet_operator.api import SpecError, parse_spec
from cachefleet_operator.curves import HitCurve, LatencyDist
from cachefleet_sidecar.adapt.mrc import MINI_SIM_FRACTIONS, MissRatioCurves
from cachefleet_sidecar.cache.l1 import TenantL1
from cachefleet_sidecar.observe.metrics import Histogram
from cachefleet_sidecar.policies import available_policies

ALLOCATORS = ("cachefleet", "class-only", "equal", "oracle")
DEFAULT_INTERVAL_S = 10.0
DEFAULT_HIT_LATENCY_S = 0.001
#: Capacity steps of the oracle's dynamic programme.
ORACLE_STEPS = 200
#: Below this share of the baseline's upstream time, what allocation can avoid is noise
#: and the savings ratio is not reported.
MIN_AVOIDABLE = 0.01


class WorkloadError(ValueError):
    """A workload line that cannot be replayed (names the line)."""


@dataclass(frozen=True, slots=True)
class Request:
    ts: float
    tenant: str
    digest: int
    size: int
    upstream_s: float


def load_workload(path: Path) -> list[Request]:
    """The workload's requests; raises :class:`WorkloadError` naming the bad line."""
    out: list[Request] = []
    last_ts = -math.inf
    with path.open("rb") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
                req = Request(
                    ts=float(doc["ts"]),
                    tenant=str(doc["tenant"]),
                    digest=xxhash.xxh3_128_intdigest(str(doc["key"]).encode()),
                    size=int(doc["bytes"]),
                    upstream_s=float(doc["upstream_s"]),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise WorkloadError(f"{path}:{number}: {type(exc).__name__}: {exc}") from exc
            if req.ts < last_ts:
                raise WorkloadError(f"{path}:{number}: ts {req.ts} goes back in time")
            if req.size <= 0 or req.upstream_s < 0 or not math.isfinite(req.upstream_s):
                raise WorkloadError(f"{path}:{number}: bytes must be > 0, upstream_s >= 0")
            last_ts = req.ts
            out.append(req)
    if not out:
        raise WorkloadError(f"{path}: no requests")
    return out


def parse_window(text: str) -> float:
    """A Prometheus duration (``30s``, ``1m``, ``1m30s``) in seconds."""
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    parts = re.findall(r"(\d+)(ms|s|m|h)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {text!r}")
    return sum(int(n) * units[u] for n, u in parts)


# ------------------------------------------------------------------ per-window data


@dataclass(slots=True)
class _Window:
    """What the sidecar counted for one tenant in one interval."""

    lookups: int = 0
    hits: int = 0
    latency: Histogram = field(default_factory=Histogram)
    upstream: Histogram = field(default_factory=Histogram)
    hit_latency: Histogram = field(default_factory=Histogram)
    latencies: list[float] = field(default_factory=list)
    reuse: list[float] = field(default_factory=lambda: [0.0] * (len(REUSE_BUCKETS) + 1))
    cold_bytes: float = 0.0
    #: The tenant's own policy simulated at ``sim_sizes`` (empty for LRU tenants).
    sim_sizes: tuple[int, ...] = ()
    sim_hits: list[float] = field(default_factory=list)
    sim_requests: float = 0.0


def _sum_hist(hists: Iterable[Histogram]) -> Histogram:
    out = Histogram()
    for h in hists:
        out.counts = [a + b for a, b in zip(out.counts, h.counts, strict=True)]
        out.sum += h.sum
    return out


def _dist(hist: Histogram) -> LatencyDist | None:
    buckets = [(float("inf") if b == "+Inf" else float(b), c) for b, c in hist.cumulative()]
    return LatencyDist.from_buckets(buckets, hist.sum)


def _metrics(
    windows: Sequence[Mapping[str, _Window]],
    curve_windows: Sequence[Mapping[str, _Window]],
    interval_s: float,
) -> dict[str, TenantMetrics]:
    """What the operator's PromQL would return: rates over ``windows`` (one interval each),
    the curves (and their lookup totals) over ``curve_windows``."""
    out: dict[str, TenantMetrics] = {}
    tenants = {t for w in windows for t in w}
    for t in tenants:
        ws = [w[t] for w in windows if t in w]
        lookups = sum(w.lookups for w in ws)
        if lookups == 0:
            continue
        hits = sum(w.hits for w in ws)
        latency = _dist(_sum_hist(w.latency for w in ws))
        cws = [w[t] for w in curve_windows if t in w]
        reuse = [sum(col) for col in zip(*(w.reuse for w in cws), strict=True)]
        cumulative, acc = [], 0.0
        for bound, count in zip((*REUSE_BUCKETS, math.inf), reuse, strict=True):
            acc += count
            cumulative.append((bound, acc))
        footprint = sum(w.cold_bytes for w in cws)
        curve = HitCurve.from_histogram(cumulative, float(sum(w.lookups for w in cws)), footprint)
        sims = [w for w in cws if w.sim_sizes]
        if sims:  # what the operator does with the sidecars' mini-simulation series
            sizes = sims[-1].sim_sizes
            totals = [sum(col) for col in zip(*(w.sim_hits for w in sims), strict=True)]
            curve = (
                HitCurve.from_hits(
                    zip(sizes, totals, strict=True),
                    sum(w.sim_requests for w in sims),
                    cold_ratio=None if curve is None else curve.cold_ratio,
                    footprint_bytes=footprint,
                )
                or curve
            )
        out[t] = TenantMetrics(
            p95_s=latency.quantile(0.95) if latency else None,
            hit_ratio=hits / lookups,
            rps=lookups / (interval_s * len(windows)),
            curve=curve,
            miss_latency=_dist(_sum_hist(w.upstream for w in cws)),
            hit_latency=_dist(_sum_hist(w.hit_latency for w in ws)),
        )
    return out


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


# --------------------------------------------------------------------------- replay


@dataclass(slots=True)
class TenantResult:
    name: str
    requests: int = 0
    hits: int = 0
    upstream_seconds: float = 0.0
    windows: int = 0
    windows_met: int = 0
    share_time: float = 0.0

    def as_dict(self, duration: float) -> dict[str, Any]:
        return {
            "name": self.name,
            "requests": self.requests,
            "hit_ratio": round(self.hits / self.requests, 4) if self.requests else None,
            "upstream_seconds": round(self.upstream_seconds, 3),
            "sla_windows_met": round(self.windows_met / self.windows, 4) if self.windows else None,
            "mean_share": round(self.share_time / duration, 4) if duration > 0 else None,
        }


@dataclass(slots=True)
class Replay:
    """One allocator's replay: totals, per tenant, and the timeline for the plot."""

    allocator: str
    tenants: dict[str, TenantResult]
    upstream_seconds: float = 0.0
    requests: int = 0
    hits: int = 0
    timeline: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self, duration: float) -> dict[str, Any]:
        return {
            "allocator": self.allocator,
            "upstream_seconds": round(self.upstream_seconds, 3),
            "hit_ratio": round(self.hits / self.requests, 4) if self.requests else None,
            "tenants": [t.as_dict(duration) for t in self.tenants.values()],
        }


def _met(d: TenantDemand, window: _Window) -> bool:
    if d.p95_target_s is not None and _p95(window.latencies) > d.p95_target_s:
        return False
    return not (d.min_hit_ratio and window.hits / window.lookups < d.min_hit_ratio)


class _ReplayRun:
    """One replay in progress: the tenants' L1, the sidecar's curves, the windows of
    counts the operator reads, and the shares the allocator last set."""

    def __init__(
        self,
        start: float,
        demands: Sequence[TenantDemand],
        capacity: int,
        *,
        allocator: str,
        policy: str,
        interval_s: float,
        window_s: float,
        curve_window_s: float,
        params: AllocationParams,
        static_shares: Mapping[str, float] | None,
        mrc_samples: int,
        mrc_max_rate: float,
    ) -> None:
        self.names = [d.name for d in demands]
        self.by_name = {d.name: d for d in demands}
        self.demands = demands
        self.capacity = capacity
        self.interval_s = interval_s
        self.params = params
        self.static = static_shares is not None
        self.l1: TenantL1[int, bool] = TenantL1(capacity, policy, max_tenants=len(self.names) + 1)
        self.now = start
        self.start = start
        self.curves = MissRatioCurves(
            mrc_samples,
            mrc_max_rate,
            clock=lambda: self.now,
            policy_sizes=tuple(int(f * capacity) for f in MINI_SIM_FRACTIONS),
            default_policy=policy,
        )
        self.result = Replay(allocator, {n: TenantResult(n) for n in self.names})
        self.stats_n = max(1, round(window_s / interval_s))
        self.curve_n = max(1, round(curve_window_s / interval_s))
        self.history: deque[dict[str, _Window]] = deque(maxlen=max(self.stats_n, self.curve_n))
        self.shares: dict[str, float] | None = None
        self.reuse_before: dict[str, tuple[list[float], float]] = {}
        self.sim_before: dict[str, tuple[list[float], float]] = {}
        self.current: dict[str, _Window] = {}
        if static_shares is not None:
            self.apply(static_shares)
        else:
            self.apply(allocate(demands, {}, None, capacity, 0, params).shares())

    def apply(self, new: Mapping[str, float]) -> None:
        """The allocator's shares become the tenants' L1 quotas."""
        self.shares = dict(new)
        shares = self.shares
        self.l1.set_quotas({n: (int(shares.get(n, 0.0) * self.capacity), None) for n in self.names})

    def read_curves(self) -> None:
        """Each open window gets what the curves counted since the last window closed."""
        snaps = dict(self.curves.snapshots())
        sims = dict(self.curves.policy_curves())
        for name, win in self.current.items():
            snap = snaps.get(name)
            if snap is not None:
                before, cold_before = self.reuse_before.get(name, ([0.0] * len(snap.counts), 0.0))
                win.reuse = [a - b for a, b in zip(snap.counts, before, strict=True)]
                win.cold_bytes = snap.cold_bytes - cold_before
                self.reuse_before[name] = (list(snap.counts), snap.cold_bytes)
            sim = sims.get(name)
            if sim is not None:
                hits_before, req_before = self.sim_before.get(name, ([0.0] * len(sim.hits), 0.0))
                win.sim_sizes = sim.sizes
                win.sim_hits = [a - b for a, b in zip(sim.hits, hits_before, strict=True)]
                win.sim_requests = sim.requests - req_before
                self.sim_before[name] = (list(sim.hits), sim.requests)
            d = self.by_name.get(name)
            if d is not None and win.lookups:
                tr = self.result.tenants[name]
                tr.windows += 1
                tr.windows_met += _met(d, win)

    def close_window(self, at: float) -> None:
        """The interval ends: its windows go to the history and the timeline, and the
        allocator (unless the shares are static) reallocates from the history."""
        self.read_curves()
        current = self.current
        self.history.append(current)
        row: dict[str, Any] = {"t": round(at - self.start, 3), "shares": dict(self.shares or {})}
        row["hit_ratio"] = {n: (w.hits / w.lookups) for n, w in current.items() if w.lookups}
        self.result.timeline.append(row)
        self.current = {}
        if not self.static:
            past = list(self.history)
            metrics = _metrics(past[-self.stats_n :], past[-self.curve_n :], self.interval_s)
            if metrics:
                new = allocate(self.demands, metrics, self.shares, self.capacity, 0, self.params)
                self.apply(new.shares())

    def serve(self, req: Request, hit_latency_s: float) -> None:
        """One request through the L1, as the sidecar serves it and counts it."""
        tenant = req.tenant
        if tenant not in self.by_name:
            return
        win = self.current.get(tenant)
        if win is None:
            win = self.current[tenant] = _Window()
        self.now = req.ts
        self.curves.access(tenant, req.digest, req.size)
        hit = self.l1.get(tenant, req.digest) is not None
        latency = hit_latency_s if hit else req.upstream_s
        if hit:
            win.hit_latency.observe(latency)
        else:
            win.upstream.observe(req.upstream_s)
            # As the sidecar: the miss stores the answer with what it cost upstream.
            self.l1.put(tenant, req.digest, True, req.size, req.upstream_s)
        win.lookups += 1
        win.hits += hit
        win.latency.observe(latency)
        win.latencies.append(latency)
        result = self.result
        tr = result.tenants[tenant]
        tr.requests += 1
        tr.hits += hit
        result.requests += 1
        result.hits += hit
        if not hit:
            tr.upstream_seconds += req.upstream_s
            result.upstream_seconds += req.upstream_s


def replay(
    requests: Sequence[Request],
    demands: Sequence[TenantDemand],
    capacity: int,
    *,
    allocator: str,
    policy: str,
    interval_s: float,
    window_s: float,
    curve_window_s: float,
    hit_latency_s: float,
    params: AllocationParams,
    static_shares: Mapping[str, float] | None = None,
    mrc_samples: int = DEFAULT_MAX_SAMPLES,
    mrc_max_rate: float = DEFAULT_MAX_RATE,
) -> Replay:
    """Replay ``requests`` under ``allocator`` (static allocators pass ``static_shares``)."""
    start = requests[0].ts
    run = _ReplayRun(
        start,
        demands,
        capacity,
        allocator=allocator,
        policy=policy,
        interval_s=interval_s,
        window_s=window_s,
        curve_window_s=curve_window_s,
        params=params,
        static_shares=static_shares,
        mrc_samples=mrc_samples,
        mrc_max_rate=mrc_max_rate,
    )
    boundary = start + interval_s
    last_ts = start
    for req in requests:
        while req.ts >= boundary:
            _account_shares(run.result, run.shares, boundary - last_ts)
            last_ts = boundary
            run.close_window(boundary)
            boundary += interval_s
        run.serve(req, hit_latency_s)
    end = requests[-1].ts
    _account_shares(run.result, run.shares, end - last_ts)
    if run.current:
        run.close_window(end)
    return run.result


def _account_shares(result: Replay, shares: Mapping[str, float] | None, seconds: float) -> None:
    for name, tr in result.tenants.items():
        tr.share_time += (shares or {}).get(name, 0.0) * seconds


# --------------------------------------------------------------------------- oracle


def exact_savings(
    requests: Sequence[Request], names: Sequence[str], hit_latency_s: float
) -> dict[str, list[float]]:
    """Per tenant: upstream seconds saved, by reuse-distance bucket (exact byte-weighted LRU)."""
    samplers = {n: ShardsSampler(max_samples=10**9) for n in names}
    saved: dict[str, list[float]] = {n: [0.0] * (len(REUSE_BUCKETS) + 1) for n in names}
    for req in requests:
        sampler = samplers.get(req.tenant)
        if sampler is None:
            continue
        before = list(sampler.counts)
        sampler.access(req.digest, req.size)
        for i, (a, b) in enumerate(zip(sampler.counts, before, strict=True)):
            if a != b:
                saved[req.tenant][i] += max(0.0, req.upstream_s - hit_latency_s)
                break
    return saved


def oracle_shares(
    demands: Sequence[TenantDemand],
    saved: Mapping[str, list[float]],
    capacity: int,
    steps: int = ORACLE_STEPS,
) -> dict[str, float]:
    """The static split (in 1/steps of capacity, within floors and caps) saving the most."""

    def gain(name: str, units: int) -> float:
        size = capacity * units / steps
        buckets = saved[name]
        total = 0.0
        for bound, value in zip(REUSE_BUCKETS, buckets, strict=False):
            if bound <= size:
                total += value
        return total

    # best[u] = (value, choices) using the tenants so far and u units
    best: list[tuple[float, tuple[int, ...]] | None] = [(0.0, ())] + [None] * steps
    for d in demands:
        floor = 0 if d.priority_class is PriorityClass.BEST_EFFORT else d.min_share
        lo = math.ceil(floor * steps - 1e-9)
        hi = max(lo, math.floor(d.max_share * steps + 1e-9))
        gains = [gain(d.name, u) for u in range(steps + 1)]
        nxt: list[tuple[float, tuple[int, ...]] | None] = [None] * (steps + 1)
        for used, state in enumerate(best):
            if state is None:
                continue
            for u in range(lo, min(hi, steps - used) + 1):
                value = state[0] + gains[u]
                slot = nxt[used + u]
                if slot is None or value > slot[0] + 1e-12:
                    nxt[used + u] = (value, (*state[1], u))
        best = nxt
    winner = max((s for s in best if s is not None), key=lambda s: s[0], default=None)
    if winner is None:  # floors cannot be met on the grid: fall back to the floors
        return {d.name: d.min_share for d in demands}
    return {d.name: u / steps for d, u in zip(demands, winner[1], strict=True)}


# ------------------------------------------------------------------------ reporting


def savings_ratio(results: Mapping[str, Replay]) -> float | None:
    """Share of the oracle's saving over the better baseline that cachefleet achieves."""
    if not {"cachefleet", "class-only", "equal", "oracle"} <= set(results):
        return None
    baseline = min(results["class-only"].upstream_seconds, results["equal"].upstream_seconds)
    possible = baseline - results["oracle"].upstream_seconds
    if possible <= MIN_AVOIDABLE * baseline:
        return None
    return (baseline - results["cachefleet"].upstream_seconds) / possible


def table(results: Mapping[str, Replay], duration: float) -> str:
    lines = [
        f"{'allocator':<11} {'upstream s':>11} {'hit ratio':>9}   per tenant: hit ratio / "
        "SLA windows met / mean share"
    ]
    for name, r in results.items():
        per = "  ".join(
            f"{t.name} {t.as_dict(duration)['hit_ratio'] or 0:.2f}/"
            f"{t.as_dict(duration)['sla_windows_met'] or 0:.2f}/"
            f"{t.as_dict(duration)['mean_share'] or 0:.2f}"
            for t in r.tenants.values()
        )
        hit = r.hits / r.requests if r.requests else 0.0
        lines.append(f"{name:<11} {r.upstream_seconds:>11.1f} {hit:>9.3f}   {per}")
    ratio = savings_ratio(results)
    if ratio is not None:
        lines.append(
            f"cachefleet achieves {ratio:.0%} of the oracle's saving over the better baseline"
        )
    elif {"cachefleet", "class-only", "equal", "oracle"} <= set(results):
        lines.append(
            f"the oracle avoids less than {MIN_AVOIDABLE:.0%} of the better baseline's upstream "
            "time: no allocation matters much at this size"
        )
    return "\n".join(lines)


def plot(replay_: Replay, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = [row["t"] for row in replay_.timeline]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name in replay_.tenants:
        ax1.plot(times, [row["shares"].get(name, 0.0) for row in replay_.timeline], label=name)
        ax2.plot(
            times,
            [row["hit_ratio"].get(name, math.nan) for row in replay_.timeline],
            label=name,
        )
    ax1.set_ylabel("share of L1")
    ax1.set_title(f"{replay_.allocator}: shares and hit ratios over trace time")
    ax1.legend(loc="upper right", fontsize="small")
    ax2.set_ylabel("hit ratio (interval)")
    ax2.set_xlabel("trace time, s")
    ax2.set_ylim(0, 1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def simulate(
    requests: Sequence[Request],
    demands: Sequence[TenantDemand],
    capacity: int,
    *,
    policy: str = "lirs",
    interval_s: float = DEFAULT_INTERVAL_S,
    window_s: float = 120.0,
    curve_window_s: float = 600.0,
    hit_latency_s: float = DEFAULT_HIT_LATENCY_S,
    params: AllocationParams | None = None,
    allocators: Sequence[str] = ALLOCATORS,
    mrc_samples: int = DEFAULT_MAX_SAMPLES,
    mrc_max_rate: float = DEFAULT_MAX_RATE,
) -> dict[str, Replay]:
    """Every allocator's replay of the same trace."""
    params = params or AllocationParams()
    names = [d.name for d in demands]
    n = len(demands)
    statics: dict[str, dict[str, float] | None] = {
        "cachefleet": None,
        "class-only": allocate(demands, {}, None, capacity, 0, params).shares(),
        "equal": {name: 1.0 / n for name in names},
    }
    if "oracle" in allocators:
        saved = exact_savings(requests, names, hit_latency_s)
        statics["oracle"] = oracle_shares(demands, saved, capacity)
    results = {}
    for name in allocators:
        results[name] = replay(
            requests,
            demands,
            capacity,
            allocator=name,
            policy=policy,
            interval_s=interval_s,
            window_s=window_s,
            curve_window_s=curve_window_s,
            hit_latency_s=hit_latency_s,
            params=params,
            static_shares=statics[name],
            mrc_samples=mrc_samples,
            mrc_max_rate=mrc_max_rate,
        )
    return results


def demands_from_file(
    path: Path,
) -> tuple[list[TenantDemand], AllocationParams, float, float]:
    """(tenants, tuning, metrics window s, curve window s) of an InferenceCache YAML."""
    from cachefleet_operator.assignment import demands_from_spec

    doc = yaml.safe_load(path.read_text())
    if not isinstance(doc, dict) or not isinstance(doc.get("spec"), dict):
        raise SpecError("spec", f"{path}: not an InferenceCache (no spec)")
    # Prometheus is not read by a replay: a cache written for simulation may leave it out
    raw = {"prometheus": {"url": "http://127.0.0.1:9090"}, **doc["spec"]}
    spec = parse_spec(raw)
    tuning = spec.allocation
    params = AllocationParams(tuning.smoothing, tuning.hysteresis, tuning.min_gain)
    prom = spec.prometheus
    return (
        demands_from_spec(spec),
        params,
        parse_window(prom.window),
        parse_window(prom.curve_window),
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="cachefleet simulate",
        description="Replay a multi-tenant trace through the L1 with each allocator in the loop.",
    )
    p.add_argument("--workload", type=Path, required=True, help="JSON lines, in time order")
    p.add_argument("--cache", type=Path, required=True, help="an InferenceCache YAML")
    p.add_argument("--capacity-bytes", type=int, required=True, help="L1 bytes of the pod")
    p.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S, help="rebalance, s")
    p.add_argument("--policy", default="lirs", choices=available_policies())
    p.add_argument("--hit-latency", type=float, default=DEFAULT_HIT_LATENCY_S)
    p.add_argument("--allocators", default=",".join(ALLOCATORS))
    p.add_argument("--mrc-samples", type=int, default=DEFAULT_MAX_SAMPLES)
    p.add_argument("--mrc-max-rate", type=float, default=DEFAULT_MAX_RATE)
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--plot", type=Path, help="PNG of cachefleet's shares and hit ratios")
    args = p.parse_args(argv)
    allocators = [a.strip() for a in args.allocators.split(",") if a.strip()]
    unknown = sorted(set(allocators) - set(ALLOCATORS))
    if unknown:
        p.error(f"--allocators: unknown {', '.join(unknown)}; known: {', '.join(ALLOCATORS)}")
    if args.capacity_bytes <= 0 or args.interval <= 0:
        p.error("--capacity-bytes and --interval must be > 0")
    try:
        demands, params, window_s, curve_window_s = demands_from_file(args.cache)
        requests = load_workload(args.workload)
    except (OSError, WorkloadError, yaml.YAMLError) as exc:
        print(f"cachefleet simulate: {exc}", file=sys.stderr)
        return 2
    except SpecError as exc:
        print(f"cachefleet simulate: {args.cache}: {exc.field}: {exc.message}", file=sys.stderr)
        return 2
    duration = requests[-1].ts - requests[0].ts
    print(
        f"replaying {len(requests):,} requests ({duration:.0f} s, {len(demands)} tenants) "
        f"at {args.capacity_bytes:,} bytes, policy {args.policy}, every {args.interval:g} s",
        file=sys.stderr,
    )
    results = simulate(
        requests,
        demands,
        args.capacity_bytes,
        policy=args.policy,
        interval_s=args.interval,
        window_s=window_s,
        curve_window_s=curve_window_s,
        hit_latency_s=args.hit_latency,
        params=params,
        allocators=allocators,
        mrc_samples=args.mrc_samples,
        mrc_max_rate=args.mrc_max_rate,
    )
    print(table(results, duration))
    if args.json:
        out = {
            "capacity_bytes": args.capacity_bytes,
            "policy": args.policy,
            "interval_s": args.interval,
            "savings_vs_oracle": savings_ratio(results),
            "results": [r.as_dict(duration) for r in results.values()],
            "timeline": results["cachefleet"].timeline if "cachefleet" in results else [],
        }
        args.json.write_text(json.dumps(out, indent=2))
    if args.plot and "cachefleet" in results:
        plot(results["cachefleet"], args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
