"""What an InferenceCache runs on: its pods (selector), model, capacity, Redis, Prometheus,
the upstream's limits and the allocation's tuning."""

from __future__ import annotations

from enum import StrEnum

from pydantic import ConfigDict, Field, model_validator

from cachefleet_common.defaults import UPSTREAM_MAX_CONNECTIONS, UPSTREAM_MAX_WAITING
from cachefleet_operator.allocation import (
    DEFAULT_HYSTERESIS,
    DEFAULT_MIN_GAIN,
    DEFAULT_SMOOTHING,
)
from cachefleet_operator.api.base import (
    _DURATION_PATTERN,
    DEFAULT_CURVE_WINDOW,
    DEFAULT_METRICS_WINDOW,
    DEFAULT_PROMETHEUS_TIMEOUT_S,
    REDIS_ONE_OF_MESSAGE,
    REDIS_ONE_OF_RULE,
    _cel,
    _Model,
)
from cachefleet_operator.quantity import ByteQuantity


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
