"""One reconcile of an InferenceCache, independent of kopf.

:class:`Reconciler` reads metrics, allocates, publishes to the sidecars and
returns an :class:`Outcome`: the status patch, the Events to emit and the
kind of failure, if any. ``handlers.py`` turns an Outcome into kopf terms
(status patch, ``kopf.event``, ``TemporaryError`` / ``PermanentError``), so
the logic here is tested with fakes and no Kubernetes at all.

Model version: when ``spec.model.version`` differs from the version in the
status, the model scope's epoch is advanced to one past the epoch the status
recorded with the old version (CAS, fence, announce, see
:mod:`cachefleet_operator.invalidation`; a reconcile whose status patch was
lost finds Redis already there and does not advance twice) and the reconcile waits up to
:data:`~cachefleet_operator.invalidation.MODEL_ACK_WAIT_S` for the
acknowledgements; status then shows ``modelVersion``, the epochs and
``sidecars.epochsInSync`` (re-read on every reconcile, so convergence shows
up even when it took longer). Every reconcile also merges the epochs of the
status back into Redis (max only), so a Redis that restarted without
persistence never goes back to older epochs.

Rate limits: every reconcile that publishes also reads the buckets the
sidecars keep for each tenant with ``limits`` (on Redis's clock) and writes
``status.tenants[].limits``: each limit, used, remaining, seconds to full
(:func:`limits_usage`, the arithmetic of the sidecars' ``x-ratelimit-*``
headers). A failed read leaves the usage out, never a fault.

Fault policy: Prometheus unreachable or without data -> the last allocation
is kept (or a class-based one on first sight), ``Degraded``; Redis
unreachable -> nothing new is recorded as in force, ``Ready=False``,
``Degraded``; both are temporary. An invalid spec -> ``Ready=False`` with the
field named, a Warning Event, and a permanent failure (no retry storm).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from pydantic import ValidationError
from redis.exceptions import RedisError

from cachefleet_common.contract.fleet import decode_fleet_batch
from cachefleet_common.contract.messages import QuotaAssignment, RateLimits, TenantQuota
from cachefleet_common.contract.names import Policy, cache_ref
from cachefleet_common.contract.ops import read_epochs, restore_epochs
from cachefleet_common.epochs import model_scope
from cachefleet_common.limits import BUCKETS, TenantLimits, usage
from cachefleet_operator.allocation import (
    Allocation,
    AllocationParams,
    MetricsTable,
    TenantDemand,
    TenantMetrics,
    allocate,
    describe_moves,
    fleet_hit_ratio,
    hold,
    needed_hit_ratio,
    quota_moves,
)
from cachefleet_operator.api import (
    Condition,
    ConditionStatus,
    InferenceCacheSpec,
    InferenceCacheStatus,
    LimitUsage,
    ObservedMetrics,
    RedisEndpoint,
    RoutingStatus,
    SavingsStatus,
    SemanticSpec,
    SidecarStatus,
    SpecError,
    TenantLimitsSpec,
    TenantLimitsUsage,
    TenantSpec,
    TenantStatus,
    listed_l1_bytes,
    listed_l2_bytes,
    parse_redis_endpoint,
    parse_spec,
    unlisted_l1_bytes,
    unlisted_l2_bytes,
)
from cachefleet_operator.fleet import FleetCurves
from cachefleet_operator.invalidation import (
    MODEL_ACK_WAIT_S,
    InvalidatorFactory,
    redis_invalidator,
)
from cachefleet_operator.metrics import OperatorMetrics
from cachefleet_operator.metrics_source import (
    MetricsSource,
    MetricsSourceFactory,
    MetricsUnavailable,
    PolicySwitches,
    PolicySwitchSource,
    SavingsSource,
    prometheus_source,
)
from cachefleet_operator.outcome import (
    Event,
    Outcome,
    SecretUnavailable,
    now_rfc3339,
    parse_rfc3339,
)
from cachefleet_operator.pressure import TenantPressure, slo_pressure
from cachefleet_operator.publisher import (
    ControlPlane,
    ControlPlaneFactory,
    ControlPlaneUnavailable,
    redis_control_plane,
)

log = logging.getLogger(__name__)

#: Share moves smaller than this (fraction of capacity) are not announced as Events.
EVENT_MIN_MOVE = 0.005
#: First retry delay after a temporary fault, seconds; doubles per retry.
RETRY_BASE_DELAY_S = 2.0
#: Longest retry delay after a temporary fault, seconds.
RETRY_MAX_DELAY_S = 60.0
#: Shortest span of policy switches worth a query: a reconcile sooner than this
#: after the last report leaves the span to the next one (nothing is lost).
POLICY_EVENTS_MIN_SPAN_S = 5.0
#: Longest span one reconcile reports (after a long outage, older switches are not).
POLICY_EVENTS_MAX_SPAN_S = 3600.0

READY = "Ready"
DEGRADED = "Degraded"
SLA_VIOLATED = "SLAViolated"
#: True while some tenant's SLA is out of cache's reach (no share within bounds meets it).
CACHE_CANNOT_MEET_SLA = "CacheCannotMeetSLA"
#: Estimated requests a tenant's curve must stand on (over the curve window) before the
#: operator says cache cannot meet the tenant's SLA: a cold start's curve is all first
#: accesses, and says nothing yet about reuse.
REACH_MIN_REQUESTS = 1000.0
#: Rebalances in a row the evidence must hold before ``CacheCannotMeetSLA`` names a tenant
#: (so never on the first rebalance, and never for a transient dip).
REACH_REBALANCES = 3


class SecretReader(Protocol):
    """Reads one key of a Secret (injectable; the default uses the Kubernetes API)."""

    async def read(self, namespace: str, name: str, key: str) -> str: ...


def policy_switch_events(found: list[PolicySwitches]) -> list[Event]:
    """One Event per tenant and (from, to): the sidecars' switches and rollbacks.

    The switching engine only ever switches *to* SITS; a move away from SITS
    is its rollback (docs/sits.md).
    """
    events = []
    for s in found:
        pods = f"{s.pods} pod{'' if s.pods == 1 else 's'}"
        if s.from_policy == Policy.SITS.value:
            events.append(
                Event(
                    "Normal",
                    "PolicyRolledBack",
                    f"tenant {s.tenant}: L1 policy rolled back {s.from_policy} -> "
                    f"{s.to_policy} on {pods} (the switch did not bring P99 under its bar)",
                )
            )
        else:
            events.append(
                Event(
                    "Normal",
                    "PolicySwitched",
                    f"tenant {s.tenant}: L1 policy switched {s.from_policy} -> {s.to_policy} "
                    f"on {pods} (P99 stayed over its baseline)",
                )
            )
    return events


def retry_delay(retry: int) -> float:
    """Backoff before retry number ``retry`` (0-based)."""
    return min(RETRY_MAX_DELAY_S, RETRY_BASE_DELAY_S * (2.0 ** max(0, min(retry, 16))))


def set_condition(
    conditions: list[Condition],
    type_: str,
    status: ConditionStatus,
    reason: str,
    message: str,
    generation: int | None,
    now: str,
) -> list[Condition]:
    """``conditions`` with ``type_`` set; the transition time moves only when status does."""
    out: list[Condition] = []
    found = False
    for c in conditions:
        if c.type == type_:
            found = True
            since = c.last_transition_time if c.status == status else now
            out.append(
                Condition(
                    type=type_,
                    status=status,
                    reason=reason,
                    message=message,
                    last_transition_time=since or now,
                    observed_generation=generation,
                )
            )
        else:
            out.append(c)
    if not found:
        out.append(
            Condition(
                type=type_,
                status=status,
                reason=reason,
                message=message,
                last_transition_time=now,
                observed_generation=generation,
            )
        )
    return out


def condition(conditions: list[Condition], type_: str) -> Condition | None:
    return next((c for c in conditions if c.type == type_), None)


def shedding_events(previous: SidecarStatus | None, shedding: list[str]) -> list[Event]:
    """An Event per pod whose admission started or stopped shedding since the last reconcile."""
    before = set((previous.shedding if previous is not None else None) or [])
    now = set(shedding)
    started = [
        Event(
            "Warning",
            "AdmissionShedding",
            f"pod {pod}: model server saturated; BestEffort misses get 429, Standard ones wait",
        )
        for pod in sorted(now - before)
    ]
    stopped = [
        Event("Normal", "AdmissionRecovered", f"pod {pod}: model server has room; shedding stopped")
        for pod in sorted(before - now)
    ]
    return started + stopped


def demands_from_spec(spec: InferenceCacheSpec) -> list[TenantDemand]:
    """The allocation view of a validated spec's tenants."""
    return [
        TenantDemand(
            name=t.name,
            priority_class=t.priority_class,
            min_share=t.min_share,
            max_share=t.max_share,
            p95_target_s=t.sla.p95_latency_seconds if t.sla else None,
            min_hit_ratio=t.sla.min_hit_ratio if t.sla else None,
            min_rps=t.sla.min_rps if t.sla else None,
            ttft_target_s=t.sla.ttft_p95_seconds if t.sla else None,
            itl_target_s=t.sla.itl_p95_seconds if t.sla else None,
        )
        for t in spec.tenants
    ]


