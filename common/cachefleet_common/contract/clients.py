"""Redis clients for a URL: redis-py (the operator, tools) and the sidecar's own RESP client."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode

from cachefleet_common import resp
from cachefleet_common.contract.urls import parse_redis_url

#: The client types :func:`redis_from_url` returns.
RedisClient = Redis | RedisCluster


def redis_from_url(url: str, *, cluster: bool | None = None, **options: Any) -> RedisClient:
    """An asyncio client for ``url``: :class:`Redis` or :class:`RedisCluster`.

    ``options`` go to the client constructor (timeouts, ``retry``,
    ``decode_responses`` ...). The client connects lazily.
    """
    target = parse_redis_url(url, cluster=cluster)
    common: dict[str, Any] = {"username": target.username, "password": target.password}
    if target.tls:
        common["ssl"] = True
        if target.ca_file:
            common["ssl_ca_certs"] = target.ca_file
    if target.cluster:
        startup = [ClusterNode(host, port) for host, port in target.nodes]
        return RedisCluster(startup_nodes=startup, **common, **options)
    host, port = target.nodes[0]
    return Redis(host=host, port=port, db=target.db, **common, **options)


def resp_client(
    url: str,
    *,
    cluster: bool | None = None,
    command_timeout_s: float = resp.DEFAULT_COMMAND_TIMEOUT_S,
    connect_timeout_s: float = resp.DEFAULT_CONNECT_TIMEOUT_S,
) -> resp.RespClient:
    """The sidecar's lean hot-path client (:mod:`cachefleet_common.resp`) for ``url``.

    Same URL convention, credentials (ACL user) and TLS (``rediss``, ``?ssl_ca_certs``)
    as :func:`redis_from_url`; it connects lazily (call ``connect()`` to warm up).
    """
    target = parse_redis_url(url, cluster=cluster)
    host, port = target.nodes[0]
    settings = resp.NodeSettings(
        host=host,
        port=port,
        username=target.username,
        password=target.password,
        db=0 if target.cluster else target.db,
        ssl_context=resp.tls_context(target.ca_file) if target.tls else None,
        connect_timeout_s=connect_timeout_s,
    )
    return resp.RespClient(
        settings,
        cluster=target.cluster,
        startup=target.nodes,
        command_timeout_s=command_timeout_s,
    )
