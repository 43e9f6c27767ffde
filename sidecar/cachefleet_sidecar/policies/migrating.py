"""A pause-free policy switch: two policies, one draining into the other.

Switching a partition's policy by moving every entry in one step blocks the
event loop for O(n): a pause that grows with the partition, and every request
waits it out. A :class:`Migration` makes the switch O(1) instead and spreads
the move:

* The **front** (the new policy) takes over at once: every ``put`` goes
  there, and every ``get`` looks there first.
* The **back** (the old policy) keeps the entries not moved yet. A ``get``
  that finds its key only in the back moves that entry to the front (value,
  size and cost: nothing is lost) and counts the hit there; ``put`` and
  ``remove`` drop the back's copy of the key, so no key is ever in both.
* :meth:`Migration.step` moves at most ``n`` of the back's entries, coldest
  first, to the front: the owner calls it in bounded batches between
  requests until :attr:`Migration.done`, then keeps :attr:`Migration.front`.
* Bytes: ``used_bytes`` = front + back, never over ``capacity_bytes``. The
  front holds the full capacity; when a ``put`` needs room, the back's
  coldest entries (untouched since the switch, so the coldest of all) give
  way first, counted as evictions; the front evicts only what the back
  cannot cover.
* Switching again mid-migration: to the back's policy (a rollback) is
  :meth:`Migration.reversed`, the same two structures with the roles
  swapped: the entries already moved stay where they are and drain back.
  To a third policy, a new ``Migration`` whose back is this one (it drains
  this one's back, then its front); the depth is bounded by the switches
  made while one is in flight.

Every operation does bounded work: ``get`` at most one move, ``put`` at most
the evictions its bytes need (as any policy's ``put``), ``step(n)`` at most
``n`` moves (plus O(1) amortised per move inside the policies). Pure, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic

from cachefleet_sidecar.policies.base import (
    K,
    ReplacementPolicy,
    V,
    check_capacity,
    check_size,
)


class Migration(Generic[K, V]):
    """``back``'s entries moving into ``front``, which serves as the policy in force."""

    __slots__ = ("_trimmed", "back", "front", "moved")

    def __init__(self, back: ReplacementPolicy[K, V], front: ReplacementPolicy[K, V]) -> None:
        #: The policy in force (admissions and lookups go here first).
        self.front = front
        #: The policy being drained.
        self.back = back
        #: Entries the back gave up for room (evictions of this migration).
        self._trimmed = 0
        #: Entries moved from the back to the front so far (touched or stepped).
        self.moved = 0
        if back.used_bytes + front.used_bytes > front.capacity_bytes:
            self._trim(back.used_bytes + front.used_bytes - front.capacity_bytes)

    # ------------------------------------------------------------ properties

    @property
    def name(self) -> str:
        return self.front.name

    @property
    def capacity_bytes(self) -> int:
        return self.front.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self.front.used_bytes + self.back.used_bytes

    @property
    def evictions(self) -> int:
        return self.front.evictions + self.back.evictions + self._trimmed

    @property
    def done(self) -> bool:
        """True once the back holds nothing: the front alone is the partition."""
        return len(self.back) == 0

    @property
    def pending(self) -> int:
        """Entries still in the back."""
        return len(self.back)

    def __len__(self) -> int:
        return len(self.front) + len(self.back)

    def __contains__(self, key: object) -> bool:
        return key in self.front or key in self.back

    def __repr__(self) -> str:
        return f"Migration({self.back!r} -> {self.front!r}, moved={self.moved})"

    # ------------------------------------------------------------ operations

    def get(self, key: K) -> V | None:
        value = self.front.get(key)
        if value is not None:
            return value
        entry = self.back.pop_entry(key)
        if entry is None:
            return None
        value, size, cost = entry
        # Bytes only change tier, so the front has room (it holds the full
        # capacity and front + back fit in it): this put evicts nothing.
        self.front.put(key, value, size, cost)
        self.moved += 1
        found = self.front.get(key)  # the hit counts as a reference there
        return value if found is None else found

    def put(self, key: K, value: V, size: int, cost: float | None = None) -> list[tuple[K, V]]:
        check_size(size)
        front = self.front
        capacity = front.capacity_bytes
        if size > capacity:
            return []  # as every policy: not stored, the old value stays
        back = self.back
        back.pop_entry(key)  # the new value supersedes the back's copy
        evicted: list[tuple[K, V]] = []
        if key not in front:
            need = back.used_bytes + front.used_bytes + size - capacity
            if need > 0:
                evicted = self._trim(need)
        evicted += front.put(key, value, size, cost)
        over = back.used_bytes + front.used_bytes - capacity
        if over > 0:  # a replacement that grew: the back covers it
            evicted += self._trim(over)
        return evicted

    def remove(self, key: K) -> bool:
        in_front = self.front.remove(key)
        in_back = self.back.remove(key)
        return in_front or in_back

    def clear(self) -> None:
        self.front.clear()
        self.back.clear()

    def resize(self, capacity_bytes: int) -> list[tuple[K, V]]:
        check_capacity(capacity_bytes)
        over = self.used_bytes - capacity_bytes
        evicted = self._trim(over) if over > 0 else []
        return evicted + self.front.resize(capacity_bytes)

    def items(self) -> Iterator[tuple[K, V, int]]:
        # Untouched since the switch: the back is colder than the front.
        yield from self.back.items()
        yield from self.front.items()

    def pop_entry(self, key: K) -> tuple[V, int, float | None] | None:
        entry = self.front.pop_entry(key)
        return entry if entry is not None else self.back.pop_entry(key)

    def pop_coldest(self) -> tuple[K, V, int, float | None] | None:
        entry = self.back.pop_coldest()
        return entry if entry is not None else self.front.pop_coldest()

    # -------------------------------------------------------------- migration

    def step(self, n: int) -> int:
        """Move up to ``n`` of the back's entries to the front, coldest first; how many moved."""
        front = self.front
        back = self.back
        moved = 0
        while moved < n:
            entry = back.pop_coldest()
            if entry is None:
                break
            key, value, size, cost = entry
            front.put(key, value, size, cost)
            moved += 1
        self.moved += moved
        return moved

    def reversed(self) -> Migration[K, V]:
        """The switch undone mid-way: the back is in force again, the front drains into it.

        The back takes over at the capacity in force (it kept its own
        meanwhile; the bytes fit, so this evicts nothing). Evictions counted
        by this object are not carried over: the owner keeps its running
        total across the swap.
        """
        self.back.resize(self.front.capacity_bytes)
        return Migration(self.front, self.back)

    # -------------------------------------------------------------- internals

    def _trim(self, need: int) -> list[tuple[K, V]]:
        """Evict the back's coldest entries until ``need`` bytes are free (or it is empty)."""
        back = self.back
        evicted: list[tuple[K, V]] = []
        while need > 0:
            entry = back.pop_coldest()
            if entry is None:
                break
            key, value, size, _ = entry
            need -= size
            evicted.append((key, value))
        self._trimmed += len(evicted)
        return evicted
