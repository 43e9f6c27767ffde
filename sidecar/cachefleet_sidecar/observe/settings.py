"""The observe room's settings: where traces go, and who sees tenant names in /status.

The sidecar's command line (the top floor) fills this record; the room's code
reads it, never the whole sidecar configuration.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Peers /status shows tenant names to: loopback's two addresses, not all of 127.0.0.0/8
#: (a service mesh delivers client traffic from 127.0.0.6).
DEFAULT_STATUS_PEERS = ("127.0.0.1/32", "::1/128")


@dataclass(frozen=True, slots=True)
class ObserveSettings:
    """Tracing and the status page's audience."""

    #: OTLP/HTTP collector the request spans go to (docs/tracing.md); empty: no tracing.
    otlp_endpoint: str = ""
    #: CIDRs whose peers see tenant names in /status.
    status_peers: tuple[str, ...] = DEFAULT_STATUS_PEERS