def slo_targets(spec: InferenceCacheSpec) -> dict[tuple[str, str], float]:
    """(tenant, objective) -> the seconds each tenant's ``sla`` states (latency, ttft, itl)."""
    out: dict[tuple[str, str], float] = {}
    for t in spec.tenants:
        if t.sla is None:
            continue
        for objective, seconds in (
            ("latency", t.sla.p95_latency_seconds),
            ("ttft", t.sla.ttft_p95_seconds),
            ("itl", t.sla.itl_p95_seconds),
        ):
            if seconds is not None:
                out[(t.name, objective)] = seconds
    return out


def build_assignment(spec: InferenceCacheSpec, allocation: Allocation) -> QuotaAssignment:
    """The quota table for the sidecars (generation 0; set by the caller).

    With ``tenantDefaults``, ``default_tenant`` tells the sidecars how to treat
    a tenant the table does not name: its class, its policy, the L1 pool all
    of them share on each pod and the L2 pool all of them share fleet-wide.
    """
    by_name = {t.name: t for t in spec.tenants}
    defaults = spec.tenant_defaults
    return QuotaAssignment(
        generation=0,
        default_policy=spec.default_policy,
        model=spec.model.name,
        model_version=spec.model.version,
        default_tenant=None
        if defaults is None
        else TenantQuota(
            l1_bytes=unlisted_l1_bytes(spec),
            l2_bytes=unlisted_l2_bytes(spec),
            l2_guest_max_share=defaults.l2_guest_max_share,
            policy=defaults.policy,
            priority_class=defaults.priority_class,
            fairness_weight=_weight(defaults.fairness_weight),
        ),
        tenants={
            t.name: TenantQuota(
                l1_bytes=t.l1_bytes,
                l2_bytes=t.l2_bytes,
                policy=by_name[t.name].policy,
                collapse_whitespace=by_name[t.name].collapse_whitespace,
                cache_nondeterministic=by_name[t.name].cache_nondeterministic,
                semantic=_semantic(by_name[t.name]).enabled if by_name[t.name].semantic else None,
                semantic_threshold=_semantic(by_name[t.name]).threshold,
                semantic_shadow=_semantic(by_name[t.name]).shadow,
                priority_class=by_name[t.name].priority_class.value,
                ttl_seconds=by_name[t.name].ttl_seconds or spec.ttl_seconds,
                allow_bypass=_cache_control(by_name[t.name], "allow_bypass"),
                allow_max_age=_cache_control(by_name[t.name], "allow_max_age"),
                limits=_limits(by_name[t.name]),
                fairness_weight=_weight(by_name[t.name].fairness_weight),
            )
            for t in allocation.tenants
        },
        ttl_seconds=spec.ttl_seconds,
        objectives={o.name: o.priority_class.value for o in spec.objectives},
    )


