"""Tier glue: what the request path reads from and writes to L1 and L2, and freshness.

:class:`L2` is the interface of the second tier as the sidecar uses it (the
two-phase versioned read of the fast path, the read and write of the slow
path, quotas and usage); :class:`l2.RedisL2` implements it, and a sidecar
without Redis has no L2 at all (``None``, checked once where it matters).
:class:`Freshness` holds each tenant's TTL and Cache-Control allowances;
:class:`Tiers` reads L1 (ageing its hits), stores answers in L1 and L2 and
judges what L2 returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client.core import Metric

from cachefleet_common import keys
from cachefleet_common import prices as pricing
from cachefleet_common.contract.messages import QuotaAssignment
from cachefleet_common.epochs import EpochVector
from cachefleet_common.sampling import HASH_MASK, HASH_SHIFT
from cachefleet_sidecar.adapt.mrc import MissRatioCurves
from cachefleet_sidecar.cache import directives
from cachefleet_sidecar.cache.entry import (
    L1_OVERHEAD_BYTES,
    V_EXPIRES_AT,
    V_FILLED_AT,
    V_RESPONSE,
    V_UPSTREAM_S,
    CorruptEntry,
    Entry,
    L1Value,
    OldEntry,
    reaged,
)
from cachefleet_sidecar.cache.hits import Turns
from cachefleet_sidecar.cache.l1 import TenantL1, TenantLimitError
from cachefleet_sidecar.cache.purge import PurgeIndex
from cachefleet_sidecar.cache.settings import CacheSettings
from cachefleet_sidecar.observe.metrics import BUCKETS, SidecarMetrics
from cachefleet_sidecar.tasks import Background

if TYPE_CHECKING:
    from cachefleet_sidecar.adapt.switching import SwitchingEngine
    from cachefleet_sidecar.cache.keying import Keying, Lookup
    from cachefleet_sidecar.cache.l2 import L2Read
    from cachefleet_sidecar.cache.l2_guard import L2Counters
    from cachefleet_sidecar.cache.l2_warm import Recent

log = logging.getLogger("cachefleet.sidecar")


class L2(Protocol):
    """The second tier (Redis) as the sidecar uses it; :class:`l2.RedisL2` is the one."""

    counters: L2Counters
    #: Called (synchronously) when a read was refused for being behind the fence.
    on_behind: Callable[[], None] | None

    @property
    def state(self) -> str:
        """``ok``, ``degraded`` or ``down``."""
        ...

    def begin_read(self, tenant: str, digest_hex: str, vector: EpochVector) -> L2Read | None:
        """Send a versioned read now (the fast path); None when it cannot be sent."""
        ...

    def finish_read(self, read: L2Read) -> bytes | None:
        """The value a begun read found, once its last reply is in (None: a miss)."""
        ...

    async def get(
        self, tenant: str, digest_hex: str, vector: EpochVector | None = None
    ) -> bytes | None: ...

    async def put(
        self,
        tenant: str,
        digest_hex: str,
        value: bytes,
        vector: EpochVector | None = None,
        *,
        l1_id: int | None = None,
        ttl_s: float | None = None,
    ) -> bool: ...

    async def set_limit(
        self, tenant: str, l2_bytes: int, *, guest_max_share: float | None = None
    ) -> bool: ...

    async def usage(self, tenant: str) -> tuple[int, int]: ...

    async def recent(
        self, tenant: str, limit: int, timeout_s: float, budget_bytes: int
    ) -> Recent | None: ...

    async def recent_guests(
        self, limit: int, timeout_s: float, budget_bytes: int
    ) -> Recent | None: ...

    def forget_registrations(self) -> None: ...

    async def connect(self) -> bool: ...

    async def aclose(self) -> None: ...

    def families(self) -> Iterator[Metric]:
        """The tier's metric families, read at scrape time."""
        ...


