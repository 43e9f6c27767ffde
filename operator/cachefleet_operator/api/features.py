"""The optional parts of an InferenceCache spec: objectives, warm-up, observability,
routing (the Gateway API Inference Extension) and savings (prices)."""

from __future__ import annotations

from pydantic import ConfigDict, Field, model_validator

from cachefleet_common.prices import Price
from cachefleet_operator.allocation import (
    PriorityClass,
)
from cachefleet_operator.api.base import (
    _NAME_PATTERN,
    MAX_PRICES,
    POOL_REF_MESSAGE,
    POOL_REF_RULE,
    _cel,
    _Model,
)
from cachefleet_operator.quantity import ByteQuantity


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
