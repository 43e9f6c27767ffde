"""The composition root: every part of a sidecar, built from its :class:`SidecarConfig`.

:func:`build` makes each part and hands it the parts it uses, explicitly; no
part reaches another through a shared object, and each room gets its own
settings record (``config.http``, ``config.caching``, ...), never the whole
configuration. The :class:`Sidecar` it returns is only the list of parts, for
the server (their lifecycle) and for tests. Every metric collector is
registered here, each by the part that owns it.

The rooms (packages; each ``__init__`` is empty), by floor, top to bottom
(``pyproject.toml``'s layers contract; a room imports only the floors below it):

* the top floor: ``app``, ``compose`` (this module), ``config`` and ``flags``
  (the command line), ``admin`` (status, heartbeat, admin endpoints), ``traced``;
* ``control/``: the control sync, :class:`control.upkeep.Upkeep` (purges,
  warm-up, epoch metrics);
* ``tenancy/``: identity rules, :class:`tenancy.tenants.Tenants`,
  :class:`tenancy.tenants.QuotaApplier`, rate limits;
* ``cache/``: the request path (:class:`cache.handler.Handler`, with
  :class:`cache.keying.Keying` for keys and their scope), the tier glue
  (:class:`cache.tiers.Tiers`, :class:`cache.tiers.Freshness`, the typed
  :class:`cache.tiers.L2` interface), entries, L1, L2 (Redis), L3 (semantic),
  the purge index, the policy switcher;
* ``http/``: the client side (:mod:`http.server`), the upstream pool
  (:mod:`http.upstream`), the relay (:class:`http.relay.Relay`), admission's gate;
* ``observe/``: metrics, tracing;
* ``adapt/``: policy switching, curves (and the fleet samples they forward), GPU
  and host pressure, admission;
* ``policies/`` (L1's replacement policies), then ``tasks``.

The shared kernel (``cachefleet_common``: the Redis contract, epochs, keys, the
flag mechanism) is below them all.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, NamedTuple

from cachefleet_common.contract.clients import resp_client
from cachefleet_common.epochs import EpochTracker
from cachefleet_sidecar.adapt import mrc as mrc_module
from cachefleet_sidecar.adapt.fleetsample import FleetShipper
from cachefleet_sidecar.adapt.host import HostPressure
from cachefleet_sidecar.adapt.mrc import MissRatioCurves
from cachefleet_sidecar.adapt.settings import AdaptSettings
from cachefleet_sidecar.adapt.switching import SwitchingConfig, SwitchingEngine
from cachefleet_sidecar.adapt.telemetry import GpuTelemetry
from cachefleet_sidecar.admin import Admin
from cachefleet_sidecar.cache.entry import L1Value
from cachefleet_sidecar.cache.handler import Handler, HitsCountedHandler
from cachefleet_sidecar.cache.hits import HitBook
from cachefleet_sidecar.cache.keying import Keying
from cachefleet_sidecar.cache.l1 import TenantL1
from cachefleet_sidecar.cache.l3 import SemanticTier
from cachefleet_sidecar.cache.purge import PurgeIndex
from cachefleet_sidecar.cache.switcher import PolicySwitcher
from cachefleet_sidecar.cache.tiers import L2, Freshness, Tiers
from cachefleet_sidecar.config import SidecarConfig
from cachefleet_sidecar.control.settings import ControlSettings
from cachefleet_sidecar.control.upkeep import Upkeep
from cachefleet_sidecar.http.gate import AdmissionGate
from cachefleet_sidecar.http.outbox import Outbox
from cachefleet_sidecar.http.relay import Relay
from cachefleet_sidecar.http.server import Handler as ServerHandler
from cachefleet_sidecar.http.server import Limiter
from cachefleet_sidecar.http.upstream import UpstreamPool
from cachefleet_sidecar.observe.metrics import (
    SidecarMetrics,
    admission_families,
    guest_families,
    reuse_families,
)
from cachefleet_sidecar.tasks import Background
from cachefleet_sidecar.tenancy.limits_redis import RateLimiter
from cachefleet_sidecar.tenancy.tenants import QuotaApplier, Tenants

if TYPE_CHECKING:  # tracing's modules are imported only when it is on
    from cachefleet_sidecar.observe.tracing import Tracing
    from cachefleet_sidecar.traced import Resolve

log = logging.getLogger("cachefleet.sidecar")


@dataclass(eq=False, slots=True)
class Sidecar:
    """The parts of one sidecar (built by :func:`build`)."""

    config: SidecarConfig
    metrics: SidecarMetrics
    l1: TenantL1[int, L1Value]
    l2: L2 | None
    l3: SemanticTier
    mrc: MissRatioCurves | None
    tracker: EpochTracker
    upstream: UpstreamPool
    telemetry: GpuTelemetry
    host: HostPressure
    gate: AdmissionGate | None
    switching: SwitchingEngine | None
    background: Background
    outbox: Outbox
    limiter: Limiter
    freshness: Freshness
    tenants: Tenants
    keying: Keying
    tiers: Tiers
    relay: Relay
    switcher: PolicySwitcher
    handler: Handler
    quotas: QuotaApplier
    upkeep: Upkeep
    admin: Admin
    #: Ships the fleet-sampled accesses to Redis (None: no Redis, or curves off).
    fleet: FleetShipper | None = None
    #: Per-tenant rate limits (None: neither Redis nor --tenant-limits).
    rates: RateLimiter | None = None
    #: Traces (docs/tracing.md); None: off, and nothing of it is imported.
    tracing: Tracing | None = None
    #: What the connections call when tracing is on (the handler, traced).
    traced: ServerHandler | None = None

    @property
    def front(self) -> ServerHandler:
        """The handler the server's connections call."""
        return self.handler if self.traced is None else self.traced

    async def aclose(self) -> None:
        """Let background work finish (bounded), then close the parts' connections."""
        await self.background.aclose()
        if self.tracing is not None:  # the last spans go out (bounded), off the loop
            await asyncio.to_thread(self.tracing.shutdown)
        await self.upstream.aclose()
        await self.l3.aclose()
        if self.gate is not None:
            await self.gate.aclose()
        if self.l2 is not None:
            await self.l2.aclose()
        if self.rates is not None:
            await self.rates.aclose()


