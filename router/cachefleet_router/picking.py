"""A picker by load alone: the fallback when a prompt gives nothing to match.

:class:`LeastLoadedPicker` implements :class:`~cachefleet_router.endpoints.Picker`
without any prefix index: it sends a request to the ready endpoint with the
fewest requests this router has in flight there, then the shortest queue its
model server reports (waiting + running), then the lowest address (so the
choice is deterministic). The service uses it for requests whose body could
not be read, and it is a complete picker on its own.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from .endpoints import Decision, Endpoint, RouteRequest

REASON = "least-loaded"


class LeastLoadedPicker:
    """Fewest requests in flight from this router, then shortest reported queue, then address."""

    def __init__(self) -> None:
        self._outstanding: dict[str, int] = {}

    def outstanding(self, address: str) -> int:
        return self._outstanding.get(address, 0)

    def _key(self, endpoint: Endpoint) -> tuple[int, float, str]:
        queue = 0.0
        if endpoint.metrics is not None:
            queue = endpoint.metrics.waiting + endpoint.metrics.running
        return (self.outstanding(endpoint.address), queue, endpoint.address)

    def pick(self, request: RouteRequest, endpoints: Sequence[Endpoint]) -> Decision | None:
        if not endpoints:
            return None
        best = min(endpoints, key=self._key)
        self._outstanding[best.address] = self.outstanding(best.address) + 1
        return Decision(address=best.address, reason=REASON)

    def done(self, decision: Decision, request: RouteRequest, *, ok: bool) -> None:
        left = self.outstanding(decision.address) - 1
        if left > 0:
            self._outstanding[decision.address] = left
        else:
            self._outstanding.pop(decision.address, None)