class Freshness:
    """Entry TTLs by tenant (the operator's ttlSeconds) and the Cache-Control directives
    each tenant may use."""

    def __init__(self, ttl_s: float = 0.0) -> None:
        #: Entry TTL of tenants the operator sets none for (0: no limit).
        self.default_ttl_s = ttl_s
        self._ttl: dict[str, float] = {}
        self._default_ttl = ttl_s or math.inf
        #: Cache-Control directives each tenant may use (absent: all); changed in place.
        self.allowed: dict[str, directives.Allowed] = {}

    def ttl_of(self, tenant: str) -> float:
        """Seconds after its fill an entry of ``tenant`` stops being served (inf: no limit)."""
        return self._ttl.get(tenant, self._default_ttl)

    def apply(self, assignment: QuotaAssignment, l1: TenantL1[int, L1Value]) -> None:
        """Per-tenant TTLs and Cache-Control allowances from the operator's table.

        An L1 value keeps the expiry its TTL gave it when stored, so a tenant
        whose TTL shrinks has its L1 partition emptied (L2 and L3 judge each
        entry's age at read time, under the TTL in force).
        """
        before = {t: self.ttl_of(t) for t in l1.tenants}
        self._default_ttl = assignment.ttl_seconds or self.default_ttl_s or math.inf
        self._ttl = {
            t: float(q.ttl_seconds) for t, q in assignment.tenants.items() if q.ttl_seconds
        }
        self.allowed.clear()
        self.allowed.update(
            {
                t: directives.Allowed(
                    bypass=q.allow_bypass is not False, max_age=q.allow_max_age is not False
                )
                for t, q in assignment.tenants.items()
                if q.allow_bypass is False or q.allow_max_age is False
            }
        )
        for tenant, ttl in before.items():
            if self.ttl_of(tenant) < ttl:
                l1.clear(tenant)


