"""The local service launchers the tests and ``cachefleet demo`` stand on."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable

import pytest

from cachefleet_e2e.services import (
    PrometheusServer,
    RedisCluster,
    RedisServer,
    ServiceBinaryMissing,
    redis_command,
)

PrometheusFactory = Callable[..., PrometheusServer]


@pytest.mark.redis
def test_redis_restart_keeps_the_port_and_pause_hangs_clients() -> None:
    with RedisServer() as server:
        port, workdir = server.port, server.workdir
        assert redis_command(port, "SET", "k", "v").startswith(b"+OK")
        server.kill()
        assert not server.running
        with pytest.raises(ConnectionRefusedError):
            redis_command(port, "PING")
        server.restart()
        assert server.port == port
        assert redis_command(port, "GET", "k") == b"$-1\r\n"  # a restart loses data

        server.pause()
        with pytest.raises(TimeoutError):
            redis_command(port, "PING", timeout_s=0.2)
        server.resume()
        assert redis_command(port, "PING").startswith(b"+PONG")
    assert not workdir.exists()
    assert not server.running


@pytest.mark.redis_cluster
def test_cluster_serves_every_slot(redis_cluster: RedisCluster) -> None:
    assert len(redis_cluster.ports) == 3
    assert redis_cluster.url.startswith("redis+cluster://127.0.0.1:")
    for port in redis_cluster.ports:
        info = redis_command(port, "CLUSTER", "INFO")
        assert b"cluster_state:ok" in info
        assert b"cluster_known_nodes:3" in info


@pytest.mark.prometheus
def test_prometheus_reload_swaps_targets(prometheus_factory: PrometheusFactory) -> None:
    server: PrometheusServer = prometheus_factory({"sidecars": ["127.0.0.1:9"]})
    assert _scrape_targets(server) == {"sidecars": ["127.0.0.1:9"]}
    server.reload({"sidecars": ["127.0.0.1:10", "127.0.0.1:11"], "operator": ["127.0.0.1:12"]})
    assert _scrape_targets(server) == {
        "sidecars": ["127.0.0.1:10", "127.0.0.1:11"],
        "operator": ["127.0.0.1:12"],
    }
    server.stop()
    assert not server_answers(server)


def test_missing_binary_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ServiceBinaryMissing, match=r"install redis-server: make deps"):
        RedisServer()


def _scrape_targets(server: PrometheusServer) -> dict[str, list[str]]:
    """Job -> targets, as the running server reports its configuration."""
    with urllib.request.urlopen(server.url + "/api/v1/status/config", timeout=2) as response:
        body = json.load(response)
    # The API returns YAML text; every line we need is "- host:port" under a job.
    jobs: dict[str, list[str]] = {}
    current = ""
    for line in body["data"]["yaml"].splitlines():
        stripped = line.strip()
        if stripped.startswith("- job_name:"):
            current = stripped.split(":", 1)[1].strip()
            jobs[current] = []
        elif stripped.startswith("- 127.0.0.1:") and current:
            jobs[current].append(stripped[2:])
    return jobs


def server_answers(server: PrometheusServer) -> bool:
    try:
        with urllib.request.urlopen(server.url + "/-/ready", timeout=1):
            return True
    except OSError:
        return False
