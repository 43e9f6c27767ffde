"""The sidecar's in-process L1: one byte-bounded partition per tenant.

Each tenant gets its own replacement-policy instance (see
:mod:`cachefleet_sidecar.policies`), so a tenant's puts can only evict that
tenant's entries. Partition sizes:

* Without quotas, the active tenants (those that called ``get`` or ``put``)
  share ``total_bytes`` equally (floor division). A new tenant's arrival
  shrinks the others to the new equal share; that is the only way one
  tenant's activity can evict another's entries.
* With quotas from the operator, a tenant in the quota map gets its
  ``l1_bytes`` (scaled down proportionally if the map asks for more than
  ``total_bytes``, so the L1 never outgrows its budget), and every active
  tenant not in the map gets an equal share of what the map leaves
  unassigned (possibly 0: such a tenant caches nothing).

*Known* tenants (:meth:`TenantL1.set_reserved`: those named by configuration,
API keys or quotas) and *guests* (any other active tenant): with a guest
share ``F`` > 0 and any known tenant, guests together get ``F`` of the
budget, split equally among the active guests, and known tenants share the
rest, so no number of guest names can shrink a known tenant's partition.
With ``F`` = 0 guests are sized like every other tenant without a quota.

The guests' pool can also be given in bytes with a policy of its own
(:meth:`TenantL1.set_guest_pool`: the operator's ``tenantDefaults``); it then
replaces the guest share, and holds even when no tenant is known.

Partitions are bounded by ``max_tenants``. When the table is full, a new
tenant (guest or known) takes the slot of the guest seen least recently:
that guest's entries are dropped and its bytes go back to the others
(:attr:`TenantL1.on_replaced` is told its name). Known tenants never lose
their slot this way; only when every slot holds a known tenant does a new
one raise :class:`TenantLimitError` (it is served uncached). The guests'
recency is an ``OrderedDict`` (one ``move_to_end`` per request of a guest;
known tenants keep a plain tick), so finding the guest to replace is O(1),
and a guest replacing a guest resizes nobody.
:meth:`TenantL1.expire_idle` drops partitions not used for a number of
:meth:`TenantL1.advance` ticks (entries, share and slot).

A partition's policy is, in order: an explicit :meth:`TenantL1.set_policy`
override, the quota's policy, the L1's default policy. Changing it is O(1):
the partition becomes a :class:`~cachefleet_sidecar.policies.migrating.Migration`
whose front (the new policy) serves at once, while the old structure's
entries move over when touched and in bounded batches of
:meth:`TenantL1.migrate_step`, which the owner calls between requests until
:attr:`TenantL1.migrating` is False. Entries (with their sizes and costs) are
dropped only when the new capacity is smaller, and then the old structure's
coldest go first. Switching back mid-way swaps the two structures' roles.

Pure and single-threaded: no I/O, no locks; the sidecar calls it from its
event loop.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from cachefleet_sidecar.policies import (
    ReplacementPolicy,
    SITSPolicy,
    available_policies,
    make_policy,
)
from cachefleet_sidecar.policies.migrating import Migration

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

#: How many tenant partitions one L1 holds unless told otherwise.
DEFAULT_MAX_TENANTS = 64


class TenantLimitError(RuntimeError):
    """A new tenant would exceed the L1's ``max_tenants`` partitions."""


@dataclass(frozen=True, slots=True)
class TenantStats:
    """One tenant partition at one moment."""

    policy: str
    capacity_bytes: int
    used_bytes: int
    entries: int
    #: Entries evicted for capacity since the tenant became active, including
    #: those a policy change dropped because the new capacity was smaller.
    evictions: int
    #: Entries still in the structure of the previous policy (a switch in progress).
    migrating: int = 0


def _check_policy(name: str) -> str:
    name = str(name)
    if name not in available_policies():
        raise ValueError(
            f"unknown L1 policy {name!r}; available: {', '.join(available_policies())}"
        )
    return name


