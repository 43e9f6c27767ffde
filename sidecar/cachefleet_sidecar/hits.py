"""The bookkeeping of L1 hits, applied once per loop turn for all of the turn's hits.

An L1 hit is answered inside ``data_received``. What it must count does not
delay its answer, and most of it need not be counted one hit at a time: the
hit path appends one tuple to the book (:meth:`HitBook.add`), and the first
hit of a loop turn asks the outbox to apply the book once the turn's answers
are written (:meth:`Outbox.later`). :meth:`HitBook.flush` then counts, for
every hit, in one pass:

* the tenant's ``l1``/``hit`` request and its latency (histogram),
* what it saved the model (:class:`~cachefleet_sidecar.savings.Saved`, summed
  per tenant and model and added once),
* the miss-ratio curves' access, made only for a key the tenant's sampler
  tracks (the sampling hash is compared here: an unsampled hit does not call
  into the curves),
* the switching engine's observation (unless the caller observes the
  request itself), then the engine's window check (``on_observed``).

Whoever reads the counters flushes first (:meth:`SidecarMetrics.flush`, which
a scrape calls), so what a scrape shows is exact.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from . import savings
from .entry import V_COMPLETION, V_PROMPT, V_RESPONSE, V_UPSTREAM_S, L1Value
from .keys import CacheKey
from .metrics import BUCKETS, SidecarMetrics
from .mrc import HASH_MASK, HASH_SHIFT, MissRatioCurves

if TYPE_CHECKING:
    from .switching import SwitchingEngine

#: One L1 hit: tenant, key, the L1 value served, seconds to answer, whether switching observes it.
Hit = tuple[str, CacheKey, L1Value, float, bool]


class HitBook:
    """The L1 hits of a loop turn, waiting for their bookkeeping."""

    __slots__ = ("_later", "_metrics", "_mrc", "_on_observed", "_prices", "_switching", "pending")

    def __init__(
        self,
        metrics: SidecarMetrics,
        later: Callable[..., None],
        *,
        mrc: MissRatioCurves | None = None,
        switching: SwitchingEngine | None = None,
        prices: Mapping[str, savings.Price] | None = None,
        on_observed: Callable[[], None] | None = None,
    ) -> None:
        self._metrics = metrics
        #: Runs a callable once the loop turn's answers are written (:meth:`Outbox.later`).
        self._later = later
        self._mrc = mrc
        self._switching = switching
        self._prices = prices
        self._on_observed = on_observed
        self.pending: list[Hit] = []
        metrics.flushers.append(self.flush)

    def add(
        self, tenant: str, key: CacheKey, value: L1Value, seconds: float, observe: bool = True
    ) -> None:
        """Count one L1 hit once this loop turn's answers are written."""
        pending = self.pending
        pending.append((tenant, key, value, seconds, observe))
        if len(pending) == 1:
            self._later(self.flush)

    def flush(self) -> None:
        """Count the hits waiting (nothing when none wait)."""
        hits = self.pending
        if not hits:
            return
        self.pending = []
        metrics, mrc, engine, prices = self._metrics, self._mrc, self._switching, self._prices
        # Per tenant of this batch: [requests, its metrics, latency histogram, latency sum,
        # the curves' sampling threshold (-1: no curves), latencies and key hashes observed].
        tenants: dict[str, list[Any]] = {}
        # Per (tenant, key model): [hits, prompt tokens, completion tokens, model seconds, cost].
        saved: dict[tuple[str, str], list[Any]] = {}
        last_tenant: str | None = None
        last_key: CacheKey | None = None
        row: list[Any] = []
        sums: list[Any] = []
        for tenant, key, value, seconds, observe in hits:
            if tenant != last_tenant:
                found = tenants.get(tenant)
                if found is None:
                    tm = metrics.tenant(tenant)
                    threshold = -1 if mrc is None else mrc.threshold(tenant)
                    found = [0, tm, tm.histogram("l1"), 0.0, threshold, [], []]
                    tenants[tenant] = found
                row, last_tenant, last_key = found, tenant, None
            row[0] += 1
            row[2].counts[bisect_left(BUCKETS, seconds)] += 1
            row[3] += seconds
            digest = key.digest
            if (digest >> HASH_SHIFT) & HASH_MASK < row[4]:  # a sampled key: the curves count it
                assert mrc is not None
                mrc.access(tenant, digest, len(value[V_RESPONSE]))
                row[4] = mrc.threshold(tenant)
            if key is not last_key:  # a hot key's hits come in runs: their sums are shared
                last_key = key
                group = saved.get((tenant, key.model))
                if group is None:
                    group = saved[(tenant, key.model)] = [0, 0, 0, 0.0, 0.0]
                sums = group
            prompt, completion = value[V_PROMPT], value[V_COMPLETION]
            sums[0] += 1
            sums[1] += prompt
            sums[2] += completion
            sums[3] += value[V_UPSTREAM_S]
            if prices:
                price = savings.cost(prices, key.model, prompt, completion)
                if price is not None:
                    sums[4] += price
            if observe and engine is not None:
                row[5].append(seconds)
                row[6].append(digest)
        observed = False
        for tenant, (count, tm, hist, total, _, latencies, key_hashes) in tenants.items():
            tm.requests_done("l1", "hit", count)
            hist.sum += total
            if latencies and engine is not None:
                engine.observe_many(tenant, latencies, key_hashes)
                observed = True
        for (tenant, model), (count, prompt, completion, upstream_s, cost) in saved.items():
            tenants[tenant][1].saving(model).add_many(count, prompt, completion, upstream_s, cost)
        if observed and self._on_observed is not None:
            self._on_observed()
