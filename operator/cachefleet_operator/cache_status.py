"""The InferenceCache status a reconcile writes, pure: conditions, the tenants' rows,
savings, the SLA condition, rate-limit usage, routing, and the Events of what changed."""

from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from cachefleet_common.contract.names import Policy
from cachefleet_common.limits import BUCKETS, TenantLimits, usage
from cachefleet_operator.allocation import (
    Allocation,
)
from cachefleet_operator.api import (
    Condition,
    ConditionStatus,
    InferenceCacheSpec,
    InferenceCacheStatus,
    LimitUsage,
    ObservedMetrics,
    RoutingStatus,
    SavingsStatus,
    SidecarStatus,
    TenantLimitsUsage,
    TenantStatus,
)
from cachefleet_operator.metrics_source import (
    PolicySwitches,
)
from cachefleet_operator.outcome import (
    Event,
)

READY = "Ready"
DEGRADED = "Degraded"
SLA_VIOLATED = "SLAViolated"


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


def routing_status(name: str, spec: InferenceCacheSpec) -> RoutingStatus | None:
    """``status.routing`` of the cache ``name``: the pool routing to it, or None when off."""
    pool = spec.routing.pool_name(name)
    if pool is None:
        return None
    source = "Referenced" if spec.routing.inference_pool_ref is not None else "Rendered"
    return RoutingStatus(pool=pool, pool_source=source)


def previous_status(raw: Mapping[str, Any] | None) -> InferenceCacheStatus:
    try:
        return InferenceCacheStatus.model_validate(dict(raw or {}))
    except ValidationError:
        return InferenceCacheStatus()


def tenant_status(
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


def sla_condition(allocation: Allocation) -> tuple[ConditionStatus, str, str, str]:
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
