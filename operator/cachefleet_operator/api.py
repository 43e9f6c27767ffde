"""The custom resources of cachefleet as pydantic models: the single source of truth.

``InferenceCache`` and ``CacheInvalidation`` (group ``cachefleet.io``, version
``v1alpha1``), spec and status. :mod:`cachefleet_operator.crdgen` turns these
models into the CRD YAML; the operator parses every object it handles with
them, so what the API server validates and what the operator accepts are the
same rules. Field names are camelCase on the wire (Kubernetes style) and
snake_case in Python.

Cross-field rules that the API server can check are attached as CEL
``x-kubernetes-validations`` *and* enforced by a pydantic validator with the
same message, so an object that slipped past an older CRD is still refused by
the operator with a message that names the field.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from cachefleet_common import classes
from cachefleet_common.contract.fleet import FLEET_SAMPLE_RATE
from cachefleet_common.contract.lua import DEFAULT_GUEST_MAX_SHARE
from cachefleet_common.contract.names import NAME_RE, Policy
from cachefleet_common.defaults import UPSTREAM_MAX_CONNECTIONS, UPSTREAM_MAX_WAITING
from cachefleet_common.prices import Price
from cachefleet_operator.allocation import (
    DEFAULT_HYSTERESIS,
    DEFAULT_MIN_GAIN,
    DEFAULT_SMOOTHING,
    PriorityClass,
)
from cachefleet_operator.quantity import ByteQuantity

GROUP = "cachefleet.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

#: The most tenants one InferenceCache may list (bounds CEL cost and object size).
MAX_TENANTS = 1000
#: Largest fairness weight of a tenant (the sidecar's queue takes weights within its bounds).
MAX_FAIRNESS_WEIGHT = 1000.0
#: Most entries of spec.objectives.
MAX_OBJECTIVES = 256
#: Fraction of each pod's L1 that all unlisted tenants share when tenantDefaults does not say.
DEFAULT_UNLISTED_SHARE = 0.1
#: The most models spec.savings.prices may price (the table travels in an env variable).
MAX_PRICES = 256
#: The most of each pod's L1 tenantDefaults may set aside (the --guest-share bound).
MAX_UNLISTED_SHARE = 0.9
#: Fraction of the fleet's L2 bytes all unlisted tenants share when the spec says none.
DEFAULT_UNLISTED_L2_SHARE = 0.1
#: Shortest rebalance interval a spec may ask for, seconds.
MIN_REBALANCE_INTERVAL_S = 1
#: Rebalance interval when the spec does not say, seconds.
DEFAULT_REBALANCE_INTERVAL_S = 30
#: Prometheus query timeout when the spec does not say, seconds.
DEFAULT_PROMETHEUS_TIMEOUT_S = 5.0
#: Rate window of the PromQL queries when the spec does not say.
DEFAULT_METRICS_WINDOW = "2m"
#: Window of the reuse-distance (miss-ratio curve) query when the spec does not say:
#: longer than the rate window, so reuse at long distances (minutes apart) is seen.
DEFAULT_CURVE_WINDOW = "10m"
#: Invalidation acknowledgement timeout when the spec does not say, seconds.
DEFAULT_INVALIDATION_TIMEOUT_S = 60

_NAME_PATTERN = NAME_RE.pattern
_DURATION_PATTERN = r"^[1-9][0-9]*(s|m|h)$"

GUARANTEED_SUM_RULE = (
    "!has(self.tenants) || self.tenants.filter(t, has(t.priorityClass) && "
    "t.priorityClass == 'Guaranteed').map(t, has(t.minShare) ? t.minShare : 0.0).sum() <= 1.0"
)
GUARANTEED_SUM_MESSAGE = "the minShare of all Guaranteed tenants must sum to at most 1"
ALL_MIN_SUM_RULE = (
    "!has(self.tenants) || self.tenants.map(t, has(t.minShare) ? t.minShare : 0.0).sum() <= 1.0"
)
ALL_MIN_SUM_MESSAGE = "the minShare of all tenants must sum to at most 1"
MIN_MAX_RULE = "!has(self.minShare) || !has(self.maxShare) || self.minShare <= self.maxShare"
MIN_MAX_MESSAGE = "minShare must not exceed maxShare"
BEST_EFFORT_RULE = (
    "!has(self.priorityClass) || self.priorityClass != 'BestEffort' || !has(self.minShare) "
    "|| self.minShare == 0.0"
)
BEST_EFFORT_MESSAGE = "a BestEffort tenant has no floor: minShare must be 0"
REDIS_ONE_OF_RULE = "has(self.url) != has(self.secretRef)"
REDIS_ONE_OF_MESSAGE = "set exactly one of url and secretRef"
POOL_REF_RULE = "!has(self.inferencePoolRef) || (has(self.enabled) && self.enabled)"
POOL_REF_MESSAGE = "inferencePoolRef needs enabled: true"
NAMESPACE_SCOPE_RULE = "self.type != 'Namespace' || (has(self.tenant) && has(self.namespace))"
NAMESPACE_SCOPE_MESSAGE = "scope Namespace needs tenant and namespace"
KEY_SCOPE_RULE = "self.type != 'Key' || has(self.key)"
KEY_SCOPE_MESSAGE = "scope Key needs key (the X-Cache-Key of a hit)"
#: A key purge names an entry by the SHA-256 hex digest of its key (X-Cache-Key).
KEY_DIGEST_PATTERN = r"^[0-9a-f]{64}$"
#: An HTTP header name (a token).
HEADER_NAME_PATTERN = r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}$"
IMMUTABLE_RULE = "self == oldSelf"
IMMUTABLE_MESSAGE = "a CacheInvalidation is one-shot: its spec is immutable"


def _cel(rule: str, message: str, field_path: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"rule": rule, "message": message}
    if field_path is not None:
        out["fieldPath"] = field_path
    return out


class SpecError(ValueError):
    """A spec the operator cannot act on; ``field`` is its path, e.g. ``spec.tenants[1]``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class _Model(BaseModel):
    # extra="forbid": an unknown field in a spec is an error naming it, as the API
    # server's strict field validation (kubectl's default) makes it. Status models
    # and the whole-object models ignore extras (kopf keeps its own state there).
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_enum_values=False,
    )

    def wire(self) -> dict[str, Any]:
        """The object as Kubernetes stores it (camelCase, ``None`` fields left out)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class _Observed(_Model):
    """Status and whole objects: fields this version does not know are ignored."""

    model_config = ConfigDict(extra="ignore")


# ------------------------------------------------------------------- InferenceCache


class SelectorOperator(StrEnum):
    """Operator of a label selector requirement."""

    IN = "In"
    NOT_IN = "NotIn"
    EXISTS = "Exists"
    DOES_NOT_EXIST = "DoesNotExist"


class LabelSelectorRequirement(_Model):
    """One requirement of a label selector."""

    key: str = Field(description="Label key.", min_length=1, max_length=317)
    operator: SelectorOperator = Field(description="How the key relates to the values.")
    values: list[str] | None = Field(
        default=None, description="Values for In / NotIn; empty for Exists / DoesNotExist."
    )


class LabelSelector(_Model):
    """Which pods run a sidecar of this cache (a standard Kubernetes label selector)."""

    match_labels: dict[str, str] | None = Field(
        default=None, description="Labels a pod must carry, exactly."
    )
    match_expressions: list[LabelSelectorRequirement] | None = Field(
        default=None, description="Further requirements, all of which must hold."
    )


class ModelRef(_Model):
    """The model served behind the cache; a new version invalidates its entries."""

    name: str = Field(description="Model name as clients send it.", min_length=1, max_length=253)
    version: str = Field(
        description="Model version; changing it advances the model's epoch.",
        min_length=1,
        max_length=128,
    )


class Capacity(_Model):
    """How many bytes the cache may use, split among tenants by the operator."""

    l1_bytes_per_pod: ByteQuantity = Field(
        ge=0, description="In-process (L1) bytes on every pod: an integer or a quantity (512Mi)."
    )
    l2_bytes: ByteQuantity = Field(
        ge=0, description="Redis (L2) bytes for the whole fleet: an integer or a quantity (8Gi)."
    )


class SecretKeyRef(_Model):
    """A key of a Secret in the cache's namespace."""

    name: str = Field(description="Secret name.", min_length=1, max_length=253)
    key: str = Field(default="url", description="Key holding the value.", min_length=1)


