"""Discovery: static endpoints read through vLLM-style /metrics, and the pure Kubernetes parts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from cachefleet_router.discovery import (
    EndpointPool,
    KubeDiscovery,
    MetricsScraper,
    Reading,
    matches,
    pod_members,
    pool_target,
)
from cachefleet_router.metrics import RouterMetrics

from .conftest import MetricsServer

MakeServer = Callable[..., Awaitable[MetricsServer]]


async def test_endpoints_are_ready_once_read_and_out_after_two_failed_reads(
    metrics_servers: MakeServer,
) -> None:
    one, two = await metrics_servers(waiting=3, running=2), await metrics_servers()
    metrics = RouterMetrics()
    pool = EndpointPool(metrics)
    pool.set_members({one.address: one.address, two.address: two.address})
    assert pool.synced
    assert pool.ready() == []
    scraper = MetricsScraper(pool, 0.5)
    try:
        await scraper.scrape_once()
        assert {e.address for e in pool.ready()} == {one.address, two.address}
        read = pool.get(one.address)
        assert read is not None
        assert read.metrics is not None
        assert (read.metrics.waiting, read.metrics.running) == (3.0, 2.0)
        assert read.metrics.kv_capacity_tokens == 16_000

        port = two.port
        await two.stop()  # the model server goes away
        await scraper.scrape_once()
        assert {e.address for e in pool.ready()} == {one.address, two.address}  # one miss
        await scraper.scrape_once()
        assert [e.address for e in pool.ready()] == [one.address]  # two periods: out
        assert (
            metrics.registry.get_sample_value(
                "cachefleet_router_scrape_failures_total", {"endpoint": two.address}
            )
            == 2.0
        )
        assert metrics.registry.get_sample_value("cachefleet_router_endpoints_ready") == 1.0
        assert pool.get(two.address) is not None  # still a member: it may come back

        await two.start(port)  # back on the same address
        await scraper.scrape_once()
        assert {e.address for e in pool.ready()} == {one.address, two.address}
    finally:
        await scraper.aclose()


async def test_an_error_answer_is_a_failure_and_other_servers_are_routed_by_load(
    metrics_servers: MakeServer,
) -> None:
    other = await metrics_servers()  # a server with metrics, none of them known (TGI, llama.cpp)
    other.body = "# just some other exporter\ntgi_queue_size 3\nprocess_cpu_seconds_total 1.0\n"
    broken = await metrics_servers()
    broken.status = 500
    html = await metrics_servers()  # a proxy's page, even with 200, says nothing about load
    html.body = "<html>upstream connect error</html>"
    html.content_type = "text/html"
    pool = EndpointPool()
    pool.set_members({other.address: "other", broken.address: "broken", html.address: "html"})
    scraper = MetricsScraper(pool, 0.5)
    try:
        for _ in range(3):
            await scraper.scrape_once()
        assert [e.name for e in pool.ready()] == ["other"]
        read = pool.get(other.address)
        assert read is not None
        assert read.metrics is None  # ready, by load alone
        broken.status = 404  # no /metrics at all: ready, by load
        html.body, html.content_type = None, "text/plain"  # now it answers like vLLM
        await scraper.scrape_once()
        assert sorted(e.name for e in pool.ready()) == ["broken", "html", "other"]
        by_name = {e.name: e for e in pool.ready()}
        assert by_name["broken"].metrics is None
        assert by_name["html"].metrics is not None
    finally:
        await scraper.aclose()


def test_why_an_endpoint_is_not_ready_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    pool = EndpointPool()
    pool.set_members({"10.0.0.1:8000": "a"})
    caplog.set_level(logging.INFO, logger="cachefleet_router.discovery")
    for _ in range(5):
        pool.record_reading("10.0.0.1:8000", Reading(error="HTTP 500"))
    said = [r.getMessage() for r in caplog.records if "not ready" in r.getMessage()]
    assert said == ["endpoint 10.0.0.1:8000 not ready: reading its /metrics failed: HTTP 500"]
    assert [r.levelno for r in caplog.records if "not ready" in r.getMessage()] == [logging.INFO]
    pool.record_reading("10.0.0.1:8000", Reading(missing=True))
    pool.record_reading("10.0.0.1:8000", Reading(missing=True))
    by_load = [r.getMessage() for r in caplog.records if "by load" in r.getMessage()]
    assert len(by_load) == 1
    assert [e.name for e in pool.ready()] == ["a"]


async def test_members_leave_at_once_and_their_series_go() -> None:
    metrics = RouterMetrics()
    pool = EndpointPool(metrics, require_metrics=False)
    pool.set_members({"10.0.0.1:8000": "pod-a", "10.0.0.2:8000": "pod-b"})
    assert len(pool.ready()) == 2  # without scraping, members are ready on arrival
    metrics.decisions.labels("10.0.0.2:8000", "least-loaded").inc()
    pool.set_members({"10.0.0.1:8000": "pod-a"})
    assert [e.name for e in pool.ready()] == ["pod-a"]
    assert (
        metrics.registry.get_sample_value(
            "cachefleet_router_decisions_total",
            {"endpoint": "10.0.0.2:8000", "reason": "least-loaded"},
        )
        is None
    )


def pod(
    name: str,
    ip: str | None = "10.1.0.1",
    *,
    labels: dict[str, str] | None = None,
    phase: str = "Running",
    ready: str = "True",
    deleting: bool = False,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {"app": "vllm"} if labels is None else labels}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    status: dict[str, Any] = {"phase": phase, "conditions": [{"type": "Ready", "status": ready}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


def test_pod_members_take_only_ready_matching_pods_one_address_per_port() -> None:
    pods = [
        pod("a", "10.1.0.1"),
        pod("b", "10.1.0.2", ready="False"),
        pod("c", "10.1.0.3", phase="Pending"),
        pod("d", None),
        pod("e", "10.1.0.5", deleting=True),
        pod("f", "10.1.0.6", labels={"app": "other"}),
        pod("g", "fd00::7"),
    ]
    members = pod_members(pods, {"app": "vllm"}, (8000, 8001))
    assert members == {
        "10.1.0.1:8000": "a",
        "10.1.0.1:8001": "a",
        "[fd00::7]:8000": "g",
        "[fd00::7]:8001": "g",
    }
    assert not matches({"app": "vllm"}, {})  # an empty selector selects nothing


def test_pool_target_reads_selector_and_ports_and_names_bad_fields() -> None:
    good = {
        "spec": {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": 8000}]}
    }
    assert pool_target(good) == ({"app": "vllm"}, (8000,))
    bad = [
        ({}, "spec"),
        ({"spec": {"targetPorts": [{"number": 8000}]}}, "spec.selector.matchLabels"),
        ({"spec": {"selector": {"matchLabels": {"a": "b"}}}}, "spec.targetPorts"),
        (
            {"spec": {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 0}]}},
            "spec.targetPorts[0].number",
        ),
    ]
    for doc, field in bad:
        with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
            pool_target(doc)


async def test_watch_resumes_from_its_version_and_lists_again_when_told_it_is_too_old() -> None:
    """A scripted API server (httpx transport): list, a 410 ERROR event, list again, resume."""

    def listing(version: str, *pods: dict[str, Any]) -> httpx.Response:
        return httpx.Response(200, json={"metadata": {"resourceVersion": version}, "items": pods})

    def events(*items: dict[str, Any]) -> httpx.Response:
        return httpx.Response(200, content="".join(json.dumps(e) + "\n" for e in items).encode())

    gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old"}}
    modified_b = pod("b", "10.1.0.2")
    modified_b["metadata"]["resourceVersion"] = "12"
    script = [
        listing("5", pod("a", "10.1.0.1")),
        events(gone),
        listing("9", pod("b", "10.1.0.2", ready=False)),
        events({"type": "MODIFIED", "object": modified_b}),
    ]
    seen: list[httpx.Request] = []
    done = asyncio.Event()

    async def api(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if script:
            return script.pop(0)
        done.set()
        return httpx.Response(500, json={"message": "script over"})

    pool = EndpointPool(require_metrics=False)
    async with httpx.AsyncClient(
        transport=httpx.MockTransport(api), base_url="http://api.test"
    ) as client:
        discovery = KubeDiscovery(client, pool, "ml", selector={"app": "vllm"}, target_ports=(80,))
        task = asyncio.ensure_future(discovery.run())
        try:
            await asyncio.wait_for(done.wait(), 10.0)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    assert {e.address: e.name for e in pool.endpoints()} == {"10.1.0.2:80": "b"}
    assert discovery.lists == 2
    watches = [r.url.params for r in seen if r.url.params.get("watch") == "true"]
    assert [w.get("resourceVersion") for w in watches] == ["5", "9"]
    assert all(w.get("labelSelector") == "app=vllm" for w in watches)
    assert seen[0].url.path == "/api/v1/namespaces/ml/pods"
