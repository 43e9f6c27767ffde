"""The composition root: every part of a sidecar, built from its :class:`SidecarConfig`.

:func:`build` makes each part and hands it the parts it uses, explicitly; no
part reaches another through a shared object. The :class:`Sidecar` it returns
is only the list of parts, for the server (their lifecycle) and for tests.
Every metric collector is registered here, each by the part that owns it.

The rooms (packages; each ``__init__`` is empty):

* ``http/``: the client side (:mod:`http.server`), the upstream pool
  (:mod:`http.upstream`), the relay (:class:`http.relay.Relay`), wire helpers;
* ``cache/``: the request path (:class:`cache.handler.Handler`, with
  :class:`cache.keying.Keying` for keys and their scope), the tier glue
  (:class:`cache.tiers.Tiers`, :class:`cache.tiers.Freshness`, the typed
  :class:`cache.tiers.L2` interface), entries, keys, L1 and its policies, L2
  (Redis), L3 (semantic), the purge index;
* ``tenancy/``: identity rules, :class:`tenancy.tenants.Tenants`,
  :class:`tenancy.tenants.QuotaApplier`;
* ``adapt/``: policy switching (:class:`adapt.switcher.PolicySwitcher`), curves
  (and the fleet samples they forward), GPU and host pressure, admission;
* ``control/``: the control sync, :class:`control.upkeep.Upkeep` (purges,
  warm-up, epoch metrics);
* ``observe/``: metrics, savings, :class:`observe.admin.Admin` (status, heartbeat,
  admin endpoints).

``contract/`` (the Redis contract with the operator: names, messages, Lua,
operations), ``epochs`` and ``resp`` stay at the top, with ``config``,
``tasks``, this module and ``app``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from cachefleet_common.contract.clients import resp_client
from cachefleet_common.epochs import EpochTracker
from cachefleet_sidecar.adapt import mrc as mrc_module
from cachefleet_sidecar.adapt.fleetsample import FleetShipper
from cachefleet_sidecar.adapt.host import HostPressure
from cachefleet_sidecar.adapt.mrc import MissRatioCurves
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
from cachefleet_sidecar.control.upkeep import Upkeep
from cachefleet_sidecar.http.gate import AdmissionGate
from cachefleet_sidecar.http.outbox import Outbox
from cachefleet_sidecar.http.relay import Relay
from cachefleet_sidecar.http.server import Handler as ServerHandler
from cachefleet_sidecar.http.server import Limiter, Limits
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
    ``config.redis_url``; ``tracing``: instead of one for ``config.otlp_endpoint``;
    nothing connects until the server starts)."""
    if staleness_bound_s is None:
        staleness_bound_s = config.staleness_bound_s
    # Serve-stale (the InferenceCache's outage choice) is a longer, stated bound: while
    # Redis answers, epochs are confirmed every poll and invalidations arrive as fast
    # as in strict mode; only when confirmations stop does the longer bound matter.
    staleness_bound_s = max(staleness_bound_s, config.redis_outage_staleness_s)
    cache = config.cache
    metrics = metrics or SidecarMetrics(cache, config.max_tenants)
    telemetry = telemetry or GpuTelemetry()
    host = host or HostPressure()
    if l2 is None and config.redis_url:
        from cachefleet_sidecar.cache.l2 import (
            RedisL2,  # redis-py is imported only by sidecars that use Redis
        )

        l2 = RedisL2.from_url(config.redis_url, cache, ttl_s=config.l2_ttl_s)
    # Tracing on: the traced parts (traced.py) stand in for the plain ones.
    upstream_cls: type[UpstreamPool] = UpstreamPool
    gate_cls: type[AdmissionGate] = AdmissionGate
    l3_cls: type[SemanticTier] = SemanticTier
    tiers_cls: type[Tiers] = Tiers
    if tracing is None and config.otlp_endpoint:
        from cachefleet_sidecar.observe.tracing import Tracing

        try:
            pod = {"service.instance.id": config.pod}
            tracing = Tracing(endpoint=config.otlp_endpoint, attributes=pod)
        except ImportError as exc:  # traces are never worth failing the data path for
            log.error("--otlp-endpoint: no tracing (%s): install cachefleet[tracing]", exc)
    if tracing is not None:
        from cachefleet_sidecar import traced

        upstream_cls, gate_cls = traced.TracedUpstream, traced.TracedGate
        l3_cls, tiers_cls = traced.TracedSemanticTier, traced.TracedTiers
    l1: TenantL1[int, L1Value] = TenantL1(
        config.l1_bytes,
        default_policy=config.policy.value,
        max_tenants=config.max_tenants,
        guest_share=config.guest_share,
    )
    l3 = l3_cls.from_config(config)
    l3.on_shadow = lambda t, outcome: metrics.tenant(t).shadow_compared(outcome)
    mrc = (
        MissRatioCurves(
            config.mrc_samples,
            config.mrc_max_rate,
            policy_sizes=tuple(int(f * config.l1_bytes) for f in mrc_module.MINI_SIM_FRACTIONS),
            default_policy=config.policy.value,
        )
        if config.mrc_samples > 0
        else None
    )
    #: Invalidation epochs; until :meth:`Keying.enable_epochs` they do not gate L1.
    tracker = EpochTracker(staleness_bound_s)
    tracker.valid_until = math.inf
    upstream = upstream_cls(
        config.upstream,
        read_timeout_s=config.upstream_timeout_s,
        max_connections=config.upstream_max_connections,
        max_waiting=config.upstream_max_queued,
    )
    gate: AdmissionGate | None = None
    if config.admission is not None:  # class-aware admission (docs/admission.md)
        gate = gate_cls(
            config.admission,
            config.admission_metrics_url or config.upstream.rstrip("/") + "/metrics",
            on_refusal=metrics.admission_refused,
            on_wait=metrics.admission_waited,
        )
    switching = (
        SwitchingEngine(SwitchingConfig(window_s=config.switch_window_s), now=time.monotonic())
        if config.switch_window_s > 0
        else None
    )
    background = Background()
    #: The answers of a loop turn and their bookkeeping (the server's connections share it).
    outbox = Outbox()
    limiter = Limiter(
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
        outbox=outbox,
    )
    l2_usage: dict[str, tuple[int, int]] = {}
    purge_index = PurgeIndex()

    switcher = PolicySwitcher(
        engine=switching,
        l1=l1,
        mrc=mrc,
        metrics=metrics,
        telemetry=telemetry,
        host=host,
        background=background,
    )
    tenants = Tenants(
        config, l1=l1, l3=l3, mrc=mrc, metrics=metrics, switcher=switcher, l2_usage=l2_usage
    )
    l1.on_replaced = tenants.replaced
    resolve = tenants.resolve if tracing is None else traced.traced_resolve(tenants.resolve)
    freshness = Freshness(config)
    keying = Keying(
        config,
        tracker=tracker,
        metrics=metrics,
        resolve=resolve,
        freshness=freshness,
        l3=l3,
    )
    tiers = tiers_cls(
        config,
        l1=l1,
        l2=l2,
        mrc=mrc,
        metrics=metrics,
        keying=keying,
        freshness=freshness,
        purge_index=purge_index,
        l2_allowed=tenants.l2_allowed,
        background=background,
        l2_name=tenants.l2_name,
    )
    # -- rate limits (docs/rate-limits.md): from --tenant-limits, or the operator's table
    rates: RateLimiter | None = None
    if config.tenant_limits or config.redis_url:
        rates = RateLimiter(
            cache,
            limits=config.tenant_limits,
            client=resp_client(config.redis_url) if config.redis_url else None,
            background=background,
            count_hits=config.limits_count_hits,
            on_refused=metrics.rate_limited,
        )
    # --
    if gate is not None:  # GIE's headers: a request's class and flow (tenancy)
        gate.flow_of = tenants.admission_of
    relay = Relay(
        config,
        upstream=upstream,
        metrics=metrics,
        gate=gate,
        priority_class=tenants.priority_class,
        rates=rates,
    )
    upkeep = Upkeep(
        config,
        l1=l1,
        l2=l2,
        keying=keying,
        tenants=tenants,
        freshness=freshness,
        purge_index=purge_index,
        metrics=metrics,
    )
    admin = Admin(
        config,
        l1=l1,
        l2=l2,
        l3=l3,
        keying=keying,
        tenants=tenants,
        upkeep=upkeep,
        relay=relay,
        metrics=metrics,
        telemetry=telemetry,
        gate=gate,
        switching=switching,
        host=host,
        l2_usage=l2_usage,
    )
    # --limits-count-hits: a rate-limited tenant's hits are counted, outside the fast path
    counts_hits = config.limits_count_hits and rates is not None
    handler_class = HitsCountedHandler if counts_hits else Handler
    handler = handler_class(
        config,
        keying=keying,
        tiers=tiers,
        freshness=freshness,
        relay=relay,
        resolve=resolve,
        l1=l1,
        l2=l2,
        l3=l3,
        mrc=mrc,
        metrics=metrics,
        upstream=upstream,
        gate=gate,
        switcher=None if switching is None else switcher,
        hits=HitBook(
            metrics,
            outbox,
            mrc=mrc,
            switching=switching,
            prices=config.price_table,
            on_observed=None if switching is None else switcher.switch_due,
        ),
        outbox=outbox,
        background=background,
        admin=admin.handle,
    )
    quotas = QuotaApplier(
        config,
        tenants=tenants,
        keying=keying,
        freshness=freshness,
        l1=l1,
        l2=l2,
        l3=l3,
        mrc=mrc,
        switcher=switcher,
        background=background,
    )
    if rates is not None:
        quotas.listeners.append(rates.apply)
        admin.rate_limits = rates.status

    # Every collector, each from the part that owns the state it reads.
    metrics.usage_source = admin.usage
    metrics.gauge_sources.append(telemetry.collect)
    if l2 is not None:
        metrics.gauge_sources.append(l2.families)
    metrics.gauge_sources.append(upkeep.families)
    metrics.gauge_sources.append(partial(guest_families, cache, admin.guest_pool))
    if mrc is not None:
        metrics.gauge_sources.append(partial(reuse_families, cache, mrc))
    metrics.gauge_sources.append(l3.families)
    if gate is not None:
        metrics.gauge_sources.append(partial(admission_families, cache, gate.core))
    metrics.gauge_sources.append(partial(limiter.families, cache))
    metrics.gauge_sources.append(partial(upstream.families, cache))
    if rates is not None:
        metrics.gauge_sources.append(rates.families)
    fleet = None
    if mrc is not None and config.redis_url:  # samples for the fleet-wide curves
        client = resp_client(config.redis_url)
        fleet = FleetShipper(mrc, cache, config.pod, client, rate=config.fleet_sample_rate)
        metrics.gauge_sources.append(fleet.families)

    return Sidecar(
        config=config,
        metrics=metrics,
        l1=l1,
        l2=l2,
        l3=l3,
        mrc=mrc,
        tracker=tracker,
        upstream=upstream,
        telemetry=telemetry,
        host=host,
        gate=gate,
        switching=switching,
        background=background,
        outbox=outbox,
        limiter=limiter,
        freshness=freshness,
        tenants=tenants,
        keying=keying,
        tiers=tiers,
        relay=relay,
        switcher=switcher,
        handler=handler,
        quotas=quotas,
        upkeep=upkeep,
        admin=admin,
        fleet=fleet,
        rates=rates,
        tracing=tracing,
        traced=None if tracing is None else traced.TracedHandler(handler, tracing),
    )
