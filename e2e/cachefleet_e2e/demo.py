"""``cachefleet demo``: the whole fleet on this machine, under a multi-tenant load.

Starts the :class:`~cachefleet_e2e.fleet.LocalFleet` (Redis, a stand-in
model server, sidecar processes, Prometheus, the operator on the API
emulator), then drives three tenants through the sidecars for a while:

* ``acme-support`` (Guaranteed): a small set of recurring questions;
* ``search-assistant`` (Standard): a wider set, less skewed;
* ``nightly-evals`` (BestEffort): a sweep of one-off prompts, the noisy
  neighbour that would flush a shared LRU.

It prints progress every few seconds, then a per-tenant report (what the
clients saw, what the operator allocated and why, the Events it emitted),
and writes ``report.json`` and ``demo.png`` (hit ratio, p95 and L1 quota per
tenant over time) to ``--out``.

Then (``--routing both``, the default; ``only`` skips the cache part) it
compares ``cachefleet router`` with round-robin on simulated model servers
(:mod:`cachefleet_e2e.routing_demo`) and writes ``routing.json`` and
``routing.png`` (time to first token, prefix-cache hits per pod) beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from . import routing_demo
from .fleet import DEFAULT_TENANTS, LocalFleet

#: (prompt pool size, Zipf exponent or None for a one-off sweep, requests/s) per tenant.
WORKLOAD: dict[str, tuple[int, float | None, float]] = {
    "acme-support": (200, 1.1, 25.0),
    "search-assistant": (800, 0.8, 25.0),
    "nightly-evals": (100_000, None, 40.0),
}
SAMPLE_EVERY_S = 2.0


@dataclass(frozen=True, slots=True)
class Outcome:
    t: float
    tenant: str
    x_cache: str
    status: int
    latency_s: float


class ZipfPicker:
    """Draws prompt numbers 0..n-1 with P(k) ~ 1/(k+1)^s, or a sweep when s is None."""

    def __init__(self, n: int, s: float | None, rng: random.Random) -> None:
        self.n, self.s, self.rng, self.next = n, s, rng, 0
        if s is not None:
            weights = [1.0 / (k + 1) ** s for k in range(n)]
            total = sum(weights)
            acc, self.cdf = 0.0, []
            for w in weights:
                acc += w / total
                self.cdf.append(acc)

    def pick(self) -> int:
        if self.s is None:
            self.next += 1
            return self.next % self.n
        u = self.rng.random()
        lo, hi = 0, self.n - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if self.cdf[mid] < u:
                lo = mid + 1
            else:
                hi = mid
        return lo


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def drive(fleet: LocalFleet, duration_s: float, seed: int, outcomes: list[Outcome]) -> None:
    """Send each tenant's load round-robin across the sidecars for ``duration_s``."""
    rng = random.Random(seed)
    start = time.monotonic()
    urls = [sc.url for sc in fleet.sidecars]
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)

    async def tenant_loop(
        client: httpx.AsyncClient, tenant: str, worker: int, workers: int
    ) -> None:
        pool, s, rate = WORKLOAD[tenant]
        picker = ZipfPicker(pool, s, random.Random(rng.random()))
        if s is None:
            picker.next = worker * (pool // workers)
        interval = workers / rate
        sent = 0
        while (now := time.monotonic() - start) < duration_s:
            k = picker.pick()
            body = {
                "model": "demo-llm",
                "messages": [{"role": "user", "content": f"{tenant} question number {k}?"}],
                "temperature": 0,
            }
            url = urls[(sent + worker) % len(urls)]
            t0 = time.perf_counter()
            try:
                resp = await client.post(
                    url + "/v1/chat/completions", json=body, headers={"X-Tenant-ID": tenant}
                )
                outcome = Outcome(
                    now,
                    tenant,
                    resp.headers.get("x-cache", "?"),
                    resp.status_code,
                    time.perf_counter() - t0,
                )
            except httpx.HTTPError:
                outcome = Outcome(now, tenant, "ERROR", 0, time.perf_counter() - t0)
            outcomes.append(outcome)
            sent += 1
            delay = start + now + interval - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)

    async with httpx.AsyncClient(timeout=10.0, limits=limits) as client:
        tasks = [
            tenant_loop(client, tenant, w, 4)
            for tenant in WORKLOAD
            if tenant in {t.name for t in fleet.tenants}
            for w in range(4)
        ]
        await asyncio.gather(*tasks)