def _weight(weight: float) -> float | None:
    """A fairness weight for the sidecars: None for the default (1), as old tables said."""
    return None if weight == 1.0 else weight


def _cache_control(tenant: TenantSpec, field: str) -> bool | None:
    """A tenant's Cache-Control allowance for the sidecars: False, or None (allowed)."""
    if tenant.cache_control is None or getattr(tenant.cache_control, field):
        return None
    return False


def _limits(tenant: TenantSpec) -> RateLimits | None:
    """A tenant's request and token limits for the sidecars (None: none set)."""
    spec = tenant.limits
    if spec is None or spec == TenantLimitsSpec():
        return None
    return RateLimits(
        requests_per_minute=spec.requests_per_minute,
        tokens_per_minute=spec.tokens_per_minute,
        tokens_per_day=spec.tokens_per_day,
    )


def tenant_limits(spec: InferenceCacheSpec) -> dict[str, TenantLimits]:
    """The tenants of ``spec`` that state limits, and their limits."""
    out = {}
    for t in spec.tenants:
        limits = _limits(t)
        if limits is not None:
            out[t.name] = TenantLimits(
                limits.requests_per_minute, limits.tokens_per_minute, limits.tokens_per_day
            )
    return out


def limits_usage(limits: TenantLimits, tats_ms: list[float], now_ms: float) -> TenantLimitsUsage:
    """``status.tenants[].limits``: each stated limit against its bucket at ``now_ms``, by
    the arithmetic of the sidecars' ``x-ratelimit-*`` headers (``tats_ms``, ``now_ms``:
    milliseconds on Redis's clock, the script's)."""
    field_of = {name: field for name, field, _ in BUCKETS}
    parts = {
        field_of[b.name]: LimitUsage(
            limit=b.limit,
            used=b.used,
            remaining=b.remaining,
            reset_seconds=round(b.reset_s, 3),
        )
        for b in usage(tats_ms, now_ms, limits)
    }
    return TenantLimitsUsage.model_validate(parts)


def _semantic(tenant: TenantSpec) -> SemanticSpec:
    """A tenant's L3 settings (no ``semantic`` block: the sidecar's default, off unless set)."""
    return tenant.semantic or SemanticSpec()


def assignment_digest(assignment: QuotaAssignment) -> str:
    """Digest of what the sidecars act on (not generation or issue time)."""
    # Without tenantDefaults the digest is what it was before default_tenant existed,
    # so an upgrade does not move every cache's quota generation.
    # A listed tenant's l2_guest_max_share is always None (it is the pool's): left out too.
    skip: dict[str, Any] = {"generation": True, "issued_at": True}
    skip["tenants"] = {"__all__": {"l2_guest_max_share"}}
    if assignment.default_tenant is None:
        skip["default_tenant"] = True
    body = assignment.model_dump(mode="json", exclude=skip)
    quotas = [*body["tenants"].values(), body.get("default_tenant") or {}]
    for quota in quotas:  # limits unset: the digest of before they existed
        if quota.get("limits") is None:
            quota.pop("limits", None)
    # Fair queuing's fields, when at their defaults, leave the digest as it was before them.
    if not body.get("objectives"):
        body.pop("objectives", None)
    for part in [body.get("default_tenant"), *(body.get("tenants") or {}).values()]:
        if isinstance(part, dict) and part.get("fairness_weight") is None:
            part.pop("fairness_weight", None)
    raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def routing_status(name: str, spec: InferenceCacheSpec) -> RoutingStatus | None:
    """``status.routing`` of the cache ``name``: the pool routing to it, or None when off."""
    pool = spec.routing.pool_name(name)
    if pool is None:
        return None
    source = "Referenced" if spec.routing.inference_pool_ref is not None else "Rendered"
    return RoutingStatus(pool=pool, pool_source=source)


def _previous_status(raw: Mapping[str, Any] | None) -> InferenceCacheStatus:
    try:
        return InferenceCacheStatus.model_validate(dict(raw or {}))
    except ValidationError:
        return InferenceCacheStatus()


