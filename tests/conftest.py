"""Shared pytest fixtures: real Redis, Redis Cluster and Prometheus on loopback.

The services start once per session (Redis ~20 ms, the cluster ~2 s,
Prometheus ~0.2 s) and are torn down at the end; per-test fixtures hand out
a flushed view of them. A missing binary fails the test with the launcher's
message ("install redis-server: make deps"); nothing is skipped silently.
Tests that kill or pause Redis start their own :class:`RedisServer`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import pytest

from cachefleet_e2e.services import PrometheusServer, RedisCluster, RedisServer

PrometheusFactory = Callable[..., PrometheusServer]


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One standalone redis-server for the whole session."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """One 3-node Redis Cluster for the whole session."""
    with RedisCluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def prometheus_factory() -> Iterator[PrometheusFactory]:
    """``factory(scrape_targets, scrape_interval_s=1)`` -> a started PrometheusServer.

    Every server it made is stopped at the end of the session (tests may stop
    theirs earlier; stopping twice is harmless).
    """
    started: list[PrometheusServer] = []

    def factory(
        scrape_targets: Mapping[str, Sequence[str]], scrape_interval_s: float = 1.0
    ) -> PrometheusServer:
        server = PrometheusServer(scrape_targets, scrape_interval_s=scrape_interval_s)
        started.append(server)
        return server.start()

    yield factory
    for server in started:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of the session's standalone Redis, emptied for this test."""
    if not redis_server.running:  # a test may have broken it: bring it back
        redis_server.restart()
    redis_server.flushall()
    return redis_server.url


@pytest.fixture
def cluster_urls(redis_cluster: RedisCluster) -> list[str]:
    """Per-node URLs of the session's Redis Cluster, emptied for this test."""
    redis_cluster.flushall()
    return redis_cluster.urls


@pytest.fixture
def cluster_url(redis_cluster: RedisCluster, cluster_urls: list[str]) -> str:
    """``redis+cluster://`` URL of the session's Redis Cluster, emptied for this test."""
    return redis_cluster.url