class RedisEndpoint(_Model):
    """Where the control state and L2 live: a URL, or a Secret holding it."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [_cel(REDIS_ONE_OF_RULE, REDIS_ONE_OF_MESSAGE)]
        }
    )

    url: str | None = Field(
        default=None,
        description=(
            "redis://host:port/db (or rediss://) for one server; "
            "redis+cluster://host:port,host:port (or rediss+cluster://) for a cluster."
        ),
        pattern=r"^(redis|rediss|redis\+cluster|rediss\+cluster)://",
    )
    secret_ref: SecretKeyRef | None = Field(
        default=None, description="Secret key holding the URL (use this when it has a password)."
    )
    outage_staleness_seconds: int = Field(
        default=0,
        ge=0,
        le=86400,
        description=(
            "What the sidecars do while Redis is unreachable. 0 (strict): L1 hits stop once "
            "the invalidation epochs cannot be confirmed (within the staleness bound, 2 s) and "
            "every request goes to the model server. N > 0: L1 hits go on for up to N seconds "
            "after the last confirmation, so an answer may be up to N seconds older than an "
            "invalidation that completed during the outage."
        ),
    )

    @model_validator(mode="after")
    def _one_of(self) -> RedisEndpoint:
        if (self.url is None) == (self.secret_ref is None):
            raise ValueError(REDIS_ONE_OF_MESSAGE)
        return self


class UpstreamLimits(_Model):
    """How many connections each sidecar opens to its model server (docs/limits.md)."""

    max_connections: int = Field(
        default=UPSTREAM_MAX_CONNECTIONS,
        ge=1,
        le=65536,
        description=(
            "Connections each sidecar keeps open or opening to its model server at once "
            "(--upstream-max-connections); requests beyond them wait. Identical concurrent "
            "misses share one (single-flight)."
        ),
    )
    max_queued: int = Field(
        default=UPSTREAM_MAX_WAITING,
        ge=0,
        le=1048576,
        description=(
            "Requests that may wait for a free connection (--upstream-max-queued); beyond "
            "them a request gets 503 with Retry-After at once."
        ),
    )


class PrometheusEndpoint(_Model):
    """Where the operator reads the sidecars' metrics."""

    url: str = Field(description="Prometheus base URL.", pattern=r"^https?://")
    window: str = Field(
        default=DEFAULT_METRICS_WINDOW,
        description="Rate window of the queries, e.g. 2m.",
        pattern=_DURATION_PATTERN,
    )
    curve_window: str = Field(
        default=DEFAULT_CURVE_WINDOW,
        description=(
            "Window of the miss-ratio-curve query (reuse distances), e.g. 10m; longer than "
            "window so that reuse minutes apart counts."
        ),
        pattern=_DURATION_PATTERN,
    )
    timeout_seconds: float = Field(
        default=DEFAULT_PROMETHEUS_TIMEOUT_S,
        gt=0,
        le=60,
        description="Timeout of one query, seconds.",
    )