def _tenant_status(
    allocation: Allocation,
    saved: Mapping[str, Mapping[str, float]] | None = None,
    currency: str | None = None,
    limits: Mapping[str, TenantLimitsUsage] | None = None,
) -> list[TenantStatus]:
    out = []
    for i, t in enumerate(allocation.tenants):
        m = allocation.metrics.get(t.name) if allocation.metrics else None
        observed = (
            ObservedMetrics(
                p95_seconds=m.p95_s,
                hit_ratio=m.hit_ratio,
                rps=m.rps,
                ttft_p95_seconds=m.ttft_p95_s,
                itl_p95_seconds=m.itl_p95_s,
            )
            if m is not None
            else None
        )
        out.append(
            TenantStatus(
                name=t.name,
                priority_class=t.priority_class,
                share=t.share,  # exact: a held allocation must reproduce the same bytes
                weight=round(t.weight, 6),
                l1_bytes=t.l1_bytes,
                l2_bytes=t.l2_bytes,
                reason=allocation.reason(i),
                observed=observed,
                sla_met=t.sla_met,
                savings=None
                if saved is None
                else savings_status([saved.get(t.name, {})], currency),
                limits=(limits or {}).get(t.name),
            )
        )
    return out


async def _savings(
    source: MetricsSource | None, cache: str, spec: InferenceCacheSpec
) -> dict[str, dict[str, float]] | None:
    """Per-tenant savings over the window; None when unknown (never a fault)."""
    if source is None or not isinstance(source, SavingsSource):
        return None
    try:
        return await source.savings(cache, spec.prometheus.window)
    except MetricsUnavailable:
        return None


def savings_status(
    parts: Iterable[Mapping[str, float]], currency: str | None = None
) -> SavingsStatus:
    """``parts`` (:func:`~cachefleet_operator.metrics_source.savings_from` values) added up.

    ``currency`` (spec.savings.currency) goes with a cost, never without one.
    """
    total: dict[str, float] = {}
    for part in parts:
        for name, value in part.items():
            total[name] = total.get(name, 0.0) + value
    cost = total.get("cost")
    return SavingsStatus(
        model_seconds=round(total.get("model_seconds", 0.0), 3),
        prompt_tokens=round(total.get("prompt_tokens", 0.0)),
        completion_tokens=round(total.get("completion_tokens", 0.0)),
        cost=None if cost is None else round(cost, 6),
        currency=None if cost is None else currency,
    )


def saved_model_hours(saved: Mapping[str, Mapping[str, float]] | None) -> float | None:
    """The SAVED column: model-hours over the window, all tenants (4 decimals: 0.36 s)."""
    if saved is None:
        return None
    return round(sum(part.get("model_seconds", 0.0) for part in saved.values()) / 3600.0, 4)


def _sla_condition(allocation: Allocation) -> tuple[ConditionStatus, str, str, str]:
    """(status, reason, message, attainment text) of SLAViolated."""
    known = [t for t in allocation.tenants if t.sla_met is not None]
    missing = [t.name for t in known if not t.sla_met]
    attainment = f"{len(known) - len(missing)}/{len(known)}"
    if not known:
        return ConditionStatus.UNKNOWN, "NoObservations", "no SLA observations yet", "-"
    if missing:
        names = ", ".join(missing[:10]) + (" ..." if len(missing) > 10 else "")
        return ConditionStatus.TRUE, "TenantsMissSLA", f"SLA missed by: {names}", attainment
    return (
        ConditionStatus.FALSE,
        "AllTenantsMeetSLA",
        "every observed tenant meets its SLA",
        attainment,
    )


def window_seconds(window: str) -> float:
    """Seconds of a PromQL window as the spec writes it (digits, then ``s``, ``m`` or ``h``)."""
    return float(window[:-1]) * {"s": 1.0, "m": 60.0, "h": 3600.0}[window[-1]]


def reach_evidence(
    allocation: Allocation,
    in_force: Mapping[str, float],
    window_s: float,
    min_requests: float = REACH_MIN_REQUESTS,
) -> set[str]:
    """Tenants whose SLA cache cannot meet, on this rebalance's evidence alone.

    The allocator's finding (``cannot_meet``, read on one pod's curve) counts
    only when the tenant does not meet its SLA now (one that does is within
    reach, whatever its curve says), its curve stands on at least
    ``min_requests`` estimated requests over the curve window (``window_s``),
    and, when the finding is that no cache size reaches the SLA, the fleet
    does not reach it either: neither the best of its fleet-wide curve (one
    cache the fleet shares, where a key's first access on a pod that L2
    answers is a hit; counted when it too stands on ``min_requests``) nor the
    pod curve's best plus the hits the fleet adds beyond it at the share in
    force (:func:`fleet_hit_ratio`, what the observed hit ratio shows) reaches
    the hit ratio the SLA needs.
    """
    demands = {d.name: d for d in allocation.demands}
    out = set()
    for t in allocation.tenants:
        m = allocation.metrics.get(t.name) if allocation.metrics else None
        if not t.why_not or t.sla_met or m is None or m.curve is None:
            continue
        if m.curve.requests * window_s < min_requests:
            continue
        if t.beyond_any_size:
            need = needed_hit_ratio(demands[t.name], m)
            size = in_force.get(t.name, t.share) * allocation.l1_capacity
            best = fleet_hit_ratio(m.curve, m.hit_ratio, size)
            fleet = m.fleet_curve
            if fleet is not None and fleet.requests * window_s >= min_requests:
                best = max(best, fleet.max_hit_ratio)
            if need is not None and best >= need - 1e-9:
                continue
        out.add(t.name)
    return out


