"""The tenants of an InferenceCache: each one's class, SLA, bounds, caching and limits, and
the defaults of the tenants it does not list."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from cachefleet_common import classes
from cachefleet_common.contract.lua import DEFAULT_GUEST_MAX_SHARE
from cachefleet_common.contract.names import Policy
from cachefleet_operator.allocation import (
    PriorityClass,
)
from cachefleet_operator.api.base import (
    _NAME_PATTERN,
    BEST_EFFORT_MESSAGE,
    BEST_EFFORT_RULE,
    DEFAULT_UNLISTED_L2_SHARE,
    DEFAULT_UNLISTED_SHARE,
    MAX_FAIRNESS_WEIGHT,
    MAX_UNLISTED_SHARE,
    MIN_MAX_MESSAGE,
    MIN_MAX_RULE,
    _cel,
    _Model,
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