def build(
    config: SidecarConfig,
    *,
    metrics: SidecarMetrics | None = None,
    l2: L2 | None = None,
    telemetry: GpuTelemetry | None = None,
    staleness_bound_s: float | None = None,
    host: HostPressure | None = None,
    tracing: Tracing | None = None,
) -> Sidecar:
    """Every part of a sidecar for ``config`` (``l2``: the L2 to use instead of Redis at
    ``config.redis_url``; ``tracing``: instead of one for the OTLP endpoint; nothing
    connects until the server starts)."""
    if l2 is None and config.redis_url:
        from cachefleet_sidecar.cache.l2 import (
            RedisL2,  # redis-py is imported only by sidecars that use Redis
        )

        l2 = RedisL2.from_url(config.redis_url, config.cache, ttl_s=config.caching.l2_ttl_s)
    if tracing is None and config.observe.otlp_endpoint:
        tracing = _tracing(config.observe.otlp_endpoint, config.pod)
    base = _Base(
        config,
        metrics or SidecarMetrics(config.cache, config.tenancy.max_tenants),
        telemetry or GpuTelemetry(),
        host or HostPressure(),
        l2,
        _kinds(tracing),
        Background(),
    )
    stores = _stores(base)
    front = _http_front(base)
    switching = _switching(config.adapt)
    switcher = PolicySwitcher(
        engine=switching,
        l1=stores.l1,
        mrc=stores.mrc,
        metrics=base.metrics,
        telemetry=base.telemetry,
        host=base.host,
        background=base.background,
    )
    l2_usage: dict[str, tuple[int, int]] = {}
    tenants = _tenants(base, stores, switcher, l2_usage)
    if front.gate is not None:  # GIE's headers: a request's class and flow (tenancy)
        front.gate.flow_of = tenants.admission_of
    resolve = base.kinds.resolve(tenants.resolve)
    path = _request_path(base, stores, tenants, resolve, staleness_bound_s)
    rates = _rates(base)
    relay = Relay(
        tenant_header=config.tenancy.tenant_header,
        upstream=front.upstream,
        metrics=base.metrics,
        gate=front.gate,
        priority_class=tenants.priority_class,
        rates=rates,
    )
    upkeep = Upkeep(
        config.control,
        cache=config.cache,
        l1=stores.l1,
        l2=l2,
        keying=path.keying,
        tenants=tenants,
        freshness=path.freshness,
        purge_index=path.purge_index,
        metrics=base.metrics,
    )
    admin = _admin(base, stores, front, path, tenants, upkeep, relay, switching, l2_usage)
    handler = _handler(
        base, stores, front, path, relay, resolve, switching, switcher, admin, rates is not None
    )
    quotas = _quotas(base, stores, path, tenants, switcher)
    if rates is not None:
        quotas.listeners.append(rates.apply)
        admin.rate_limits = rates.status
    sidecar = Sidecar(
        config=config,
        metrics=base.metrics,
        l1=stores.l1,
        l2=l2,
        l3=stores.l3,
        mrc=stores.mrc,
        tracker=path.keying.tracker,
        upstream=front.upstream,
        telemetry=base.telemetry,
        host=base.host,
        gate=front.gate,
        switching=switching,
        background=base.background,
        outbox=front.outbox,
        limiter=front.limiter,
        freshness=path.freshness,
        tenants=tenants,
        keying=path.keying,
        tiers=path.tiers,
        relay=relay,
        switcher=switcher,
        handler=handler,
        quotas=quotas,
        upkeep=upkeep,
        admin=admin,
        fleet=_fleet(config, stores.mrc),
        rates=rates,
        tracing=tracing,
        traced=base.kinds.front(handler),
    )
    _register_collectors(sidecar)
    return sidecar


