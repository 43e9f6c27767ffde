"""The messages that travel through Redis, as pydantic models.

Quota tables (:class:`QuotaAssignment`), control-channel notices
(:class:`ControlMessage`), heartbeats and epoch acknowledgements. Which key or
channel carries each is in :mod:`cachefleet_common.contract.names`.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

from cachefleet_common.contract.names import Policy

PROTOCOL_VERSION = 1


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class RateLimits(_Model):
    """A tenant's request and token limits, fleet-wide (docs/rate-limits.md); None: no limit."""

    requests_per_minute: int | None = Field(default=None, gt=0)
    tokens_per_minute: int | None = Field(
        default=None, gt=0, description="Prompt + completion tokens per minute"
    )
    tokens_per_day: int | None = Field(default=None, gt=0)


class TenantQuota(_Model):
    """What one tenant may use, as assigned by the operator."""

    l1_bytes: Annotated[int, Field(ge=0, description="L1 bytes on every pod")]
    l2_bytes: Annotated[int, Field(ge=0, description="L2 bytes in Redis, fleet-wide")]
    l2_guest_max_share: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description=(
            "Fraction of l2_bytes one unlisted tenant may hold (default_tenant only); "
            "None = contract.lua.DEFAULT_GUEST_MAX_SHARE"
        ),
    )
    policy: Policy | None = Field(default=None, description="L1 policy; None = cache default")
    collapse_whitespace: bool | None = Field(
        default=None,
        description="Collapse whitespace inside message text when keying; None = sidecar default",
    )
    cache_nondeterministic: bool | None = Field(
        default=None,
        description="Cache requests with temperature > 0 and no seed; None = sidecar default",
    )
    semantic: bool | None = Field(
        default=None, description="Semantic tier (L3) on for this tenant; None = sidecar default"
    )
    semantic_threshold: float | None = Field(
        default=None, gt=0, le=1, description="L3 similarity threshold; None = sidecar default"
    )
    semantic_shadow: bool | None = Field(
        default=None,
        description="L3 measures would-be hits against upstream and serves none; None = default",
    )
    priority_class: Literal["Guaranteed", "Standard", "BestEffort"] | None = Field(
        default=None,
        description="The tenant's class (admission and routing order); None = Standard",
    )
    ttl_seconds: float | None = Field(
        default=None,
        gt=0,
        description="No tier serves an entry filled longer ago; None = the sidecar's default",
    )
    allow_bypass: bool | None = Field(
        default=None,
        description="Cache-Control no-cache / no-store obeyed; None = allowed",
    )
    allow_max_age: bool | None = Field(
        default=None, description="Cache-Control max-age obeyed; None = allowed"
    )
    #: Absent for older operators; ignored by older sidecars (``extra="ignore"``).
    limits: RateLimits | None = Field(
        default=None, description="Request and token limits, fleet-wide; None = none"
    )
    fairness_weight: float | None = Field(
        default=None,
        gt=0,
        le=1000,
        description="Share of the Standard queue's releases against other tenants; None = 1",
    )


class QuotaAssignment(_Model):
    """The whole quota table of one cache; ``generation`` only moves forward."""

    protocol: int = PROTOCOL_VERSION
    generation: Annotated[int, Field(ge=0)]
    issued_at: float = Field(default_factory=time.time)
    default_policy: Policy = Policy.LRU
    model: str | None = None
    model_version: str | None = None
    tenants: dict[str, TenantQuota] = Field(default_factory=dict)
    #: How a tenant ``tenants`` does not name is treated (``spec.tenantDefaults``):
    #: admitted with a partition of its own on demand, its policy and class from
    #: here, ``l1_bytes`` the pool all such tenants share on each pod and
    #: ``l2_bytes`` the L2 bytes all of them share fleet-wide (the guests' pool,
    #: contract.names.GUESTS; 0: they stay in L1), ``l2_guest_max_share`` the most
    #: of it one of them may hold. None: such tenants are refused
    #: or mapped to the default tenant, as without quotas.
    default_tenant: TenantQuota | None = None
    #: TTL of tenants not in ``tenants`` (the InferenceCache's spec.ttlSeconds); None = none.
    ttl_seconds: float | None = Field(default=None, gt=0)
    #: GIE InferenceObjective name -> the class it lowers a request to (spec.objectives);
    #: a request's class is never raised by it (docs/admission.md).
    objectives: dict[str, Literal["Guaranteed", "Standard", "BestEffort"]] = Field(
        default_factory=dict
    )


def newer_assignment(
    generation: bytes | str | None, raw: bytes | str | None, applied: int
) -> QuotaAssignment | None:
    """The quota table read from :func:`quotas_key` (``HMGET generation assignment``)
    when it is newer than generation ``applied``; None when it is not, or absent.

    Raises :class:`pydantic.ValidationError` for an assignment that does not parse.
    """
    if generation is None or raw is None or int(generation) <= applied:
        return None
    assignment = QuotaAssignment.model_validate_json(raw)
    return assignment if assignment.generation > applied else None


class ControlMessage(_Model):
    """A "look now" notice on the control channel.

    A ``kind="epochs"`` notice also carries the epochs just advanced (``epochs``,
    {scope: epoch}); receivers max-merge them, so a duplicate or a late one is
    harmless, and still confirm by reading :func:`epochs_key`.
    """

    protocol: int = PROTOCOL_VERSION
    kind: Literal["quotas", "epochs", "ping"]
    generation: int = 0
    epochs: dict[str, int] | None = None
    sent_at: float = Field(default_factory=time.time)


class Heartbeat(_Model):
    """What a live sidecar says about itself, refreshed every few seconds."""

    protocol: int = PROTOCOL_VERSION
    pod: str
    quota_generation: int = -1
    #: The L1 policy of each tenant the pod holds a partition for, but unlisted ones.
    policy_by_tenant: dict[str, Policy] = Field(default_factory=dict)
    #: Unlisted tenants (tenantDefaults, --guest-share) holding a partition, by policy:
    #: counted, not named (thousands of them would make every heartbeat that long).
    unlisted_by_policy: dict[Policy, int] = Field(default_factory=dict)
    redis_ok: bool = True
    #: Admission is shedding: the pod's model server is saturated (docs/admission.md).
    shedding: bool = False
    sent_at: float = Field(default_factory=time.time)


class EpochAck(_Model):
    """A sidecar's acknowledgement: the epochs it has applied, and when."""

    protocol: int = PROTOCOL_VERSION
    pod: str
    epochs: dict[str, int] = Field(default_factory=dict)
    acked_at: float = Field(default_factory=time.time)


#: KEYS[1] = epochs_key; ARGV[1] = scope, ARGV[2] = the epoch the caller read.
#: Returns {1, new epoch} when the epoch was still ARGV[2] (now +1), else


def ack_epochs(raw: bytes | str) -> tuple[str, dict[str, int]] | None:
    """(pod, epochs) of one JSON :class:`EpochAck` (hash value or announcement), or None.

    The invalidation wait reads one per sidecar; plain JSON, no model.
    """
    try:
        doc = orjson.loads(raw)
        pod, epochs = doc["pod"], doc["epochs"]
        if not isinstance(pod, str) or not isinstance(epochs, dict):
            return None
        return pod, {str(s): int(e) for s, e in epochs.items()}
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None