async def _read_limits_usage(
    plane: ControlPlane, cache: str, spec: InferenceCacheSpec
) -> dict[str, TenantLimitsUsage] | None:
    """Each limited tenant's usage against its limits, from the buckets the sidecars
    keep in Redis; None when there are none or they could not be read (never a fault:
    the quotas were published, the usage is only shown)."""
    limited = tenant_limits(spec)
    if not limited:
        return None
    try:
        now_ms, tats = await plane.rate_limit_state(cache, sorted(limited))
    except (ControlPlaneUnavailable, RedisError, OSError) as exc:
        log.debug("%s: rate-limit usage not read: %s", cache, exc)
        return None
    return {
        tenant: limits_usage(limits, tats.get(tenant, [0.0, 0.0, 0.0]), now_ms)
        for tenant, limits in limited.items()
    }


class ReachWarnings:
    """Which tenants ``CacheCannotMeetSLA`` names: evidence that held for rebalances in a row.

    The count of rebalances in a row is kept per cache and tenant, in
    memory; a rebalance without the evidence (a curve reset, too few
    requests, the SLA met) starts it over. An operator that restarts has no
    counts: the tenants the condition already named are taken as confirmed
    (the condition is the record of that), every other starts from zero.
    """

    def __init__(
        self, min_requests: float = REACH_MIN_REQUESTS, rebalances: int = REACH_REBALANCES
    ) -> None:
        self.min_requests = min_requests
        self.rebalances = max(1, rebalances)
        self._counts: dict[str, dict[str, int]] = {}

    def observe(self, cache: str, evidence: set[str], named_before: set[str]) -> set[str]:
        """Record one rebalance's ``evidence``; the tenants now confirmed out of reach."""
        known = self._counts.get(cache)
        counts = {}
        for name in evidence:
            if known is not None:
                before = known.get(name, 0)
            else:
                before = self.rebalances - 1 if name in named_before else 0
            counts[name] = min(self.rebalances, before + 1)
        self._counts[cache] = counts
        return {name for name, n in counts.items() if n >= self.rebalances}

    def pending(self, cache: str) -> dict[str, int]:
        """Tenants with evidence not yet confirmed, and for how many rebalances it held."""
        counts = self._counts.get(cache, {})
        return {name: n for name, n in counts.items() if n < self.rebalances}

    def forget(self, cache: str) -> None:
        self._counts.pop(cache, None)


def _reach_condition(
    allocation: Allocation, confirmed: set[str], pending: Mapping[str, int], needed: int
) -> tuple[ConditionStatus, str, str]:
    """(status, reason, message) of CacheCannotMeetSLA: which tenants and why."""
    out = [f"{t.name}: {t.cannot_meet}" for t in allocation.tenants if t.name in confirmed]
    if not out:
        message = "cache can meet every observed SLA"
        if pending:
            watched = ", ".join(f"{n} ({k}/{needed})" for n, k in sorted(pending.items())[:5])
            message += f"; out of reach in the last rebalances, not yet confirmed: {watched}"
        return ConditionStatus.FALSE, "WithinReach", message
    more = f" (and {len(out) - 5} more)" if len(out) > 5 else ""
    return ConditionStatus.TRUE, "SLAOutOfReach", "; ".join(out[:5]) + more


def _tenants_named(message: str | None) -> set[str]:
    return {part.split(":", 1)[0] for part in (message or "").split("; ")}


def _pressure(
    spec: InferenceCacheSpec,
    metrics: Mapping[str, TenantMetrics] | None,
    allocation: Allocation,
) -> float | None:
    """SLO pressure of the cache from this reconcile's metrics (None when unknown).

    Whether cache can still help a tenant comes from the allocation: no when no
    share within bounds meets its SLA (``cannot_meet``), yes when its curve
    says one does, unknown without a curve.
    """
    if metrics is None:
        return None
    by_name = allocation.by_name()

    def can_help(name: str) -> bool | None:
        t = by_name.get(name)
        if t is None or t.predicted_hit_ratio is None:
            return None
        return not t.why_not

    def pressure_of(t: TenantSpec) -> TenantPressure:
        m, sla = metrics.get(t.name), t.sla
        return TenantPressure(
            p95_s=None if m is None else m.p95_s,
            p95_target_s=sla.p95_latency_seconds if sla else None,
            priority_class=t.priority_class,
            cache_can_help=can_help(t.name),
            ttft_s=None if m is None else m.ttft_p95_s,
            ttft_target_s=sla.ttft_p95_seconds if sla else None,
            itl_s=None if m is None else m.itl_p95_s,
            itl_target_s=sla.itl_p95_seconds if sla else None,
        )

    return slo_pressure(map(pressure_of, spec.tenants))