# ------------------------------------------------------------------ the steps


class _Kinds(NamedTuple):
    """The classes of the parts tracing wraps: the plain ones, or traced.py's."""

    upstream: type[UpstreamPool]
    gate: type[AdmissionGate]
    l3: type[SemanticTier]
    tiers: type[Tiers]
    #: Identity's resolver as the handler calls it (timed when traced).
    resolve: Callable[[Resolve], Resolve]
    #: What the connections call instead of the handler (None: the handler itself).
    front: Callable[[Handler], ServerHandler | None]


def _kinds(tracing: Tracing | None) -> _Kinds:
    """Tracing on: the traced parts (traced.py, imported only then) stand in for the plain."""
    if tracing is None:
        return _Kinds(
            UpstreamPool, AdmissionGate, SemanticTier, Tiers, lambda r: r, lambda _h: None
        )
    from cachefleet_sidecar import traced

    return _Kinds(
        traced.TracedUpstream,
        traced.TracedGate,
        traced.TracedSemanticTier,
        traced.TracedTiers,
        traced.traced_resolve,
        lambda handler: traced.TracedHandler(handler, tracing),
    )


def _tracing(endpoint: str, pod: str) -> Tracing | None:
    """Traces to the OTLP ``endpoint``; None where the tracing extra is not installed."""
    from cachefleet_sidecar.observe.tracing import Tracing

    try:
        return Tracing(endpoint=endpoint, attributes={"service.instance.id": pod})
    except ImportError as exc:  # traces are never worth failing the data path for
        log.error("--otlp-endpoint: no tracing (%s): install cachefleet[tracing]", exc)
        return None


class _Base(NamedTuple):
    """What every step reads: the configuration and the parts given from outside."""

    config: SidecarConfig
    metrics: SidecarMetrics
    telemetry: GpuTelemetry
    host: HostPressure
    l2: L2 | None
    kinds: _Kinds
    background: Background


class _Stores(NamedTuple):
    l1: TenantL1[int, L1Value]
    l3: SemanticTier
    mrc: MissRatioCurves | None


def _stores(base: _Base) -> _Stores:
    """L1, the semantic tier and the tenants' miss-ratio curves."""
    config, metrics = base.config, base.metrics
    caching, max_tenants = config.caching, config.tenancy.max_tenants
    l1: TenantL1[int, L1Value] = TenantL1(
        caching.l1_bytes,
        default_policy=caching.policy.value,
        max_tenants=max_tenants,
        guest_share=config.tenancy.guest_share,
    )
    l3 = base.kinds.l3.from_settings(
        config.semantic, cache=config.cache, upstream=config.http.upstream, max_tenants=max_tenants
    )
    l3.on_shadow = lambda t, outcome: metrics.tenant(t).shadow_compared(outcome)
    adapt = config.adapt
    mrc = (
        MissRatioCurves(
            adapt.mrc_samples,
            adapt.mrc_max_rate,
            policy_sizes=tuple(int(f * caching.l1_bytes) for f in mrc_module.MINI_SIM_FRACTIONS),
            default_policy=caching.policy.value,
        )
        if adapt.mrc_samples > 0
        else None
    )
    return _Stores(l1, l3, mrc)


