"""A stand-in for the operator's Prometheus metrics source whose answers a test sets.

The reconciler asks ``metrics_source(url, timeout_s)`` for a source and then
``fetch(cache, window, curve_window)``; :meth:`FakeMetrics.factory` is that
factory, returning the same object, so a test changes ``data`` (or ``error``)
between rebalances and counts the reads in ``calls``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from cachefleet_operator.allocation import TenantMetrics
from cachefleet_operator.metrics_source import MetricsUnavailable


class FakeMetrics:
    """Per-tenant metrics as the test sets them (``error``: what the next reads raise)."""

    def __init__(self, data: Mapping[str, TenantMetrics] | None = None) -> None:
        self.data: dict[str, TenantMetrics] = dict(data or {})
        self.error: MetricsUnavailable | None = None
        self.calls = 0

    def factory(self, url: str, timeout_s: float) -> FakeMetrics:
        return self

    async def fetch(
        self, cache: str, window: str, curve_window: str | None = None
    ) -> dict[str, TenantMetrics]:
        self.calls += 1
        await asyncio.sleep(0)
        if self.error is not None:
            raise self.error
        return dict(self.data)
