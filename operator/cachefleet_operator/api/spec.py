"""The InferenceCache spec as a whole (its cross-field rules) and the bytes it gives listed
and unlisted tenants."""

from __future__ import annotations

from pydantic import ConfigDict, Field, model_validator

from cachefleet_common.contract.fleet import FLEET_SAMPLE_RATE
from cachefleet_common.contract.names import Policy
from cachefleet_operator.allocation import (
    PriorityClass,
)
from cachefleet_operator.api.base import (
    ALL_MIN_SUM_MESSAGE,
    ALL_MIN_SUM_RULE,
    DEFAULT_REBALANCE_INTERVAL_S,
    GUARANTEED_SUM_MESSAGE,
    GUARANTEED_SUM_RULE,
    HEADER_NAME_PATTERN,
    MAX_OBJECTIVES,
    MAX_TENANTS,
    MIN_REBALANCE_INTERVAL_S,
    _cel,
    _Model,
)
from cachefleet_operator.api.features import (
    ObjectiveSpec,
    ObservabilitySpec,
    RoutingSpec,
    SavingsSpec,
    WarmupSpec,
)
from cachefleet_operator.api.resources import (
    AllocationTuning,
    Capacity,
    LabelSelector,
    ModelRef,
    PrometheusEndpoint,
    RedisEndpoint,
    UpstreamLimits,
)
from cachefleet_operator.api.tenants import (
    MAX_TTL_SECONDS,
    AdmissionSpec,
    TenantDefaults,
    TenantSpec,
)