class _Front(NamedTuple):
    upstream: UpstreamPool
    gate: AdmissionGate | None
    #: The answers of a loop turn and their bookkeeping (the server's connections share it).
    outbox: Outbox
    limiter: Limiter


def _http_front(base: _Base) -> _Front:
    """The upstream pool, admission's gate, and the client side's outbox and limits."""
    http, adapt, metrics = base.config.http, base.config.adapt, base.metrics
    upstream = base.kinds.upstream(
        http.upstream,
        read_timeout_s=http.upstream_timeout_s,
        max_connections=http.upstream_max_connections,
        max_waiting=http.upstream_max_queued,
    )
    gate: AdmissionGate | None = None
    if adapt.admission is not None:  # class-aware admission (docs/admission.md)
        gate = base.kinds.gate(
            adapt.admission,
            adapt.admission_metrics_url or http.upstream.rstrip("/") + "/metrics",
            on_refusal=metrics.admission_refused,
            on_wait=metrics.admission_waited,
        )
    outbox = Outbox()
    return _Front(upstream, gate, outbox, Limiter(http.limits, outbox=outbox))


def _switching(settings: AdaptSettings) -> SwitchingEngine | None:
    """The policy switching engine (None: --switch-window 0)."""
    if settings.switch_window_s <= 0:
        return None
    return SwitchingEngine(SwitchingConfig(window_s=settings.switch_window_s), now=time.monotonic())


def _tenants(
    base: _Base,
    stores: _Stores,
    switcher: PolicySwitcher,
    l2_usage: dict[str, tuple[int, int]],
) -> Tenants:
    """The tenants (identity, quotas, lifetimes); L1 tells them of each replaced entry."""
    tenants = Tenants(
        base.config.tenancy,
        l1=stores.l1,
        l3=stores.l3,
        mrc=stores.mrc,
        metrics=base.metrics,
        switcher=switcher,
        l2_usage=l2_usage,
    )
    stores.l1.on_replaced = tenants.replaced
    return tenants


class _Path(NamedTuple):
    freshness: Freshness
    keying: Keying
    tiers: Tiers
    purge_index: PurgeIndex


def _request_path(
    base: _Base,
    stores: _Stores,
    tenants: Tenants,
    resolve: Resolve,
    staleness_bound_s: float | None,
) -> _Path:
    """Keys and their scope, entry TTLs, and the tiers that store and judge answers."""
    caching = base.config.caching
    freshness = Freshness(caching.ttl_s)
    keying = Keying(
        caching,
        tracker=_epochs(base.config.control, staleness_bound_s),
        metrics=base.metrics,
        resolve=resolve,
        allowed=freshness.allowed,
        l3=stores.l3,
    )
    purge_index = PurgeIndex()
    tiers = base.kinds.tiers(
        caching,
        l1=stores.l1,
        l2=base.l2,
        mrc=stores.mrc,
        metrics=base.metrics,
        keying=keying,
        freshness=freshness,
        purge_index=purge_index,
        l2_allowed=tenants.l2_allowed,
        background=base.background,
        l2_name=tenants.l2_name,
    )
    return _Path(freshness, keying, tiers, purge_index)


def _epochs(settings: ControlSettings, staleness_bound_s: float | None) -> EpochTracker:
    """Invalidation epochs; until :meth:`Keying.enable_epochs` they do not gate L1."""
    bound = settings.staleness_bound_s if staleness_bound_s is None else staleness_bound_s
    # Serve-stale (the InferenceCache's outage choice) is a longer, stated bound: while
    # Redis answers, epochs are confirmed every poll and invalidations arrive as fast
    # as in strict mode; only when confirmations stop does the longer bound matter.
    tracker = EpochTracker(max(bound, settings.redis_outage_staleness_s))
    tracker.valid_until = math.inf
    return tracker


