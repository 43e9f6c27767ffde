"""Fleet-wide curves end to end: sidecars' samples reach the stream, the operator's curve
sees the reuse the fleet has, and a tenant the fleet serves is not called out of reach.

Three real sidecars on one Redis serve a key stream round-robin (each pod sees
mostly first accesses; L2 answers them for the fleet). The Reconciler, against
the same Redis, reads the stream into its fleet curves; its Prometheus answers
are set by the test from the pods' own histograms (what Prometheus would sum).
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import pytest

from cachefleet_common import resp
from cachefleet_common.contract import fleet
from cachefleet_common.contract.clients import redis_from_url, resp_client
from cachefleet_common.contract.names import fleet_samples_key
from cachefleet_common.sampling import ReuseHistogram
from cachefleet_e2e.fake_metrics import FakeMetrics
from cachefleet_e2e.services import RedisServer
from cachefleet_operator.allocation import TenantMetrics
from cachefleet_operator.curves import HitCurve, LatencyDist
from cachefleet_operator.fleet import FleetCurves
from cachefleet_operator.metrics import OperatorMetrics
from cachefleet_operator.publisher import RedisControlPlane
from cachefleet_operator.reach import REACH_REBALANCES, ReachWarnings
from cachefleet_operator.reconcile import Reconciler
from cachefleet_sidecar.adapt.fleetsample import FleetShipper
from cachefleet_sidecar.adapt.mrc import MissRatioCurves

from .conftest import RunningSidecar, SidecarFactory

CACHE = "test/cache"
WINDOW = "10m"
WINDOW_S = 600.0
L1 = 8 * 2**20
L2 = 64 * 2**20


async def stream_samples(url: str, cache: str = CACHE) -> list[fleet.FleetSample]:
    payloads, _ = await RedisControlPlane(url).fleet_batches(cache, None)
    return [s for raw in payloads for s in fleet.decode_fleet_batch(raw)[1]]


async def wait_for_samples(url: str, count: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len(await stream_samples(url)) >= count:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"fewer than {count} samples in the stream after {timeout_s}s")


def forward_all(pods: list[RunningSidecar]) -> None:
    """Forward every key (rate 1, as the tracker below expects): a small trace, measured exactly."""
    for pod in pods:
        assert pod.sidecar.mrc is not None
        pod.sidecar.mrc.forward_fleet(1.0, fleet.FLEET_BATCH_MAX)


@pytest.mark.redis
async def test_samples_reach_the_stream_and_the_operator_reads_only_new_ones(
    sidecar_factory: SidecarFactory, any_redis: str
) -> None:
    pod = await sidecar_factory(redis_url=any_redis)
    forward_all([pod])
    for n in range(5):
        assert (await pod.chat(f"question {n}", tenant="search")).status_code == 200
    await wait_for_samples(any_redis, 5)
    samples = await stream_samples(any_redis)
    assert [s.tenant for s in samples] == ["search"] * 5
    assert all(s.size > 0 for s in samples)
    plane = RedisControlPlane(any_redis)
    payloads, last = await plane.fleet_batches(CACHE, None)
    assert payloads
    assert last is not None
    assert await plane.fleet_batches(CACHE, last) == ([], last)  # nothing new since
    assert (await pod.chat("question 0", tenant="search")).status_code == 200
    await wait_for_samples(any_redis, 6)
    newer, _ = await plane.fleet_batches(CACHE, last)
    assert [len(fleet.decode_fleet_batch(p)[1]) for p in newer] == [1]
    metrics = (await pod.admin.get("/metrics")).text
    assert 'cachefleet_fleet_samples_total{cache="test/cache",outcome="sent"} 6.0' in metrics
    assert 'cachefleet_fleet_samples_total{cache="test/cache",outcome="dropped"} 0.0' in metrics


async def test_a_redis_fault_drops_the_batch_and_counts_it() -> None:
    curves = MissRatioCurves()
    dead = resp_client("redis://127.0.0.1:1", connect_timeout_s=0.2)
    shipper = FleetShipper(curves, CACHE, "pod-a", dead, rate=1.0, batch_max=2)
    for digest in (1, 2, 3):
        curves.access("search", digest, 100)
    assert await shipper.flush() == 0
    assert (shipper.sent, shipper.failed, curves.fleet_dropped) == (0, 2, 1)
    assert shipper.dropped == 3
    assert await shipper.flush() == 0  # nothing left to send: the batch is gone, not queued
    await shipper.stop()
    assert curves.fleet_threshold == 0  # stopped: nothing more is kept for it
    with pytest.raises(resp.RespError):
        await dead.execute("PING")


@pytest.mark.redis
async def test_a_sidecar_whose_redis_dies_serves_on_and_counts_the_samples_lost(
    sidecar_factory: SidecarFactory,
) -> None:
    with RedisServer() as redis:
        pod = await sidecar_factory(redis_url=redis.url)
        forward_all([pod])
        assert (await pod.chat("before", tenant="search")).status_code == 200
        await wait_for_samples(redis.url, 1)
        redis.kill()
        for n in range(5):
            assert (await pod.chat(f"after {n}", tenant="search")).status_code == 200
        dropped = 'cachefleet_fleet_samples_total{cache="test/cache",outcome="dropped"} 5.0'
        deadline = time.monotonic() + 20.0
        while dropped not in (text := (await pod.admin.get("/metrics")).text):
            assert time.monotonic() < deadline, text
            await asyncio.sleep(0.2)
        assert 'cachefleet_fleet_samples_total{cache="test/cache",outcome="sent"} 1.0' in text


def spec(redis_url: str) -> dict[str, Any]:
    return {
        "selector": {"matchLabels": {"cachefleet.io/cache": "cache"}},
        "model": {"name": "llama", "version": "v1"},
        "capacity": {"l1BytesPerPod": L1, "l2Bytes": L2},
        "fleetSampleRate": 1,  # every key: a small trace, measured exactly
        "redis": {"url": redis_url},
        "prometheus": {"url": "http://127.0.0.1:9", "window": "1m", "curveWindow": WINDOW},
        "tenants": [
            {"name": "search", "minShare": 0.1, "sla": {"minHitRatio": 0.5}},
            {"name": "chat", "minShare": 0.1},
        ],
    }


def pods_curve(pods: list[RunningSidecar], tenant: str) -> HitCurve:
    """The per-pod curve Prometheus gives: the pods' histograms summed, per second of window."""
    hists = []
    for pod in pods:
        assert pod.sidecar.mrc is not None
        hists += [h for t, h in pod.sidecar.mrc.snapshots() if t == tenant]
    summed = [sum(c) / WINDOW_S for c in zip(*(h.counts for h in hists), strict=True)]
    made = HitCurve.from_histogram(ReuseHistogram(tuple(summed), 0.0, 1.0, 0).cumulative())
    assert made is not None
    return made


