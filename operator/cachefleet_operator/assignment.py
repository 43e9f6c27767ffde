"""What the operator publishes to the sidecars, pure: the allocation's demands from the spec,
the quota assignment (shares, policies, caching, limits) and its digest."""

import hashlib
import json
from typing import Any

from cachefleet_common.contract.messages import QuotaAssignment, RateLimits, TenantQuota
from cachefleet_common.limits import TenantLimits
from cachefleet_operator.allocation import (
    Allocation,
    TenantDemand,
)
from cachefleet_operator.api import (
    InferenceCacheSpec,
    SemanticSpec,
    TenantLimitsSpec,
    TenantSpec,
    unlisted_l1_bytes,
    unlisted_l2_bytes,
)


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
