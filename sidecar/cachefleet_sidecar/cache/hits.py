"""The bookkeeping of L1 hits, applied once per loop turn for all of the turn's hits.

An L1 hit is answered inside ``data_received``. What it must count does not
delay its answer, and most of it need not be counted one hit at a time: the
hit path appends one tuple to the book (:meth:`HitBook.add`), the first hit
of a loop turn makes sure the turn is open (:meth:`Outbox.turn`), and the
outbox applies the book at every turn's end, once the turn's answers are
written (:meth:`Outbox.every_turn`). :meth:`HitBook.flush` then counts them
a run of one tenant's hits at a time (the tenant's metrics looked up once
per run):

* the tenant's ``l1``/``hit`` requests (added once) and their latencies (histogram),
* what they saved the model (:class:`~cachefleet_common.pricing.Saved`, summed
  over a run of hits on one key and added once),
* the miss-ratio curves' access, made only for a key the tenant's sampler
  tracks (the sampling hash is compared here: an unsampled hit does not call
  into the curves),
* the switching engine's observations, one call per run (unless the caller
  observes the request itself), then the engine's window check (``on_observed``).

Whoever reads the counters flushes first (:meth:`SidecarMetrics.flush`, which
a scrape calls), so what a scrape shows is exact.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from cachefleet_common import prices as pricing
from cachefleet_common.keys import CacheKey
from cachefleet_common.sampling import HASH_MASK, HASH_SHIFT
from cachefleet_sidecar.adapt.mrc import MissRatioCurves
from cachefleet_sidecar.cache.entry import V_COMPLETION, V_PROMPT, V_RESPONSE, V_UPSTREAM_S, L1Value
from cachefleet_sidecar.observe.metrics import BUCKETS, SidecarMetrics

if TYPE_CHECKING:
    from cachefleet_sidecar.adapt.switching import SwitchingEngine

#: The (tier, result) an L1 hit counts under in :attr:`TenantMetrics.requests`.
L1_HIT = ("l1", "hit")
#: One L1 hit: tenant, key, the L1 value served, seconds to answer, whether switching observes it.
Hit = tuple[str, CacheKey, L1Value, float, bool]


class Turns(Protocol):
    """The loop turns the hits' answers are written in (:class:`Outbox`)."""

    def turn(self) -> bool:
        """Open a turn unless one is open; False without a running loop."""
        ...

    def every_turn(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` at the end of every turn, once its answers are written."""
        ...


class HitBook:
    """The L1 hits of a loop turn, waiting for their bookkeeping."""

    __slots__ = ("_metrics", "_mrc", "_on_observed", "_prices", "_switching", "_turn", "pending")

    def __init__(
        self,
        metrics: SidecarMetrics,
        turns: Turns,
        *,
        mrc: MissRatioCurves | None = None,
        switching: SwitchingEngine | None = None,
        prices: Mapping[str, pricing.Price] | None = None,
        on_observed: Callable[[], None] | None = None,
    ) -> None:
        self._metrics = metrics
        #: Opens the loop turn whose end flushes the book (:meth:`Outbox.turn`).
        self._turn = turns.turn
        self._mrc = mrc
        self._switching = switching
        self._prices = prices
        self._on_observed = on_observed
        self.pending: list[Hit] = []
        metrics.flushers.append(self.flush)
        turns.every_turn(self.flush)

    def add(
        self, tenant: str, key: CacheKey, value: L1Value, seconds: float, observe: bool = True
    ) -> None:
        """Count one L1 hit once this loop turn's answers are written."""
        pending = self.pending
        pending.append((tenant, key, value, seconds, observe))
        if len(pending) == 1 and not self._turn():
            self.flush()  # no running loop: counted at once

    def flush(self) -> None:
        """Count the hits waiting (nothing when none wait), a run of one tenant's hits at a time."""
        hits = self.pending
        if not hits:
            return
        self.pending = []
        if len(hits) == 1:  # a lone hit in its turn (a quiet server): counted directly
            if self._one(*hits[0]) and self._on_observed is not None:
                self._on_observed()
            return
        observed = False
        start, end = 0, len(hits)
        while start < end:
            tenant = hits[start][0]
            stop = start + 1
            while stop < end and hits[stop][0] == tenant:
                stop += 1
            observed |= self._count(tenant, hits if stop - start == end else hits[start:stop])
            start = stop
        if observed and self._on_observed is not None:
            self._on_observed()

    def _one(
        self, tenant: str, key: CacheKey, value: L1Value, seconds: float, observe: bool
    ) -> bool:
        """Count one hit (what :meth:`_count` does for a run of one, without its loops);
        whether switching observed it."""
        tm = self._metrics.tenant(tenant)
        hist = tm.latency.get("l1") or tm.histogram("l1")
        hist.counts[bisect_left(BUCKETS, seconds)] += 1
        hist.sum += seconds
        digest = key.digest
        mrc = self._mrc
        if mrc is not None and (digest >> HASH_SHIFT) & HASH_MASK < mrc.threshold(tenant):
            mrc.access(tenant, digest, len(value[V_RESPONSE]))
        prompt, completion = value[V_PROMPT], value[V_COMPLETION]
        cost = 0.0
        prices = self._prices
        if prices:
            cost = pricing.cost(prices, key.model, prompt, completion) or 0.0
        tm.saving(key.model).add_many(1, prompt, completion, value[V_UPSTREAM_S], cost)
        requests = tm.requests
        requests[L1_HIT] = requests.get(L1_HIT, 0) + 1
        engine = self._switching
        if engine is None or not observe:
            return False
        engine.observe_many(tenant, ((seconds, digest),))
        return True

    def _count(self, tenant: str, run: list[Hit]) -> bool:
        """Count a run of ``tenant``'s hits; whether switching observed some."""
        mrc, prices = self._mrc, self._prices
        tm = self._metrics.tenant(tenant)
        hist = tm.latency.get("l1") or tm.histogram("l1")
        buckets = hist.counts
        threshold = -1 if mrc is None else mrc.threshold(tenant)
        total = 0.0
        # What a run of hits on one key saved, added once (a hot key's hits come in runs).
        last: CacheKey | None = None
        count = prompt = completion = 0
        upstream_s = cost = 0.0
        for _, key, value, seconds, _ in run:
            buckets[bisect_left(BUCKETS, seconds)] += 1
            total += seconds
            digest = key.digest
            if (digest >> HASH_SHIFT) & HASH_MASK < threshold:  # a sampled key: the curves count it
                assert mrc is not None
                mrc.access(tenant, digest, len(value[V_RESPONSE]))
                threshold = mrc.threshold(tenant)
            if key is not last:
                if last is not None:
                    tm.saving(last.model).add_many(count, prompt, completion, upstream_s, cost)
                last = key
                count = prompt = completion = 0
                upstream_s = cost = 0.0
            count += 1
            prompt += value[V_PROMPT]
            completion += value[V_COMPLETION]
            upstream_s += value[V_UPSTREAM_S]
            if prices:
                price = pricing.cost(prices, key.model, value[V_PROMPT], value[V_COMPLETION])
                if price is not None:
                    cost += price
        if last is not None:
            tm.saving(last.model).add_many(count, prompt, completion, upstream_s, cost)
        requests = tm.requests
        requests[L1_HIT] = requests.get(L1_HIT, 0) + len(run)
        hist.sum += total
        engine = self._switching
        if engine is None:
            return False
        observed = [(hit[3], hit[1].digest) for hit in run if hit[4]]
        if observed:
            engine.observe_many(tenant, observed)
        return bool(observed)