class AllocationTuning(_Model):
    """How eagerly quotas follow the metrics."""

    smoothing: float = Field(
        default=DEFAULT_SMOOTHING,
        gt=0,
        le=1,
        description="EWMA weight of the newest target share (1 = jump straight to it).",
    )
    hysteresis: float = Field(
        default=DEFAULT_HYSTERESIS,
        ge=0,
        le=1,
        description="A share moves only when its target differs by more than this fraction.",
    )
    min_gain: float = Field(
        default=DEFAULT_MIN_GAIN,
        ge=0,
        le=1,
        description=(
            "Shares move only when the predicted gain (upstream seconds saved, weighted) "
            "exceeds this fraction of the current one, or an SLA cache can meet is missed."
        ),
    )


class Sla(_Model):
    """A tenant's service level targets; each one is optional."""

    p95_latency_seconds: float | None = Field(
        default=None, gt=0, description="Target p95 request latency, seconds."
    )
    min_hit_ratio: float | None = Field(
        default=None, ge=0, le=1, description="Minimum cache hit ratio (hits / hits + misses)."
    )
    min_rps: float | None = Field(
        default=None, ge=0, description="Request rate the tenant is promised, requests/second."
    )
    ttft_p95_seconds: float | None = Field(
        default=None,
        gt=0,
        description=(
            "Target p95 time to first token of model answers (misses and bypasses, not hits), "
            "seconds: the first SSE data event of a streamed answer, the whole answer otherwise."
        ),
    )
    itl_p95_seconds: float | None = Field(
        default=None,
        gt=0,
        description=(
            "Target p95 inter-token latency of streamed model answers (each answer's mean gap "
            "between SSE data events), seconds."
        ),
    )