def window_stats(outcomes: list[Outcome], t0: float, t1: float) -> dict[str, dict[str, float]]:
    by: dict[str, list[Outcome]] = defaultdict(list)
    for o in outcomes:
        if t0 <= o.t < t1:
            by[o.tenant].append(o)
    out = {}
    for tenant, rows in by.items():
        looked = [o for o in rows if o.x_cache in {"HIT-L1", "HIT-L2", "MISS"}]
        hits = sum(o.x_cache.startswith("HIT") for o in looked)
        out[tenant] = {
            "requests": float(len(rows)),
            "hit_ratio": hits / len(looked) if looked else math.nan,
            "p95_s": percentile([o.latency_s for o in rows], 0.95),
        }
    return out


def quotas(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in status.get("tenants") or []}


async def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    fleet = LocalFleet(pods=args.pods, rebalance_interval_s=args.rebalance)
    outcomes: list[Outcome] = []
    timeline: list[dict[str, Any]] = []
    print(
        f"starting the local fleet: redis, stand-in model server, {args.pods} sidecars, "
        "prometheus, the operator on the Kubernetes API emulator ...",
        flush=True,
    )
    with fleet.run():
        status = await asyncio.to_thread(fleet.wait_for_quotas)
        print(
            f"operator assigned quotas (generation {status.get('quotaGeneration')}); "
            f"driving load for {args.duration:g}s",
            flush=True,
        )
        load = asyncio.create_task(drive(fleet, args.duration, args.seed, outcomes))
        t = 0.0
        while not load.done():
            await asyncio.sleep(SAMPLE_EVERY_S)
            t += SAMPLE_EVERY_S
            status = await asyncio.to_thread(fleet.status)
            stats = window_stats(outcomes, max(0.0, t - 2 * SAMPLE_EVERY_S), t)
            q = quotas(status)
            saved = savings_by_tenant(await asyncio.to_thread(fleet.sidecar_status))
            timeline.append({"t": t, "stats": stats, "quotas": q, "saved": saved})
            line = "  ".join(
                f"{name}: hit {s['hit_ratio']:.0%} p95 {s['p95_s'] * 1000:.0f}ms "
                f"L1 {q.get(name, {}).get('l1Bytes', 0) // 1024}KiB"
                for name, s in sorted(stats.items())
            )
            print(f"[{t:5.1f}s] {line}", flush=True)
        await load
        status = await asyncio.to_thread(fleet.status)
        sidecars = await asyncio.to_thread(fleet.sidecar_status)
        events = fleet.events()
    return {
        "outcomes": outcomes,
        "timeline": timeline,
        "status": status,
        "sidecars": sidecars,
        "events": events,
    }


#: What a sidecar's /status says each tenant saved (summed over models and pods).
SAVED_FIELDS = ("hits", "prompt_tokens", "completion_tokens", "model_seconds")


