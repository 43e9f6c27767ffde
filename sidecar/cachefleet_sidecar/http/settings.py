"""The http room's settings: the model server it relays to, and what one client may hold.

The sidecar's command line (the top floor) fills this record; the room's code
reads it, never the whole sidecar configuration.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cachefleet_sidecar.http.server import Limits
from cachefleet_sidecar.http.upstream import DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_WAITING

DEFAULT_UPSTREAM = "http://127.0.0.1:8000"
#: Seconds the model server may stay silent before the request fails with 504.
DEFAULT_UPSTREAM_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class HttpSettings:
    """The upstream (the model server) and the client-side limits (docs/limits.md)."""

    upstream: str = DEFAULT_UPSTREAM
    upstream_timeout_s: float = DEFAULT_UPSTREAM_TIMEOUT_S
    #: Connections open to the model server at once; more requests wait (bounded queue).
    upstream_max_connections: int = DEFAULT_MAX_CONNECTIONS
    #: Requests waiting for an upstream connection; beyond them 503.
    upstream_max_queued: int = DEFAULT_MAX_WAITING
    #: What one client may make the sidecar hold (the defaults live with the server).
    limits: Limits = field(default_factory=Limits)
