"""The control room's settings: how fresh invalidation epochs must be, and the L1 warm-up.

The sidecar's command line (the top floor) fills this record; the room's code
reads it, never the whole sidecar configuration.
"""

from __future__ import annotations

from dataclasses import dataclass

from cachefleet_common.epochs import DEFAULT_STALENESS_BOUND_S
from cachefleet_sidecar.control.warm import DEFAULT_WARM_TIMEOUT_S


@dataclass(frozen=True, slots=True)
class ControlSettings:
    """Epoch staleness bounds and the warm-up of a starting sidecar."""

    staleness_bound_s: float = DEFAULT_STALENESS_BOUND_S
    #: 0: strict (no L1 hits once epochs are unconfirmed); N: L1 hits up to N s into an outage.
    redis_outage_staleness_s: float = 0.0
    #: Bytes a starting sidecar warms its L1 with from L2 before it is ready (0: no warm-up).
    warm_bytes: int = 0
    #: Longest a warm-up may hold readiness back, seconds.
    warm_timeout_s: float = DEFAULT_WARM_TIMEOUT_S