class Tiers:
    """Reads L1, stores answers in L1 and L2 and judges what L2 returns, for the request path."""

    def __init__(
        self,
        settings: CacheSettings,
        *,
        l1: TenantL1[int, L1Value],
        l2: L2 | None,
        mrc: MissRatioCurves | None,
        metrics: SidecarMetrics,
        keying: Keying,
        freshness: Freshness,
        purge_index: PurgeIndex,
        l2_allowed: Callable[[str], bool],
        background: Background,
        l2_name: Callable[[str], str] = str,
    ) -> None:
        self.l1 = l1
        self.l2 = l2
        self.mrc = mrc
        self.metrics = metrics
        self.keying = keying
        self.ttl_of = freshness.ttl_of
        self.purge_index = purge_index
        #: Whether a tenant may use L2 (guests of --guest-share stay in L1).
        self.l2_allowed = l2_allowed
        #: A tenant's name in L2 keys (a guest's scope in the guests' pool, or its own).
        self.l2_name = l2_name
        self.background = background
        #: Largest answer stored in L2 (larger ones stay in L1 only).
        self.l2_max_entry_bytes = min(settings.l2_max_entry_bytes, settings.max_entry_bytes)
        #: Prices per 1k tokens by model (--price-table): hits count their cost too.
        self.prices = settings.price_table

    def saved(
        self, tenant: str, model: str, prompt: int, completion: int, upstream_s: float
    ) -> None:
        """Count what one hit saved the model (and its price, with a price table)."""
        price = pricing.cost(self.prices, model, prompt, completion) if self.prices else None
        self.metrics.tenant(tenant).saving(model).add(prompt, completion, upstream_s, price)

    def l1_aged(self, tenant: str, key: keys.CacheKey, hit: L1Value, mono: float) -> L1Value | None:
        """An L1 hit found past its check time: None when its TTL is over (it is
        dropped), else the value with its ``Age`` brought up to date (kept in L1)."""
        if mono >= hit[V_EXPIRES_AT]:
            self.l1.remove(tenant, key.digest)
            return None
        value = reaged(hit, mono)
        with contextlib.suppress(TenantLimitError):
            evicted = self.l1.put(
                tenant,
                key.digest,
                value,
                len(value[V_RESPONSE]) + L1_OVERHEAD_BYTES,
                value[V_UPSTREAM_S],
            )
            if evicted:  # one more Age digit can push a full partition over
                self.metrics.tenant(tenant).evicted("l1", evicted)
        return value

    def l1_fresh(self, lookup: Lookup, key: keys.CacheKey, digest: int) -> L1Value | None:
        """The slow path's L1 hit on ``digest``: owned, within the TTL and ``max-age``."""
        tenant = lookup.tenant
        mono = time.monotonic()
        if self.keying.tracker.valid_until <= mono:
            return None
        hit = self.l1.get(tenant, digest)
        if hit is None or hit[0] != tenant:
            return None
        if hit[2] <= mono:
            hit = self.l1_aged(tenant, key, hit, mono)
            if hit is None:
                return None
        if lookup.max_age is not None and mono - hit[V_FILLED_AT] > lookup.max_age:
            return None
        return hit

    def l1_put(
        self,
        tenant: str,
        key: keys.CacheKey,
        entry: Entry,
        cost: float | None = None,
        *,
        rendered: tuple[L1Value, int] | None = None,
    ) -> None:
        """Store an answer from L2 or upstream in L1 (and count the access for the curves).

        ``rendered`` is ``entry.l1_value()`` when the caller has rendered it already.
        """
        if rendered is None:
            rendered = entry.l1_value(
                key.sha256_hex, time.time(), time.monotonic(), self.ttl_of(tenant)
            )
        value, size = rendered
        if self.mrc is not None:
            self.mrc.access(tenant, key.digest, size)
        try:
            evicted = self.l1.put(tenant, key.digest, value, size, cost)
        except TenantLimitError:
            self.metrics.fault("tenant_limit")
            return
        self.metrics.tenant(tenant).evicted("l1", evicted)
        if self.keying.versioned:  # a key purge can arrive: remember which L1 key it would name
            self.purge_index.add(key.sha256_hex, tenant, key.digest, self.l1.contains)

    def l2_begin(self, lookup: Lookup, key: keys.CacheKey) -> asyncio.Future[Any] | None:
        """Send the versioned L2 read of an L1 miss now; its last reply's future, or None."""
        assert self.l2 is not None
        vector = self.keying.vector(lookup, key)
        if vector is None or vector is False:
            return None
        read = self.l2.begin_read(self.l2_name(lookup.tenant), key.sha256_hex, vector)
        if read is None:
            return None
        lookup.l2_read = read
        future: asyncio.Future[Any] = read.futures[-1]
        return future

    def l2_rendered(
        self, tenant: str, key: keys.CacheKey, entry: Entry
    ) -> tuple[bytes, tuple[L1Value, int] | None]:
        """An L2 hit's response and its promotion to L1 (:meth:`Entry.l2_hit`), now;
        no promotion (None) when the tenant's L1 partition could not hold it."""
        ttl = self.ttl_of(tenant)
        room = self.l1.room(tenant)
        return entry.l2_hit(key.sha256_hex, time.time(), time.monotonic(), ttl, room)

    def l2_promoted(
        self, tenant: str, key: keys.CacheKey, entry: Entry, promoted: tuple[L1Value, int] | None
    ) -> None:
        """An L2 hit's promotion to L1 (:meth:`l2_rendered`): stored, or, when L1 could not
        hold it, only its access counted for the curves (as :meth:`l1_put` would)."""
        if promoted is not None:
            self.l1_put(tenant, key, entry, rendered=promoted)
            return
        mrc = self.mrc
        if mrc is not None and (key.digest >> HASH_SHIFT) & HASH_MASK < mrc.threshold(tenant):
            # what the promotion would have cost (HIT-L1 is as long as HIT-L2)
            age = len(b"%d" % entry.age(time.time()))
            mrc.access(tenant, key.digest, entry.l1_bytes(key.sha256_hex) - 1 + age)

    async def l2_get(self, lookup: Lookup, key: keys.CacheKey) -> Entry | None:
        if self.l2 is None or not self.l2_allowed(lookup.tenant):
            return None
        vector = self.keying.vector(lookup, key)
        if vector is False:
            return None
        data = await self.l2.get(self.l2_name(lookup.tenant), key.sha256_hex, vector)
        if data is None:
            return None
        return self.l2_entry(lookup, key, data)

    def l2_entry(self, lookup: Lookup, key: keys.CacheKey, data: bytes) -> Entry | None:
        """The entry an L2 read returned, if this request may be answered with it."""
        tenant = lookup.tenant
        if not self.keying.current(lookup):
            return None  # the epochs moved while the read was out: do not serve it
        try:
            if len(data) > self.l2_max_entry_bytes + 64 * 1024:  # body + envelope and headers
                raise CorruptEntry("larger than any entry this sidecar stores")
            entry = Entry.loads(data)
        except OldEntry:
            self.metrics.fault("old_entry_format")  # a miss: the fill writes the new format
            return None
        except ValueError as exc:
            self.metrics.fault("corrupt_entry")
            log.debug("L2 entry of %s refused: %s", tenant, exc)
            return None
        if entry.stream != key.stream:
            self.metrics.fault("corrupt_entry")
            return None
        if entry.tenant != tenant:
            self.metrics.cross_tenant_hits += 1
            return None
        elapsed = entry.elapsed(time.time())
        if elapsed >= self.ttl_of(tenant):
            return None  # older than the tenant's TTL: a miss, the fill replaces it
        if lookup.max_age is not None and elapsed > lookup.max_age:
            return None
        return entry

    def l2_store(self, lookup: Lookup, key: keys.CacheKey, entry: Entry) -> None:
        """Write a stored answer to L2 in the background, if the tenant uses L2 and it fits."""
        if self.l2 is None or not self.l2_allowed(lookup.tenant):
            return
        if len(entry.body) <= self.l2_max_entry_bytes:
            self.background.spawn(self._l2_put(self.l2, lookup, key, entry))
        else:
            self.metrics.fault("entry_too_large")

    async def _l2_put(self, l2: L2, lookup: Lookup, key: keys.CacheKey, entry: Entry) -> None:
        vector = self.keying.vector(lookup, key)
        if vector is False:
            return  # keyed under epochs that have moved on: nobody can read it
        ttl = self.ttl_of(lookup.tenant) - entry.elapsed(time.time())
        if ttl <= 0:
            return
        name = self.l2_name(lookup.tenant)
        await l2.put(name, key.sha256_hex, entry.dumps(), vector, l1_id=key.digest, ttl_s=ttl)