class TenantL1(Generic[K, V]):
    """Per-tenant partitioned, byte-bounded L1 cache."""

    __slots__ = (
        "_default_policy",
        "_evictions_before",
        "_guest_policy",
        "_guest_pool",
        "_guest_share",
        "_max_tenants",
        "_overrides",
        "_parts",
        "_quotas",
        "_recent",
        "_reserved",
        "_seen",
        "_total",
        "on_replaced",
        "replaced",
        "tick",
    )

    def __init__(
        self,
        total_bytes: int,
        default_policy: str = "lru",
        max_tenants: int = DEFAULT_MAX_TENANTS,
        guest_share: float = 0.0,
    ) -> None:
        if total_bytes < 0:
            raise ValueError(f"total_bytes must be >= 0, got {total_bytes}")
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be >= 1, got {max_tenants}")
        if not 0.0 <= guest_share < 1.0:
            raise ValueError(f"guest_share must be in [0, 1), got {guest_share}")
        self._total = total_bytes
        self._guest_share = guest_share
        self._reserved: frozenset[str] = frozenset()
        #: Coarse clock for idleness, advanced by the owner (:meth:`advance`).
        self.tick = 0
        #: Tick of each known tenant's partition's last use.
        self._seen: dict[str, int] = {}
        #: The same for guests, least recently used first (the replacement order).
        self._recent: OrderedDict[str, int] = OrderedDict()
        #: The guests' pool in bytes and their policy (None: the guest share, the default).
        self._guest_pool: int | None = None
        self._guest_policy: str | None = None
        #: Called with the name of a guest whose partition a newcomer took.
        self.on_replaced: Callable[[str], None] | None = None
        #: Partitions taken from guests by newcomers since construction.
        self.replaced = 0
        self._default_policy = _check_policy(default_policy)
        self._max_tenants = max_tenants
        self._parts: dict[str, ReplacementPolicy[K, V]] = {}
        self._quotas: dict[str, tuple[int, str | None]] | None = None
        self._overrides: dict[str, str] = {}
        # Evictions counted by policy instances a tenant no longer uses.
        self._evictions_before: dict[str, int] = {}

    # ------------------------------------------------------------- hit path

    def get(self, tenant: str, key: K) -> V | None:
        """The cached value of ``key`` for ``tenant``, or None.

        A new ``tenant`` gets a partition at once (see the module doc);
        raises :class:`TenantLimitError` only if every slot holds a known tenant.
        """
        part = self._parts.get(tenant)
        if part is None:
            part = self._activate(tenant)
        recent = self._recent
        if tenant in recent:
            recent[tenant] = self.tick
            recent.move_to_end(tenant)
        else:
            self._seen[tenant] = self.tick
        return part.get(key)

    def put(self, tenant: str, key: K, value: V, size: int, cost: float | None = None) -> int:
        """Store ``value`` (``size`` bytes) for ``tenant``; the number evicted.

        ``cost`` is what a hit on it saves (upstream seconds), when known;
        cost-aware policies (SITS) weigh it.

        Only ``tenant``'s own entries are evicted. An entry bigger than the
        tenant's partition is not stored. Raises :class:`TenantLimitError`
        like :meth:`get`.
        """
        part = self._parts.get(tenant)
        if part is None:
            part = self._activate(tenant)
        recent = self._recent
        if tenant in recent:
            recent[tenant] = self.tick
            recent.move_to_end(tenant)
        else:
            self._seen[tenant] = self.tick
        return len(part.put(key, value, size, cost))

    def room(self, tenant: str) -> float:
        """The largest entry ``tenant``'s partition could store, in bytes (its capacity;
        infinite for a tenant without a partition yet: :meth:`put` decides)."""
        part = self._parts.get(tenant)
        return math.inf if part is None else part.capacity_bytes

    def contains(self, tenant: str, key: K) -> bool:
        """True if ``key`` is resident for ``tenant`` (no recency touch, no activation)."""
        part = self._parts.get(tenant)
        return part is not None and key in part

    def remove(self, tenant: str, key: K) -> bool:
        """Drop one entry; True if it was cached. Does not activate ``tenant``."""
        part = self._parts.get(tenant)
        return part is not None and part.remove(key)

    def clear(self, tenant: str | None = None) -> None:
        """Drop every entry of ``tenant`` (all tenants if None); shares stay."""
        if tenant is None:
            for each in self._parts.values():
                each.clear()
            return
        part = self._parts.get(tenant)
        if part is not None:
            part.clear()

    # -------------------------------------------------------------- control

    @property
    def total_bytes(self) -> int:
        return self._total

    @property
    def max_tenants(self) -> int:
        return self._max_tenants

    @property
    def default_policy(self) -> str:
        return self._default_policy

    @property
    def tenants(self) -> tuple[str, ...]:
        """Active tenants, in order of arrival."""
        return tuple(self._parts)

    @property
    def used_bytes(self) -> int:
        """Bytes held by all partitions together."""
        return sum(part.used_bytes for part in self._parts.values())

    def resize(self, total_bytes: int) -> None:
        """Change the whole L1's budget; partitions follow (shrinking evicts)."""
        if total_bytes < 0:
            raise ValueError(f"total_bytes must be >= 0, got {total_bytes}")
        self._total = total_bytes
        self._apply(self._parts)

    def set_default_policy(self, name: str) -> None:
        """Change the policy of tenants with no quota policy and no override."""
        self._default_policy = _check_policy(name)
        self._apply(self._parts)

    def set_quotas(self, quotas: Mapping[str, tuple[int, str | None]] | None) -> None:
        """Apply the operator's ``{tenant: (l1_bytes, policy or None)}``.

        ``None`` returns to equal shares of ``total_bytes``. Tenants in the
        map need not be active yet; their bytes are reserved either way.
        """
        if quotas is None:
            self._quotas = None
        else:
            checked: dict[str, tuple[int, str | None]] = {}
            for tenant, (l1_bytes, policy) in quotas.items():
                if l1_bytes < 0:
                    raise ValueError(f"tenant {tenant!r}: l1_bytes must be >= 0, got {l1_bytes}")
                checked[tenant] = (l1_bytes, None if policy is None else _check_policy(policy))
            self._quotas = checked
        self._sort_seen()
        self._apply(self._parts)

    def set_policy(self, tenant: str, name: str | None) -> None:
        """Force ``tenant``'s policy to ``name`` (None: back to quota/default).

        The override outlives later quota updates until it is cleared. An
        active tenant's entries migrate into the new policy at once; an
        inactive tenant starts with it.
        """
        if name is None:
            self._overrides.pop(tenant, None)
        else:
            self._overrides[tenant] = _check_policy(name)
        if tenant in self._parts:
            self._apply((tenant,))

    def set_pressure(self, pressure: float) -> None:
        """Model-server saturation (0..1) for the cost-aware policies (SITS).

        Applied to the partitions that exist now; a partition created later
        gets it at the next call (the sidecar calls once per switching window).
        """
        for part in self._parts.values():
            front = part.front if isinstance(part, Migration) else part
            if isinstance(front, SITSPolicy):
                front.pressure = pressure

    @property
    def migrating(self) -> bool:
        """True while some partition still holds entries of a previous policy."""
        return any(isinstance(part, Migration) for part in self._parts.values())

    def migrate_step(self, budget: int) -> int:
        """Move up to ``budget`` entries of switched partitions into their new policy.

        Bounded work, for the owner to call between requests until
        :attr:`migrating` is False; a partition whose old structure is empty
        becomes its new policy alone. Returns the number of entries moved.
        """
        moved = 0
        for tenant, part in list(self._parts.items()):
            if not isinstance(part, Migration):
                continue
            if moved < budget:
                moved += part.step(budget - moved)
            if part.done:
                self._replace(tenant, part, part.front)
        return moved

    def remove_tenant(self, tenant: str) -> bool:
        """Drop ``tenant``'s partition and give its share back; True if active."""
        if not self._drop(tenant):
            return False
        self._apply(self._parts)
        return True

    def _drop(self, tenant: str) -> bool:
        if self._parts.pop(tenant, None) is None:
            return False
        self._evictions_before.pop(tenant, None)
        self._seen.pop(tenant, None)
        self._recent.pop(tenant, None)
        return True

    @property
    def reserved(self) -> frozenset[str]:
        return self._reserved

    @property
    def guest_share(self) -> float:
        return self._guest_share

    def set_reserved(self, tenants: Iterable[str]) -> None:
        """The known tenants: guests can never take bytes from them (see the module doc)."""
        reserved = frozenset(tenants)
        if reserved != self._reserved:
            self._reserved = reserved
            self._sort_seen()
            self._apply(self._parts)

    def set_guest_pool(self, pool_bytes: int | None, policy: str | None = None) -> None:
        """Guests together get ``pool_bytes`` (capped at the total), with ``policy``.

        None returns to the guest share given at construction (and the default
        policy). Unlike the guest share it applies with no tenant known, too:
        then every tenant is a guest, and the pool is all they get.
        """
        if pool_bytes is not None and pool_bytes < 0:
            raise ValueError(f"guest pool must be >= 0 bytes, got {pool_bytes}")
        checked = None if policy is None else _check_policy(policy)
        if (pool_bytes, checked) != (self._guest_pool, self._guest_policy):
            self._guest_pool = pool_bytes
            self._guest_policy = checked
            self._apply(self._parts)

    def is_guest(self, tenant: str) -> bool:
        return tenant not in self._reserved and (self._quotas is None or tenant not in self._quotas)

    def advance(self) -> int:
        """Move the idleness clock one tick; returns the new tick."""
        self.tick += 1
        return self.tick

    def expire_idle(self, max_idle_ticks: int) -> list[str]:
        """Drop every partition unused for more than ``max_idle_ticks`` ticks; their names."""
        limit = self.tick - max_idle_ticks
        last = {**self._seen, **self._recent}
        gone = [t for t in self._parts if last.get(t, self.tick) < limit]
        for tenant in gone:
            self._drop(tenant)
        if gone:
            self._apply(self._parts)
        return gone

    def entries(self, tenant: str) -> list[tuple[K, V, int]]:
        """``tenant``'s resident ``(key, value, size)``, coldest first (O(n): tests, debugging)."""
        part = self._parts.get(tenant)
        return [] if part is None else list(part.items())

    def stats(self) -> dict[str, TenantStats]:
        """Per active tenant: policy, capacity, bytes used, entries, evictions."""
        return {
            tenant: TenantStats(
                policy=part.name,
                capacity_bytes=part.capacity_bytes,
                used_bytes=part.used_bytes,
                entries=len(part),
                evictions=self._evictions_before.get(tenant, 0) + part.evictions,
                migrating=part.pending if isinstance(part, Migration) else 0,
            )
            for tenant, part in self._parts.items()
        }

    # ------------------------------------------------------------ internals

    def _activate(self, tenant: str) -> ReplacementPolicy[K, V]:
        if len(self._parts) >= self._max_tenants:
            victim = self._least_recent_guest()
            if victim is not None:
                capacity = self._parts[victim].capacity_bytes
                self._drop(victim)
                self.replaced += 1
                if self.on_replaced is not None:
                    self.on_replaced(victim)
                if self.is_guest(tenant):
                    # A guest for a guest: every share stays as it was, nothing to resize.
                    same: ReplacementPolicy[K, V] = make_policy(self._policy_of(tenant), capacity)
                    self._parts[tenant] = same
                    self._recent[tenant] = self.tick
                    return same
        if len(self._parts) >= self._max_tenants:
            raise TenantLimitError(
                f"L1 already holds {self._max_tenants} tenant partitions; "
                f"tenant {tenant!r} cannot get one"
            )
        tenants = [*self._parts, tenant]
        part: ReplacementPolicy[K, V] = make_policy(
            self._policy_of(tenant), self._capacities(tenants)[tenant]
        )
        self._parts[tenant] = part
        if self.is_guest(tenant):
            self._recent[tenant] = self.tick
        self._apply(self._parts)
        return part

    def _least_recent_guest(self) -> str | None:
        """The guest seen least recently (O(1)), or None if every partition is a known tenant."""
        return next(iter(self._recent), None)

    def _sort_seen(self) -> None:
        """Who is a guest changed: file each partition's tick under known or guest again.

        O(partitions), on a change of the known tenants or quotas only; guests
        keep their order of last use (by tick, then by their previous order).
        """
        ticks = {**self._seen, **self._recent}
        self._seen = {t: n for t, n in ticks.items() if not self.is_guest(t)}
        guests = sorted(
            ((n, i, t) for i, (t, n) in enumerate(ticks.items()) if self.is_guest(t)),
        )
        self._recent = OrderedDict((t, n) for n, _, t in guests)

    def _policy_of(self, tenant: str) -> str:
        override = self._overrides.get(tenant)
        if override is not None:
            return override
        if self._quotas is not None:
            quota = self._quotas.get(tenant)
            if quota is not None and quota[1] is not None:
                return quota[1]
        if self._guest_policy is not None and self.is_guest(tenant):
            return self._guest_policy
        return self._default_policy

    def _capacities(self, tenants: Iterable[str]) -> dict[str, int]:
        """Partition sizes for the active ``tenants``."""
        tenants = list(tenants)
        quotas = self._quotas
        guest_pool = 0
        guests: list[str] = []
        if self._guest_pool is not None:
            guest_pool = min(self._guest_pool, self._total)
            guests = [t for t in tenants if self.is_guest(t)]
        elif self._guest_share > 0 and (self._reserved or quotas):
            guest_pool = int(self._total * self._guest_share)
            guests = [t for t in tenants if self.is_guest(t)]
        budget = self._total - guest_pool
        out = dict.fromkeys(guests, guest_pool // len(guests) if guests else 0)
        members = [t for t in tenants if t not in out]
        if quotas is None:
            share = budget // len(members) if members else 0
            out.update(dict.fromkeys(members, share))
            return out
        asked = sum(l1_bytes for l1_bytes, _ in quotas.values())
        if asked > budget:
            granted = {t: q * budget // asked for t, (q, _) in quotas.items()}
        else:
            granted = {t: q for t, (q, _) in quotas.items()}
        rest = [t for t in members if t not in granted]
        share = (budget - sum(granted.values())) // len(rest) if rest else 0
        out.update({t: granted.get(t, share) for t in members})
        return out

    def _apply(self, tenants: Iterable[str]) -> None:
        """Bring the partitions of ``tenants`` to their current size and policy."""
        capacities = self._capacities(self._parts)
        for tenant in list(tenants):
            part = self._parts[tenant]
            capacity = capacities[tenant]
            policy = self._policy_of(tenant)
            if part.name != policy:
                if isinstance(part, Migration) and part.back.name == policy:
                    # Back to the policy still draining: swap the roles.
                    part.resize(capacity)
                    new: ReplacementPolicy[K, V] = part.reversed()
                else:
                    new = Migration(part, make_policy(policy, part.capacity_bytes))
                self._replace(tenant, part, new)
                part = new
            if part.capacity_bytes != capacity:
                part.resize(capacity)

    def _replace(
        self, tenant: str, old: ReplacementPolicy[K, V], new: ReplacementPolicy[K, V]
    ) -> None:
        """Put ``new`` in ``old``'s place, keeping the tenant's eviction count continuous."""
        self._evictions_before[tenant] = (
            self._evictions_before.get(tenant, 0) + old.evictions - new.evictions
        )
        self._parts[tenant] = new