class SemanticSpec(_Model):
    """A tenant's semantic tier (L3): answers for paraphrases of its earlier questions."""

    enabled: bool = Field(
        default=False,
        description=(
            "Answer a deterministic request from the most similar earlier question of this "
            "tenant (same model, version, system prompt and parameters) when its embedding is "
            "close enough and it passes the false-hit guard; needs sidecars started with "
            "CACHEFLEET_SEMANTIC_SOURCE."
        ),
    )
    threshold: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="Cosine similarity a hit needs; empty = the sidecar's default (0.8).",
    )
    shadow: bool | None = Field(
        default=None,
        description=(
            "Shadow mode: L3 serves nothing; a sample of the requests it would have answered "
            "goes upstream anyway and the two answers are compared (counted as "
            "cachefleet_l3_shadow_comparisons_total), to see the false-hit rate before "
            "serving; empty = the sidecar's default (CACHEFLEET_SEMANTIC_SHADOW, off)."
        ),
    )


class AdmissionSpec(_Model):
    """Class-aware admission in the sidecars while their model server is saturated.

    Saturated: the server's own metrics say at least ``maxWaiting`` requests wait
    for prefill, or its KV cache is ``maxKvUsage`` full (or ``maxRunning`` run).
    Then a BestEffort tenant's miss gets 429 with Retry-After, a Standard one waits
    (bounded), a Guaranteed one passes; a cache hit is never refused (docs/admission.md).
    """

    enabled: bool = Field(default=True, description="Admission on for this cache's sidecars.")
    max_waiting: int = Field(
        default=classes.DEFAULT_MAX_WAITING,
        ge=1,
        le=100000,
        description="Requests waiting for prefill (vllm:num_requests_waiting) that saturate.",
    )
    max_kv_usage: float = Field(
        default=classes.DEFAULT_MAX_KV_USAGE,
        gt=0,
        le=1,
        description="KV cache usage (vllm:kv_cache_usage_perc, 0-1] that saturates.",
    )
    max_running: int | None = Field(
        default=None,
        ge=1,
        le=100000,
        description="Running requests that saturate; empty = not a signal.",
    )
    standard_queue: int = Field(
        default=classes.DEFAULT_STANDARD_QUEUE,
        ge=0,
        le=100000,
        description="Standard requests that may wait per sidecar (429 beyond).",
    )
    standard_max_wait_seconds: float = Field(
        default=classes.DEFAULT_STANDARD_MAX_WAIT_S,
        gt=0,
        le=3600,
        description="Seconds a Standard request waits for room before it gets 503.",
    )


#: Longest entry TTL a spec may ask for, seconds (one year).
MAX_TTL_SECONDS = 31_536_000


class CacheControlSpec(_Model):
    """Which request ``Cache-Control`` directives a tenant may use (RFC 9111 semantics).

    A directive the tenant may not use is ignored (the request is served as
    if it had not been sent) and counted in
    ``cachefleet_cache_control_ignored_total``. ``only-if-cached`` never costs
    the model anything and is always obeyed.
    """

    allow_bypass: bool = Field(
        default=True,
        description=(
            "Obey no-cache (skip the cache, refresh the entry) and no-store (do not store the "
            "answer); false: both ignored and counted."
        ),
    )
    allow_max_age: bool = Field(
        default=True,
        description=(
            "Obey max-age=N (serve only an entry filled at most N seconds ago); false: ignored "
            "and counted."
        ),
    )


class TenantLimitsSpec(_Model):
    """A tenant's request and token limits, enforced fleet-wide (docs/rate-limits.md)."""

    requests_per_minute: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Requests per minute that reach the model server (cache hits count only with "
            "--limits-count-hits); beyond: 429 with Retry-After and x-ratelimit-* headers."
        ),
    )
    tokens_per_minute: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Prompt + completion tokens per minute: estimated at admission, corrected from the "
            "answer's usage. Cache hits never consume tokens."
        ),
    )
    tokens_per_day: int | None = Field(
        default=None, ge=1, description="Prompt + completion tokens per day."
    )