def savings_by_tenant(sidecars: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """Per tenant: hits, tokens and model seconds the sidecars' hits saved (their /status)."""
    out: dict[str, dict[str, float]] = {}
    for status in sidecars.values():
        for tenant, models in ((status or {}).get("savings") or {}).items():
            total = out.setdefault(tenant, dict.fromkeys(SAVED_FIELDS, 0.0))
            for saved in models.values():
                for name in SAVED_FIELDS:
                    total[name] += float(saved.get(name, 0))
    return out


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    outcomes: list[Outcome] = result["outcomes"]
    tenants: dict[str, Any] = {}
    q = quotas(result["status"])
    saved = savings_by_tenant(result.get("sidecars") or {})
    for plan in DEFAULT_TENANTS:
        rows = [o for o in outcomes if o.tenant == plan.name]
        if not rows:
            continue
        counts = Counter(o.x_cache for o in rows)
        looked = counts["HIT-L1"] + counts["HIT-L2"] + counts["MISS"]
        tenants[plan.name] = {
            "class": plan.priority_class,
            "requests": len(rows),
            "x_cache": dict(counts),
            "hit_ratio": (counts["HIT-L1"] + counts["HIT-L2"]) / looked if looked else None,
            "p50_ms": percentile([o.latency_s for o in rows], 0.5) * 1000,
            "p95_ms": percentile([o.latency_s for o in rows], 0.95) * 1000,
            "sla_p95_ms": plan.p95_latency_s * 1000,
            "errors": sum(o.status != 200 for o in rows),
            "l1_bytes_per_pod": q.get(plan.name, {}).get("l1Bytes"),
            "share": q.get(plan.name, {}).get("share"),
            "reason": q.get(plan.name, {}).get("reason"),
            "saved": saved.get(plan.name),
        }
    return {
        "tenants": tenants,
        "conditions": result["status"].get("conditions"),
        "sla_attainment": result["status"].get("slaAttainment"),
        "quota_generation": result["status"].get("quotaGeneration"),
        "saved_model_hours": result["status"].get("savedModelHours"),
        "saved_model_seconds": (result["status"].get("savings") or {}).get("modelSeconds"),
        "events": [
            {"reason": e.get("reason"), "type": e.get("type"), "message": e.get("message")}
            for e in result["events"]
        ],
    }


def print_report(summary: dict[str, Any]) -> None:
    print("\nper tenant (what the clients saw, and what the operator allocated):")
    print(
        f"{'tenant':<18}{'class':<12}{'reqs':>6}{'hit':>7}{'p50':>9}{'p95':>9}"
        f"{'SLA p95':>9}{'L1/pod':>10}{'share':>7}  errors"
    )
    for name, t in summary["tenants"].items():
        hit = "-" if t["hit_ratio"] is None else f"{t['hit_ratio']:.0%}"
        l1 = "-" if t["l1_bytes_per_pod"] is None else f"{t['l1_bytes_per_pod'] // 1024}KiB"
        share = "-" if t["share"] is None else f"{t['share']:.2f}"
        print(
            f"{name:<18}{t['class']:<12}{t['requests']:>6}{hit:>7}{t['p50_ms']:>7.1f}ms"
            f"{t['p95_ms']:>7.1f}ms{t['sla_p95_ms']:>7.0f}ms{l1:>10}{share:>7}  {t['errors']}"
        )
    for name, t in summary["tenants"].items():
        if t["reason"]:
            print(f"  {name}: {t['reason']}")
    print("\nwhat cache hits saved the model (the sidecars' /status, all pods):")
    print(f"{'tenant':<18}{'hits':>8}{'prompt tok':>12}{'compl tok':>11}{'model s':>10}")
    for name, t in summary["tenants"].items():
        s = t.get("saved") or dict.fromkeys(SAVED_FIELDS, 0.0)
        print(
            f"{name:<18}{s['hits']:>8.0f}{s['prompt_tokens']:>12.0f}"
            f"{s['completion_tokens']:>11.0f}{s['model_seconds']:>10.1f}"
        )
    if summary.get("saved_model_hours") is not None:
        print(
            f"operator: {summary['saved_model_hours']:g} model-hours "
            f"({summary['saved_model_seconds'] or 0:g} model seconds) saved over its Prometheus "
            "window at its last rebalance (the SAVED column of kubectl get inferencecaches)"
        )
    print(
        f"\nSLA attainment: {summary['sla_attainment']}; quota generation "
        f"{summary['quota_generation']}"
    )
    for c in summary["conditions"] or []:
        message = c.get("message") or ""
        print(f"  condition {c.get('type')}={c.get('status')}: {c.get('reason')} {message}")
    if summary["events"]:
        print("events on the InferenceCache:")
        for e in summary["events"][-8:]:
            print(f"  {e['type']} {e['reason']}: {e['message']}")


def plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib missing: no plot; pip install 'cachefleet[demo]')")
        return False
    timeline = result["timeline"]
    fig, axes = plt.subplots(4, 1, figsize=(9, 11), sharex=True)
    names = sorted({n for row in timeline for n in row["stats"]})
    for name in names:
        ts = [row["t"] for row in timeline if name in row["stats"]]
        axes[0].plot(
            ts,
            [row["stats"][name]["hit_ratio"] for row in timeline if name in row["stats"]],
            label=name,
        )
        axes[1].plot(
            ts,
            [row["stats"][name]["p95_s"] * 1000 for row in timeline if name in row["stats"]],
            label=name,
        )
        axes[2].plot(
            [row["t"] for row in timeline],
            [row["quotas"].get(name, {}).get("l1Bytes", 0) / 1024 for row in timeline],
            label=name,
        )
        axes[3].plot(
            [row["t"] for row in timeline],
            [(row.get("saved") or {}).get(name, {}).get("model_seconds", 0.0) for row in timeline],
            label=name,
        )
    axes[0].set_ylabel("hit ratio (4 s window)")
    axes[1].set_ylabel("client p95 (ms)")
    axes[2].set_ylabel("L1 quota per pod (KiB)")
    axes[3].set_ylabel("model seconds saved (all pods)")
    axes[3].set_xlabel("seconds into the load")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.suptitle("cachefleet demo: three tenants, SLA-weighted quotas")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="cachefleet demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of load (default 40)")
    parser.add_argument("--pods", type=int, default=3, help="sidecar processes (default 3)")
    parser.add_argument("--rebalance", type=int, default=5, help="operator rebalance interval, s")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("demo-out"), help="report directory")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument(
        "--routing",
        choices=("both", "off", "only"),
        default="both",
        help="the routing comparison (cachefleet router vs round-robin on simulated model "
        "servers) after the cache demo, not at all, or alone (default both)",
    )
    parser.add_argument(
        "--routing-conversations",
        type=int,
        default=routing_demo.RoutingLoad().conversations,
        help="conversations in the routing comparison (default %(default)s, 5 turns each)",
    )
    args = parser.parse_args(argv)
    if args.routing_conversations < 1:
        parser.error("--routing-conversations must be >= 1")
    if args.duration <= 0 or args.pods < 1:
        parser.error("--duration must be > 0 and --pods >= 1")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # kopf runs in a thread here: its notice that OS signals are not its to handle is noise.
    logging.getLogger("kopf").setLevel(logging.ERROR)
    errors = 0
    if args.routing != "only":
        errors += _cache_demo(args)
    if args.routing != "off":
        errors += _routing_demo(args)
    return 1 if errors else 0


