"""The CacheInvalidation: its scope, spec, phase and status."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from cachefleet_operator.api.base import (
    _NAME_PATTERN,
    DEFAULT_INVALIDATION_TIMEOUT_S,
    IMMUTABLE_MESSAGE,
    IMMUTABLE_RULE,
    KEY_DIGEST_PATTERN,
    KEY_SCOPE_MESSAGE,
    KEY_SCOPE_RULE,
    NAMESPACE_SCOPE_MESSAGE,
    NAMESPACE_SCOPE_RULE,
    _cel,
    _Model,
    _Observed,
)
from cachefleet_operator.api.status import Condition


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