class TenantSpec(_Model):
    """One tenant of the cache: its class, SLA and share bounds."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(MIN_MAX_RULE, MIN_MAX_MESSAGE, ".minShare"),
                _cel(BEST_EFFORT_RULE, BEST_EFFORT_MESSAGE, ".minShare"),
            ]
        }
    )

    name: str = Field(
        description="Tenant id as the sidecar sees it (header or API-key map).",
        pattern=_NAME_PATTERN,
        max_length=63,
    )
    priority_class: PriorityClass = Field(
        default=PriorityClass.STANDARD,
        description=(
            "Guaranteed: minShare always held, served first. Standard: proportional share "
            "of the rest. BestEffort: only what is left."
        ),
    )
    sla: Sla | None = Field(default=None, description="Service level targets.")
    min_share: float = Field(
        default=0.0, ge=0, le=1, description="Fraction of capacity the tenant always keeps."
    )
    max_share: float = Field(
        default=1.0, ge=0, le=1, description="Fraction of capacity the tenant never exceeds."
    )
    policy: Policy | None = Field(
        default=None, description="L1 policy of this tenant; empty = the cache default."
    )
    collapse_whitespace: bool | None = Field(
        default=None,
        description=(
            "Collapse whitespace runs inside message text when keying (right for prose, "
            "wrong for code); empty = the sidecar's default (off)."
        ),
    )
    cache_nondeterministic: bool | None = Field(
        default=None,
        description=(
            "Also cache requests with temperature > 0 and no seed; empty = the sidecar's "
            "default (off)."
        ),
    )
    semantic: SemanticSpec | None = Field(
        default=None,
        description="Semantic tier (L3) of this tenant; empty = the sidecar's default (off).",
    )
    ttl_seconds: int | None = Field(
        default=None,
        ge=1,
        le=MAX_TTL_SECONDS,
        description=(
            "Seconds after its fill an entry of this tenant stops being served, by L1, L2 and "
            "L3 alike; empty = spec.ttlSeconds."
        ),
    )
    cache_control: CacheControlSpec | None = Field(
        default=None,
        description="Request Cache-Control directives this tenant may use; empty = all.",
    )
    limits: TenantLimitsSpec | None = Field(
        default=None,
        description="Request and token limits, fleet-wide; empty = none.",
    )
    fairness_weight: float = Field(
        default=1.0,
        gt=0,
        le=MAX_FAIRNESS_WEIGHT,
        description=(
            "Share of the releases from a saturated model server's Standard queue against "
            "the other tenants waiting there (weighted fair queuing); 2 = twice a tenant of 1."
        ),
    )

    @model_validator(mode="after")
    def _bounds(self) -> TenantSpec:
        if self.min_share > self.max_share:
            raise ValueError(MIN_MAX_MESSAGE)
        if self.priority_class is PriorityClass.BEST_EFFORT and self.min_share > 0:
            raise ValueError(BEST_EFFORT_MESSAGE)
        return self


class TenantDefaults(_Model):
    """How a tenant that ``tenants`` does not list is treated: one customer of many.

    Such a tenant is admitted on its first request (instead of refused) and
    gets an L1 partition of its own on each pod it reaches, from a pool of
    ``share`` of the pod's L1 that all unlisted tenants split equally; when a
    pod's ``--max-tenants`` partitions are taken, the unlisted tenant seen least
    recently gives up its partition (listed tenants never do). In L2 all
    unlisted tenants share ``l2Share`` of the fleet's L2 bytes (each in its own
    key scope: only the byte budget is pooled; one of them holds at most
    ``l2GuestMaxShare`` of it). The listed tenants' shares are fractions of what the pools
    leave; with none listed, the pools are the whole L1 and L2.
    """

    share: float = Field(
        default=DEFAULT_UNLISTED_SHARE,
        gt=0,
        le=MAX_UNLISTED_SHARE,
        description=(
            "Fraction of each pod's L1 that all unlisted tenants share (split equally among "
            "those active on the pod); the listed tenants share the rest."
        ),
    )
    l2_share: float = Field(
        default=DEFAULT_UNLISTED_L2_SHARE,
        ge=0,
        le=MAX_UNLISTED_SHARE,
        description=(
            "Fraction of the fleet's L2 bytes that all unlisted tenants share (one of them "
            "holds at most l2GuestMaxShare of it; 0 = they stay in L1); the listed tenants "
            "share the rest."
        ),
    )
    l2_guest_max_share: float = Field(
        default=DEFAULT_GUEST_MAX_SHARE,
        gt=0,
        le=1,
        description=(
            "Fraction of the unlisted tenants' L2 pool (l2Share) that one of them may hold: "
            "a write over it evicts that tenant's own least recently used entries first, so "
            "one busy tenant cannot take the pool from the others. 1 = no cap of its own."
        ),
    )
    priority_class: Literal["Standard", "BestEffort"] = Field(
        default="Standard",
        description=(
            "Class of an unlisted tenant (admission, routing). Guaranteed needs a minShare: "
            "list the tenant."
        ),
    )
    policy: Policy | None = Field(
        default=None, description="L1 policy of unlisted tenants; empty = the cache default."
    )
    fairness_weight: float = Field(
        default=1.0,
        gt=0,
        le=MAX_FAIRNESS_WEIGHT,
        description="Fairness weight of each unlisted tenant in the Standard queue.",
    )


class ObjectiveSpec(_Model):
    """A GIE InferenceObjective name and the class its requests are lowered to."""

    name: str = Field(
        description=(
            "The InferenceObjective's name, as the gateway sends it in "
            "x-gateway-inference-objective."
        ),
        pattern=_NAME_PATTERN,
        max_length=63,
    )
    priority_class: PriorityClass = Field(
        description=(
            "Class of a request naming this objective, when lower than its tenant's: an "
            "objective never raises a tenant's class."
        ),
    )


class WarmupSpec(_Model):
    """L1 warm-up of starting sidecars from L2 (a rollout or scale-out does not start cold)."""

    bytes: ByteQuantity = Field(
        ge=0,
        le=1 << 40,
        description=(
            "Bytes of L1 a starting sidecar fills from L2 with its tenants' most recently "
            "used entries (each tenant within its L1 share) before it reports ready, an "
            "integer or a quantity (64Mi); 0: off."
        ),
    )
    timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description="Longest a warm-up holds readiness back (a Redis that is down ends it).",
    )


class ObservabilitySpec(_Model):
    """Where the cache's sidecars send traces (docs/tracing.md)."""

    otlp_endpoint: str | None = Field(
        default=None,
        max_length=2048,
        pattern=r"^https?://",
        description=(
            "OTLP/HTTP collector the injected sidecars send request spans to "
            "(http://collector:4318; /v1/traces is added unless given); the W3C traceparent "
            "goes on to the model server. Empty = no tracing. A change reaches Pods created "
            "after it."
        ),
    )


