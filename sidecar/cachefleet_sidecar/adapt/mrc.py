"""Online miss-ratio curves per tenant: fixed-size SHARDS over byte-weighted reuse distances.

What the operator needs to move cache by *gain* is, for every tenant, how its
hit ratio would change with the bytes it is given: its miss-ratio curve
(MRC). This module measures it on the live key stream, at a bounded cost.

* **Spatial sampling** (SHARDS, Waldspurger et al., FAST'15): a key is
  tracked iff ``hash(key) < threshold``; every access to a tracked key is
  sampled, so reuse of a sampled key is always seen. The sampling rate is
  ``R = threshold / 2**24``.
* **Fixed size** (SHARDS's ``s_max`` form): a tenant tracks at most
  ``max_samples`` keys. When one more would be tracked, the key with the
  largest hash is dropped and the threshold falls to its hash, so the rate
  adapts to the tenant's working set and a small tenant is measured at rate
  1 (exactly).
* **Byte-weighted distances**: the reuse distance of an access is the bytes
  of the distinct (sampled) keys touched since the same key's previous
  access, scaled by ``1/R``, plus the key's own size: the smallest LRU
  partition that would have made this access a hit. A Fenwick tree over
  access slots gives it in O(log n).
* **Export**: a per-tenant histogram of those sizes whose bucket counts are
  *estimated requests* (each sample weighs ``1/R``), first accesses in
  ``+Inf`` only. Histograms from many pods add up in Prometheus
  (``sum by (tenant, le) (rate(...))``), and the hit ratio at ``C`` bytes is
  ``bucket(le <= C) / bucket(+Inf)``.

* **Other policies**: reuse distance is LRU's stack distance, so the
  histogram is LRU's curve. A tenant whose partition runs another policy
  (LIRS, ...) also gets a :class:`MiniSim`: that policy simulated at a few
  sizes (:data:`MINI_SIM_FRACTIONS` of the L1) on the same sample, each
  miniature cache ``R`` times smaller (miniature simulation, Waldspurger et
  al., ATC'17). Its estimated hits at each size are exported beside the
  histogram.

Cost: an access to an unsampled key is a shift, a mask and a comparison;
a sampled one is O(log max_samples), plus one policy
operation per miniature cache. A **budget** of sampled accesses per second
for the whole sidecar bounds it: every 256 samples the clock is read, and if
they came faster than the budget allows, the rate of the tenant with the most
samples in that burst halves (keys above the new threshold are dropped, as
fixed-size SHARDS does). Hot tenants are the ones slowed; a quiet tenant
keeps rate 1 and is measured exactly. Pure: no I/O; the clock
is injected (a replay passes trace time).

* **Fleet samples**: with :meth:`MissRatioCurves.forward_fleet`, every access
  to a key whose sampling hash is below a fixed fleet-wide threshold is also
  appended, as (tenant, digest, size, wall time), to a bounded buffer (full:
  dropped and counted) that :mod:`cachefleet_sidecar.adapt.fleetsample` ships to
  Redis. Every pod forwards the same keys, so the operator can replay them
  into one :class:`ShardsSampler` per tenant: the fleet-wide curve, where a
  key's first access on one pod is a reuse when another pod saw it before
  (L2 answers it). Its threshold never adapts (it is the fleet's contract);
  an access to a key above it costs one more comparison.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from cachefleet_common.sampling import (
    DEFAULT_MAX_RATE,
    DEFAULT_MAX_SAMPLES,
    HASH_MASK,
    HASH_SHIFT,
    HASH_SPACE,
    ReuseHistogram,
    ShardsSampler,
)
from cachefleet_sidecar.policies import make_policy

#: Sampled accesses per second the whole sidecar may spend on curves; above it the
#: rate of the tenant with the most samples in that burst halves. This is what bounds
#: the hit path's cost (a sampled access costs far more than a hit, more with
#: mini-simulations).
DEFAULT_BUDGET_PER_S = 1000.0
#: The budget is checked once per this many sampled accesses (one clock read each time).
BUDGET_CHECK_EVERY = 256
#: Sizes of the miniature simulations of a non-LRU tenant, as fractions of the L1.
MINI_SIM_FRACTIONS: tuple[float, ...] = (1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4, 1.0)


class MiniSim:
    """Miniature simulation of one policy at a few sizes, fed a SHARDS sample.

    ``policy_factory(capacity_bytes)`` builds a policy with ``get``/``put``/
    ``resize``/``remove``/``items`` (the L1 policy contract). A cache of
    ``size`` bytes is simulated by one of ``size * R`` bytes fed only the
    sampled keys; when the rate falls the miniature caches shrink and the
    keys no longer sampled leave them. ``hits[i] / requests`` estimates the
    hit ratio at ``sizes[i]``.
    """

    __slots__ = ("_caches", "hits", "policy", "requests", "sizes")

    def __init__(
        self,
        policy: str,
        sizes: tuple[int, ...],
        policy_factory: Callable[[int], Any],
        rate: float = 1.0,
    ) -> None:
        self.policy = policy
        self.sizes = sizes
        self._caches = [policy_factory(max(1, int(s * rate))) for s in sizes]
        self.hits = [0.0] * len(sizes)
        self.requests = 0.0

    def sample(self, key: int, size: int, weight: float) -> None:
        self.requests += weight
        hits = self.hits
        for i, cache in enumerate(self._caches):
            if cache.get(key) is not None:
                hits[i] += weight
            else:
                cache.put(key, True, size)

    def shrink(self, threshold: int) -> None:
        """The sample's threshold fell: drop the keys above it, scale the caches down."""
        rate = threshold / HASH_SPACE
        for size, cache in zip(self.sizes, self._caches, strict=True):
            for key, _value, _size in list(cache.items()):
                if (key >> HASH_SHIFT) & HASH_MASK >= threshold:
                    cache.remove(key)
            cache.resize(max(1, int(size * rate)))


