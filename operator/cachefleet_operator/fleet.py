"""Fleet-wide miss-ratio curves from the sidecars' fleet samples (pure).

A sidecar's own curve (:mod:`cachefleet_sidecar.adapt.mrc`) counts a key's first
access on that pod as cold, though the shared L2 answers it when another pod
saw the key before. Every sidecar also forwards the accesses of the keys whose
sampling hash is below one fleet-wide threshold
(:data:`~cachefleet_common.contract.fleet.FLEET_SAMPLE_RATE`): spatial sampling
is by key hash, so every pod forwards the same keys. :class:`FleetCurves`
replays them, in time order, into one
:class:`~cachefleet_common.sampling.ShardsSampler` per cache and tenant (the
sidecars' own tracker: fixed size, so a big tenant's rate falls below the
fleet's; the sizes share one budget of keys per cache) and turns its
histogram into a curve over the curve window: hit ratio by the bytes of
*one* cache the fleet shares, which is what the L2 is and what bounds the
fleet's hit ratio. All tenants' at once, as a
:class:`~cachefleet_operator.curves.CurveTable` (:meth:`FleetCurves.table`,
what allocation reads), or one :class:`~cachefleet_operator.curves.HitCurve`
per tenant (:meth:`FleetCurves.curves`, views of its rows).

The window is the difference between the histogram now and a snapshot kept
from at least ``window_s`` earlier (sample time, so a replay of old batches
after an operator restart is not taken for a burst). The curve's ``requests``
is per second of the window, as the Prometheus-read curves are.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from cachefleet_common.contract.fleet import FLEET_SAMPLE_RATE, FleetSample
from cachefleet_common.sampling import BUCKETS, HASH_MASK, HASH_SPACE, ShardsSampler
from cachefleet_operator.curves import CurveTable, HitCurve

#: Keys tracked per tenant and cache at most (SHARDS's s_max; ~430 bytes each).
FLEET_MAX_SAMPLES = 4096
#: Keys tracked per cache, all tenants together (~100 MB): with many tenants each
#: tracks fewer (``FLEET_KEY_BUDGET // tenants``, at least ``FLEET_MIN_SAMPLES``).
FLEET_KEY_BUDGET = 250_000
FLEET_MIN_SAMPLES = 16
#: Tenants tracked per cache at most (the others' samples are ignored and counted).
FLEET_MAX_TENANTS = 10_000


@dataclass(slots=True)
class _Tenant:
    sampler: ShardsSampler
    #: (sample time, cumulative counts), oldest first; the first is the state at the start.
    history: deque[tuple[float, tuple[float, ...]]] = field(default_factory=deque)
    last_at: float = -math.inf


@dataclass(slots=True)
class _Cache:
    tenants: dict[str, _Tenant] = field(default_factory=dict)
    #: The stream id read last (None: nothing read yet).
    after: str | None = None
    #: Keys each tracker may hold (0: not decided yet).
    per_tenant: int = 0
    #: The sampling rate the cache's sidecars are told to use (0: not said, the default).
    rate: float = 0.0
    #: The lowest pod threshold (``thr``) folded into the trackers (None: none yet).
    floor: int | None = None


class FleetCurves:
    """Per cache and tenant, the fleet-wide reuse histogram and its curve over a window."""

    def __init__(
        self,
        max_samples: int = FLEET_MAX_SAMPLES,
        rate: float = FLEET_SAMPLE_RATE,
        max_tenants: int = FLEET_MAX_TENANTS,
        key_budget: int = FLEET_KEY_BUDGET,
    ) -> None:
        self.max_samples = max_samples
        self.rate = rate
        self.max_tenants = max_tenants
        self.key_budget = key_budget
        self._caches: dict[str, _Cache] = {}
        #: Samples not used: a tenant past ``max_tenants``, or a batch that was not one.
        self.ignored = 0

    def after(self, cache: str) -> str | None:
        """The stream id to read after (None: from the oldest kept)."""
        state = self._caches.get(cache)
        return None if state is None else state.after

    def ingest(
        self,
        cache: str,
        batches: Iterable[tuple[int, list[FleetSample]]],
        last_id: str | None = None,
        tenants: Iterable[str] | None = None,
        rate: float | None = None,
    ) -> int:
        """Replay (threshold, samples) batches in time order; the samples used.

        ``tenants`` (None: any) are the ones to measure; the others' samples
        are skipped and their state goes. ``last_id`` is where the next read starts.
        ``rate`` (None: as before, else the constructor's) is the cache's
        ``spec.fleetSampleRate``: a tenant's tracker samples at most that share of
        the keys and at most what each batch's pod forwarded (its ``thr``: during a
        rollout some pods still forward at the old rate), and scales its counts by
        the share it kept. A tracker cannot raise its threshold again, so once a
        read holds no batch below the thresholds folded in so far (the pods that
        forwarded less are gone, e.g. after a rollout to a higher rate), every
        tracker of the cache starts over at the rate in force.
        """
        batches = list(batches)
        state = self._caches.setdefault(cache, _Cache())
        if rate is not None:
            state.rate = rate
        top = max(1, int(HASH_SPACE * (state.rate or self.rate)))
        low = min((threshold for threshold, _ in batches), default=None)
        if low is not None:
            if state.floor is not None and state.floor < min(low, top):
                state.tenants.clear()
                state.floor = None
            state.floor = low if state.floor is None else min(state.floor, low)
        if last_id is not None:
            state.after = last_id
        wanted = None if tenants is None else frozenset(tenants)
        if wanted is not None:
            for gone in [t for t in state.tenants if t not in wanted]:
                del state.tenants[gone]
            state.per_tenant = self._per_tenant(len(wanted))
            for kept in state.tenants.values():
                if kept.sampler.max_samples > state.per_tenant:
                    kept.sampler.shrink_to(state.per_tenant)
        samples: list[FleetSample] = []
        for threshold, batch in batches:
            for sample in batch:
                if wanted is not None and sample.tenant not in wanted:
                    continue
                tracked = self._tenant(state, sample.tenant)
                if tracked is None:
                    self.ignored += 1
                    continue
                # a pod that forwards fewer keys than the tracker expects: keep to its subset
                if threshold < tracked.sampler.threshold:
                    tracked.sampler.lower_threshold(max(1, threshold))
                samples.append(sample)
        samples.sort(key=lambda s: s.at)
        used = 0
        touched: dict[str, _Tenant] = {}
        for sample in samples:
            tracked = state.tenants[sample.tenant]
            sampler = tracked.sampler
            h = sample.key & HASH_MASK
            if not tracked.history:
                tracked.history.append((sample.at, tuple(sampler.counts)))
            if sample.at > tracked.last_at:
                tracked.last_at = sample.at
            touched[sample.tenant] = tracked
            if h < sampler.threshold:
                sampler.sample(sample.key, h, sample.size)
                used += 1
        for tracked in touched.values():
            tracked.history.append((tracked.last_at, tuple(tracked.sampler.counts)))
        return used

    def _per_tenant(self, tenants: int) -> int:
        """Keys each tracker may hold with ``tenants`` tenants in the cache."""
        share = self.key_budget // max(1, min(tenants, self.max_tenants))
        return max(min(FLEET_MIN_SAMPLES, self.max_samples), min(self.max_samples, share))

    def _tenant(self, state: _Cache, tenant: str) -> _Tenant | None:
        tracked = state.tenants.get(tenant)
        if tracked is None:
            if len(state.tenants) >= self.max_tenants:
                return None
            per = state.per_tenant or self._per_tenant(len(state.tenants) + 1)
            sampler = ShardsSampler(per, state.rate or self.rate)
            tracked = state.tenants[tenant] = _Tenant(sampler)
        return tracked

    def curves(self, cache: str, window_s: float) -> dict[str, HitCurve]:
        """Each tenant's fleet curve over the last ``window_s`` (of sample time)."""
        names, table = self.table(cache, window_s)
        found = zip(names, map(table.curve, range(len(names))), strict=True)
        return {tenant: curve for tenant, curve in found if curve is not None}

    def table(self, cache: str, window_s: float) -> tuple[list[str], CurveTable]:
        """:meth:`curves` as a table, all tenants' at once: the tenants with a window of
        samples, and their rows (no curve where nothing was sampled in it)."""
        state = self._caches.get(cache)
        names: list[str] = []
        counts: list[tuple[float, ...]] = []
        for tenant, tracked in (state.tenants if state is not None else {}).items():
            window = _window(tracked, window_s)
            if window is not None:
                names.append(tenant)
                counts.extend(window)
        if not names:
            return [], CurveTable([])
        now_base = np.array(counts, dtype=np.float64).reshape(len(names), 2, -1)
        delta = now_base[:, 0] - now_base[:, 1]
        # per bound, the reuse rate over the window, accumulated bound by bound
        rates = np.cumsum(np.where(delta > 0.0, delta, 0.0) / window_s, axis=1)
        unknown = np.full(len(names), math.nan)
        return names, CurveTable.from_histograms(_BOUNDS, rates, unknown, unknown)

    def forget(self, cache: str) -> None:
        self._caches.pop(cache, None)


#: The bounds of a fleet histogram: the sidecars' reuse buckets, then +Inf.
_BOUNDS = np.array((*BUCKETS, math.inf))


def _window(
    tracked: _Tenant, window_s: float
) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """(counts now, counts a window ago) of a tenant's histogram (None: one snapshot only)."""
    history = tracked.history
    if len(history) < 2:
        return None
    now, counts = history[-1]
    # the newest snapshot at least a window old is the base; older ones are not needed again
    while len(history) > 2 and history[1][0] <= now - window_s:
        history.popleft()
    return counts, history[0][1]