async def reach_conditions(
    reconciler: Reconciler, redis_url: str, data: dict[str, TenantMetrics]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """CacheCannotMeetSLA after each of REACH_REBALANCES + 1 reconciles, and the last status."""
    reconciler.metrics_source = FakeMetrics(data).factory
    status: dict[str, Any] = {}
    found = []
    for _ in range(REACH_REBALANCES + 1):
        outcome = await reconciler.reconcile("test", "cache", 1, spec(redis_url), status)
        assert outcome.result == "ok", outcome.failure_message
        status = {**status, **outcome.status}
        found += [c for c in status["conditions"] if c["type"] == "CacheCannotMeetSLA"]
    return found, status


@pytest.mark.redis
async def test_a_tenant_the_fleet_serves_is_within_reach_and_gets_the_l2(
    sidecar_factory: SidecarFactory, redis_url: str
) -> None:
    """The demo's case: search's keys go round-robin over 3 pods, so no pod ever sees one
    twice (its curve tops out at 0) while the fleet reuses 2/3; the SLA asks 1/2. No
    observed hit ratio helps (none is given). chat reuses its keys on one pod."""
    pods = [
        await sidecar_factory(redis_url=redis_url, pod=f"pod-{p}", fleet_sample_rate=1.0)
        for p in "abc"
    ]
    i = 0
    for _ in range(3):
        for n in range(40):  # 40 keys: each comes back on another pod
            assert (await pods[i % 3].chat(f"search {n}", tenant="search")).status_code == 200
            i += 1
    for n in range(40):  # chat: twice in a row on the same pod
        for _ in range(2):
            assert (await pods[n % 3].chat(f"chat {n}", tenant="chat")).status_code == 200
    await wait_for_samples(redis_url, 200)

    assert pods_curve(pods, "search").max_hit_ratio == 0.0
    assert pods_curve(pods, "chat").max_hit_ratio == pytest.approx(0.5)
    slow = LatencyDist.from_buckets([(0.999, 0.0), (1.0, 100.0), (math.inf, 100.0)])
    data = {
        name: TenantMetrics(rps=1.0, curve=pods_curve(pods, name), miss_latency=slow)
        for name in ("search", "chat")
    }
    reach = ReachWarnings(min_requests=100)  # 120 requests of search in the window

    fleet = FleetCurves()  # at the spec's rate (and the pods': the sidecars' flag)
    with_fleet = Reconciler(metrics=OperatorMetrics(), reach=reach, fleet=fleet)
    found, status = await reach_conditions(with_fleet, redis_url, data)
    assert [(c["status"], c["reason"]) for c in found] == [("False", "WithinReach")] * len(found)
    assert all(c["message"] == "cache can meet every observed SLA" for c in found)
    assert fleet.curves(CACHE, WINDOW_S)["search"].max_hit_ratio == pytest.approx(2 / 3)
    assert fleet.curves(CACHE, WINDOW_S)["chat"].max_hit_ratio == pytest.approx(0.5)
    by_name = {t["name"]: t for t in status["tenants"]}
    # L1 by one pod's curves: search, with no reuse on any pod, has its floor ...
    assert by_name["search"]["share"] == pytest.approx(0.1)
    # ... L2 by the fleet's: search's reuse counts there as much as chat's
    assert by_name["search"]["l2Bytes"] > 3 * by_name["search"]["share"] * L2
    assert "predicted hit ratio 0.00; fleet-wide with its L2 0.67" in by_name["search"]["reason"]

    # the same without the stream: one pod's view, so search is named on the 3rd rebalance
    admin = redis_from_url(redis_url)
    await admin.delete(fleet_samples_key(CACHE))
    await admin.aclose()
    without = Reconciler(metrics=OperatorMetrics(), reach=ReachWarnings(min_requests=100))
    found, status = await reach_conditions(without, redis_url, data)
    assert [c["status"] for c in found] == ["False"] * (REACH_REBALANCES - 1) + ["True"] * 2
    assert found[-1]["message"].startswith("search: cache cannot meet its SLA: 100% of its")
    by_name = {t["name"]: t for t in status["tenants"]}
    assert by_name["search"]["l2Bytes"] == math.floor(by_name["search"]["share"] * L2)
