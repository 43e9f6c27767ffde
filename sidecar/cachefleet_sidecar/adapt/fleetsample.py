"""Shipping the fleet-sampled accesses to Redis, for the operator's fleet-wide curves.

:class:`~cachefleet_sidecar.adapt.mrc.MissRatioCurves` appends the accesses of keys
below the fleet threshold (:data:`~cachefleet_common.contract.fleet.FLEET_SAMPLE_RATE`,
the same on every pod) to a bounded buffer; :class:`FleetShipper` takes that
buffer every :data:`~cachefleet_common.contract.fleet.FLEET_FLUSH_S` and appends it
as one entry to the cache's stream (``XADD ... MAXLEN ~``), on its own lean
RESP connection. Nothing here is on the request path. A Redis fault (down,
slow, refused by an ACL) drops that batch and counts its samples; it never
reaches a request. The operator reads the stream each rebalance
(:mod:`cachefleet_operator.fleet`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric

from cachefleet_common import resp
from cachefleet_common.contract import fleet
from cachefleet_common.contract.ops import add_fleet_batch
from cachefleet_sidecar.adapt.mrc import MissRatioCurves

log = logging.getLogger(__name__)

#: Upper bound of one XADD, seconds (a slow Redis costs a batch, not a backlog).
FLEET_ADD_TIMEOUT_S = 1.0


class FleetShipper:
    """Sends ``curves``' fleet samples to the stream of ``cache`` every ``flush_s`` seconds."""

    def __init__(
        self,
        curves: MissRatioCurves,
        cache: str,
        pod: str,
        client: resp.RespClient,
        *,
        rate: float = fleet.FLEET_SAMPLE_RATE,
        batch_max: int = fleet.FLEET_BATCH_MAX,
        flush_s: float = fleet.FLEET_FLUSH_S,
    ) -> None:
        self.curves = curves
        self.cache = cache
        self.pod = pod
        self.client = client
        self.flush_s = flush_s
        #: Samples written to the stream, and those lost to a Redis fault.
        self.sent = 0
        self.failed = 0
        self._task: asyncio.Task[None] | None = None
        curves.forward_fleet(rate, batch_max)

    @property
    def dropped(self) -> int:
        """Samples lost: buffer full between two flushes, or the batch's XADD failed."""
        return self.curves.fleet_dropped + self.failed

    async def flush(self) -> int:
        """Send what the buffer holds as one batch; the samples sent (0 on a fault)."""
        samples = self.curves.take_fleet_samples()
        if not samples:
            return 0
        payload = fleet.encode_fleet_batch(self.pod, self.curves.fleet_threshold, samples)
        try:
            await add_fleet_batch(self.client, self.cache, payload, timeout_s=FLEET_ADD_TIMEOUT_S)
        except (resp.RespError, OSError) as exc:
            self.failed += len(samples)
            log.debug("fleet samples not sent (%d dropped): %s", len(samples), exc)
            return 0
        self.sent += len(samples)
        return len(samples)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            await self.flush()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="fleet-samples")

    async def stop(self) -> None:
        """Stop shipping (what the buffer holds is sent once more, bounded) and close."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await self.flush()
        self.curves.forward_fleet(0.0, 0)
        await self.client.aclose()

    def families(self) -> Iterator[Metric]:
        """``cachefleet_fleet_samples_total`` by outcome (sent / dropped), for /metrics."""
        family = CounterMetricFamily(
            "cachefleet_fleet_samples",
            "Fleet-sampled accesses for the operator's fleet-wide curves: sent to the "
            "Redis stream, or dropped (buffer full within a flush interval, or Redis fault).",
            labels=["cache", "outcome"],
        )
        family.add_metric([self.cache, "sent"], self.sent)
        family.add_metric([self.cache, "dropped"], self.dropped)
        yield family