@dataclass(frozen=True, slots=True)
class PolicyCurve:
    """A snapshot of one tenant's miniature simulations: estimated hits by size."""

    policy: str
    sizes: tuple[int, ...]
    hits: tuple[float, ...]
    requests: float


class MissRatioCurves:
    """The sidecar's curves: per tenant a sampler, and a mini-sim if its policy is not LRU.

    ``policy_sizes`` (bytes) are the sizes the mini-sims run at (none: no
    mini-sims). ``set_policy`` tells which policy a tenant's partition runs.
    """

    __slots__ = (
        "_burst",
        "_burst_by",
        "_burst_start",
        "_fleet_wall",
        "_limit",
        "_policies",
        "_samplers",
        "_sims",
        "budget_per_s",
        "clock",
        "default_policy",
        "fleet_buffer",
        "fleet_capacity",
        "fleet_dropped",
        "fleet_threshold",
        "max_rate",
        "max_samples",
        "policy_sizes",
    )

    def __init__(
        self,
        max_samples: int = DEFAULT_MAX_SAMPLES,
        max_rate: float = DEFAULT_MAX_RATE,
        budget_per_s: float = DEFAULT_BUDGET_PER_S,
        clock: Callable[[], float] = time.monotonic,
        policy_sizes: tuple[int, ...] = (),
        default_policy: str = "lru",
    ) -> None:
        if max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {max_samples}")
        if not 0.0 < max_rate <= 1.0:
            raise ValueError(f"max_rate must be in (0, 1], got {max_rate}")
        if not budget_per_s > 0:
            raise ValueError(f"budget_per_s must be > 0, got {budget_per_s}")
        self.max_samples = max_samples
        self.max_rate = max_rate
        self.budget_per_s = budget_per_s
        self.clock = clock
        self.policy_sizes = tuple(s for s in policy_sizes if s > 0)
        self.default_policy = default_policy
        self._samplers: dict[str, ShardsSampler] = {}
        self._sims: dict[str, MiniSim] = {}
        self._policies: dict[str, str] = {}
        self._burst = 0
        self._burst_by: dict[str, int] = {}
        self._burst_start = clock()
        self._limit: frozenset[str] | None = None
        #: Keys with a sampling hash below this are forwarded fleet-wide (0: none).
        self.fleet_threshold = 0
        #: Forwarded accesses not yet shipped: (tenant, digest, size, unix seconds).
        self.fleet_buffer: list[tuple[str, int, int, float]] = []
        self.fleet_capacity = 0
        #: Accesses not forwarded because the buffer was full.
        self.fleet_dropped = 0
        self._fleet_wall: Callable[[], float] = time.time

    def forward_fleet(
        self, rate: float, capacity: int, wall: Callable[[], float] = time.time
    ) -> None:
        """Forward the accesses of keys below the fleet ``rate`` (0: stop), ``capacity`` at most
        between two :meth:`take_fleet_samples`; ``wall`` stamps them (unix seconds)."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"fleet rate must be in [0, 1], got {rate}")
        self.fleet_threshold = int(HASH_SPACE * rate)
        self.fleet_capacity = max(0, capacity)
        self._fleet_wall = wall

    def take_fleet_samples(self) -> list[tuple[str, int, int, float]]:
        """The forwarded accesses since the last call (the buffer starts over)."""
        out, self.fleet_buffer = self.fleet_buffer, []
        return out

    def limit_to(self, tenants: frozenset[str] | None) -> None:
        """Measure only ``tenants`` (None: every tenant); the others' state goes.

        The sidecar passes its known tenants: curves are for the operator, which
        allocates only to them, and made-up names must not cost memory.
        """
        self._limit = tenants
        if tenants is not None:
            for tenant in [t for t in self._samplers if t not in tenants]:
                self.forget(tenant)

    def set_policy(self, tenant: str, policy: str | None) -> None:
        """The policy ``tenant``'s partition runs (None: the default); a change restarts its sim."""
        if policy is None:
            self._policies.pop(tenant, None)
        else:
            self._policies[tenant] = policy
        sim = self._sims.get(tenant)
        if sim is not None and sim.policy != self._policies.get(tenant, self.default_policy):
            del self._sims[tenant]
            self._ensure_sim(tenant)

    def _ensure_sim(self, tenant: str) -> None:
        policy = self._policies.get(tenant, self.default_policy)
        sampler = self._samplers.get(tenant)
        if policy == "lru" or not self.policy_sizes or sampler is None:
            return
        try:
            make_policy(policy, 1)
        except ValueError:  # a policy this build lacks: no mini-sim, the LRU curve stands
            return
        self._sims[tenant] = MiniSim(
            policy, self.policy_sizes, lambda capacity: make_policy(policy, capacity), sampler.rate
        )

    def threshold(self, tenant: str) -> int:
        """The sampling hash below which an access of ``tenant`` counts (for its curve,
        or as a fleet sample: :meth:`forward_fleet`).

        A caller that checks ``(digest >> HASH_SHIFT) & HASH_MASK < threshold(tenant)`` itself
        calls :meth:`access` only for sampled keys; the threshold moves only
        in :meth:`access` (and :meth:`forget`, :meth:`limit_to`,
        :meth:`forward_fleet`), so it may be kept until the next of those. A
        tenant not measured yet has the whole hash space: its first access
        starts its sampler.
        """
        sampler = self._samplers.get(tenant)
        if sampler is None:
            return HASH_SPACE
        # the fleet-sampled keys go through access() too (they are forwarded there)
        return max(sampler.threshold, self.fleet_threshold)

    def access(self, tenant: str, digest: int, size: int) -> None:
        sampler = self._samplers.get(tenant)
        if sampler is None:
            if self._limit is not None and tenant not in self._limit:
                return
            sampler = self._samplers[tenant] = ShardsSampler(self.max_samples, self.max_rate)
            self._ensure_sim(tenant)
        h = (digest >> HASH_SHIFT) & HASH_MASK
        if h < self.fleet_threshold:
            if len(self.fleet_buffer) < self.fleet_capacity:
                self.fleet_buffer.append((tenant, digest, size, self._fleet_wall()))
            else:
                self.fleet_dropped += 1
        if h >= sampler.threshold:
            return
        self._burst += 1
        by = self._burst_by
        by[tenant] = by.get(tenant, 0) + 1
        # over budget, the hottest tenant's rate halved: this key may have left the sample
        if self._burst >= BUDGET_CHECK_EVERY and self._over_budget() and h >= sampler.threshold:
            return
        if size < 1:
            size = 1
        sim = self._sims.get(tenant)
        if sim is not None:
            sim.sample(digest, size, HASH_SPACE / sampler.threshold)
        before = sampler.threshold
        sampler.sample(digest, h, size)
        if sim is not None and sampler.threshold != before:
            sim.shrink(sampler.threshold)

    def _over_budget(self) -> bool:
        """At the end of a burst: if it came too fast, halve its biggest sampler's rate."""
        now = self.clock()
        fast = now - self._burst_start < self._burst / self.budget_per_s
        if fast:
            hottest = max(self._burst_by, key=lambda t: self._burst_by[t])
            sampler = self._samplers.get(hottest)
            if sampler is not None:
                sampler.lower_threshold(max(1, sampler.threshold // 2))
                sim = self._sims.get(hottest)
                if sim is not None:
                    sim.shrink(sampler.threshold)
        self._burst, self._burst_start = 0, now
        self._burst_by.clear()
        return fast

    def forget(self, tenant: str) -> None:
        """Stop measuring ``tenant`` (it left the cache)."""
        self._samplers.pop(tenant, None)
        self._sims.pop(tenant, None)

    def tenants(self) -> tuple[str, ...]:
        return tuple(self._samplers)

    def snapshots(self) -> Iterator[tuple[str, ReuseHistogram]]:
        for tenant, sampler in list(self._samplers.items()):
            yield tenant, sampler.snapshot()

    def policy_curves(self) -> Iterator[tuple[str, PolicyCurve]]:
        for tenant, sim in list(self._sims.items()):
            yield tenant, PolicyCurve(sim.policy, sim.sizes, tuple(sim.hits), sim.requests)
