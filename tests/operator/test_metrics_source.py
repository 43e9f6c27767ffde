"""PrometheusMetricsSource against a real Prometheus scraping a stand-in sidecar exporter."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from cachefleet_common.contract.promql import (
    METRIC_POLICY_SWITCHES,
    METRIC_REQUEST_DURATION,
    METRIC_REQUESTS,
)
from cachefleet_operator.metrics_source import (
    MetricsUnavailable,
    PolicySwitches,
    PrometheusMetricsSource,
)

CACHE = "default/chat"
#: Prometheus needs target discovery plus two scrapes before rate() answers.
FIRST_DATA_TIMEOUT_S = 25.0


async def test_unreachable_prometheus_is_metrics_unavailable() -> None:
    source = PrometheusMetricsSource("http://127.0.0.1:1", timeout_s=1.0)
    with pytest.raises(MetricsUnavailable) as info:
        await source.fetch(CACHE, "1m")
    assert info.value.reason == "PrometheusUnavailable"
    # what happened, not "timed out" (client retries used to outlast the timeout)
    assert "connection refused" in str(info.value)


async def test_a_silent_prometheus_is_reported_as_timed_out() -> None:
    """A listener that never answers: the one case that is a timeout."""

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(30)
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        source = PrometheusMetricsSource(f"http://127.0.0.1:{port}", timeout_s=0.5)
        with pytest.raises(MetricsUnavailable) as info:
            await source.fetch(CACHE, "1m")
        assert "timed out" in str(info.value)
    finally:
        server.close()


@pytest.fixture
def exporter() -> Iterator[tuple[str, Histogram, Counter]]:
    """The sidecar's metric names, with numbers the test controls."""
    registry = CollectorRegistry()
    latency = Histogram(
        METRIC_REQUEST_DURATION.removesuffix("_seconds") + "_seconds",
        "request latency",
        ["cache", "tenant", "tier"],
        buckets=(0.05, 0.1, 0.2, 0.4, 0.8, 1.6),
        registry=registry,
    )
    requests = Counter(
        METRIC_REQUESTS.removesuffix("_total"),
        "requests",
        ["cache", "tenant", "tier", "result"],
        registry=registry,
    )
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield f"127.0.0.1:{server.server_port}", latency, requests
    finally:
        server.shutdown()
        thread.join(5)


@pytest.mark.prometheus
@pytest.mark.slow
async def test_per_tenant_p95_hit_ratio_and_rate(
    exporter: tuple[str, Histogram, Counter], prometheus_factory: object
) -> None:
    target, latency, requests = exporter
    prom = prometheus_factory({"sidecars": [target]}, scrape_interval_s=0.5)  # type: ignore[operator]
    source = PrometheusMetricsSource(prom.url, timeout_s=2.0)
    # a tenant without hits still exports a zero hit series (promql_hit_ratio
    # divides per-tenant hit rate by hit+miss rate; a missing numerator means no ratio)
    requests.labels(CACHE, "slow", "l1", "hit")
    deadline = time.monotonic() + FIRST_DATA_TIMEOUT_S
    result = {}
    while time.monotonic() < deadline:
        for _ in range(20):
            latency.labels(CACHE, "fast", "l1").observe(0.03)
            latency.labels(CACHE, "slow", "upstream").observe(0.7)
            requests.labels(CACHE, "fast", "l1", "hit").inc(3)
            requests.labels(CACHE, "fast", "upstream", "miss").inc(1)
            requests.labels(CACHE, "slow", "upstream", "miss").inc(1)
        try:
            result = await source.fetch(CACHE, "30s")
        except MetricsUnavailable:
            result = {}
        if {"fast", "slow"} <= set(result) and result["slow"].p95_s is not None:
            break
        await asyncio.sleep(0.5)
    assert {"fast", "slow"} <= set(result), "no per-tenant data from Prometheus in time"
    assert result["fast"].p95_s is not None
    assert result["fast"].p95_s <= 0.05
    assert result["slow"].p95_s is not None
    assert 0.4 < result["slow"].p95_s <= 0.8
    assert result["fast"].hit_ratio == pytest.approx(0.75, abs=0.05)
    assert result["slow"].hit_ratio == pytest.approx(0.0, abs=1e-9)
    assert result["fast"].rps is not None
    assert result["fast"].rps > result["slow"].rps  # type: ignore[operator]


def _prom_count(url: str, promql: str) -> float:
    """``count(...)`` straight from Prometheus' HTTP API (0 when empty or not up yet)."""
    query = urllib.parse.urlencode({"query": f"count({promql})"})
    try:
        with urllib.request.urlopen(f"{url}/api/v1/query?{query}", timeout=2) as answer:
            body = json.load(answer)
    except OSError:
        return 0.0
    result = body.get("data", {}).get("result", [])
    return float(result[0]["value"][1]) if result else 0.0


