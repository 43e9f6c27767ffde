"""What the control sync drives on this pod: epoch moves, key purges, and the L1 warm-up.

:class:`Upkeep` drops purged entries from L1 (twice, around one pass of the
loop), fills L1 from L2 before readiness (``--warm-bytes``), and exposes the
epochs this pod knows as metric families.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator

import orjson
from prometheus_client.core import GaugeMetricFamily, Metric

from cachefleet_sidecar.cache.entry import Entry, L1Value
from cachefleet_sidecar.cache.keying import Keying
from cachefleet_sidecar.cache.l1 import TenantL1, TenantLimitError
from cachefleet_sidecar.cache.purge import PurgeIndex
from cachefleet_sidecar.cache.tiers import L2, Freshness
from cachefleet_sidecar.control.settings import ControlSettings
from cachefleet_sidecar.control.warm import WarmReport, warm_l1
from cachefleet_sidecar.observe.metrics import SidecarMetrics
from cachefleet_sidecar.tenancy.tenants import Tenants

log = logging.getLogger("cachefleet.sidecar")


class Upkeep:
    """Purges, warm-up and the epochs' metrics of one sidecar."""

    def __init__(
        self,
        settings: ControlSettings,
        *,
        cache: str,
        l1: TenantL1[int, L1Value],
        l2: L2 | None,
        keying: Keying,
        tenants: Tenants,
        freshness: Freshness,
        purge_index: PurgeIndex,
        metrics: SidecarMetrics,
    ) -> None:
        self.settings = settings
        #: The InferenceCache's NAMESPACE/NAME (the metrics' label).
        self.cache = cache
        self.l1 = l1
        self.l2 = l2
        self.keying = keying
        self.tracker = keying.tracker
        self.tenants = tenants
        self.ttl_of = freshness.ttl_of
        #: SHA-256 digest -> L1 key of entries in L1, for key purges (with Redis only).
        self.purge_index = purge_index
        self.metrics = metrics
        #: The L1 warm-up from L2 at start (--warm-bytes; /status "warmup").
        self.warm = WarmReport()
        #: Key purges applied to L1 (/status "purges"): digests named, entries dropped,
        #: and whole-L1 drops (a purge range the log no longer held).
        self.purge_stats = {"digests": 0, "l1_entries_dropped": 0, "l1_emptied": 0}

    async def on_purge(self, digests: list[str] | None) -> None:
        """Key purges arrived: drop those entries from L1 (``None``: drop all of L1).

        Dropped twice, around one pass of the loop: an L2 hit answered just
        before may still have its promotion to L1 queued for the end of its
        turn (:class:`~cachefleet_sidecar.cache.tiers.L2HitBook`); the second drop comes after it.
        The control sync takes the new purge number (and acknowledges it) only
        after this returns.
        """
        dropped = self._drop_purged(digests)
        await asyncio.sleep(0)
        dropped += self._drop_purged(digests)
        stats = self.purge_stats
        if digests is None:
            stats["l1_emptied"] += 1
        else:
            stats["digests"] += len(digests)
            stats["l1_entries_dropped"] += dropped
        log.info("purged %s from L1", "everything" if digests is None else f"{len(digests)} keys")

    def _drop_purged(self, digests: list[str] | None) -> int:
        if digests is None:
            self.l1.clear()
            self.purge_index.clear()
            return 0
        return sum(self.l1.remove(t, k) for t, k in self.purge_index.take(digests))

    async def warm_up(self, synced: Callable[[], bool]) -> None:
        """Fill L1 from L2 before readiness (docs: warm pods), bounded by --warm-timeout.

        Waits (within the bound) until ``synced()`` says the epochs are confirmed
        and the quotas were read, so entries are judged under the epochs in force.
        """
        cfg, report = self.settings, self.warm
        report.state = "running"
        started = time.monotonic()
        try:
            async with asyncio.timeout(cfg.warm_timeout_s):
                # two components' state, no event to wait on: polled, within the bound
                while not synced():  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
                tenants = self.tenants
                assert self.l2 is not None  # the server warms only with an L2
                await warm_l1(
                    self.l2,
                    sorted(t for t in tenants.named() if tenants.l2_allowed(t)),
                    self.tracker,
                    self._warm_put,
                    budget_bytes=cfg.warm_bytes,
                    share=self._l1_share,
                    resident=self.l1.contains,
                    report=report,
                    read_timeout_s=cfg.warm_timeout_s,
                    guest_slots=self._free_guest_slots,
                    is_guest=self.l1.is_guest,
                )
            report.state = "done"
        except TimeoutError:
            report.state = "timed_out"
        except Exception:  # a cache fault never holds readiness: counted, logged
            report.state = "failed"
            self.metrics.fault("warmup")
            log.exception("L1 warm-up failed")
        report.seconds = time.monotonic() - started
        log.info("L1 warm-up %s", orjson.dumps(report.describe()).decode())

    def _free_guest_slots(self) -> int:
        """Guests a warm-up may add: the L1's free partitions (none takes a warmed one's
        slot), while the guests have an L2 pool."""
        if not self.tenants.guests_in_l2:
            return 0
        return max(0, self.l1.max_tenants - len(self.l1.tenants))

    def _l1_share(self, tenant: str) -> int | None:
        stats = self.l1.stats().get(tenant)
        return None if stats is None else stats.capacity_bytes

    def _warm_put(self, tenant: str, digest_hex: str, l1_key: int, entry: Entry) -> int:
        """Put a warmed entry in L1; the bytes it costs there (0: not stored, or too old
        for its tenant's TTL)."""
        ttl, now = self.ttl_of(tenant), time.time()
        if entry.elapsed(now) >= ttl:
            return 0
        value, size = entry.l1_value(digest_hex, now, time.monotonic(), ttl)
        try:
            self.l1.put(tenant, l1_key, value, size)
        except TenantLimitError:
            return 0
        if not self.l1.contains(tenant, l1_key):
            return 0
        self.purge_index.add(digest_hex, tenant, l1_key, self.l1.contains)
        return size

    def families(self) -> Iterator[Metric]:
        """The epochs this sidecar knows and whether they are confirmed (with Redis)."""
        if not self.keying.versioned:
            return
        cache = self.cache
        epoch = GaugeMetricFamily(
            "cachefleet_epoch",
            "Invalidation epoch this sidecar knows, by scope (cache, tenant:<t>, model:<m>).",
            labels=["cache", "scope"],
        )
        for scope, value in self.tracker.known.items():
            epoch.add_metric([cache, scope], value)
        confirmed = GaugeMetricFamily(
            "cachefleet_epochs_confirmed",
            "1 while the epochs were confirmed within the staleness bound (L1 may serve).",
            labels=["cache"],
        )
        confirmed.add_metric([cache], 1.0 if self.tracker.fresh() else 0.0)
        yield from (epoch, confirmed)
