"""The interface every L1 replacement policy implements.

A policy is a byte-bounded map from opaque hashable keys to opaque values.
The caller states each entry's size in bytes; the policy keeps the sum of
resident sizes within ``capacity_bytes`` by evicting, and reports what it
evicted so the caller can account for it. Policies are pure, single-threaded
data structures on the sidecar's hit path: no I/O, no locks, O(1) per
operation (amortised).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Protocol, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ReplacementPolicy(Protocol[K, V]):
    """A byte-bounded cache with a replacement policy.

    Contract shared by every implementation:

    * ``get`` returns the resident value or ``None``; a hit counts as a
      reference (updates recency / reuse state).
    * ``put`` inserts or replaces and evicts as needed so that
      ``used_bytes <= capacity_bytes``; it never evicts the entry it is
      storing. An entry larger than ``capacity_bytes`` is not stored: ``put``
      returns ``[]`` and leaves the cache unchanged (a resident entry under
      that key keeps its old value).
    * ``items`` yields resident entries coldest first, so that filling
      another policy from it in that order ends with the hottest entries the
      most recent ("migration"). Do not mutate the cache while iterating.
    * ``put``'s optional ``cost`` (the upstream seconds a hit on the entry
      saves) is a hint: a policy may weigh it, never store less because of it.
    * ``evictions`` counts entries evicted for capacity (by ``put`` and
      ``resize``); ``remove``, ``clear``, ``pop_entry`` and ``pop_coldest``
      are not evictions.
    * ``pop_entry`` and ``pop_coldest`` take a resident entry out with its
      size and cost, leaving no trace of it (no ghost, no adaptation): they
      are how a policy switch moves entries without losing their metadata
      (:mod:`cachefleet_sidecar.policies.migrating`). Both are O(1) amortised.
    """

    @property
    def name(self) -> str:
        """The policy's name as in :class:`cachefleet_common.contract.names.Policy`."""
        ...

    @property
    def capacity_bytes(self) -> int: ...

    @property
    def used_bytes(self) -> int: ...

    @property
    def evictions(self) -> int: ...

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool:
        """True if ``key`` is resident (a recorded-but-evicted key is not)."""
        ...

    def get(self, key: K) -> V | None: ...

    def put(self, key: K, value: V, size: int, cost: float | None = None) -> list[tuple[K, V]]:
        """Store ``value``; ``cost`` is what a hit saves (upstream seconds), if known.

        Policies that do not weigh cost (LRU, LIRS) ignore it.
        """
        ...

    def remove(self, key: K) -> bool:
        """Drop ``key``; True if it was resident."""
        ...

    def clear(self) -> None: ...

    def resize(self, capacity_bytes: int) -> list[tuple[K, V]]:
        """Change the capacity; shrinking evicts and returns what it evicted."""
        ...

    def items(self) -> Iterator[tuple[K, V, int]]:
        """Resident ``(key, value, size)`` triples, coldest first."""
        ...

    def pop_entry(self, key: K) -> tuple[V, int, float | None] | None:
        """Take ``key``'s resident entry out: ``(value, size, cost)``, or None."""
        ...

    def pop_coldest(self) -> tuple[K, V, int, float | None] | None:
        """Take out the entry next to be evicted: ``(key, value, size, cost)``; None if empty."""
        ...


def check_size(size: int) -> None:
    """Reject sizes a policy cannot account for."""
    if size < 0:
        raise ValueError(f"entry size must be >= 0 bytes, got {size}")


def check_capacity(capacity_bytes: int) -> None:
    """Reject capacities a policy cannot honour."""
    if capacity_bytes < 0:
        raise ValueError(f"capacity must be >= 0 bytes, got {capacity_bytes}")