def _routing_demo(args: argparse.Namespace) -> int:
    """The routing comparison; the number of failed requests."""
    print("\n== routing: cachefleet router vs round-robin", flush=True)
    load = routing_demo.RoutingLoad(conversations=args.routing_conversations, seed=args.seed)
    result = asyncio.run(routing_demo.compare(load))
    routing_demo.print_report(result)
    written = routing_demo.write(result, args.out, plotted=not args.no_plot)
    print("\nwrote " + ", ".join(written))
    failed = sum(int(p["errors"]) for p in result["phases"])
    if failed:
        print(f"routing: {failed} requests failed", file=sys.stderr)
    return failed


def _cache_demo(args: argparse.Namespace) -> int:
    """The cache demo; the number of failed requests."""
    try:
        import uvloop

        result = uvloop.run(run_demo(args))
    except ImportError:  # pragma: no cover
        result = asyncio.run(run_demo(args))
    summary = summarize(result)
    print_report(summary)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(summary, indent=2, default=str))
    written = [str(args.out / "report.json")]
    if not args.no_plot and plot(result, args.out / "demo.png"):
        written.append(str(args.out / "demo.png"))
    print("\nwrote " + ", ".join(written))
    errors = int(sum(t["errors"] for t in summary["tenants"].values()))
    if errors:
        print(f"{errors} requests failed", file=sys.stderr)
    return errors