class InferencePoolRef(_Model):
    """An InferencePool (inference.networking.k8s.io/v1) in the cache's namespace."""

    name: str = Field(
        description="InferencePool name.",
        min_length=1,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
    )


class RoutingSpec(_Model):
    """Whether the cache's pods are routed by cachefleet's endpoint picker, and through which pool.

    The picker (``cachefleet router``), its Service and the InferencePool are
    deployed by the Helm chart (``router.*`` values, docs/routing-install.md);
    the operator validates this field and reports the pool in
    ``status.routing`` and ``kubectl get inferencecaches``. It creates nothing.
    """

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [_cel(POOL_REF_RULE, POOL_REF_MESSAGE, ".inferencePoolRef")]
        }
    )

    enabled: bool = Field(
        default=False,
        description=(
            "Requests reach these pods through an InferencePool whose endpoint picker is "
            "cachefleet's (prefix- and load-aware); the chart's router values deploy it."
        ),
    )
    inference_pool_ref: InferencePoolRef | None = Field(
        default=None,
        description=(
            "An existing InferencePool that routes to these pods (the chart's "
            "router.existingPool); empty: the pool the chart renders, named after this cache."
        ),
    )

    @model_validator(mode="after")
    def _ref_needs_enabled(self) -> RoutingSpec:
        if self.inference_pool_ref is not None and not self.enabled:
            raise ValueError(POOL_REF_MESSAGE)
        return self

    def pool_name(self, cache_name: str) -> str | None:
        """The InferencePool routing to the cache ``cache_name``; None when routing is off."""
        if not self.enabled:
            return None
        return self.inference_pool_ref.name if self.inference_pool_ref else cache_name


