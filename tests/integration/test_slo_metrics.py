"""Time to first token and inter-token latency as the sidecar measures them (issue 36).

A stand-in model server whose stream's first event comes after 300 ms and the
next every 20 ms: the tenant's TTFT histogram has its median in the 0.25-0.5 s
bucket, its ITL in the 10-50 ms one (bucket counts from /metrics, not the
test's clock). Hits are not model answers: they leave both histograms alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cachefleet_e2e.fake_upstream import FakeUpstream
from cachefleet_operator.allocation import TenantMetrics
from cachefleet_operator.metrics_source import MetricsUnavailable, PrometheusMetricsSource

from .conftest import RunningSidecar

#: Streamed misses per test (the median is the third's bucket).
N = 5
#: Bound on waiting for Prometheus' first answer with the tenant's histograms, seconds.
FIRST_DATA_TIMEOUT_S = 30.0


def buckets(text: str, name: str, **labels: str) -> dict[str, float]:
    """le -> cumulative count of one histogram series in an exposition."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{name}_bucket" and all(
                sample.labels.get(k) == v for k, v in labels.items()
            ):
                out[sample.labels["le"]] = out.get(sample.labels["le"], 0.0) + sample.value
    return out


def within(hist: dict[str, float], low: str, high: str) -> float:
    """Observations in (low, high]."""
    return hist[high] - hist[low]


async def test_streamed_misses_give_ttft_and_itl_in_their_buckets(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    upstream.latency_s["slow"] = 0.3
    upstream.event_gap_s = 0.02
    for i in range(N):
        resp = await sidecar.chat(f"stream {i}", tenant="slow", body={"stream": True})
        assert resp.headers["x-cache"] == "MISS"
        assert resp.text.endswith("data: [DONE]\n\n")
    # a hit of the same stream: served, and not a model answer
    hit = await sidecar.chat("stream 0", tenant="slow", body={"stream": True})
    assert hit.headers["x-cache"] == "HIT-L1"
    text = (await sidecar.admin.get("/metrics")).text
    ttft = buckets(text, "cachefleet_ttft_seconds", tenant="slow", model="m1")
    itl = buckets(text, "cachefleet_itl_seconds", tenant="slow", model="m1")
    assert ttft["+Inf"] == N  # the hit is not counted
    assert itl["+Inf"] == N
    # the median (3rd of 5) in (0.25, 0.5]: at most 2 below, at least 3 up to 0.5
    assert ttft["0.25"] <= N // 2 < ttft["0.5"]
    assert within(ttft, "0.25", "0.5") > N // 2
    # three token events 20 ms apart: a mean gap in (10 ms, 50 ms]
    assert itl["0.01"] <= N // 2 < itl["0.05"]
    assert within(itl, "0.01", "0.05") > N // 2


async def test_whole_answers_give_ttft_only(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    upstream.latency_s["plain"] = 0.3
    for i in range(3):
        assert (await sidecar.chat(f"plain {i}", tenant="plain")).headers["x-cache"] == "MISS"
    # an error carries no token: not timed
    upstream.fail_next = 1
    assert (await sidecar.chat("fails", tenant="plain")).status_code == 500
    text = (await sidecar.admin.get("/metrics")).text
    ttft = buckets(text, "cachefleet_ttft_seconds", tenant="plain", model="m1")
    assert ttft["+Inf"] == 3
    assert within(ttft, "0.25", "0.5") == 3
    assert buckets(text, "cachefleet_itl_seconds", tenant="plain") == {}


async def test_a_stream_broken_after_its_first_token_keeps_its_ttft(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    upstream.break_stream_next = 1  # two events, then the connection closes
    with pytest.raises(httpx.HTTPError):
        await sidecar.chat("broken", tenant="acme", body={"stream": True})
    text = (await sidecar.admin.get("/metrics")).text
    assert buckets(text, "cachefleet_ttft_seconds", tenant="acme", model="m1")["+Inf"] == 1
    assert buckets(text, "cachefleet_itl_seconds", tenant="acme") == {}


async def test_bypassed_answers_are_timed_under_their_model(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    headers = {"Cache-Control": "no-cache, no-store"}
    resp = await sidecar.chat("bypass", tenant="acme", headers=headers, body={"stream": True})
    assert resp.headers["x-cache"] == "BYPASS"
    text = (await sidecar.admin.get("/metrics")).text
    assert buckets(text, "cachefleet_ttft_seconds", tenant="acme", model="m1")["+Inf"] == 1
    assert buckets(text, "cachefleet_itl_seconds", tenant="acme", model="m1")["+Inf"] == 1


@pytest.mark.prometheus
@pytest.mark.slow
async def test_the_operator_reads_the_tenants_ttft_and_itl_through_prometheus(
    sidecar: RunningSidecar, upstream: FakeUpstream, prometheus_factory: Any
) -> None:
    """Sidecar -> Prometheus -> the operator's metrics source: the p95 it reads is in the
    bucket the stand-in's timing puts it in."""
    upstream.latency_s["slow"] = 0.3
    upstream.event_gap_s = 0.02
    target = sidecar.admin_url.removeprefix("http://")
    prom = prometheus_factory({"sidecars": [target]}, scrape_interval_s=0.5)
    source = PrometheusMetricsSource(prom.url, timeout_s=2.0)
    deadline = time.monotonic() + FIRST_DATA_TIMEOUT_S
    table: Mapping[str, TenantMetrics] = {}
    n = 0
    while time.monotonic() < deadline:
        for _ in range(3):  # open loop: new misses whatever Prometheus has seen
            n += 1
            resp = await sidecar.chat(f"p {n}", tenant="slow", body={"stream": True})
            assert resp.headers["x-cache"] == "MISS"
        try:
            table = await source.fetch("test/cache", "30s")
        except MetricsUnavailable:
            table = {}
        if "slow" in table and table["slow"].itl_p95_s is not None:
            break
        await asyncio.sleep(0.5)
    assert "slow" in table, "no per-tenant data from Prometheus in time"
    ttft, itl = table["slow"].ttft_p95_s, table["slow"].itl_p95_s
    assert ttft is not None
    assert 0.25 < ttft <= 0.5
    assert itl is not None
    assert 0.01 < itl <= 0.05
