"""Redis URLs: ``redis[s][+cluster]://[user:password@]host:port[,host:port...][/db]``.

Parsing and redacting only (docs/redis-protocol.md); the clients are built in
:mod:`cachefleet_common.contract.clients`.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit, urlunsplit

#: URL schemes that name a Redis Cluster, and the plain scheme of each node.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


@dataclass(frozen=True)
class RedisTarget:
    """A parsed Redis URL (the convention is in docs/redis-protocol.md)."""

    cluster: bool
    nodes: tuple[tuple[str, int], ...]
    tls: bool = False
    username: str | None = None
    password: str | None = None
    db: int = 0
    #: CA bundle that signs the server's certificate (``?ssl_ca_certs=PATH``), for rediss.
    ca_file: str | None = None


def redact_url(url: str) -> str:
    """``url`` with its password (or a lone user-info token) replaced by ``***``.

    For logs, ``/status`` and error messages: a URL that carries credentials
    is never shown whole.
    """
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if not at:
        return url
    user, colon, _ = userinfo.partition(":")
    masked = f"{user}:***" if colon else "***"
    return urlunsplit(parts._replace(netloc=f"{masked}@{hosts}"))


def parse_redis_url(url: str, *, cluster: bool | None = None) -> RedisTarget:
    """Parse a Redis URL; ``cluster`` overrides what the scheme says.

    Raises ValueError on a URL that is not ``redis``, ``rediss``,
    ``redis+cluster`` or ``rediss+cluster`` or that names no host.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in CLUSTER_SCHEMES:
        is_cluster, tls = True, CLUSTER_SCHEMES[scheme] == "rediss"
    elif scheme in ("redis", "rediss"):
        is_cluster, tls = False, scheme == "rediss"
    else:
        raise ValueError(f"not a Redis URL: {redact_url(url)!r}")
    if cluster is not None:
        is_cluster = cluster
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    nodes: list[tuple[str, int]] = []
    for item in hosts.split(","):
        if not item:
            continue
        node = urlsplit(f"//{item}")
        if not node.hostname:
            raise ValueError(f"no host in Redis URL {redact_url(url)!r}")
        nodes.append((node.hostname, node.port or 6379))
    if not nodes:
        raise ValueError(f"no host in Redis URL {redact_url(url)!r}")
    path = parts.path.strip("/")
    ca_files = parse_qs(parts.query).get("ssl_ca_certs")
    return RedisTarget(
        cluster=is_cluster,
        nodes=tuple(nodes),
        tls=tls,
        username=unquote(username) or None,
        password=unquote(password) or None,
        db=int(path) if path.isdigit() else 0,
        ca_file=ca_files[0] if ca_files else None,
    )
