"""Warm-up: a starting sidecar fills its L1 from L2 before it reports ready.

A rollout or a scale-out starts pods with an empty L1; without a warm-up
every one of them sends its first requests of every popular prompt to L2
(or upstream). With ``--warm-bytes`` set, a sidecar with Redis reads, for
each of its known tenants, the entries L2 used most recently (the tenant's
LRU sorted set, :func:`cachefleet_common.contract.names.lru_key`: a fine proxy for
"most requested") and puts them in its L1, before ``/readyz`` says ready:

* bounded in bytes (``--warm-bytes`` over all tenants, and each tenant's own
  L1 share, which the L1 enforces), in entries per tenant
  (:data:`WARM_ENTRIES_PER_TENANT`), and in what it reads: each value's length
  is asked first, and only values that fit in what is left of the budget (and
  of the tenant's share) are read, in batches of at most
  :data:`~cachefleet_sidecar.cache.l2_warm.WARM_BATCH_BYTES` /
  :data:`~cachefleet_sidecar.cache.l2_warm.WARM_BATCH_ENTRIES`
  (:meth:`cachefleet_sidecar.cache.l2.RedisL2.recent`): a warm-up never holds
  much more than ``--warm-bytes`` of values, however large the entries;
* bounded in time (``--warm-timeout``): a Redis that is down or slow ends the
  warm-up, never readiness;
* every value is judged as a versioned read would judge it (:func:`judge`):
  written under exactly the epochs the sidecar knows now for its model and
  namespace, no fence field ahead of them (key purges included), a
  well-formed entry of that tenant; anything else is skipped and counted by
  reason. Entries written by sidecars older than the L1-key line
  (:func:`cachefleet_common.contract.versioned.split_l1_id`) cannot be warmed (skipped
  as ``no_l1_key``);
* unlisted tenants (guests of ``tenantDefaults`` with an L2 pool) after the
  listed ones, from what they left: the pool's most recently used entries
  (one read of :data:`WARM_ENTRIES_PER_TENANT`, :meth:`RedisL2.recent_guests
  <cachefleet_sidecar.cache.l2.RedisL2.recent_guests>`), guests in order of
  their last use, at most as many as the L1 has free partitions (a guest
  beyond them would take a warmed guest's slot; its entries are skipped as
  ``guest_slots``), each within its L1 share as a tenant is.

:class:`WarmReport` is what ``/status`` shows under ``warmup``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from cachefleet_common.contract.versioned import entry_head, split_l1_id
from cachefleet_common.epochs import EpochTracker
from cachefleet_sidecar.cache.entry import Entry

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
    #: Tenants with an entry warmed, and of them the unlisted ones (guests).
    tenants: int = 0
    guests: int = 0
    #: Bytes of values read from L2 (at most the budget).
    read_bytes: int = 0
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
            "guests": self.guests,
            "read_bytes": self.read_bytes,
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
    guest_slots: Callable[[], int] = lambda: 0,
    is_guest: Callable[[str], bool] = lambda _: True,
) -> None:
    """Fill L1 from L2 for ``tenants`` within ``budget_bytes`` (the caller bounds the time).

    ``put(tenant, digest_hex, l1_key, entry)`` stores one entry and returns the
    bytes it costs in L1 (0: not stored). ``share(tenant)`` is the tenant's L1
    partition in bytes when known (the L1 enforces it anyway: a put over it
    evicts the tenant's least recent, i.e. earlier warmed, entries);
    ``resident(tenant, l1_key)`` says whether an entry is still in L1, so only
    what stayed is counted. A tenant whose read fails is skipped; an epoch
    that moves while a tenant's values are out drops that batch. Then up to
    ``guest_slots()`` unlisted tenants (asked once the listed ones are in; names
    ``is_guest`` accepts) from the guests' pool, within what is left of
    ``budget_bytes``; what stayed of theirs is counted once all are in (each new
    guest partition shrinks the others').
    """
    started = time.monotonic()
    left = budget_bytes
    try:
        for tenant in tenants:
            if left <= 0:
                break
            version = tracker.version
            cap = share(tenant)
            room = left if cap is None else min(left, cap)
            got = await l2.recent(tenant, per_tenant, read_timeout_s, room)
            if got is None:
                report.skip("redis")
                continue
            values, fence, unread = got
            _read(report, unread, (v for _, v in values))
            if tracker.version != version:
                report.skip("epochs_moved")
                continue
            stored = _fill(tenant, values, fence, tracker, put, share, left, report)
            left -= _count(report, resident, {tenant: stored})
        guests = guest_slots() if left > 0 else 0
        if guests > 0:
            await _warm_guests(
                l2, tracker, put, share, resident, report, left, guests, is_guest,
                per_tenant, read_timeout_s,
            )  # fmt: skip
    finally:
        report.seconds = time.monotonic() - started


async def _warm_guests(
    l2: L2,
    tracker: EpochTracker,
    put: Callable[[str, str, int, Entry], int],
    share: Callable[[str], int | None],
    resident: Callable[[str, int], bool],
    report: WarmReport,
    left: int,
    guests: int,
    is_guest: Callable[[str], bool],
    limit: int,
    read_timeout_s: float,
) -> None:
    """:func:`warm_l1`'s guests: the pool's most recent entries, by guest, ``left`` bytes."""
    version = tracker.version
    got = await l2.recent_guests(limit, read_timeout_s, left)
    if got is None:
        report.skip("redis")
        return
    pool, fence, unread = got
    _read(report, unread, (v for _, _, v in pool))
    if tracker.version != version:
        report.skip("epochs_moved")
        return
    by_guest: dict[str, list[tuple[str, bytes | None]]] = {}
    for owner, digest, value in pool:  # most recent first: guests in order of last use
        if owner not in by_guest:
            if not is_guest(owner):
                report.skip("not_a_guest")  # listed since it wrote: it warms as a tenant
                continue
            if len(by_guest) >= guests:
                report.skip("guest_slots")
                continue
            by_guest[owner] = []
        by_guest[owner].append((digest, value))
    stored: dict[str, list[tuple[int, int]]] = {}
    for owner, values in by_guest.items():
        if left <= 0:
            break
        stored[owner] = _fill(owner, values, fence, tracker, put, share, left, report)
        left -= sum(cost for _, cost in stored[owner])
    before = report.tenants
    _count(report, resident, stored)
    report.guests += report.tenants - before


def _read(report: WarmReport, unread: int, values: Iterable[bytes | None]) -> None:
    """Count what one read took from L2, and what it left unread for the budget."""
    report.read_bytes += sum(len(v) for v in values if v is not None)
    if unread:
        report.skipped["over_budget"] = report.skipped.get("over_budget", 0) + unread


def _fill(
    tenant: str,
    values: list[tuple[str, bytes | None]],
    fence: Mapping[str, int],
    tracker: EpochTracker,
    put: Callable[[str, str, int, Entry], int],
    share: Callable[[str], int | None],
    left: int,
    report: WarmReport,
) -> list[tuple[int, int]]:
    """Put ``tenant``'s warmable ``values`` (most recent first) in L1 within its share and
    ``left`` bytes; (L1 key, bytes) of each stored."""
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
    return stored


def _count(
    report: WarmReport,
    resident: Callable[[str, int], bool],
    stored: Mapping[str, list[tuple[int, int]]],
) -> int:
    """Count in ``report`` what of ``stored`` (by tenant) is still in L1; its bytes."""
    total = 0
    for tenant, entries in stored.items():
        kept = [cost for l1_id, cost in entries if resident(tenant, l1_id)]
        report.entries += len(kept)
        report.bytes += sum(kept)
        total += sum(kept)
        if kept:
            report.tenants += 1
    return total