class ModelPrice(_Model):
    """What one model's tokens cost: a row of the sidecars' price table."""

    model: str = Field(
        min_length=1,
        max_length=253,
        description='The model as requests name it ("model" of the body); "*": every other model.',
    )
    prompt_per1k: float = Field(
        default=0.0,
        ge=0.0,
        allow_inf_nan=False,
        alias="promptPer1k",
        description="Price of 1,000 prompt tokens, in spec.savings.currency.",
    )
    completion_per1k: float = Field(
        default=0.0,
        ge=0.0,
        allow_inf_nan=False,
        alias="completionPer1k",
        description="Price of 1,000 completion tokens, in spec.savings.currency.",
    )


class SavingsSpec(_Model):
    """What the tokens cache hits saved are worth: the sidecars count their price."""

    prices: list[ModelPrice] = Field(
        default_factory=list,
        max_length=MAX_PRICES,
        description=(
            "Prices per 1,000 tokens by model, given to every sidecar of the cache "
            '(status.savings.cost adds them up); a model with no price and no "*" row '
            "counts no cost. Models are unique."
        ),
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["model"],
        },
    )
    currency: str | None = Field(
        default=None,
        min_length=1,
        max_length=16,
        pattern=r"^[A-Za-z][A-Za-z0-9$._-]*$",
        description=(
            "The one currency of all prices (e.g. USD), shown beside status.savings.cost; "
            "empty: costs carry no currency."
        ),
    )

    @model_validator(mode="after")
    def _unique_models(self) -> SavingsSpec:
        seen: set[str] = set()
        for price in self.prices:
            if price.model in seen:
                raise ValueError(f"prices: model {price.model!r} is priced twice")
            seen.add(price.model)
        return self

    def price_table(self) -> dict[str, Price]:
        """The prices as the sidecars' price table: model -> (prompt, completion) per 1,000."""
        return {p.model: (p.prompt_per1k, p.completion_per1k) for p in self.prices}


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


# ----------------------------------------------------------------- CacheInvalidation


class ScopeType(StrEnum):
    """What an invalidation covers."""

    CACHE = "Cache"
    TENANT = "Tenant"
    MODEL = "Model"
    NAMESPACE = "Namespace"
    KEY = "Key"