def _rates(base: _Base) -> RateLimiter | None:
    """Rate limits (docs/rate-limits.md): from --tenant-limits, or the operator's table."""
    config = base.config
    tenancy = config.tenancy
    if not (tenancy.tenant_limits or config.redis_url):
        return None
    return RateLimiter(
        config.cache,
        limits=tenancy.tenant_limits,
        client=resp_client(config.redis_url) if config.redis_url else None,
        background=base.background,
        count_hits=tenancy.limits_count_hits,
        on_refused=base.metrics.rate_limited,
    )


def _admin(
    base: _Base,
    stores: _Stores,
    front: _Front,
    path: _Path,
    tenants: Tenants,
    upkeep: Upkeep,
    relay: Relay,
    switching: SwitchingEngine | None,
    l2_usage: dict[str, tuple[int, int]],
) -> Admin:
    """Status, heartbeat and the admin endpoints, over every part they report on."""
    return Admin(
        base.config,
        l1=stores.l1,
        l2=base.l2,
        l3=stores.l3,
        keying=path.keying,
        tenants=tenants,
        upkeep=upkeep,
        relay=relay,
        metrics=base.metrics,
        telemetry=base.telemetry,
        gate=front.gate,
        switching=switching,
        host=base.host,
        l2_usage=l2_usage,
    )


def _handler(
    base: _Base,
    stores: _Stores,
    front: _Front,
    path: _Path,
    relay: Relay,
    resolve: Resolve,
    switching: SwitchingEngine | None,
    switcher: PolicySwitcher,
    admin: Admin,
    rate_limited: bool,
) -> Handler:
    """The request path; with --limits-count-hits and rate limits, the handler that counts
    a limited tenant's hits (outside the fast path)."""
    config, metrics = base.config, base.metrics
    counts_hits = config.tenancy.limits_count_hits and rate_limited
    handler_class = HitsCountedHandler if counts_hits else Handler
    return handler_class(
        config.caching,
        admin_on_proxy=config.admin_listen is None,
        keying=path.keying,
        tiers=path.tiers,
        relay=relay,
        resolve=resolve,
        l1=stores.l1,
        l2=base.l2,
        l3=stores.l3,
        metrics=metrics,
        switcher=None if switching is None else switcher,
        hits=HitBook(
            metrics,
            front.outbox,
            mrc=stores.mrc,
            switching=switching,
            prices=config.caching.price_table,
            on_observed=None if switching is None else switcher.switch_due,
        ),
        outbox=front.outbox,
        background=base.background,
        admin=admin.handle,
    )


def _quotas(
    base: _Base, stores: _Stores, path: _Path, tenants: Tenants, switcher: PolicySwitcher
) -> QuotaApplier:
    """What applies the operator's quota table to every part it moves."""
    return QuotaApplier(
        base.config.tenancy,
        tenants=tenants,
        keying=path.keying,
        freshness=path.freshness,
        l1=stores.l1,
        l2=base.l2,
        l3=stores.l3,
        mrc=stores.mrc,
        switcher=switcher,
        background=base.background,
    )


def _fleet(config: SidecarConfig, mrc: MissRatioCurves | None) -> FleetShipper | None:
    """Samples for the fleet-wide curves (None: no Redis, or curves off)."""
    if mrc is None or not config.redis_url:
        return None
    client = resp_client(config.redis_url)
    return FleetShipper(mrc, config.cache, config.pod, client, rate=config.adapt.fleet_sample_rate)


def _register_collectors(sc: Sidecar) -> None:
    """Every collector, each from the part that owns the state it reads."""
    cache, metrics = sc.config.cache, sc.metrics
    sources = metrics.gauge_sources
    metrics.usage_source = sc.admin.usage
    sources.append(sc.telemetry.collect)
    if sc.l2 is not None:
        sources.append(sc.l2.families)
    sources.append(sc.upkeep.families)
    sources.append(partial(guest_families, cache, sc.admin.guest_pool))
    if sc.mrc is not None:
        sources.append(partial(reuse_families, cache, sc.mrc))
    sources.append(sc.l3.families)
    if sc.gate is not None:
        sources.append(partial(admission_families, cache, sc.gate.core))
    sources.append(partial(sc.limiter.families, cache))
    sources.append(partial(sc.upstream.families, cache))
    if sc.rates is not None:
        sources.append(sc.rates.families)
    if sc.fleet is not None:
        sources.append(sc.fleet.families)