@pytest.mark.prometheus
@pytest.mark.slow
async def test_policy_switches_count_pods_over_tiled_spans(prometheus_factory: object) -> None:
    """Two sidecars export the switch counter at 0; both switch, one rolls back."""
    pods = []
    try:
        for _ in range(2):
            registry = CollectorRegistry()
            counter = Counter(
                METRIC_POLICY_SWITCHES.removesuffix("_total"),
                "policy switches",
                ["cache", "tenant", "from_policy", "to_policy"],
                registry=registry,
            )
            counter.labels(CACHE, "t", "lirs", "sits")  # at 0, as the sidecar exports them
            counter.labels(CACHE, "t", "sits", "lirs")
            server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
            pods.append((counter, server, thread))
        targets = [f"127.0.0.1:{server.server_port}" for _, server, _ in pods]
        prom = prometheus_factory({"sidecars": targets}, scrape_interval_s=0.5)  # type: ignore[operator]
        source = PrometheusMetricsSource(prom.url, timeout_s=2.0)
        selector = f'{METRIC_POLICY_SWITCHES}{{cache="{CACHE}"}}'
        deadline = time.monotonic() + FIRST_DATA_TIMEOUT_S
        while time.monotonic() < deadline:
            if _prom_count(prom.url, selector) >= 4:
                break
            await asyncio.sleep(0.5)
        assert _prom_count(prom.url, selector) == 4, "the zero series were not scraped in time"
        await asyncio.sleep(1.2)  # a few scrapes at 0 on both sides of `start`
        start = time.time()
        await asyncio.sleep(1.0)
        pods[0][0].labels(CACHE, "t", "lirs", "sits").inc()
        pods[1][0].labels(CACHE, "t", "lirs", "sits").inc()
        pods[0][0].labels(CACHE, "t", "sits", "lirs").inc()
        expected = [
            PolicySwitches("t", "lirs", "sits", 2),
            PolicySwitches("t", "sits", "lirs", 1),
        ]
        found: list[PolicySwitches] = []
        end = start
        while found != expected and time.monotonic() < deadline + 10:
            await asyncio.sleep(0.5)
            end = time.time()
            found = await source.policy_switches(CACHE, end - start, end)
        assert found == expected
        # The span before `start` saw none of it, and so does the span after `end`.
        assert await source.policy_switches(CACHE, 1.0, start) == []
        await asyncio.sleep(1.5)  # more scrapes, no more switches
        later = time.time()
        assert await source.policy_switches(CACHE, later - end, later) == []
    finally:
        for _, server, thread in pods:
            server.shutdown()
            thread.join(5)


@pytest.mark.prometheus
@pytest.mark.slow
async def test_savings_from_a_sidecars_own_metrics(prometheus_factory: object) -> None:
    """The sidecar's real savings families, scraped; the operator's queries add them up."""
    from cachefleet_sidecar.observe.metrics import SidecarMetrics

    metrics = SidecarMetrics(CACHE)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=metrics.registry)
    try:
        prom = prometheus_factory(  # type: ignore[operator]
            {"sidecars": [f"127.0.0.1:{server.server_port}"]}, scrape_interval_s=0.5
        )
        source = PrometheusMetricsSource(prom.url, timeout_s=2.0)
        deadline = time.monotonic() + FIRST_DATA_TIMEOUT_S
        found: dict[str, dict[str, float]] = {}
        while time.monotonic() < deadline:
            for model in ("m1", "m2"):
                metrics.tenant("acme").saving(model).add(100, 20, 0.5, 0.01)
            metrics.tenant("free").saving("m1").add(10, 0, 0.1, None)
            found = await source.savings(CACHE, "30s")
            if {"acme", "free"} <= set(found) and found["acme"].get("model_seconds", 0) > 0:
                break
            await asyncio.sleep(0.5)
        assert {"acme", "free"} <= set(found), "no savings from Prometheus in time"
        acme, free = found["acme"], found["free"]
        # both models added up: per hit 2 x (100 prompt, 20 completion, 0.5 s, 0.01); a
        # scrape may fall between two adds (families are read one after another): approx
        assert acme["prompt_tokens"] == pytest.approx(5 * acme["completion_tokens"], rel=0.05)
        assert acme["model_seconds"] == pytest.approx(acme["prompt_tokens"] / 200, rel=0.05)
        assert acme["cost"] == pytest.approx(acme["model_seconds"] / 50, rel=0.05)
        assert "cost" not in free  # unpriced hits export no cost series
        assert free["completion_tokens"] == 0
    finally:
        server.shutdown()
        thread.join(5)