class InvalidationScope(_Model):
    """The entries to invalidate."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "self.type != 'Tenant' || has(self.tenant)",
                    "scope Tenant needs tenant",
                    ".tenant",
                ),
                _cel(
                    "self.type != 'Model' || has(self.model)", "scope Model needs model", ".model"
                ),
                _cel(NAMESPACE_SCOPE_RULE, NAMESPACE_SCOPE_MESSAGE, ".namespace"),
                _cel(KEY_SCOPE_RULE, KEY_SCOPE_MESSAGE, ".key"),
            ]
        }
    )

    type: ScopeType = Field(
        description=(
            "Cache (everything), Tenant, Model, Namespace (one namespace of one tenant) or "
            "Key (one entry, by its X-Cache-Key)."
        )
    )
    tenant: str | None = Field(
        default=None,
        description=(
            "Tenant id for scopes Tenant and Namespace; for scope Key it narrows the purge "
            "to that tenant's entries (empty: every tenant's)."
        ),
        pattern=_NAME_PATTERN,
    )
    model: str | None = Field(default=None, description="Model name for scope Model.")
    namespace: str | None = Field(
        default=None,
        description="Namespace (the value of the sidecars' namespace header) for scope Namespace.",
        pattern=_NAME_PATTERN,
    )
    key: str | None = Field(
        default=None,
        description="SHA-256 hex digest of the entry's key (X-Cache-Key) for scope Key.",
        pattern=KEY_DIGEST_PATTERN,
    )

    @model_validator(mode="after")
    def _needs(self) -> InvalidationScope:
        if self.type is ScopeType.TENANT and self.tenant is None:
            raise ValueError("scope Tenant needs tenant")
        if self.type is ScopeType.MODEL and self.model is None:
            raise ValueError("scope Model needs model")
        if self.type is ScopeType.NAMESPACE and (self.tenant is None or self.namespace is None):
            raise ValueError(NAMESPACE_SCOPE_MESSAGE)
        if self.type is ScopeType.KEY and self.key is None:
            raise ValueError(KEY_SCOPE_MESSAGE)
        return self


class CacheRef(_Model):
    """An InferenceCache in the same namespace."""

    name: str = Field(description="InferenceCache name.", min_length=1, max_length=253)


class CacheInvalidationSpec(_Model):
    """What to invalidate; one-shot like a Job."""

    model_config = ConfigDict(
        json_schema_extra={"x-kubernetes-validations": [_cel(IMMUTABLE_RULE, IMMUTABLE_MESSAGE)]}
    )

    cache_ref: CacheRef = Field(description="The InferenceCache to invalidate.")
    scope: InvalidationScope = Field(description="Which entries.")
    reason: str | None = Field(default=None, description="Why (shown in Events).", max_length=1024)
    timeout_seconds: int = Field(
        default=DEFAULT_INVALIDATION_TIMEOUT_S,
        ge=1,
        le=3600,
        description="How long to wait for every live sidecar to acknowledge.",
    )


class InvalidationPhase(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    COMPLETED = "Completed"
    FAILED = "Failed"


class CacheInvalidationStatus(_Observed):
    """Progress and result of an invalidation."""

    phase: InvalidationPhase | None = Field(default=None, description="Where it stands.")
    epoch: int | None = Field(default=None, description="Epoch the invalidation advanced to.")
    expected_acks: int | None = Field(default=None, description="Live sidecars at the start.")
    acks: int | None = Field(default=None, description="Sidecars that acknowledged.")
    propagation_seconds: float | None = Field(
        default=None, description="From the epoch change to the last acknowledgement, seconds."
    )
    lagging_pods: list[str] | None = Field(
        default=None, description="Pods that did not acknowledge in time."
    )
    start_time: str | None = Field(default=None, description="When it started (RFC 3339).")
    completion_time: str | None = Field(default=None, description="When it ended (RFC 3339).")
    message: str | None = Field(default=None, description="Human-readable detail.")
    observed_generation: int | None = Field(default=None, description="Generation handled.")
    conditions: list[Condition] | None = Field(default=None, description="Conditions.")


class CacheInvalidation(_Observed):
    """A versioned, acknowledged invalidation of (part of) an InferenceCache."""

    api_version: Literal["cachefleet.io/v1alpha1"] = "cachefleet.io/v1alpha1"
    kind: Literal["CacheInvalidation"] = "CacheInvalidation"
    spec: CacheInvalidationSpec
    status: CacheInvalidationStatus | None = None


# ------------------------------------------------------------------------ parsing


def _loc(loc: tuple[int | str, ...], root: str) -> str:
    out = root
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part and not part.startswith("function-") and part != "__root__":
            out += f".{part}"
    return out


def _spec_error(exc: ValidationError) -> SpecError:
    errors = exc.errors()
    # an unknown field first: that is what the API server reports for such an object
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    field = _loc(tuple(first["loc"]), "spec")
    if first["type"] == "extra_forbidden":
        return SpecError(field, "unknown field")
    return SpecError(field, str(first["msg"]).removeprefix("Value error, "))


def parse_spec(raw: dict[str, Any]) -> InferenceCacheSpec:
    """Parse an InferenceCache spec; raise :class:`SpecError` naming the first bad field.

    Only the wire (camelCase) names are accepted, and a field the CRD does not
    declare is an error: the operator refuses what a strict API server refuses.
    """
    try:
        return InferenceCacheSpec.model_validate(raw, by_alias=True, by_name=False)
    except ValidationError as exc:
        raise _spec_error(exc) from exc


def parse_redis_endpoint(raw: Any) -> RedisEndpoint:
    """Parse ``spec.redis`` alone (cleanup needs only it); :class:`SpecError` if it is bad."""
    try:
        return RedisEndpoint.model_validate(raw, by_alias=True, by_name=False)
    except ValidationError as exc:
        err = _spec_error(exc)
        raise SpecError(err.field.replace("spec", "spec.redis", 1), err.message) from exc


def parse_invalidation_spec(raw: dict[str, Any]) -> CacheInvalidationSpec:
    """Parse a CacheInvalidation spec; raise :class:`SpecError` naming the first bad field."""
    try:
        return CacheInvalidationSpec.model_validate(raw, by_alias=True, by_name=False)
    except ValidationError as exc:
        raise _spec_error(exc) from exc