#: The (tier, result) an L2 hit counts under in :attr:`TenantMetrics.requests`.
L2_HIT = ("l2", "hit")
#: One L2 hit answered from the fast path: tenant, key, the entry served, its
#: promotion to L1 (None: L1 cannot hold it), seconds to answer.
L2Hit = tuple[str, keys.CacheKey, Entry, "tuple[L1Value, int] | None", float]


class L2HitBook:
    """The bookkeeping of the L2 hits answered from the fast path, once per loop turn.

    As :class:`~cachefleet_sidecar.cache.hits.HitBook` for L1 hits: the hit
    appends one tuple (:meth:`add`) and opens the turn; at the turn's end,
    once its answers are written, :meth:`flush` promotes each hit to L1
    (:meth:`Tiers.l2_promoted`) and counts what the hit path used to count one
    hit at a time: the tenant's ``l2``/``hit`` request and its latency, what it
    saved the model, and (with switching) one observation per run of a
    tenant's hits, then the engine's window check. A scrape flushes first
    (:attr:`SidecarMetrics.flushers`).
    """

    __slots__ = ("_metrics", "_on_observed", "_switching", "_tiers", "_turn", "pending")

    def __init__(
        self,
        tiers: Tiers,
        metrics: SidecarMetrics,
        turns: Turns,
        *,
        switching: SwitchingEngine | None = None,
        on_observed: Callable[[], None] | None = None,
    ) -> None:
        self._tiers = tiers
        self._metrics = metrics
        self._turn = turns.turn
        self._switching = switching
        self._on_observed = on_observed
        self.pending: list[L2Hit] = []
        metrics.flushers.append(self.flush)
        turns.every_turn(self.flush)

    def add(
        self,
        tenant: str,
        key: keys.CacheKey,
        entry: Entry,
        promoted: tuple[L1Value, int] | None,
        seconds: float,
    ) -> None:
        """Count one L2 hit (and promote it) once this loop turn's answers are written."""
        pending = self.pending
        pending.append((tenant, key, entry, promoted, seconds))
        if len(pending) == 1 and not self._turn():
            self.flush()  # no running loop: at once

    def flush(self) -> None:
        """Promote and count the hits waiting (nothing when none wait)."""
        hits = self.pending
        if not hits:
            return
        self.pending = []
        tiers, metrics = self._tiers, self._metrics
        promote, prices = tiers.l2_promoted, tiers.prices
        engine = self._switching
        runs: list[tuple[str, list[tuple[float, int]]]] = []
        tenant_of_run = None
        observed: list[tuple[float, int]] = []
        for tenant, key, entry, promoted, seconds in hits:
            try:
                promote(tenant, key, entry, promoted)
            except Exception:  # one hit's promotion never loses the others' counts
                log.exception("promoting an L2 hit to L1 failed")
            if tenant != tenant_of_run:
                tenant_of_run = tenant
                tm = metrics.tenant(tenant)
                hist = tm.latency.get("l2") or tm.histogram("l2")
                requests = tm.requests
                if engine is not None:
                    observed = []
                    runs.append((tenant, observed))
            requests[L2_HIT] = requests.get(L2_HIT, 0) + 1
            hist.counts[bisect_left(BUCKETS, seconds)] += 1
            hist.sum += seconds
            # Tiers.saved, the tenant's metrics looked up once per run
            prompt, completion = entry.prompt_tokens, entry.completion_tokens
            price = pricing.cost(prices, key.model, prompt, completion) if prices else None
            tm.saving(key.model).add(prompt, completion, entry.upstream_s, price)
            if engine is not None:
                observed.append((seconds, key.digest))
        if engine is not None:
            for tenant, run in runs:
                engine.observe_many(tenant, run)
            if self._on_observed is not None:
                self._on_observed()