class Reconciler:
    """Reconciles InferenceCaches; every I/O dependency is injected."""

    def __init__(
        self,
        *,
        metrics_source: MetricsSourceFactory = prometheus_source,
        control_plane: ControlPlaneFactory = redis_control_plane,
        secrets: SecretReader | None = None,
        metrics: OperatorMetrics | None = None,
        clock: Callable[[], float] = time.time,
        invalidator: InvalidatorFactory | None = None,
        policy_events_min_span_s: float = POLICY_EVENTS_MIN_SPAN_S,
        reach: ReachWarnings | None = None,
        fleet: FleetCurves | None = None,
    ) -> None:
        self.reach = reach or ReachWarnings()
        #: Fleet-wide curves per cache, fed from the sidecars' fleet-sample stream.
        self.fleet = fleet or FleetCurves()
        self.invalidator = invalidator or redis_invalidator
        self.metrics_source = metrics_source
        self.control_plane = control_plane
        self.secrets = secrets
        self.metrics = metrics or OperatorMetrics()
        self.clock = clock
        self.policy_events_min_span_s = policy_events_min_span_s

    async def redis_url(self, namespace: str, spec: InferenceCacheSpec | RedisEndpoint) -> str:
        redis = spec if isinstance(spec, RedisEndpoint) else spec.redis
        if redis.url is not None:
            return redis.url
        ref = redis.secret_ref
        if ref is None or self.secrets is None:
            raise SecretUnavailable("no Secret reader configured for spec.redis.secretRef")
        return await self.secrets.read(namespace, ref.name, ref.key)

    async def reconcile(
        self,
        namespace: str,
        name: str,
        generation: int | None,
        raw_spec: Mapping[str, Any],
        raw_status: Mapping[str, Any] | None,
        trigger: str = "change",
    ) -> Outcome:
        started = time.perf_counter()
        outcome = await self._reconcile(namespace, name, generation, raw_spec, raw_status)
        self.metrics.reconcile_duration.labels(trigger, outcome.result).observe(
            time.perf_counter() - started
        )
        return outcome

    async def _reconcile(
        self,
        namespace: str,
        name: str,
        generation: int | None,
        raw_spec: Mapping[str, Any],
        raw_status: Mapping[str, Any] | None,
    ) -> Outcome:
        now = now_rfc3339(self.clock)
        previous = _previous_status(raw_status)
        conditions = list(previous.conditions or [])
        try:
            spec = parse_spec(dict(raw_spec))
        except SpecError as exc:
            return self._invalid(exc, conditions, generation, now)

        cache = cache_ref(namespace, name)
        prev_shares = {t.name: t.share for t in previous.tenants or []}
        prev_l2 = {t.name: t.l2_bytes for t in previous.tenants or []}
        demands = demands_from_spec(spec)
        faults: list[tuple[str, str]] = []

        metrics: Mapping[str, TenantMetrics] | None
        source: MetricsSource | None = None
        try:
            source = self.metrics_source(str(spec.prometheus.url), spec.prometheus.timeout_seconds)
            metrics = await source.fetch(
                cache, spec.prometheus.window, spec.prometheus.curve_window
            )
        except MetricsUnavailable as exc:
            metrics = None
            faults.append((exc.reason, exc.message))
            self.metrics.reconcile_errors.labels(exc.reason).inc()

        l1_bytes, l2_bytes = listed_l1_bytes(spec), listed_l2_bytes(spec)
        if metrics:
            metrics = await self._with_fleet_curves(namespace, spec, cache, demands, metrics)
        if metrics is not None:
            params = AllocationParams(
                spec.allocation.smoothing, spec.allocation.hysteresis, spec.allocation.min_gain
            )
            allocation = allocate(
                demands,
                metrics,
                prev_shares or None,
                l1_bytes,
                l2_bytes,
                params,
                prev_l2 or None,
            )
        elif prev_shares:
            allocation = hold(demands, prev_shares, l1_bytes, l2_bytes, prev_l2)
        else:
            allocation = allocate(demands, {}, None, l1_bytes, l2_bytes)

        self.metrics.set_slo_pressure(namespace, name, _pressure(spec, metrics, allocation))
        self.metrics.set_slo_targets(cache, slo_targets(spec))
        assignment = build_assignment(spec, allocation)
        digest = assignment_digest(assignment)
        quota_generation = previous.quota_generation or 0
        if digest != previous.quota_digest:
            quota_generation += 1
        published = False
        sidecars: SidecarStatus | None = previous.sidecars
        usage_by_tenant: dict[str, TenantLimitsUsage] | None = None
        epoch_status: dict[str, Any] = {}
        epoch_events: list[Event] = []
        try:
            url = await self.redis_url(namespace, spec)
            plane = self.control_plane(url)
            stored = await plane.publish(
                cache, assignment.model_copy(update={"generation": quota_generation})
            )
            if stored > quota_generation:  # Redis knows a newer one (status was lost)
                quota_generation = stored + 1
                stored = await plane.publish(
                    cache, assignment.model_copy(update={"generation": quota_generation})
                )
            published = stored == quota_generation
            members = await plane.live_members(cache)
            usage_by_tenant = await _read_limits_usage(plane, cache, spec)
            epoch_status, epochs_in_sync, epoch_events = await self._epochs(
                url, cache, spec, previous
            )
            shedding = sorted(m.pod for m in members if m.shedding)
            sidecars = SidecarStatus(
                seen=len(members),
                in_sync=sum(1 for m in members if m.quota_generation >= quota_generation),
                epochs_in_sync=epochs_in_sync,
                shedding=shedding or None,
            )
            epoch_events += shedding_events(previous.sidecars, shedding)
        except (ControlPlaneUnavailable, SecretUnavailable, RedisError, OSError) as exc:
            faults.append(("RedisUnavailable", str(exc)))
            self.metrics.reconcile_errors.labels("RedisUnavailable").inc()

        events: list[Event] = list(epoch_events)
        status: dict[str, Any] = {"observedGeneration": generation, **epoch_status}
        routing = routing_status(name, spec)
        if routing is not None or previous.routing is not None:
            status["routing"] = routing.wire() if routing is not None else None  # None clears
        if published:
            switch_events, events_until = await self._policy_switches(source, cache, previous, now)
            events.extend(switch_events)
            if events_until is not None:
                status["policyEventsUntil"] = events_until
            moves = quota_moves(prev_shares or None, allocation, EVENT_MIN_MOVE)
            if moves and prev_shares:
                gained = sum(1 for m in moves if (m.after or 0.0) >= (m.before or 0.0))
                self.metrics.allocation_changes.labels("gained").inc(gained)
                self.metrics.allocation_changes.labels("lost").inc(len(moves) - gained)
                events.append(Event("Normal", "QuotasChanged", describe_moves(moves)))
            elif not prev_shares and allocation.tenants:
                events.append(
                    Event("Normal", "QuotasAssigned", describe_moves(quota_moves(None, allocation)))
                )
            sla_status, sla_reason, sla_message, attainment = _sla_condition(allocation)
            saved = await _savings(source, cache, spec) if metrics is not None else None
            currency = spec.savings.currency if spec.savings is not None else None
            state = InferenceCacheStatus(
                quota_generation=quota_generation,
                quota_digest=digest,
                last_rebalance_time=now,
                tenant_count=len(allocation.tenants),
                sla_attainment=attainment,
                saved_model_hours=saved_model_hours(saved),
                savings=None if saved is None else savings_status(saved.values(), currency),
                tenants=_tenant_status(allocation, saved, currency, usage_by_tenant),
                sidecars=sidecars,
            )
            status.update(state.wire())
            if metrics is not None:
                conditions = set_condition(
                    conditions, SLA_VIOLATED, sla_status, sla_reason, sla_message, generation, now
                )
                before = condition(conditions, CACHE_CANNOT_MEET_SLA)
                named = (
                    _tenants_named(before.message)
                    if before is not None and before.status == ConditionStatus.TRUE
                    else set()
                )
                evidence = reach_evidence(
                    allocation,
                    prev_shares,
                    window_seconds(spec.prometheus.curve_window),
                    self.reach.min_requests,
                )
                confirmed = self.reach.observe(cache, evidence, named)
                reach = _reach_condition(
                    allocation, confirmed, self.reach.pending(cache), self.reach.rebalances
                )
                conditions = set_condition(
                    conditions, CACHE_CANNOT_MEET_SLA, *reach, generation, now
                )
                # an Event when the set of tenants out of reach changes, not on every number
                if reach[0] == ConditionStatus.TRUE and (
                    before is None
                    or before.status != ConditionStatus.TRUE
                    or _tenants_named(before.message) != _tenants_named(reach[2])
                ):
                    events.append(Event("Warning", reach[1], reach[2]))
            ready_msg = f"quota generation {quota_generation} published"
            if sidecars is not None:
                ready_msg += f"; {sidecars.in_sync}/{sidecars.seen} sidecars in sync"
            conditions = set_condition(
                conditions,
                READY,
                ConditionStatus.TRUE,
                "QuotasPublished",
                ready_msg,
                generation,
                now,
            )
        else:
            conditions = set_condition(
                conditions,
                READY,
                ConditionStatus.FALSE,
                "RedisUnavailable",
                "quotas could not be published; sidecars keep the last ones",
                generation,
                now,
            )

        was_degraded = condition(conditions, DEGRADED)
        if faults:
            reason = faults[0][0] if len(faults) == 1 else "MultipleFaults"
            message = "; ".join(f"{r}: {m}" for r, m in faults)
            if metrics is None:
                message += " (last allocation kept)" if prev_shares else " (class-based allocation)"
            conditions = set_condition(
                conditions, DEGRADED, ConditionStatus.TRUE, reason, message, generation, now
            )
            if (
                was_degraded is None
                or was_degraded.status != ConditionStatus.TRUE
                or was_degraded.reason != reason
            ):
                events.append(Event("Warning", reason, message))
        else:
            conditions = set_condition(
                conditions,
                DEGRADED,
                ConditionStatus.FALSE,
                "Healthy",
                "metrics read and quotas published",
                generation,
                now,
            )
        status["conditions"] = [c.wire() for c in conditions]
        outcome = Outcome(status=status, events=events, result="ok", applied=published)
        if faults:
            outcome.failure = "temporary"
            outcome.failure_message = "; ".join(f"{r}: {m}" for r, m in faults)
            outcome.result = "degraded"
        return outcome

    async def _with_fleet_curves(
        self,
        namespace: str,
        spec: InferenceCacheSpec,
        cache: str,
        demands: Iterable[TenantDemand],
        metrics: Mapping[str, TenantMetrics],
    ) -> Mapping[str, TenantMetrics]:
        """``metrics`` with each tenant's fleet-wide curve, from the batches new since the
        last rebalance. Redis down or a batch that is not one: the curves go on from
        what was read before (never a fault of the reconcile; publishing reports Redis)."""
        payloads: list[bytes] = []
        last = None
        try:
            url = await self.redis_url(namespace, spec)
            payloads, last = await self.control_plane(url).fleet_batches(
                cache, self.fleet.after(cache)
            )
        except (ControlPlaneUnavailable, SecretUnavailable, RedisError, OSError) as exc:
            log.debug("%s: fleet samples not read: %s", cache, exc)
        batches = []
        for raw in payloads:
            try:
                batches.append(decode_fleet_batch(raw))
            except ValueError:
                self.fleet.ignored += 1
        names = set(metrics) | {d.name for d in demands}
        self.fleet.ingest(cache, batches, last, names, spec.fleet_sample_rate)
        window_s = window_seconds(spec.prometheus.curve_window)
        if isinstance(metrics, MetricsTable):  # from Prometheus: columns all the way
            return metrics.with_fleet_rows(*self.fleet.table(cache, window_s))
        curves = self.fleet.curves(cache, window_s)
        return {
            name: dataclasses.replace(m, fleet_curve=curves[name]) if name in curves else m
            for name, m in metrics.items()
        }

    async def _policy_switches(
        self,
        source: MetricsSource | None,
        cache: str,
        previous: InferenceCacheStatus,
        now: str,
    ) -> tuple[list[Event], str | None]:
        """Events for the sidecars' policy switches since the last report, and the new mark.

        Spans tile time: each starts at ``status.policyEventsUntil`` and ends
        now, so a switch is reported once. The first reconcile only sets the
        mark (switches from before the operator watched are not news); a
        failed or too short query leaves the mark, so the next one covers it.
        """
        if source is None or not isinstance(source, PolicySwitchSource):
            return [], None
        at = parse_rfc3339(now)
        since = parse_rfc3339(previous.policy_events_until)
        if at is None or since is None:
            return [], now
        span = at - since
        if span < self.policy_events_min_span_s:
            return [], None
        try:
            found = await source.policy_switches(cache, min(span, POLICY_EVENTS_MAX_SPAN_S), at)
        except MetricsUnavailable:
            return [], None
        return policy_switch_events(found), now

    async def _epochs(
        self, url: str, cache: str, spec: InferenceCacheSpec, previous: InferenceCacheStatus
    ) -> tuple[dict[str, Any], int, list[Event]]:
        """Restore, advance on a model-version change, and measure convergence.

        Returns (status fields, live sidecars that acknowledged the current
        epochs, Events).
        """
        events: list[Event] = []
        known = dict(previous.epochs or {})
        scope = model_scope(spec.model.name)
        invalidator = self.invalidator(url, cache)
        try:
            if known:
                await restore_epochs(invalidator.client, cache, known)
            old_version = previous.model_version
            if old_version is not None and old_version != spec.model.version:
                # The status records the version and the epochs together, so the change
                # is one advance past the recorded epoch: a reconcile whose status patch
                # was lost (or an operator that restarted) finds Redis already there and
                # does not advance again.
                intended = int(known.get(scope, 0)) + 1
                epoch, cas_at, advanced = await invalidator.advance_to(scope, intended)
                result = await invalidator.await_acks(
                    scope, epoch, timeout_s=MODEL_ACK_WAIT_S, started_at=cas_at
                )
                message = (
                    f"model {spec.model.name} {old_version} -> {spec.model.version}: "
                    f"{scope} {'advanced' if advanced else 'already advanced'} to epoch "
                    f"{result.epoch}; {result.acks}/{result.expected} sidecars acknowledged"
                )
                if result.propagation_s is not None:
                    message += f" in {result.propagation_s * 1000:.1f} ms"
                else:
                    message += f", still waiting for {', '.join(result.lagging)}"
                events.append(Event("Normal", "ModelVersionChanged", message))
            epochs = await read_epochs(invalidator.client, cache)
            acked, _lagging = await invalidator.progress(epochs)
        finally:
            await invalidator.aclose()
        return {"modelVersion": spec.model.version, "epochs": epochs}, len(acked), events

    def _invalid(
        self, exc: SpecError, conditions: list[Condition], generation: int | None, now: str
    ) -> Outcome:
        self.metrics.reconcile_errors.labels("InvalidSpec").inc()
        message = f"{exc.field}: {exc.message}"
        conditions = set_condition(
            conditions, READY, ConditionStatus.FALSE, "InvalidSpec", message, generation, now
        )
        conditions = set_condition(
            conditions, DEGRADED, ConditionStatus.TRUE, "InvalidSpec", message, generation, now
        )
        return Outcome(
            status={
                "observedGeneration": generation,
                "conditions": [c.wire() for c in conditions],
            },
            events=[Event("Warning", "InvalidSpec", message)],
            failure="permanent",
            failure_message=message,
            result="invalid",
        )

    async def cleanup(
        self, namespace: str, name: str, raw_spec: Mapping[str, Any], uid: str = ""
    ) -> int:
        """Remove the cache's Redis state; raises ControlPlaneUnavailable / SpecError.

        Only ``spec.redis`` has to be valid: a spec broken elsewhere still
        names the Redis that holds the state.
        """
        try:
            endpoint: InferenceCacheSpec | RedisEndpoint = parse_spec(dict(raw_spec))
        except SpecError:
            endpoint = parse_redis_endpoint(raw_spec.get("redis"))
        self.metrics.set_slo_pressure(namespace, name, None)
        self.reach.forget(cache_ref(namespace, name))
        self.fleet.forget(cache_ref(namespace, name))
        url = await self.redis_url(namespace, endpoint)
        return await self.control_plane(url).delete_cache_state(cache_ref(namespace, name), uid)