class InferenceCacheSpec(_Model):
    """Desired state of an InferenceCache."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(GUARANTEED_SUM_RULE, GUARANTEED_SUM_MESSAGE, ".tenants"),
                _cel(ALL_MIN_SUM_RULE, ALL_MIN_SUM_MESSAGE, ".tenants"),
            ]
        }
    )

    selector: LabelSelector = Field(description="Pods that run a sidecar of this cache.")
    model: ModelRef = Field(description="The model behind the cache.")
    capacity: Capacity = Field(description="Bytes to share among tenants.")
    redis: RedisEndpoint = Field(description="Redis for L2 and control state.")
    prometheus: PrometheusEndpoint = Field(description="Prometheus with the sidecars' metrics.")
    default_policy: Policy = Field(
        default=Policy.LRU, description="L1 policy of tenants that do not name one."
    )
    upstream: UpstreamLimits = Field(
        default_factory=UpstreamLimits,
        description="Bounds on each sidecar's connections to its model server.",
    )
    rebalance_interval_seconds: int = Field(
        default=DEFAULT_REBALANCE_INTERVAL_S,
        ge=MIN_REBALANCE_INTERVAL_S,
        le=86400,
        description="How often quotas are recomputed from the metrics, seconds.",
    )
    allocation: AllocationTuning = Field(
        default_factory=AllocationTuning,
        description="How eagerly quotas follow the metrics: smoothing, hysteresis, minimum gain.",
    )
    routing: RoutingSpec = Field(
        default_factory=RoutingSpec,
        description="Routing through cachefleet's endpoint picker (deployed by the Helm chart).",
    )
    admission: AdmissionSpec | None = Field(
        default=None,
        description="Class-aware admission when the model server saturates; empty = off.",
    )
    namespace_header: str | None = Field(
        default=None,
        description=(
            "Request header whose value partitions a tenant's entries (e.g. one namespace "
            "per knowledge base), invalidated alone by a CacheInvalidation of scope "
            "Namespace; empty = X-Cache-Namespace."
        ),
        pattern=HEADER_NAME_PATTERN,
    )
    warmup: WarmupSpec | None = Field(
        default=None, description="L1 warm-up of starting sidecars from L2; empty = off."
    )
    savings: SavingsSpec | None = Field(
        default=None,
        description=(
            "Prices that turn the tokens cache hits saved into money (the sidecars' price "
            "table); empty = tokens and model time only, or each sidecar's --price-table."
        ),
    )
    ttl_seconds: int | None = Field(
        default=None,
        ge=1,
        le=MAX_TTL_SECONDS,
        description=(
            "Entry TTL of tenants that set no ttlSeconds (and of unlisted ones), seconds; "
            "empty = entries live until evicted or the sidecars' L2 TTL."
        ),
    )
    fleet_sample_rate: float = Field(
        default=FLEET_SAMPLE_RATE,
        gt=0,
        le=1,
        description=(
            "Share of the key space whose accesses every sidecar forwards for the fleet-wide "
            "curves (the same keys on every pod; the webhook gives each injected sidecar this "
            "rate). More is a finer curve for more Redis traffic; a change reaches Pods "
            "created after it."
        ),
    )
    observability: ObservabilitySpec | None = Field(
        default=None,
        description="Traces of the sidecars' requests (OTLP); empty = off.",
    )
    tenants: list[TenantSpec] = Field(
        default_factory=list,
        max_length=MAX_TENANTS,
        description="Tenants and their SLAs; names are unique.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    objectives: list[ObjectiveSpec] = Field(
        default_factory=list,
        max_length=MAX_OBJECTIVES,
        description=(
            "GIE InferenceObjective names and the class each lowers a request to "
            "(x-gateway-inference-objective; never above the tenant's own class)."
        ),
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    tenant_defaults: TenantDefaults | None = Field(
        default=None,
        description=(
            "How tenants not in tenants are treated (admitted with a partition of their own "
            "from a shared pool); empty = as the sidecars' flags say (refused, mapped to "
            "--default-tenant, or guests of --guest-share)."
        ),
    )

    @model_validator(mode="after")
    def _tenants(self) -> InferenceCacheSpec:
        seen: set[str] = set()
        for tenant in self.tenants:
            if tenant.name in seen:
                raise ValueError(f"tenant {tenant.name!r} is listed twice")
            seen.add(tenant.name)
        guaranteed = sum(
            t.min_share for t in self.tenants if t.priority_class is PriorityClass.GUARANTEED
        )
        if guaranteed > 1.0 + 1e-9:
            raise ValueError(GUARANTEED_SUM_MESSAGE)
        if sum(t.min_share for t in self.tenants) > 1.0 + 1e-9:
            raise ValueError(ALL_MIN_SUM_MESSAGE)
        objectives = [o.name for o in self.objectives]
        if len(set(objectives)) != len(objectives):
            raise ValueError("an objective is listed twice")
        return self


# The unlisted tenants' pools (tenantDefaults), in bytes: the operator's quota table
# and `kubectl cachefleet status` read them here.


def unlisted_l1_bytes(spec: InferenceCacheSpec) -> int:
    """L1 bytes per pod that ``spec.tenantDefaults`` sets aside for all unlisted tenants.

    With no tenant listed, every tenant is unlisted: the pool is the whole L1.
    """
    defaults = spec.tenant_defaults
    if defaults is None:
        return 0
    if not spec.tenants:
        return spec.capacity.l1_bytes_per_pod
    return int(spec.capacity.l1_bytes_per_pod * defaults.share)


def listed_l1_bytes(spec: InferenceCacheSpec) -> int:
    """L1 bytes per pod the listed tenants' allocation shares: what the unlisted pool leaves."""
    return spec.capacity.l1_bytes_per_pod - unlisted_l1_bytes(spec)


def unlisted_l2_bytes(spec: InferenceCacheSpec) -> int:
    """L2 bytes fleet-wide that ``spec.tenantDefaults`` sets aside for all unlisted tenants.

    With no tenant listed, every tenant is unlisted: the pool is the whole L2.
    """
    defaults = spec.tenant_defaults
    if defaults is None or defaults.l2_share <= 0:
        return 0
    if not spec.tenants:
        return spec.capacity.l2_bytes
    return int(spec.capacity.l2_bytes * defaults.l2_share)


def listed_l2_bytes(spec: InferenceCacheSpec) -> int:
    """L2 bytes the listed tenants' allocation shares: what the unlisted pool leaves."""
    return spec.capacity.l2_bytes - unlisted_l2_bytes(spec)
