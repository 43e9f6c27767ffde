"""The InferenceCache status the operator writes, and the whole object."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import Field

from cachefleet_operator.allocation import (
    PriorityClass,
)
from cachefleet_operator.api.base import _Observed
from cachefleet_operator.api.spec import InferenceCacheSpec


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(_Observed):
    """A Kubernetes-style condition (Ready, Degraded, SLAViolated, ...)."""

    type: str = Field(description="Condition type.")
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(description="CamelCase reason.")
    message: str = Field(default="", description="Human-readable detail.")
    last_transition_time: str | None = Field(
        default=None, description="When status last changed (RFC 3339)."
    )
    observed_generation: int | None = Field(
        default=None, description="metadata.generation the condition was computed from."
    )


class ObservedMetrics(_Observed):
    """A tenant's metrics over the query window, as the operator last read them."""

    p95_seconds: float | None = Field(default=None, description="p95 request latency, seconds.")
    hit_ratio: float | None = Field(default=None, description="Hits / (hits + misses).")
    rps: float | None = Field(default=None, description="Requests per second.")
    ttft_p95_seconds: float | None = Field(
        default=None, description="p95 time to first token of model answers, seconds."
    )
    itl_p95_seconds: float | None = Field(
        default=None, description="p95 inter-token latency of streamed model answers, seconds."
    )


class SavingsStatus(_Observed):
    """What cache hits saved the model over spec.prometheus.window (all pods and models)."""

    model_seconds: float = Field(
        default=0.0, description="Upstream seconds of the hit entries' fills: model time saved."
    )
    prompt_tokens: float = Field(default=0.0, description="Prompt tokens not sent to the model.")
    completion_tokens: float = Field(
        default=0.0, description="Completion tokens the model did not have to generate."
    )
    cost: float | None = Field(
        default=None,
        description=(
            "Their price by spec.savings.prices (or the sidecars' --price-table); empty: unpriced."
        ),
    )
    currency: str | None = Field(
        default=None, description="The currency of cost (spec.savings.currency)."
    )


class LimitUsage(_Observed):
    """One of a tenant's limits and where its bucket stands (the x-ratelimit-* arithmetic)."""

    limit: int = Field(description="The limit (spec.tenants[].limits).")
    used: int = Field(
        description=(
            "What the bucket holds that has not refilled yet (limit - remaining): about what "
            "the tenant spent over the last period, fleet-wide."
        )
    )
    remaining: int = Field(description="What the tenant may still spend now.")
    reset_seconds: float = Field(description="Seconds until the bucket is full again.")


class TenantLimitsUsage(_Observed):
    """A tenant's usage against each limit it states, fleet-wide (docs/rate-limits.md)."""

    requests_per_minute: LimitUsage | None = Field(
        default=None, description="Requests to the model server per minute."
    )
    tokens_per_minute: LimitUsage | None = Field(
        default=None, description="Prompt + completion tokens per minute."
    )
    tokens_per_day: LimitUsage | None = Field(
        default=None, description="Prompt + completion tokens per day."
    )


class TenantStatus(_Observed):
    """A tenant's current allocation and SLA attainment."""

    name: str = Field(description="Tenant id.")
    priority_class: PriorityClass = Field(description="The tenant's class.")
    share: float = Field(description="Fraction of capacity allocated.")
    weight: float = Field(description="Demand weight the allocation used.")
    l1_bytes: int = Field(
        description=(
            "L1 bytes on every pod as assigned: share x spec.capacity.l1BytesPerPod. A sidecar "
            "whose own --l1-bytes is smaller applies them scaled down in proportion (the sum "
            "never exceeds its budget); its /stats shows the bytes in force."
        )
    )
    l2_bytes: int = Field(description="L2 bytes fleet-wide.")
    reason: str = Field(description="Why the tenant has this share.")
    observed: ObservedMetrics | None = Field(default=None, description="Last metrics read.")
    sla_met: bool | None = Field(
        default=None, description="Whether every SLA target was met; empty when unknown."
    )
    savings: SavingsStatus | None = Field(
        default=None, description="What the tenant's cache hits saved over the window."
    )
    limits: TenantLimitsUsage | None = Field(
        default=None,
        description=(
            "Usage against spec.tenants[].limits, read from the sidecars' buckets in Redis at "
            "lastRebalanceTime; empty without limits or when Redis could not be read."
        ),
    )


class SidecarStatus(_Observed):
    """Sidecars seen through their heartbeats."""

    seen: int = Field(description="Live sidecars (fresh heartbeat).")
    in_sync: int = Field(description="Live sidecars that applied the current quota generation.")
    epochs_in_sync: int | None = Field(
        default=None, description="Live sidecars that acknowledged the current epochs."
    )
    shedding: list[str] | None = Field(
        default=None, description="Pods whose admission sheds now (model server saturated)."
    )


class RoutingStatus(_Observed):
    """Which InferencePool routes to the cache, as spec.routing says."""

    pool: str = Field(description="Name of the InferencePool in the cache's namespace.")
    pool_source: Literal["Rendered", "Referenced"] = Field(
        description=(
            "Rendered: the chart's pool named after the cache; Referenced: "
            "spec.routing.inferencePoolRef."
        )
    )


class InferenceCacheStatus(_Observed):
    """Observed state of an InferenceCache, written by the operator."""

    observed_generation: int | None = Field(
        default=None, description="metadata.generation last reconciled."
    )
    quota_generation: int | None = Field(
        default=None, description="Generation of the quota table published to the sidecars."
    )
    quota_digest: str | None = Field(
        default=None, description="Digest of the published quota table (moves bump the generation)."
    )
    last_rebalance_time: str | None = Field(
        default=None, description="When quotas were last computed (RFC 3339)."
    )
    tenant_count: int | None = Field(default=None, description="Number of tenants.")
    sla_attainment: str | None = Field(
        default=None, description="Tenants meeting their SLA / tenants with SLA and metrics."
    )
    saved_model_hours: float | None = Field(
        default=None,
        description=(
            "Model-hours cache hits saved over spec.prometheus.window, all tenants, pods and "
            "models (the upstream time of each hit entry's fill): the SAVED column."
        ),
    )
    savings: SavingsStatus | None = Field(
        default=None, description="What cache hits saved over the window, all tenants."
    )
    tenants: list[TenantStatus] | None = Field(default=None, description="Per-tenant allocation.")
    sidecars: SidecarStatus | None = Field(default=None, description="Sidecar membership.")
    epochs: dict[str, int] | None = Field(
        default=None, description="Current invalidation epoch per scope."
    )
    model_version: str | None = Field(
        default=None,
        description="spec.model.version last acted on (a change advances the model's epoch).",
    )
    policy_events_until: str | None = Field(
        default=None,
        description="End of the span whose L1 policy switches are reported as Events (RFC 3339).",
    )
    routing: RoutingStatus | None = Field(
        default=None, description="The InferencePool routing to the cache (spec.routing.enabled)."
    )
    conditions: list[Condition] | None = Field(
        default=None, description="Ready, Degraded and SLAViolated."
    )


class InferenceCache(_Observed):
    """A cache shared by a fleet of model-server pods, split among tenants by SLA."""

    api_version: Literal["cachefleet.io/v1alpha1"] = "cachefleet.io/v1alpha1"
    kind: Literal["InferenceCache"] = "InferenceCache"
    spec: InferenceCacheSpec
    status: InferenceCacheStatus | None = None
