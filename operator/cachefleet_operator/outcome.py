"""What a reconcile or an invalidation run hands to the kopf layer: Events and Outcomes.

Shared by :mod:`cachefleet_operator.reconcile` and
:mod:`cachefleet_operator.invalidation`, so neither imports the other for its
result types.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal


class SecretUnavailable(Exception):
    """The Secret or its key could not be read."""


@dataclass(frozen=True, slots=True)
class Event:
    """A Kubernetes Event to emit on the object."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(slots=True)
class Outcome:
    """What one reconcile did: status to patch, Events, and whether to retry."""

    status: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    failure: Literal["temporary", "permanent"] | None = None
    failure_message: str = ""
    result: str = "ok"
    #: Retry delay of a temporary failure, seconds; None = the backoff of
    #: :func:`cachefleet_operator.reconcile.retry_delay`.
    delay: float | None = None
    #: Whether the spec is in force (quotas published). A fault that leaves it in
    #: force (metrics only) is retried by the rebalance timer, not by the change
    #: handler, so a later spec edit is not queued behind a metrics backoff.
    applied: bool = False


def now_rfc3339(clock: Callable[[], float] = time.time) -> str:
    """``clock()`` as an RFC 3339 UTC timestamp with second precision."""
    return datetime.fromtimestamp(clock(), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(text: str | None) -> float | None:
    """Unix time of a :func:`now_rfc3339` string; None if absent or unreadable."""
    if not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
