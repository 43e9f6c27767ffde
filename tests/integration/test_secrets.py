"""Secrets stay secret: upstream credentials, Redis passwords, the admin port's /status."""

from __future__ import annotations

import base64
import logging

import pytest

from cachefleet_common.contract.clients import redis_from_url
from cachefleet_common.contract.urls import parse_redis_url, redact_url
from cachefleet_e2e.fake_upstream import FakeUpstream
from cachefleet_sidecar.admin import public_status
from cachefleet_sidecar.config import parse_args
from cachefleet_sidecar.http.server import Request

from .conftest import SidecarFactory
from .test_tenants import _Sink

PASSWORD = "s3cr%40t-upstream"  # URL-quoted: the password is "s3cr@t-upstream"


async def test_upstream_credentials_become_basic_auth_and_are_never_shown(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    url = upstream.url.replace("http://", f"http://svc:{PASSWORD}@")
    sc = await sidecar_factory(upstream=url)
    resp = await sc.chat("hi", headers={"Authorization": "Bearer client-token"})
    assert resp.status_code == 200
    seen = upstream.seen_headers[-1]
    assert seen["host"] == upstream.url.removeprefix("http://")
    assert seen["authorization"] == "Basic " + base64.b64encode(b"svc:s3cr@t-upstream").decode()
    # Passthrough paths carry the sidecar's credentials too, not the client's.
    await sc.client.get(
        "/v1/models", headers={"Authorization": "Bearer client-token", "X-Tenant-ID": "acme"}
    )
    assert upstream.seen_headers[-1]["authorization"].startswith("Basic ")

    status = (await sc.admin.get("/status")).text
    assert "s3cr" not in status
    assert "svc:***@" in status
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "s3cr" not in logged


def test_redacted_urls() -> None:
    assert redact_url("redis://user:pw@h:1/0") == "redis://user:***@h:1/0"
    assert redact_url("rediss://:pw@h:1") == "rediss://:***@h:1"
    assert redact_url("http://token@h") == "http://***@h"
    assert redact_url("redis+cluster://u:p@a:1,b:2") == "redis+cluster://u:***@a:1,b:2"
    assert redact_url("http://h:8000/v1") == "http://h:8000/v1"
    with pytest.raises(ValueError) as info:
        parse_redis_url("memcached://u:hunter2@h")
    assert "hunter2" not in str(info.value)


def test_rediss_ca_file_reaches_the_client() -> None:
    target = parse_redis_url("rediss://cf-sidecar:pw@redis:6380/0?ssl_ca_certs=/ca.pem")
    assert (target.tls, target.username, target.password, target.ca_file) == (
        True,
        "cf-sidecar",
        "pw",
        "/ca.pem",
    )
    client = redis_from_url("rediss://redis:6380/0?ssl_ca_certs=/ca.pem")
    kwargs = client.connection_pool.connection_kwargs  # type: ignore[union-attr]
    assert kwargs["ssl_ca_certs"] == "/ca.pem"


def test_admin_port_binds_loopback_by_default() -> None:
    assert parse_args([]).admin_listen == ("127.0.0.1", 8081)


async def test_status_names_tenants_only_to_loopback_peers(sidecar_factory: SidecarFactory) -> None:
    sc = await sidecar_factory()
    await sc.chat("hi", tenant="acme")
    full = (await sc.admin.get("/status")).json()  # the test client is on loopback
    assert "acme" in full["tenants"]
    for peer in ("10.1.2.3", "::ffff:10.1.2.3", None):
        sink = _Sink()
        request = Request(b"GET", b"/status", [], b"", True, 0.0, peer)
        await sc.sidecar.admin.handle(request, sink)  # type: ignore[arg-type]
        assert b"acme" not in sink.data
        assert b'"tenant_count": 1' in sink.data
    assert public_status(full)["redis"] == full["redis"]


async def test_prometheus_credentials_never_reach_conditions() -> None:
    from cachefleet_operator.metrics_source import MetricsUnavailable, PrometheusMetricsSource

    # Nothing listens on port 9 of loopback: the query fails at once.
    source = PrometheusMetricsSource("http://ops:prom-s3cret@127.0.0.1:9", timeout_s=2.0)
    with pytest.raises(MetricsUnavailable) as info:
        await source.fetch("ns/chat", "5m")
    assert "prom-s3cret" not in str(info.value)
    assert "ops:***@127.0.0.1:9" in str(info.value)
