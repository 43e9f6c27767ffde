"""The sidecar: cache lookups, single-flight, upstream forwarding, admin endpoints.

Read path of a cacheable request (``POST`` to a :data:`keys.CACHEABLE_PATHS`
endpoint with a deterministic JSON body):

1. resolve the tenant (header, API key, default, else 4xx with a reason);
2. canonical key (:mod:`keys`), scoped by tenant, model version and epochs;
3. L1 (tenant partition) -> L2 (Redis, fills L1) -> upstream (fills both);
   concurrent identical misses share one upstream call (single-flight).

Invalidation epochs (with Redis): keys are scoped by the (cache, tenant,
model) epochs of :attr:`Sidecar.tracker`, kept by the control sync; when an
epoch moves, :meth:`Sidecar.on_epochs` bumps a scope version and clears the
key memo *before* the acknowledgement goes out, so after its ack a sidecar
can no longer find an entry of an older epoch: a request keyed before the
change is keyed again, an L2 reply that arrives after it is dropped, and L2
itself refuses readers behind the tenant's fence. L1 hits are served only
while the epochs were confirmed within the staleness bound (one float
comparison on the hit path); otherwise the request falls through to L2 /
upstream.

Steps 1-3 up to an L1 hit run synchronously in :meth:`Sidecar.fast`; the
rest is a task per request. Anything the sidecar cannot parse goes upstream
untouched (``X-Cache: BYPASS``); any cache fault is counted and the request
is served from upstream; the upstream's answer is never changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import orjson
import xxhash
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from . import directives, keys, mrc, protocol, savings, semantic
from .config import SidecarConfig, parse_args
from .entry import (
    FORWARD_DROP,
    L1_OVERHEAD_BYTES,
    STORE_DROP,
    V_COMPLETION,
    V_EXPIRES_AT,
    V_FILLED_AT,
    V_PROMPT,
    V_RESPONSE,
    V_UPSTREAM_S,
    CorruptEntry,
    Entry,
    L1Value,
    OldEntry,
    answer_problem,
    check_header_block,
    reaged,
    reason_phrase,
    usage_of,
)
from .epochs import EpochTracker, EpochVector
from .gate import AdmissionGate
from .hits import HitBook
from .host import HostPressure
from .identity import (
    API_KEYS_POLL_S,
    ApiKeys,
    TenantRules,
    TrustedNetworks,
    parse_api_keys,
    parse_networks,
)
from .l1 import TenantL1, TenantLimitError
from .l3 import Pending, Ref, SemanticTier, l3_marker, with_similarity
from .metrics import SidecarMetrics, TierUsage, admission_families, reuse_families
from .mrc import MissRatioCurves
from .policies import available_policies
from .purge import PurgeIndex
from .server import (
    Connection,
    Limiter,
    Limits,
    Outbox,
    Refusal,
    Request,
    error_response,
    simple_response,
)
from .switching import SwitchingConfig, SwitchingEngine, gpu_pressure
from .telemetry import GpuTelemetry
from .upstream import Begun, UpstreamError, UpstreamPool
from .warm import WarmReport, warm_l1

log = logging.getLogger("cachefleet.sidecar")

#: How often the L2 bytes of each tenant are read for /metrics and /status, seconds.
L2_USAGE_REFRESH_S = 10.0
#: Largest sized upstream answer sent in one write once complete; larger ones stream.
MAX_BUFFERED_BYTES = 1024 * 1024
#: How long a successful upstream answer keeps /readyz green without a probe.
READY_FRESH_S = 5.0
#: Raw request bodies whose canonical key is remembered (cleared when full).
KEY_MEMO_MAX = 16384
#: Tick of the tenant idleness clock, seconds (expiry is counted in ticks of this).
IDLE_TICK_S = 5.0
#: Bytes the key memo may hold (a key keeps its canonical form, about the body's size).
KEY_MEMO_MAX_BYTES = 64 * 1024 * 1024
ADMIN_PATHS = frozenset({b"/healthz", b"/readyz", b"/status", b"/metrics"})
#: Entries a policy switch moves per batch between requests (small: a batch runs between
#: requests on the event loop, so it must not stall them).
MIGRATION_BATCH = 256
#: Pause between two migration batches, seconds (requests run in between).
MIGRATION_PAUSE_S = 0.002


class _Flight:
    """One upstream call that concurrent identical misses share (single-flight)."""

    __slots__ = ("future", "joiners", "tier")

    def __init__(self, future: asyncio.Future[bytes | None]) -> None:
        self.future = future
        #: Requests waiting for this call's answer.
        self.joiners = 0
        #: Where the shared answer came from, as the joiners count it: "upstream" or "l3".
        self.tier = "upstream"


@dataclass(slots=True)
class Lookup:
    """What the fast path learnt about a request, reused by the slow path."""

    tenant: str
    key: keys.CacheKey | None
    bypass_reason: str | None
    no_cache: bool
    no_store: bool
    #: :attr:`Sidecar.scope_version` when the key was made.
    version: int = 0
    #: The L2 read the fast path sent for this key (an ``l2.L2Read``): L2 was asked.
    l2_read: Any = None
    #: The upstream call the fast path sent for this miss, its flight and its start.
    begun: Begun | None = None
    flight: _Flight | None = None
    begun_at: float = 0.0
    #: The request's cache namespace (--namespace-header); "" when it names none.
    namespace: str = ""
    #: Cache-Control max-age (seconds) and only-if-cached, as the tenant may use them.
    max_age: int | None = None
    only_if_cached: bool = False
    #: Some directive needs the slow path (no-cache, max-age, only-if-cached).
    slow: bool = False


class Sidecar:
    """The request handler shared by every connection (the :class:`server.Handler`)."""

    def __init__(
        self,
        config: SidecarConfig,
        *,
        metrics: SidecarMetrics | None = None,
        l2: Any = None,
        telemetry: GpuTelemetry | None = None,
        staleness_bound_s: float | None = None,
        host: HostPressure | None = None,
    ) -> None:
        self.config = config
        if staleness_bound_s is None:
            staleness_bound_s = config.staleness_bound_s
        # Serve-stale (the InferenceCache's outage choice) is a longer, stated bound: while
        # Redis answers, epochs are confirmed every poll and invalidations arrive as fast
        # as in strict mode; only when confirmations stop does the longer bound matter.
        staleness_bound_s = max(staleness_bound_s, config.redis_outage_staleness_s)
        self.metrics = metrics or SidecarMetrics(config.cache, config.max_tenants)
        self.l1: TenantL1[int, L1Value] = TenantL1(
            config.l1_bytes,
            default_policy=config.policy.value,
            max_tenants=config.max_tenants,
            guest_share=config.guest_share,
        )
        self.l1.on_replaced = self._tenant_replaced
        #: The operator's ``tenantDefaults`` (None: unlisted tenants are not admitted as such).
        self.default_quota: protocol.TenantQuota | None = None
        self.l2 = l2
        self.upstream = UpstreamPool(
            config.upstream,
            read_timeout_s=config.upstream_timeout_s,
            max_connections=config.upstream_max_connections,
            max_waiting=config.upstream_max_queued,
        )
        #: Largest answer stored in L1 / in L2 (larger ones are passed through).
        self.max_entry_bytes = config.max_entry_bytes
        self.l2_max_entry_bytes = min(config.l2_max_entry_bytes, config.max_entry_bytes)
        self.telemetry = telemetry or GpuTelemetry()
        self.tenant_header = config.tenant_header.lower().encode()
        self.namespace_header = config.namespace_header.lower().encode()
        #: SHA-256 digest -> L1 key of entries in L1, for key purges (with Redis only).
        self.purge_index = PurgeIndex()
        #: The L1 warm-up from L2 at start (--warm-bytes; /status "warmup").
        self.warm = WarmReport()
        #: Key purges applied to L1 (/status "purges"): digests named, entries dropped,
        #: and whole-L1 drops (a purge range the log no longer held).
        self.purge_stats = {"digests": 0, "l1_entries_dropped": 0, "l1_emptied": 0}
        self.api_keys: ApiKeys | None = None
        if config.api_keys_file:
            self.api_keys = ApiKeys.from_file(config.api_keys_file)
        elif config.api_keys:
            self.api_keys = ApiKeys(parse_api_keys(config.api_keys))
        #: Who the tenant of a request is (its tables follow the keys file and the quotas).
        self.tenancy = TenantRules(
            config.tenant_header,
            api_keys=self.api_keys,
            trusted=TrustedNetworks(parse_networks(config.trusted_proxies)),
            default_tenant=config.default_tenant,
            known=config.tenants,
            admit_guests=config.guest_share > 0,
            on_mismatch=self.metrics.identity_mismatch,
        )
        # bound once: the fast path calls it for every request
        self._resolve = self.tenancy.resolve
        #: Peers shown tenant names in /status (loopback's 127.0.0.1 and ::1 by default).
        self.status_peers = TrustedNetworks(parse_networks(config.status_peers))
        #: Per-tenant miss-ratio curves (None: off).
        self.mrc = (
            MissRatioCurves(
                config.mrc_samples,
                config.mrc_max_rate,
                policy_sizes=tuple(int(f * config.l1_bytes) for f in mrc.MINI_SIM_FRACTIONS),
                default_policy=config.policy.value,
            )
            if config.mrc_samples > 0
            else None
        )
        self._update_reserved()
        self.quota_generation = -1
        self.quotas: dict[str, protocol.TenantQuota] = {}
        self._key_memo: dict[tuple[str, str, bytes, int], keys.CacheKey | str] = {}
        self._key_memo_bytes = 0
        self._model_version = config.model_version
        #: Invalidation epochs; until :meth:`enable_epochs` they do not gate L1.
        self.tracker = EpochTracker(staleness_bound_s)
        self.tracker.valid_until = math.inf
        self._versioned = False
        self._scope_version = 0
        self._key_options: dict[str, keys.KeyOptions] = {}
        self._default_options = keys.KeyOptions(
            collapse_whitespace=config.collapse_whitespace,
            cache_nondeterministic=config.cache_nondeterministic,
        )
        #: Entry TTL by tenant (the operator's ttlSeconds), and of the others, seconds.
        self._ttl: dict[str, float] = {}
        self._default_ttl = config.ttl_s or math.inf
        #: Cache-Control directives each tenant may use (absent: all).
        self._allowed: dict[str, directives.Allowed] = {}
        #: Prices per 1k tokens by model (--price-table): hits count their cost too.
        self.prices = config.price_table
        self._inflight: dict[int, _Flight] = {}
        self._background: set[asyncio.Task[Any]] = set()
        #: The answers of a loop turn and their bookkeeping (the server's connections share it).
        self.outbox = Outbox()
        self._migration: asyncio.Task[None] | None = None
        self._last_upstream_ok = 0.0
        self.started_at = time.time()
        #: (bytes, limit) per tenant in L2, refreshed in the background by the server.
        self.l2_usage: dict[str, tuple[int, int]] = {}
        self.metrics.usage_source = self._usage
        self.metrics.gauge_sources.append(self.telemetry.collect)
        self.metrics.gauge_sources.append(self._redis_families)
        if self.mrc is not None:
            self.metrics.gauge_sources.append(partial(reuse_families, config.cache, self.mrc))
        self.host = host or HostPressure()
        #: The semantic tier (L3); off unless --semantic-source names a source.
        self.l3 = SemanticTier.from_config(config)
        self.metrics.gauge_sources.append(self.l3.families)
        self.l3.on_shadow = lambda t, outcome: self.metrics.tenant(t).shadow_compared(outcome)
        #: The P99-driven policy switching engine (None when switched off).
        self.switching = (
            SwitchingEngine(SwitchingConfig(window_s=config.switch_window_s), now=time.monotonic())
            if config.switch_window_s > 0
            else None
        )
        #: The L1 hits' bookkeeping, applied once per loop turn for the turn's hits.
        self.hits = HitBook(
            self.metrics,
            self.outbox.later,
            mrc=self.mrc,
            switching=self.switching,
            prices=self.prices,
            on_observed=self._switch_due,
        )
        #: Class-aware admission of upstream-bound requests (None when off; docs/admission.md).
        self.gate: AdmissionGate | None = None
        if config.admission is not None:
            self.gate = AdmissionGate(
                config.admission,
                config.admission_metrics_url or config.upstream.rstrip("/") + "/metrics",
                on_refusal=self.metrics.admission_refused,
                on_wait=self.metrics.admission_waited,
            )
            self.metrics.gauge_sources.append(
                partial(admission_families, config.cache, self.gate.core)
            )

    # ------------------------------------------------------------------ tenants
    def resolve_tenant(self, request: Request) -> str:
        """The request's tenant (:class:`identity.TenantRules`); :class:`Refusal` otherwise."""
        return self.tenancy.resolve(request.headers, request.peer)

    @property
    def known_tenants(self) -> set[str]:
        """Tenants admitted by name (configured and the operator's); empty: any valid name."""
        return self.tenancy.known

    def poll_api_keys(self) -> bool:
        """Re-read the API-keys file if it changed (called periodically by the server)."""
        if self.api_keys is None or not self.api_keys.poll():
            return False
        self._tenants_changed()
        return True

    def _tenants_changed(self) -> None:
        """Known/reserved tenants moved: forget memoised tenant decisions."""
        self.tenancy.memo.clear()
        self._update_reserved()

    def _update_reserved(self) -> None:
        """Known tenants (configured, keyed, with quotas, the default) keep shares and series."""
        reserved = set(self.known_tenants)
        if self.api_keys is not None:
            reserved |= self.api_keys.tenants
        if self.config.default_tenant is not None:
            reserved.add(self.config.default_tenant)
        self.l1.set_reserved(reserved)
        self.metrics.set_reserved(reserved)
        if self.mrc is not None:
            self.mrc.limit_to(frozenset(reserved) if reserved else None)

    def expire_idle(self, max_idle_ticks: int) -> list[str]:
        """One tick of the idleness clock: drop tenants idle for longer (L1, series, L2 gauges).

        Called every :data:`IDLE_TICK_S` by the server; returns the tenants whose
        L1 partition expired.
        """
        self.l1.advance()
        gone = self.l1.expire_idle(max_idle_ticks)
        for tenant in self.metrics.expire_idle(max_idle_ticks):
            self.l2_usage.pop(tenant, None)
        for tenant in gone:
            self.metrics.forget(tenant)
            self.metrics.forget_policy_switches(tenant)
            self.l2_usage.pop(tenant, None)
            self.l3.forget(tenant)
            if self.mrc is not None:
                self.mrc.forget(tenant)
        if gone:
            log.info("%d idle tenants expired from L1", len(gone))
        self.kick_migration()
        return gone

    def _tenant_replaced(self, tenant: str) -> None:
        """A newcomer took ``tenant``'s L1 slot: drop what this pod keeps for it.

        Its metric series stay until they idle out (bounded, ``_other`` beyond
        the bound), so a busy pod does not churn a new label value per newcomer.
        """
        self.metrics.forget_policy_switches(tenant)
        self.l2_usage.pop(tenant, None)
        self.l3.forget(tenant)
        if self.mrc is not None:
            self.mrc.forget(tenant)
        if self.switching is not None:
            self.switching.forget(tenant)

    def kick_migration(self) -> None:
        """Drain switched partitions in the background, if any (no-op without a running loop)."""
        if not self.l1.migrating or (self._migration is not None and not self._migration.done()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # nothing to run it on: touches still move entries; the next kick drains
        self._migration = loop.create_task(self._drain_migrations())
        self._background.add(self._migration)
        self._migration.add_done_callback(self._background.discard)

    async def _drain_migrations(self) -> None:
        """Move switched partitions' entries in bounded batches, yielding in between."""
        while self.l1.migrating:
            self.l1.migrate_step(MIGRATION_BATCH)
            await asyncio.sleep(MIGRATION_PAUSE_S)

    def key_options(self, tenant: str) -> keys.KeyOptions:
        return self._key_options.get(tenant, self._default_options)

    # ---------------------------------------------------------------- fast path
    def _key_for(
        self, tenant: str, kind: str, query: bytes, raw: bytes, namespace: str = ""
    ) -> keys.CacheKey | str:
        """The canonical key of a raw body, or why it is not cacheable (memoised).

        Byte-identical bodies have identical keys, so a repeated request skips
        parsing and canonicalisation: the memo is indexed by the xxh3-128 of
        the raw body within (tenant, endpoint, query string) and cleared
        whenever anything that scopes keys changes.
        """
        who = f"{tenant}/{namespace}" if namespace else tenant
        memo_key = (who, kind, query, xxhash.xxh3_128_intdigest(raw))
        found = self._key_memo.get(memo_key)
        if found is not None:
            return found
        body = keys.keyable_body(raw)
        result: keys.CacheKey | str
        if isinstance(body, str):
            result = body
        else:
            epochs: tuple[int, ...] = ()
            if self._versioned:
                model = body.get("model")
                name = model if isinstance(model, str) else ""
                epochs += self.tracker.values_for(tenant, name, namespace)
            scope = keys.Scope(tenant, self._model_version, epochs, namespace)
            try:
                result = keys.make_key(body, kind, scope, self.key_options(tenant), query=query)
            except keys.Uncacheable as exc:
                result = exc.reason
        cost = 2 * (len(raw) + len(query)) + 256
        if len(self._key_memo) >= KEY_MEMO_MAX or self._key_memo_bytes + cost > KEY_MEMO_MAX_BYTES:
            self._clear_key_memo()
        if cost <= KEY_MEMO_MAX_BYTES // 64:  # a huge body is keyed again, not remembered
            self._key_memo[memo_key] = result
            self._key_memo_bytes += cost
        return result

    def _lookup(
        self, request: Request, kind: str, query: bytes, tenant: str | None = None
    ) -> Lookup:
        """Tenant, key and cache directives of a request (``tenant`` when already decided:
        keyed again, its ignored directives were counted the first time)."""
        first = tenant is None
        if tenant is None:
            tenant = self._resolve(request.headers, request.peer)
        version = self._scope_version
        namespace = self._namespace(request)
        key = self._key_for(tenant, kind, query, request.body, namespace)
        cc = request.header(b"cache-control")
        if cc is None:
            if isinstance(key, str):
                return Lookup(tenant, None, key, False, False, version, namespace=namespace)
            return Lookup(tenant, key, None, False, False, version, namespace=namespace)
        asked = directives.parse(cc, self._allowed.get(tenant, directives.ALL_ALLOWED))
        if asked.ignored and first:
            tm = self.metrics.tenant(tenant)
            for directive in asked.ignored:
                tm.directive_ignored(directive)
        found = Lookup(
            tenant,
            None if isinstance(key, str) else key,
            key if isinstance(key, str) else None,
            asked.no_cache,
            asked.no_store,
            version,
            namespace=namespace,
        )
        found.max_age, found.only_if_cached = asked.max_age, asked.only_if_cached
        found.slow = asked.no_cache or asked.only_if_cached or asked.max_age is not None
        return found

    def _namespace(self, request: Request) -> str:
        """The request's cache namespace ("" for none); :class:`Refusal` for a bad one."""
        raw = request.header(self.namespace_header)
        if raw is None:
            return ""
        text = raw.decode("latin-1")
        if not protocol.valid_name(text):
            raise Refusal(
                400,
                f"invalid {self.config.namespace_header} {text[:80]!r}: use 1-63 of [A-Za-z0-9._-]",
            )
        return text

    # Everything that scopes keys goes through these, so the key memo stays true.
    @property
    def model_version(self) -> str:
        return self._model_version

    @model_version.setter
    def model_version(self, value: str) -> None:
        self._model_version = value
        self._rescope()

    @property
    def scope_version(self) -> int:
        """Moves whenever anything that scopes keys changes."""
        return self._scope_version

    def _rescope(self) -> None:
        self._scope_version += 1
        self._clear_key_memo()
        self._l3_retain()

    def _l3_retain(self) -> None:
        """Drop L3 partitions of another model version or older epochs (as L1/L2 keys move)."""
        if not len(self.l3.index):
            return
        version, versioned, tracker = self._model_version, self._versioned, self.tracker

        def current(tenant: str, model: str, model_version: str, epochs: tuple[int, ...]) -> bool:
            if model_version != version:
                return False
            return not versioned or epochs == tracker.values_for(tenant, model)

        self.l3.retain(current)

    def _clear_key_memo(self) -> None:
        self._key_memo.clear()
        self._key_memo_bytes = 0

    def enable_epochs(self) -> None:
        """Scope keys by the tracker's epochs and gate L1 on their confirmation."""
        self._versioned = True
        self.tracker.expire()
        self._rescope()

    def on_epochs(self) -> None:
        """The tracker's epochs moved: stop using keys made under the old ones."""
        self._rescope()
        log.info("epochs now %s", self.tracker.known)

    async def on_purge(self, digests: list[str] | None) -> None:
        """Key purges arrived: drop those entries from L1 (``None``: drop all of L1).

        Dropped twice, around one pass of the loop: an L2 hit answered just
        before may still have its promotion to L1 queued for the end of its
        turn (:meth:`_l2_hit_done`); the second drop comes after it. The
        control sync takes the new purge number (and acknowledges it) only
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
        cfg, report = self.config, self.warm
        report.state = "running"
        started = time.monotonic()
        try:
            async with asyncio.timeout(cfg.warm_timeout_s):
                # two components' state, no event to wait on: polled, within the bound
                while not synced():  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
                tenants = set(self.known_tenants)
                if self.api_keys is not None:
                    tenants |= self.api_keys.tenants
                if cfg.default_tenant is not None:
                    tenants.add(cfg.default_tenant)
                await warm_l1(
                    self.l2,
                    sorted(t for t in tenants if self._l2_allowed(t)),
                    self.tracker,
                    self._warm_put,
                    budget_bytes=cfg.warm_bytes,
                    share=self._l1_share,
                    resident=self.l1.contains,
                    report=report,
                    read_timeout_s=cfg.warm_timeout_s,
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

    def fast(self, request: Request) -> bytes | asyncio.Future[Any] | None:
        """Answer an L1 hit synchronously, or start the L2 read (:meth:`resume` answers it).

        None sends the request down the slow path (:meth:`handle`).
        """
        if request.method != b"POST":
            return None
        kind = keys.CACHEABLE_PATHS.get(request.url)
        query = b""
        if kind is None:
            path, sep, query = request.url.partition(b"?")
            kind = keys.CACHEABLE_PATHS.get(path) if sep else None
            if kind is None:
                return None
        try:
            lookup = self._lookup(request, kind, query)
        except Refusal as exc:
            request.memo = exc
            return None
        request.memo = lookup
        if lookup.key is None or lookup.slow:
            return None
        now = time.monotonic()
        if self.tracker.valid_until <= now:
            return None  # epochs not confirmed within the bound: no L1 hits
        try:
            hit = self.l1.get(lookup.tenant, lookup.key.digest)
        except TenantLimitError:
            return None
        if hit is not None and hit[2] <= now:  # V_CHECK_AT: Age out of date, or expired
            hit = self._l1_aged(lookup.tenant, lookup.key, hit, now)
        if hit is None:
            if self.l2 is not None and self._l2_allowed(lookup.tenant):
                return self._l2_begin(lookup, lookup.key)
            return self._upstream_begin(request, lookup, lookup.key)
        if hit[0] != lookup.tenant:
            self.metrics.cross_tenant_hits += 1
            return None
        self.hits.add(lookup.tenant, lookup.key, hit, time.perf_counter() - request.started)
        return hit[1]

    def _after_write(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` once this turn's answers are written (:meth:`Outbox.later`):
        the bookkeeping of a fast-path answer is not on its latency."""
        self.outbox.later(fn, *args)

    def _l1_hit_done(
        self, tenant: str, key: keys.CacheKey, hit: L1Value, seconds: float, observe: bool = True
    ) -> None:
        """What follows an L1 hit, counted now: the curves' access, the metrics, savings
        and (unless the caller observes the request itself) switching (:class:`HitBook`)."""
        self.hits.add(tenant, key, hit, seconds, observe)
        self.hits.flush()

    def _l1_aged(
        self, tenant: str, key: keys.CacheKey, hit: L1Value, mono: float
    ) -> L1Value | None:
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

    def _l1_fresh(self, lookup: Lookup, key: keys.CacheKey, digest: int) -> L1Value | None:
        """The slow path's L1 hit on ``digest``: owned, within the TTL and ``max-age``."""
        tenant = lookup.tenant
        mono = time.monotonic()
        if self.tracker.valid_until <= mono:
            return None
        hit = self.l1.get(tenant, digest)
        if hit is None or hit[0] != tenant:
            return None
        if hit[2] <= mono:
            hit = self._l1_aged(tenant, key, hit, mono)
            if hit is None:
                return None
        if lookup.max_age is not None and mono - hit[V_FILLED_AT] > lookup.max_age:
            return None
        return hit

    def _saved(
        self, tenant: str, model: str, prompt: int, completion: int, upstream_s: float
    ) -> None:
        """Count what one hit saved the model (and its price, with a price table)."""
        price = savings.cost(self.prices, model, prompt, completion) if self.prices else None
        self.metrics.tenant(tenant).saving(model).add(prompt, completion, upstream_s, price)

    def ttl_of(self, tenant: str) -> float:
        """Seconds after its fill an entry of ``tenant`` stops being served (inf: no limit)."""
        return self._ttl.get(tenant, self._default_ttl)

    def _l2_begin(self, lookup: Lookup, key: keys.CacheKey) -> asyncio.Future[Any] | None:
        """Send the versioned L2 read of an L1 miss now; its last reply's future, or None."""
        begin = getattr(self.l2, "begin_read", None)
        if begin is None:
            return None
        vector = self._vector(lookup, key)
        if vector is None or vector is False:
            return None
        read = begin(lookup.tenant, key.sha256_hex, vector)
        if read is None:
            return None
        lookup.l2_read = read
        future: asyncio.Future[Any] = read.futures[-1]
        return future

    def resume(self, request: Request) -> bytes | asyncio.Future[Any] | None:
        """What :meth:`fast` started is done: the answer, a future to wait on, or None.

        After the L2 read: a hit's answer (its promotion to L1 follows once it
        is written, :meth:`_l2_hit_done`), or on a miss the upstream call sent
        at once (:meth:`_upstream_begin`). After the upstream call: the answer
        when it came whole (:meth:`_upstream_answer`). None hands the request
        to :meth:`handle`, which never asks L2 twice nor sends upstream twice.
        """
        lookup = request.memo
        assert isinstance(lookup, Lookup)
        key = lookup.key
        assert key is not None
        if lookup.begun is not None:
            return self._upstream_answer(request, lookup, key)
        data = self.l2.finish_read(lookup.l2_read)
        entry = None if data is None else self._l2_entry(lookup, key, data)
        if entry is None:
            return self._upstream_begin(request, lookup, key)
        response, promoted = self._l2_rendered(lookup, key, entry)
        seconds = time.perf_counter() - request.started
        self._after_write(self._l2_hit_done, lookup.tenant, key, entry, promoted, seconds)
        return response

    def _l2_hit_done(
        self,
        tenant: str,
        key: keys.CacheKey,
        entry: Entry,
        promoted: tuple[L1Value, int],
        seconds: float,
    ) -> None:
        """What follows an L2 hit answered from the fast path, once it is written:
        the promotion to L1, the metrics and the switching observation."""
        self._l1_put(tenant, key, entry, rendered=promoted)
        self.metrics.tenant(tenant).request("l2", "hit", seconds)
        self._saved(
            tenant, key.model, entry.prompt_tokens, entry.completion_tokens, entry.upstream_s
        )
        if self.switching is not None:
            self._observe(tenant, seconds, key.digest)

    def _l2_rendered(
        self, lookup: Lookup, key: keys.CacheKey, entry: Entry
    ) -> tuple[bytes, tuple[L1Value, int]]:
        """An L2 hit's response and its promotion to L1 (:meth:`Entry.l2_hit`), now."""
        ttl = self.ttl_of(lookup.tenant)
        return entry.l2_hit(key.sha256_hex, time.time(), time.monotonic(), ttl)

    def _upstream_begin(
        self, request: Request, lookup: Lookup, key: keys.CacheKey
    ) -> asyncio.Future[None] | None:
        """Send a cacheable miss upstream now, without a task; the future of its head.

        Only the plain case: no identical miss in flight (that one is joined),
        no semantic tier to ask first, storing allowed, and an idle upstream
        connection. Anything else is None: :meth:`handle` does it.
        """
        tenant = lookup.tenant
        if (
            lookup.no_store
            or key.digest in self._inflight
            or self.l3.enabled(tenant)
            or (self._versioned and lookup.version != self._scope_version)
            or (self.gate is not None and self.gate.busy)  # admission decides in handle()
        ):
            return None
        headers = self._upstream_headers(request.headers, tenant, b"accept-encoding")
        started = time.perf_counter()
        begun = self.upstream.begin(request.method, request.url, headers, request.body)
        if begun is None:
            return None
        flight = _Flight(asyncio.get_running_loop().create_future())
        self._inflight[key.digest] = flight
        lookup.begun, lookup.flight, lookup.begun_at = begun, flight, started
        return begun.future

    def _upstream_answer(
        self, request: Request, lookup: Lookup, key: keys.CacheKey
    ) -> bytes | None:
        """The client's answer to a begun miss whose upstream answer came whole and sized.

        Storing it, the metrics and the joiners follow right after the answer
        is written (:meth:`_upstream_done`); anything else (an error, a body
        still arriving, a stream) is None and :meth:`handle` relays it.
        """
        begun = lookup.begun
        assert begun is not None
        whole = begun.complete_body(MAX_BUFFERED_BYTES)
        if whole is None:
            return None
        status, resp_headers, body = whole
        head = self._relay_head(request, status, resp_headers, len(body), _miss_marker(key))
        begun.release()
        self._after_write(self._upstream_done, request, lookup, key, status, resp_headers, body)
        return head + body

    def _upstream_done(
        self,
        request: Request,
        lookup: Lookup,
        key: keys.CacheKey,
        status: int,
        resp_headers: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> None:
        """What follows the answer of a begun miss: metrics, store, joiners, switching."""
        flight = lookup.flight
        assert flight is not None
        answer: Entry | None = None
        try:
            now = time.perf_counter()
            cost = now - lookup.begun_at
            self._forwarded(lookup.tenant, b"MISS", cost, now - request.started)
            captured = body if len(body) <= self.max_entry_bytes else None
            answer = self._store_answer(request, lookup, key, status, resp_headers, captured, cost)
        finally:
            self._fly_home(key, flight, answer, None)
        if self.switching is not None:
            self._observe(lookup.tenant, time.perf_counter() - request.started, key.digest)

    # ---------------------------------------------------------------- slow path
    async def handle(self, request: Request, conn: Connection) -> None:
        path, _, query = request.url.partition(b"?")
        if path in ADMIN_PATHS and self.config.admin_listen is None:
            await self.admin(request, conn)
            return
        kind = keys.CACHEABLE_PATHS.get(path) if request.method == b"POST" else None
        if kind is None:
            # Whatever the path (a variant of a cached one included), what reaches the
            # model server carries a decided identity: the same rules, the same refusals.
            try:
                tenant = self.resolve_tenant(request)
            except Refusal as exc:
                conn.write(exc.response())
                return
            await self._passthrough(request, conn, tenant=tenant, reason=keys.NOT_CACHED_ENDPOINT)
            return
        memo = request.memo
        if memo is None or (
            isinstance(memo, Lookup) and memo.version != self._scope_version and memo.begun is None
        ):
            # Keys moved since the fast path (new epochs): key again, but the identity
            # was decided once for this request (and its mismatches counted once).
            known = memo.tenant if isinstance(memo, Lookup) else None
            try:
                memo = self._lookup(request, kind, query, known)
            except Refusal as exc:
                memo = exc
        if isinstance(memo, Refusal):
            conn.write(memo.response())
            return
        assert isinstance(memo, Lookup)
        if memo.key is None:
            if memo.only_if_cached:  # nothing uncacheable is ever stored
                conn.write(_not_cached())
                return
            await self._passthrough(request, conn, tenant=memo.tenant, reason=memo.bypass_reason)
            return
        await self._cached(request, conn, memo, memo.key)
        if self.switching is not None:
            self._observe(memo.tenant, time.perf_counter() - request.started, memo.key.digest)

    async def _cached(
        self, request: Request, conn: Connection, lookup: Lookup, key: keys.CacheKey
    ) -> None:
        tenant = lookup.tenant
        tm = self.metrics.tenant(tenant)
        if lookup.begun is not None:  # the fast path sent it upstream already
            assert lookup.flight is not None
            answer: Entry | None = None
            try:
                answer = await self._miss(request, conn, lookup, key)
            finally:
                self._fly_home(key, lookup.flight, answer, None)
            return
        if not lookup.no_cache:
            try:
                hit = self._l1_fresh(lookup, key, key.digest)
            except TenantLimitError:
                if lookup.only_if_cached:
                    conn.write(_not_cached())
                    return
                await self._passthrough(request, conn, tenant=tenant, reason="tenant limit")
                return
            if hit is not None:
                conn.write(hit[V_RESPONSE])
                seconds = time.perf_counter() - request.started
                self._l1_hit_done(tenant, key, hit, seconds, False)  # handle() observes
                return
            entry = None if lookup.l2_read is not None else await self._l2_get(lookup, key)
            if entry is not None:
                response, promoted = self._l2_rendered(lookup, key, entry)
                self._l1_put(tenant, key, entry, rendered=promoted)
                conn.write(response)
                tm.request("l2", "hit", time.perf_counter() - request.started)
                self._saved(
                    tenant,
                    key.model,
                    entry.prompt_tokens,
                    entry.completion_tokens,
                    entry.upstream_s,
                )
                return
        if lookup.only_if_cached and not self.l3.enabled(tenant):
            conn.write(_not_cached())  # RFC 9111 5.2.1.7: nothing stored, nothing sent
            return
        if lookup.no_cache and lookup.no_store:
            await self._passthrough(request, conn, tenant=tenant, reason="no-cache, no-store")
            return
        leader = None if lookup.only_if_cached else self._inflight.get(key.digest)
        if leader is not None:
            self.metrics.single_flight_joins += 1
            leader.joiners += 1
            shared = await asyncio.shield(leader.future)
            if shared is not None:
                conn.write(shared)
                result = "hit" if leader.tier == "l3" else "miss"
                tm.request(leader.tier, result, time.perf_counter() - request.started)
                return
        flight = _Flight(asyncio.get_running_loop().create_future())
        self._inflight[key.digest] = flight
        answer = None
        l3_answer: bytes | None = None
        try:
            pending: Pending | None = None
            # L3 is not asked for namespaced requests: its neighbours are per tenant only
            if not lookup.no_cache and not lookup.namespace and self.l3.enabled(tenant):
                l3_answer, pending = await self._l3_get(request, lookup, key)
                if l3_answer is not None:
                    flight.tier = "l3"
                    conn.write(l3_answer)
                    tm.request("l3", "hit", time.perf_counter() - request.started)
                    return
            if lookup.only_if_cached:
                conn.write(_not_cached())
                return
            if self.gate is not None and (refused := await self._admit(tenant)) is not None:
                conn.write(refused)
                return
            answer = await self._miss(request, conn, lookup, key, pending)
        finally:
            self._fly_home(key, flight, answer, l3_answer)

    def _fly_home(
        self, key: keys.CacheKey, flight: _Flight, answer: Entry | None, l3_answer: bytes | None
    ) -> None:
        """The leader of a flight is done: its joiners get its answer (None: go yourselves)."""
        if self._inflight.get(key.digest) is flight:
            del self._inflight[key.digest]
        # The answer is copied into a response for joiners only when there are some.
        if l3_answer is None and answer is not None and flight.joiners:
            l3_answer = answer.response(b"MISS", None, key.sha256_hex)
        flight.future.set_result(l3_answer)

    async def _miss(
        self,
        request: Request,
        conn: Connection,
        lookup: Lookup,
        key: keys.CacheKey,
        pending: Pending | None = None,
    ) -> Entry | None:
        """Call upstream (or finish the call the fast path sent), forward, store when correct.

        Returns the answer for joiners; see :meth:`_store_answer`.
        """
        tenant = lookup.tenant
        if lookup.begun is not None:
            headers: list[tuple[bytes, bytes]] = []
            started = lookup.begun_at
        else:
            headers = self._upstream_headers(request.headers, tenant, b"accept-encoding")
            started = time.perf_counter()
        captured = await self._forward(
            request,
            conn,
            headers,
            _miss_marker(key),
            tenant=tenant,
            capture=self.max_entry_bytes,
            begun=lookup.begun,
            started=started,
        )
        cost = time.perf_counter() - started  # upstream seconds a hit will save
        if captured is None:
            return None
        status, resp_headers, body = captured
        if (  # L3 shadow mode: compare a correct answer with the one L3 would have served
            pending is not None
            and pending.candidate is not None
            and body is not None
            and answer_problem(status, resp_headers, body, stream=key.stream) is None
        ):
            self._spawn(self.l3.compare(tenant, pending, body))
        return self._store_answer(request, lookup, key, status, resp_headers, body, cost, pending)

    def _store_answer(
        self,
        request: Request,
        lookup: Lookup,
        key: keys.CacheKey,
        status: int,
        resp_headers: list[tuple[bytes, bytes]],
        body: bytes | None,
        cost: float,
        pending: Pending | None = None,
    ) -> Entry | None:
        """Store an upstream answer in L1 (and L2, L3) when correct; the answer for joiners.

        Only a correct answer (:func:`entry.answer_problem`) of the form the
        request asked for is stored; an answer larger than the largest entry
        (``body`` None) is neither stored nor kept for joiners.
        """
        tenant = lookup.tenant
        if body is None:
            self.metrics.fault("entry_too_large")
            return None
        entry_headers = b"".join(
            name + b": " + value + b"\r\n" for name, value in resp_headers if name not in STORE_DROP
        )
        entry = Entry(
            status,
            entry_headers,
            body,
            stream=key.stream,
            tenant=tenant,
            filled_at=time.time(),
            upstream_s=cost,
        )
        if lookup.no_store:
            return entry
        problem = answer_problem(status, resp_headers, body, stream=key.stream)
        if problem is None:
            try:  # what is stored must read back: never store a header block loads refuses
                check_header_block(entry_headers)
            except CorruptEntry as exc:
                problem = str(exc)
        if problem is not None:
            if status == 200:
                self.metrics.fault("answer_not_stored")
                log.debug("answer to %s not stored: %s", request.url, problem)
            return entry
        entry.prompt_tokens, entry.completion_tokens = usage_of(body, stream=key.stream)
        if not self._versioned or lookup.version == self._scope_version:
            # an answer fetched before a purge (or any epoch move) is not kept in L1
            self._l1_put(tenant, key, entry, cost)
        if pending is not None and lookup.version == self._scope_version:
            self.l3.add(pending, Ref(key.digest, key.sha256_hex, key.stream))
        if self.l2 is not None and self._l2_allowed(tenant):
            if len(body) <= self.l2_max_entry_bytes:
                self._spawn(self._l2_put(lookup, key, entry))
            else:
                self.metrics.fault("entry_too_large")
        return entry

    async def _admit(self, tenant: str) -> bytes | None:
        """Admission's refusal of a request about to go upstream (None: it may go)."""
        assert self.gate is not None
        quota = self.quotas.get(tenant) or self.default_quota
        return await self.gate.admit(tenant, None if quota is None else quota.priority_class)

    def _upstream_headers(
        self, headers: list[tuple[bytes, bytes]], tenant: str, drop: bytes = b""
    ) -> list[tuple[bytes, bytes]]:
        """Request headers for upstream, the tenant header saying the tenant that was decided.

        Names that read as the tenant header to a server that folds ``_`` into ``-``
        (``X_Tenant_ID``) are dropped too.
        """
        name = self.tenant_header
        out = [
            (n, v)
            for n, v in headers
            if n != name and n != drop and (b"_" not in n or n.replace(b"_", b"-") != name)
        ]
        out.append((name, tenant.encode()))
        return out

    async def _passthrough(
        self, request: Request, conn: Connection, *, tenant: str | None, reason: str | None
    ) -> None:
        headers = request.headers
        if tenant is not None:
            headers = self._upstream_headers(headers, tenant)
            # only a POST is model work worth holding back (a GET /v1/models costs no GPU)
            if (
                self.gate is not None
                and request.method == b"POST"
                and (refused := await self._admit(tenant)) is not None
            ):
                conn.write(refused)
                return
        captured = await self._forward(request, conn, headers, b"BYPASS", tenant=tenant, capture=0)
        if tenant is not None:
            result = "bypass" if captured is not None else "error"
            self.metrics.tenant(tenant).request(
                "upstream", result, time.perf_counter() - request.started
            )
        if reason is not None:
            log.debug("bypass %s: %s", request.url, reason)

    async def _forward(
        self,
        request: Request,
        conn: Connection,
        headers: list[tuple[bytes, bytes]],
        x_cache: bytes,
        *,
        tenant: str | None,
        capture: int,
        begun: Begun | None = None,
        started: float | None = None,
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes | None] | None:
        """Forward to upstream (or finish ``begun``, sent at ``started``) and relay the
        answer; None when it broke.

        Returns the status, the headers and the body when the body is at most
        ``capture`` bytes (else None in its place: nothing larger is held).
        An HTTP/1.0 client never sees chunked framing: an answer of unknown
        length is relayed as it comes and ended by closing the connection.
        """
        t0 = time.perf_counter() if started is None else started
        try:
            if begun is not None:
                resp = await self.upstream.finish(begun)
            else:
                resp = await self.upstream.request(
                    request.method, request.url, headers, request.body
                )
        except UpstreamError as exc:
            conn.write(
                error_response(
                    503 if exc.overloaded else 504 if exc.timed_out else 502,
                    f"upstream unavailable: {exc}",
                    "cachefleet_upstream",
                    code=False,
                    extra=b"x-cache: %s\r\n%s"
                    % (x_cache, b"retry-after: 1\r\n" if exc.overloaded else b""),
                )
            )
            if tenant is not None:
                self.metrics.tenant(tenant).request(
                    "upstream", "error", time.perf_counter() - request.started
                )
            return None
        # A 204 has no body and may not say a length (RFC 9110 8.6); a 304's is the GET's.
        length = resp.content_length if resp.status != 204 else None
        no_body = request.method == b"HEAD" or resp.status in (204, 304) or 100 <= resp.status < 200
        unsized = length is None and not no_body
        chunked = unsized and not request.http10
        pending = self._relay_head(request, resp.status, resp.headers, length, x_cache, chunked)
        if unsized and not chunked:  # HTTP/1.0: the end of the body is the end of the connection
            request.keep_alive = False
        # A sized answer that fits is sent in one write once complete (one syscall,
        # and a truncated body can still become a clean 502); anything else
        # (SSE, chunked, large) is relayed as it arrives, the head with the first bytes.
        buffered = length is not None and length <= MAX_BUFFERED_BYTES
        keep = capture if not buffered else max(capture, length or 0)
        parts: list[bytes] = []
        held: int | None = 0
        try:
            async for chunk in resp.chunks():
                if held is not None:
                    held += len(chunk)
                    if held <= keep:
                        parts.append(chunk)
                    else:
                        parts.clear()
                        held = None  # too large to keep: relay only
                if buffered:
                    continue
                data = b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk
                conn.write(pending + data if pending else data)
                pending = b""
                await conn.drain()
        except UpstreamError as exc:
            log.warning("upstream broke mid-response for %s: %s", request.url, exc)
            if buffered:
                conn.write(
                    error_response(
                        502,
                        f"upstream answer incomplete: {exc}",
                        "cachefleet_upstream",
                        code=False,
                        extra=b"x-cache: %s\r\n" % x_cache,
                    )
                )
            else:
                conn.abort()
            if tenant is not None:
                self.metrics.tenant(tenant).request(
                    "upstream", "error", time.perf_counter() - request.started
                )
            return None
        whole = b"".join(parts) if held is not None else None
        if buffered or pending:
            conn.write(pending + (whole or b"") if buffered else pending)
        if chunked:
            conn.write(b"0\r\n\r\n")
        if tenant is None:
            self._last_upstream_ok = time.monotonic()
        else:
            now = time.perf_counter()
            self._forwarded(tenant, x_cache, now - t0, now - request.started)
        return resp.status, resp.headers, whole if held is not None and held <= capture else None

    def _relay_head(
        self,
        request: Request,
        status: int,
        resp_headers: list[tuple[bytes, bytes]],
        length: int | None,
        x_cache: bytes,
        chunked: bool = False,
    ) -> bytes:
        """The head relayed to the client for an upstream answer (``length`` None: unsized)."""
        head = [b"HTTP/1.1 %d %s\r\n" % (status, reason_phrase(status))]
        head += [n + b": " + v + b"\r\n" for n, v in resp_headers if n not in FORWARD_DROP]
        if length is not None:
            head.append(b"content-length: %d\r\n" % length)
        elif chunked:
            head.append(b"transfer-encoding: chunked\r\n")
        elif request.method != b"HEAD" and not (status in (204, 304) or 100 <= status < 200):
            head.append(b"connection: close\r\n")
        head.append(b"x-cache: %s\r\n\r\n" % x_cache)
        return b"".join(head)

    def _forwarded(self, tenant: str, x_cache: bytes, upstream_s: float, seconds: float) -> None:
        """Count an answer relayed from upstream (its upstream time, and a miss's latency)."""
        self._last_upstream_ok = time.monotonic()
        tm = self.metrics.tenant(tenant)
        tm.upstream.observe(upstream_s)
        if x_cache.startswith(b"MISS"):
            tm.request("upstream", "miss", seconds)

    # -------------------------------------------------------------- cache tiers
    def _l1_put(
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
        if self._versioned:  # a key purge can arrive: remember which L1 key it would name
            self.purge_index.add(key.sha256_hex, tenant, key.digest, self.l1.contains)

    async def _l3_get(
        self, request: Request, lookup: Lookup, key: keys.CacheKey
    ) -> tuple[bytes | None, Pending | None]:
        """An L3 hit's response, or (None, what to index once upstream has answered).

        Like L1, L3 serves only while the epochs are confirmed; the hit's answer
        is the neighbour's exact entry, read from L1 or else L2 (an entry evicted
        from both drops its L3 row). Any fault is a miss, never an error.
        """
        tenant = lookup.tenant
        if self.tracker.valid_until <= time.monotonic():
            return None, None
        body = keys.parse_body(request.body)
        if body is None:
            return None, None
        epochs: tuple[int, ...] = ()
        if self._versioned:
            epochs = self.tracker.values_for(tenant, key.model)
        scope = keys.Scope(tenant, self._model_version, epochs)
        query = request.url.partition(b"?")[2]
        try:
            match, pending = await self.l3.lookup(
                tenant, body, key.kind, scope, self.key_options(tenant), query
            )
        except Exception:  # never the client's problem: counted, the request goes upstream
            self.metrics.fault("l3")
            log.exception("L3 lookup failed")
            return None, None
        if lookup.version != self._scope_version:
            return None, None  # the epochs moved while the embedding was computed
        if match is None or match.result != "hit" or match.similarity is None:
            return None, pending
        ref: Ref = match.ref
        if ref.stream != key.stream:
            return None, pending
        answer: bytes | None = None
        ref_key = keys.CacheKey(key.kind, key.model, ref.stream, b"", ref.digest, ref.sha256_hex)
        saved = (0, 0, 0.0)
        try:  # the neighbour's entry, within the TTL and max-age like any hit
            hit = self._l1_fresh(lookup, ref_key, ref.digest)
        except TenantLimitError:
            hit = None
        if hit is not None:
            answer = with_similarity(hit[1], match.similarity)
            saved = (hit[V_PROMPT], hit[V_COMPLETION], hit[V_UPSTREAM_S])
        else:
            entry = await self._l2_get(lookup, ref_key)
            if entry is not None and lookup.version == self._scope_version:
                answer = entry.response(
                    l3_marker(match.similarity), entry.age(time.time()), ref.sha256_hex
                )
                saved = (entry.prompt_tokens, entry.completion_tokens, entry.upstream_s)
        if answer is None:
            self.l3.gone(tenant, match)
            return None, pending
        if pending is not None and self.l3.shadowing(tenant):
            return None, self.l3.shadow(pending, answer, key.stream)  # measured, not served
        self._saved(tenant, key.model, *saved)
        return answer, None

    def _vector(self, lookup: Lookup, key: keys.CacheKey) -> EpochVector | Literal[False] | None:
        """The epochs to check in L2; None when unversioned; False when the key is outdated."""
        if not self._versioned:
            return None
        if lookup.version != self._scope_version:
            return False
        return self.tracker.vector(lookup.tenant, key.model, lookup.namespace)

    def _l2_allowed(self, tenant: str) -> bool:
        """Guests (--guest-share, tenantDefaults) stay in L1: they never read or write Redis."""
        return (
            (self.config.guest_share <= 0 and self.default_quota is None)
            or not self.l1.is_guest(tenant)
            or not (self.l1.reserved or self.quotas or self.default_quota)
        )

    async def _l2_get(self, lookup: Lookup, key: keys.CacheKey) -> Entry | None:
        if self.l2 is None or not self._l2_allowed(lookup.tenant):
            return None
        tenant = lookup.tenant
        vector = self._vector(lookup, key)
        if vector is False:
            return None
        data = await self.l2.get(tenant, key.sha256_hex, vector)
        if data is None:
            return None
        return self._l2_entry(lookup, key, data)

    def _l2_entry(self, lookup: Lookup, key: keys.CacheKey, data: bytes) -> Entry | None:
        """The entry an L2 read returned, if this request may be answered with it."""
        tenant = lookup.tenant
        if self._versioned and lookup.version != self._scope_version:
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

    async def _l2_put(self, lookup: Lookup, key: keys.CacheKey, entry: Entry) -> None:
        assert self.l2 is not None
        vector = self._vector(lookup, key)
        if vector is False:
            return  # keyed under epochs that have moved on: nobody can read it
        ttl = self.ttl_of(lookup.tenant) - entry.elapsed(time.time())
        if ttl <= 0:
            return
        await self.l2.put(
            lookup.tenant, key.sha256_hex, entry.dumps(), vector, l1_id=key.digest, ttl_s=ttl
        )

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -------------------------------------------------------------- switching
    def _observe(self, tenant: str, seconds: float, digest: int) -> None:
        """Feed the switching engine; close its windows when one has ended."""
        engine = self.switching
        assert engine is not None
        engine.observe(tenant, seconds, digest)
        self._switch_due()

    def _switch_due(self) -> None:
        """Close the switching engine's windows when one has ended."""
        engine = self.switching
        assert engine is not None
        now = time.monotonic()
        if now >= engine.next_window_at:
            try:
                self.switch_tick(now)
            except Exception:  # never the request's problem: counted, logged
                self.metrics.fault("policy_switching")
                log.exception("policy switching failed; the L1 keeps its policies")

    def switch_tick(self, now: float) -> None:
        """Apply GPU pressure, close ended windows and apply their decisions."""
        engine = self.switching
        if engine is None:
            return
        pressure = gpu_pressure(self.telemetry.samples())
        engine.set_pressure(pressure)
        engine.set_host_pressure(self.host.sample().pressure)
        self.l1.set_pressure(pressure)
        policies = {t: s.policy for t, s in self.l1.stats().items()}
        for tenant, policy in policies.items():
            if policy != engine.config.target:
                self.metrics.expect_policy_switches(tenant, policy, engine.config.target)
        for d in engine.tick(now, policies):
            # O(1): the new policy serves at once, the entries move over in the
            # background (kick_migration) and on touch; no request sees a gap.
            self.l1.set_policy(d.tenant, d.to_policy if d.action == "switch" else None)
            if self.mrc is not None:  # the curve follows the policy in force
                self.mrc.set_policy(d.tenant, self.l1.stats()[d.tenant].policy)
            self.metrics.policy_switch(d.tenant, d.from_policy, d.to_policy)
            log.info("policy %s %s", d.action, orjson.dumps(d.as_dict()).decode())
        self.kick_migration()

    # -------------------------------------------------------------- control
    def apply_quotas(self, assignment: protocol.QuotaAssignment) -> None:
        """Apply the operator's quota table (idempotent; older generations ignored)."""
        if assignment.generation <= self.quota_generation:
            return
        self.quota_generation = assignment.generation
        self.quotas = dict(assignment.tenants)
        self.default_quota = assignment.default_tenant
        self.tenancy.set_known(
            set(self.config.tenants) | set(assignment.tenants),
            admit_guests=self.config.guest_share > 0 or self.default_quota is not None,
        )
        self._tenants_changed()
        base = self._default_options
        self._key_options = {
            t: keys.KeyOptions(
                collapse_whitespace=base.collapse_whitespace
                if q.collapse_whitespace is None
                else q.collapse_whitespace,
                cache_nondeterministic=base.cache_nondeterministic
                if q.cache_nondeterministic is None
                else q.cache_nondeterministic,
            )
            for t, q in assignment.tenants.items()
        }
        self._clear_key_memo()
        self._apply_freshness(assignment)
        if assignment.tenants:
            policies = {
                t: self._usable_policy(q.policy or assignment.default_policy)
                for t, q in assignment.tenants.items()
            }
            self.l1.set_quotas(
                {t: (q.l1_bytes, policies[t]) for t, q in assignment.tenants.items()}
            )
            if self.mrc is not None:
                for tenant, policy in policies.items():
                    self.mrc.set_policy(tenant, policy)
        else:
            self.l1.set_quotas(None)
        unlisted = assignment.default_tenant
        if unlisted is None:
            self.l1.set_guest_pool(None)
        else:
            policy = self._usable_policy(unlisted.policy or assignment.default_policy)
            self.l1.set_guest_pool(unlisted.l1_bytes, policy)
        self.kick_migration()
        if self.l2 is not None:
            for tenant, quota in assignment.tenants.items():
                self._spawn(self.l2.set_limit(tenant, quota.l2_bytes))
        default = self.l3.default
        self.l3.set_options(
            {
                t: semantic.SemanticOptions(
                    enabled=default.enabled if q.semantic is None else q.semantic,
                    threshold=q.semantic_threshold or default.threshold,
                    max_bytes=default.max_bytes,
                    shadow=default.shadow if q.semantic_shadow is None else q.semantic_shadow,
                )
                for t, q in assignment.tenants.items()
            }
        )
        log.info(
            "applied quotas generation %d for %d tenants",
            assignment.generation,
            len(assignment.tenants),
        )

    def _apply_freshness(self, assignment: protocol.QuotaAssignment) -> None:
        """Per-tenant TTLs and Cache-Control allowances from the operator's table.

        An L1 value keeps the expiry its TTL gave it when stored, so a tenant
        whose TTL shrinks has its L1 partition emptied (L2 and L3 judge each
        entry's age at read time, under the TTL in force).
        """
        before = {t: self.ttl_of(t) for t in self.l1.tenants}
        self._default_ttl = assignment.ttl_seconds or self.config.ttl_s or math.inf
        self._ttl = {
            t: float(q.ttl_seconds) for t, q in assignment.tenants.items() if q.ttl_seconds
        }
        self._allowed = {
            t: directives.Allowed(
                bypass=q.allow_bypass is not False, max_age=q.allow_max_age is not False
            )
            for t, q in assignment.tenants.items()
            if q.allow_bypass is False or q.allow_max_age is False
        }
        for tenant, ttl in before.items():
            if self.ttl_of(tenant) < ttl:
                self.l1.clear(tenant)

    def _usable_policy(self, wanted: protocol.Policy) -> str:
        """``wanted`` if this sidecar implements it, else LIRS (logged, counted)."""
        if wanted.value in available_policies():
            return wanted.value
        log.warning("policy %r is not available in this sidecar; using lirs", wanted.value)
        self.metrics.fault("policy_unavailable")
        return protocol.Policy.LIRS.value

    def heartbeat(self) -> protocol.Heartbeat:
        stats = self.l1.stats()
        return protocol.Heartbeat(
            pod=self.config.pod,
            quota_generation=self.quota_generation,
            policy_by_tenant={t: protocol.Policy(s.policy) for t, s in stats.items()},
            redis_ok=self.l2 is None or self.l2.state == "ok",
            shedding=self.gate is not None and self.gate.shedding,
        )

    # -------------------------------------------------------------- admin
    def _usage(self) -> list[TierUsage]:
        out = [
            TierUsage(t, "l1", s.used_bytes, s.capacity_bytes, s.policy)
            for t, s in self.l1.stats().items()
        ]
        out += [TierUsage(t, "l2", used, limit) for t, (used, limit) in self.l2_usage.items()]
        return out

    def _redis_families(self) -> Iterator[Metric]:
        """L2 and epoch state, read at scrape time from their owners."""
        cache = self.config.cache
        if self.l2 is not None:
            counters = self.l2.counters
            up = GaugeMetricFamily(
                "cachefleet_redis_up", "1 while the L2 Redis answers.", labels=["cache"]
            )
            up.add_metric([cache], 1.0 if self.l2.state == "ok" else 0.0)
            errors = CounterMetricFamily(
                "cachefleet_redis_errors",
                "Redis operations of the L2 tier that failed or timed out.",
                labels=["cache"],
            )
            errors.add_metric([cache], counters.errors + counters.timeouts)
            stale = CounterMetricFamily(
                "cachefleet_l2_stale_refused",
                "L2 reads and writes refused because their epochs were behind the fence.",
                labels=["cache"],
            )
            stale.add_metric([cache], counters.stale_refused)
            yield from (up, errors, stale)
        if self._versioned:
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

    async def refresh_l2_usage(self) -> None:
        """Read each tenant's L2 bytes and limit (for /metrics and /status)."""
        if self.l2 is None:
            return
        for tenant in set(self.quotas) | set(self.l1.stats()):
            used, limit = await self.l2.usage(tenant)
            if limit:
                self.l2_usage[tenant] = (used, limit)

    def status(self) -> dict[str, Any]:
        self.metrics.flush()  # the hits' batched bookkeeping counts before it is shown
        stats = self.l1.stats()
        return {
            "cache": self.config.cache,
            "pod": self.config.pod,
            "upstream": protocol.redact_url(self.config.upstream),
            "uptime_s": round(time.time() - self.started_at, 3),
            "quota_generation": self.quota_generation,
            "model_version": self.model_version,
            "invalidation_epochs": self.tracker.known,
            "warmup": self.warm.describe(),
            "purges": dict(self.purge_stats),
            "epochs_confirmed": self.tracker.valid_until > time.monotonic(),
            "redis_outage": self.outage_mode(),
            "l1": {
                "capacity_bytes": self.config.l1_bytes,
                "default_policy": self.config.policy.value,
            },
            "tenants": {
                t: {
                    "policy": s.policy,
                    "l1_bytes": s.used_bytes,
                    "l1_quota_bytes": s.capacity_bytes,
                    "l1_entries": s.entries,
                    "l1_evictions": s.evictions,
                    "l1_migrating_entries": s.migrating,
                    "l2_quota_bytes": self.quotas[t].l2_bytes if t in self.quotas else None,
                    "l2_bytes": self.l2_usage[t][0] if t in self.l2_usage else None,
                }
                for t, s in stats.items()
            },
            "known_tenants": sorted(self.known_tenants),
            "savings": self.savings(),
            "saved": self.saved_totals(),
            "redis": None if self.l2 is None else self.l2.state,
            "gpu_telemetry": self.telemetry.describe(),
            "semantic": self.l3.describe(),
            "admission": {"enabled": False} if self.gate is None else self.gate.describe(),
            "policy_switching": {"enabled": False}
            if self.switching is None
            else {"enabled": True, **self.switching.status(), "host": self.host.describe()},
            "degraded": {
                "redis": self.l2 is not None and self.l2.state != "ok",
                "gpu_telemetry": not self.telemetry.available,
            },
        }

    def savings(self) -> dict[str, dict[str, dict[str, float | int]]]:
        """Per tenant and model: what cache hits saved the model since the sidecar started."""
        return {
            t: {model: saved.as_dict() for model, saved in tm.saved.items()}
            for t, tm in self.metrics.tenants.items()
            if tm.saved
        }

    def saved_totals(self) -> dict[str, float | int]:
        """:meth:`savings` added over tenants and models (shown to every peer)."""
        total = savings.Saved()
        for tm in self.metrics.tenants.values():
            for saved in tm.saved.values():
                total.hits += saved.hits
                total.prompt_tokens += saved.prompt_tokens
                total.completion_tokens += saved.completion_tokens
                total.model_seconds += saved.model_seconds
                total.cost += saved.cost
        return {**total.as_dict(), "priced": bool(self.prices)}

    def outage_mode(self) -> dict[str, Any]:
        """What this sidecar does while Redis is unreachable (the InferenceCache's choice)."""
        bound = self.config.redis_outage_staleness_s
        if bound > 0:
            return {
                "mode": "serve-stale",
                "max_staleness_s": self.tracker.bound_s,
                "says": f"L1 hits go on for up to {self.tracker.bound_s:g} s after the last "
                "confirmed epochs; requests that miss L1 go upstream",
            }
        return {
            "mode": "strict",
            "max_staleness_s": self.tracker.bound_s,
            "says": "L1 hits stop once the epochs cannot be confirmed; requests go upstream",
        }

    async def ready(self) -> bool:
        if self.warm.state == "running":
            return False  # filling L1 from L2 (bounded by --warm-timeout)
        if time.monotonic() - self._last_upstream_ok < READY_FRESH_S:
            return True
        ok = await self.upstream.probe()
        if ok:
            self._last_upstream_ok = time.monotonic()
        return ok

    async def admin(self, request: Request, conn: Connection) -> None:
        path = request.url.split(b"?", 1)[0]
        if path == b"/healthz":
            conn.write(simple_response(200, b"ok\n"))
        elif path == b"/readyz":
            ok = await self.ready()
            conn.write(
                simple_response(200, b"ready\n")
                if ok
                else simple_response(
                    503,
                    b"warming L1 from L2\n"
                    if self.warm.state == "running"
                    else b"upstream unreachable\n",
                )
            )
        elif path == b"/status":
            status = self.status()
            if not self.status_peers.trusts(request.peer):
                status = public_status(status)
            conn.write(
                simple_response(
                    200,
                    orjson.dumps(status, option=orjson.OPT_INDENT_2),
                    content_type=b"application/json",
                )
            )
        elif path == b"/metrics":
            # Piece by piece, giving the loop back in between: hits are not held up by a scrape.
            pieces: list[bytes] = []
            for piece in self.metrics.exposition():
                pieces.append(piece)
                await asyncio.sleep(0)
            conn.write(
                simple_response(200, b"".join(pieces), content_type=b"text/plain; version=0.0.4")
            )
        else:
            conn.write(simple_response(404, b"not found\n"))

    async def aclose(self) -> None:
        for task in list(self._background):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, 1.0)
        await self.upstream.aclose()
        await self.l3.aclose()
        if self.gate is not None:
            await self.gate.aclose()


def _miss_marker(key: keys.CacheKey) -> bytes:
    """The ``X-Cache`` value of a cacheable miss, with the entry's ``X-Cache-Key`` after it."""
    return b"MISS\r\nx-cache-key: " + key.sha256_hex.encode()


def _not_cached() -> bytes:
    """The answer to ``Cache-Control: only-if-cached`` when nothing is cached (RFC 9111)."""
    return error_response(
        504,
        "only-if-cached: no cached answer for this request",
        "cachefleet_not_cached",
        extra=b"x-cache: MISS\r\n",
    )


#: /status fields that name tenants: shown only to --status-peers (loopback: kubectl
#: port-forward, exec; 127.0.0.6, where Istio delivers mesh traffic, is not among them).
TENANT_FIELDS = ("tenants", "known_tenants", "invalidation_epochs", "policy_switching", "savings")


def public_status(status: dict[str, Any]) -> dict[str, Any]:
    """/status for a peer outside --status-peers: tenant names replaced by counts."""
    out = {k: v for k, v in status.items() if k not in TENANT_FIELDS}
    out["tenant_count"] = len(status.get("tenants") or {})
    out["policy_switching_enabled"] = bool((status.get("policy_switching") or {}).get("enabled"))
    out["tenants_hidden"] = (
        "tenant details are shown to 127.0.0.1 and ::1 only (kubectl port-forward), "
        "or to --status-peers"
    )
    return out


class AdminHandler:
    """Handler for the admin port: only the admin endpoints."""

    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar

    def fast(self, request: Request) -> bytes | None:
        return None

    def resume(self, request: Request) -> bytes | asyncio.Future[Any] | None:
        return None

    async def handle(self, request: Request, conn: Connection) -> None:
        await self.sidecar.admin(request, conn)


class SidecarServer:
    """Owns the listening sockets, the Redis tiers and the control sync."""

    def __init__(self, config: SidecarConfig, sidecar: Sidecar | None = None) -> None:
        self.config = config
        self.sidecar = sidecar or Sidecar(config)
        self.limiter = Limiter(
            Limits(
                max_url_bytes=config.max_url_bytes,
                max_header_bytes=config.max_header_bytes,
                max_body_bytes=config.max_body_bytes,
                body_memory_bytes=config.body_memory_bytes,
                max_pipelined=config.max_pipelined,
                idle_timeout_s=config.idle_timeout_s,
                header_timeout_s=config.header_timeout_s,
                body_timeout_s=config.body_timeout_s,
                send_timeout_s=config.send_timeout_s,
            ),
            outbox=self.sidecar.outbox,
        )
        self.connections = self.limiter.connections
        self.sidecar.metrics.gauge_sources.append(self._limit_families)
        self.servers: list[asyncio.Server] = []
        self.control: Any = None
        self._usage_task: asyncio.Task[None] | None = None
        self._keys_task: asyncio.Task[None] | None = None
        self._idle_task: asyncio.Task[None] | None = None
        self._l3_task: asyncio.Task[None] | None = None
        self._warm_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        cfg = self.config
        # The local model loads in the background (seconds): requests are served meanwhile.
        self._l3_task = loop.create_task(self.sidecar.l3.start())
        if self.sidecar.gate is not None:
            self.sidecar.gate.start()
        if cfg.redis_url and self.sidecar.l2 is None:
            from .l2 import RedisL2

            self.sidecar.l2 = RedisL2.from_url(cfg.redis_url, cfg.cache, ttl_s=cfg.l2_ttl_s)
            await self.sidecar.l2.connect()
        if cfg.redis_url:
            from .control import ControlSync

            l2 = self.sidecar.l2
            self.sidecar.enable_epochs()
            self.control = ControlSync(
                cfg.redis_url,
                cfg.cache,
                cfg.pod,
                self.sidecar.apply_quotas,
                heartbeat=self.sidecar.heartbeat,
                tracker=self.sidecar.tracker,
                on_epochs=self.sidecar.on_epochs,
                on_redis_reset=getattr(l2, "forget_registrations", None),
                on_purge=self.sidecar.on_purge,
                # The poll keeps the strict cadence even when serve-stale lengthens the bound.
                epoch_poll_s=cfg.staleness_bound_s / 4,
            )
            if l2 is not None and hasattr(l2, "on_behind"):
                l2.on_behind = self.control.poke
            await self.control.start()
            self._usage_task = loop.create_task(self._refresh_usage())
            if cfg.warm_bytes > 0 and l2 is not None:
                control, tracker = self.control, self.sidecar.tracker
                self.sidecar.warm.state = "running"  # not ready until it ends
                self._warm_task = loop.create_task(
                    self.sidecar.warm_up(
                        lambda: tracker.fresh() and control.last_sync_at is not None
                    )
                )
        if self.sidecar.api_keys is not None and self.sidecar.api_keys.path is not None:
            self._keys_task = loop.create_task(self._poll_api_keys())
        if cfg.tenant_idle_expiry_s > 0:
            self._idle_task = loop.create_task(self._expire_idle())
        main = await loop.create_server(
            lambda: Connection(self.sidecar, self.limiter), *cfg.listen, reuse_address=True
        )
        self.servers.append(main)
        self.limiter.start()
        if cfg.admin_listen is not None:
            admin = AdminHandler(self.sidecar)
            self.servers.append(
                await loop.create_server(
                    lambda: Connection(admin, self.limiter),
                    *cfg.admin_listen,
                    reuse_address=True,
                )
            )
        log.info(
            "cachefleet sidecar on %s:%d -> %s (L1 %d bytes, policy %s, redis %s)",
            *cfg.listen,
            protocol.redact_url(cfg.upstream),
            cfg.l1_bytes,
            cfg.policy.value,
            "on" if cfg.redis_url else "off",
        )

    def _limit_families(self) -> Iterator[Metric]:
        """Client-side limits at scrape time, from the limiter (docs/limits.md)."""
        cache = self.config.cache
        refused = CounterMetricFamily(
            "cachefleet_refused_requests",
            "Requests refused by a client-side limit, by HTTP status.",
            labels=["cache", "status"],
        )
        for code, count in sorted(self.limiter.refused.items()):
            refused.add_metric([cache, str(code)], count)
        dropped = CounterMetricFamily(
            "cachefleet_unread_dropped_connections",
            "Connections dropped for leaving their answers unread past --send-timeout.",
            labels=["cache"],
        )
        dropped.add_metric([cache], self.limiter.dropped_unread)
        held = GaugeMetricFamily(
            "cachefleet_request_body_bytes",
            "Request body bytes charged to --max-body-memory now (64 KiB+ bodies count twice).",
            labels=["cache"],
        )
        held.add_metric([cache], self.limiter.body_bytes)
        conns = GaugeMetricFamily(
            "cachefleet_client_connections", "Open client connections.", labels=["cache"]
        )
        conns.add_metric([cache], len(self.limiter.connections))
        pool = self.sidecar.upstream
        upstream_conns = GaugeMetricFamily(
            "cachefleet_upstream_connections",
            "Connections open or opening to the model server (bounded by "
            "--upstream-max-connections).",
            labels=["cache"],
        )
        upstream_conns.add_metric([cache], pool.open)
        upstream_refused = CounterMetricFamily(
            "cachefleet_upstream_refused",
            "Requests answered 503 because no upstream connection was free and the wait "
            "queue was full (or the wait ran out).",
            labels=["cache"],
        )
        upstream_refused.add_metric([cache], pool.refused)
        yield from (refused, dropped, held, conns, upstream_conns, upstream_refused)

    async def _refresh_usage(self) -> None:
        while True:
            await asyncio.sleep(L2_USAGE_REFRESH_S)
            try:
                await self.sidecar.refresh_l2_usage()
            except Exception as exc:  # never fatal: the gauges just stay older
                log.debug("L2 usage refresh failed: %s", exc)

    async def _expire_idle(self) -> None:
        ticks = max(1, math.ceil(self.config.tenant_idle_expiry_s / IDLE_TICK_S))
        while True:
            await asyncio.sleep(IDLE_TICK_S)
            self.sidecar.expire_idle(ticks)

    async def _poll_api_keys(self) -> None:
        while True:
            await asyncio.sleep(API_KEYS_POLL_S)
            try:
                self.sidecar.poll_api_keys()
            except Exception as exc:  # never fatal: the old keys stay in force
                log.warning("API-keys reload failed: %s", type(exc).__name__)

    @property
    def ports(self) -> list[int]:
        return [int(s.sockets[0].getsockname()[1]) for s in self.servers]

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop accepting, let in-flight requests finish (bounded), then close."""
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        for server in self.servers:
            server.close()
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            for conn in list(self.connections):
                if not conn.busy and not conn.pending:
                    conn.close()
            if not self.connections:
                break
            await asyncio.sleep(0.02)
        for conn in list(self.connections):
            conn.close()
        self.limiter.stop()
        if self._warm_task is not None:
            self._warm_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._warm_task
        for task in (self._usage_task, self._keys_task, self._idle_task, self._l3_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.control is not None:
            await self.control.stop()
        await self.sidecar.aclose()
        if self.sidecar.l2 is not None:
            await self.sidecar.l2.aclose()


async def serve(config: SidecarConfig) -> None:
    server = SidecarServer(config)
    await server.start()
    # Everything allocated so far lives as long as the process: keep it out of
    # the cyclic GC's full collections, whose pauses would land on requests.
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: finishing in-flight requests (up to %gs)", config.shutdown_grace_s)
    await server.stop()


def main(argv: list[str]) -> int:
    config = parse_args(argv)
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.run
    try:
        runner(serve(config))
    except OSError as exc:
        log.error("cannot start: %s", exc)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))
