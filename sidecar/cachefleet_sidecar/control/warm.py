"""Warm-up: a starting sidecar fills its L1 from L2 before it reports ready.

A rollout or a scale-out starts pods with an empty L1; without a warm-up
every one of them sends its first requests of every popular prompt to L2
(or upstream). With ``--warm-bytes`` set, a sidecar with Redis reads, for
each of its known tenants, the entries L2 used most recently (the tenant's
LRU sorted set, :func:`cachefleet_sidecar.contract.names.lru_key`: a fine proxy for
"most requested") and puts them in its L1, before ``/readyz`` says ready:

* bounded in bytes (``--warm-bytes`` over all tenants, and each tenant's own
  L1 share, which the L1 enforces), in entries per tenant
  (:data:`WARM_ENTRIES_PER_TENANT`) and in round trips (two per tenant:
  :meth:`cachefleet_sidecar.cache.l2.RedisL2.recent`);
* bounded in time (``--warm-timeout``): a Redis that is down or slow ends the
  warm-up, never readiness;
* every value is judged as a versioned read would judge it (:func:`judge`):
  written under exactly the epochs the sidecar knows now for its model and
  namespace, no fence field ahead of them (key purges included), a
  well-formed entry of that tenant; anything else is skipped and counted by
  reason. Entries written by sidecars older than the L1-key line
  (:func:`cachefleet_sidecar.contract.versioned.split_l1_id`) cannot be warmed (skipped
  as ``no_l1_key``).

:class:`WarmReport` is what ``/status`` shows under ``warmup``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from cachefleet_sidecar.cache.entry import Entry
from cachefleet_sidecar.contract.versioned import entry_head, split_l1_id
from cachefleet_sidecar.epochs import EpochTracker

if TYPE_CHECKING:
    from cachefleet_sidecar.cache.tiers import L2

#: Most entries read from L2 per tenant (one ZRANGE, one MGET).
WARM_ENTRIES_PER_TENANT = 512
#: Default --warm-timeout, seconds.
DEFAULT_WARM_TIMEOUT_S = 10.0

_MODEL = "model:"
_NAMESPACE = "namespace:"

WarmState = Literal["off", "running", "done", "timed_out", "failed"]


@dataclass
class WarmReport:
    """What one warm-up did (``/status`` ``warmup``)."""

    state: WarmState = "off"
    #: Entries and bytes put in L1 (still resident once the warm-up ended).
    entries: int = 0
    bytes: int = 0
    tenants: int = 0
    #: Values read but not warmed, by reason.
    skipped: dict[str, int] = field(default_factory=dict)
    seconds: float | None = None

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def describe(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "entries": self.entries,
            "bytes": self.bytes,
            "tenants": self.tenants,
            "skipped": dict(sorted(self.skipped.items())),
            "seconds": None if self.seconds is None else round(self.seconds, 3),
        }


def judge(
    value: bytes | None, fence: Mapping[str, int], tracker: EpochTracker, tenant: str
) -> tuple[int, bytes] | str:
    """(the writer's L1 key, the entry bytes) of a stored value, or why it is not warmed.

    The value must be an entry written under exactly the epochs ``tracker``
    knows now for the model and namespace its head names, with no field of
    the tenant's ``fence`` ahead of them (an invalidation or purge the
    sidecar has not applied yet).
    """
    if value is None:
        return "gone"
    head, newline, rest = value.partition(b"\n")
    if not newline:
        return "corrupt"
    model = namespace = None
    try:
        for part in head.decode().split(";"):
            scope = part.rpartition("=")[0]
            if scope.startswith(_MODEL):
                model = scope[len(_MODEL) :]
            elif scope.startswith(_NAMESPACE):
                namespace = scope[len(_NAMESPACE) :].partition("/")[2]
    except UnicodeDecodeError:
        return "corrupt"
    if model is None:
        return "corrupt"
    vector = tracker.vector(tenant, model, namespace or "")
    if entry_head(vector) != head + newline:
        return "stale"
    if any(fence.get(scope, 0) > epoch for scope, epoch in vector):
        return "behind"
    l1_id, entry = split_l1_id(rest)
    if l1_id is None:
        return "no_l1_key"
    return l1_id, entry


async def warm_l1(
    l2: L2,
    tenants: Iterable[str],
    tracker: EpochTracker,
    put: Callable[[str, str, int, Entry], int],
    *,
    budget_bytes: int,
    share: Callable[[str], int | None],
    resident: Callable[[str, int], bool],
    report: WarmReport,
    per_tenant: int = WARM_ENTRIES_PER_TENANT,
    read_timeout_s: float = 1.0,
) -> None:
    """Fill L1 from L2 for ``tenants`` within ``budget_bytes`` (the caller bounds the time).

    ``put(tenant, digest_hex, l1_key, entry)`` stores one entry and returns the
    bytes it costs in L1 (0: not stored). ``share(tenant)`` is the tenant's L1
    partition in bytes when known (the L1 enforces it anyway: a put over it
    evicts the tenant's least recent, i.e. earlier warmed, entries);
    ``resident(tenant, l1_key)`` says whether an entry is still in L1, so only
    what stayed is counted. A tenant whose read fails is skipped; an epoch
    that moves while a tenant's values are out drops that batch.
    """
    started = time.monotonic()
    left = budget_bytes
    try:
        for tenant in tenants:
            if left <= 0:
                break
            version = tracker.version
            got = await l2.recent(tenant, per_tenant, read_timeout_s)
            if got is None:
                report.skip("redis")
                continue
            values, fence = got
            if tracker.version != version:
                report.skip("epochs_moved")
                continue
            cap = share(tenant)
            room = left if cap is None else min(left, cap)
            chosen: list[tuple[str, int, Entry]] = []
            for digest, value in values:  # most recent first
                verdict = judge(value, fence, tracker, tenant)
                if isinstance(verdict, str):
                    report.skip(verdict)
                    continue
                l1_id, data = verdict
                try:
                    entry = Entry.loads(data)
                except ValueError:
                    report.skip("corrupt")
                    continue
                if entry.tenant != tenant:
                    report.skip("corrupt")
                    continue
                size = entry.l1_bytes(digest)
                if size > room:
                    report.skip("over_budget")
                    continue
                room -= size
                chosen.append((digest, l1_id, entry))
            stored: list[tuple[int, int]] = []
            for digest, l1_id, entry in reversed(chosen):  # least recent first: LRU order kept
                cost = put(tenant, digest, l1_id, entry)
                if cost > 0:
                    stored.append((l1_id, cost))
            kept = [cost for l1_id, cost in stored if resident(tenant, l1_id)]
            report.entries += len(kept)
            report.bytes += sum(kept)
            left -= sum(kept)
            if kept:
                report.tenants += 1
    finally:
        report.seconds = time.monotonic() - started
