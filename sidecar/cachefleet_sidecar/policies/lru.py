"""Byte-bounded least-recently-used replacement.

One ``OrderedDict`` from key to ``(value, size, cost)``: the front is the
least recently used entry, the end the most recent. LRU does not weigh the
cost; it keeps it so that a policy switch hands it on (see :mod:`.migrating`).
Every operation is O(1) (amortised); eviction pops from the front until the
bytes fit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic

from cachefleet_sidecar.policies.base import K, V, check_capacity, check_size


class LRUPolicy(Generic[K, V]):
    """Least-recently-used cache bounded by the sum of entry sizes in bytes."""

    __slots__ = ("_capacity", "_data", "_evictions", "_used")

    name = "lru"

    def __init__(self, capacity_bytes: int) -> None:
        check_capacity(capacity_bytes)
        self._capacity = capacity_bytes
        self._used = 0
        self._evictions = 0
        self._data: OrderedDict[K, tuple[V, int, float | None]] = OrderedDict()

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def evictions(self) -> int:
        return self._evictions

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __repr__(self) -> str:
        return (
            f"LRUPolicy(entries={len(self._data)}, used_bytes={self._used}, "
            f"capacity_bytes={self._capacity})"
        )

    def get(self, key: K) -> V | None:
        data = self._data
        entry = data.get(key)
        if entry is None:
            return None
        data.move_to_end(key)
        return entry[0]

    def put(self, key: K, value: V, size: int, cost: float | None = None) -> list[tuple[K, V]]:
        check_size(size)
        if size > self._capacity:
            return []
        data = self._data
        old = data.get(key)
        if old is not None:
            self._used -= old[1]
            data.move_to_end(key)
        data[key] = (value, size, cost)
        self._used += size
        if self._used <= self._capacity:
            return []
        return self._evict()

    def remove(self, key: K) -> bool:
        entry = self._data.pop(key, None)
        if entry is None:
            return False
        self._used -= entry[1]
        return True

    def clear(self) -> None:
        self._data.clear()
        self._used = 0

    def resize(self, capacity_bytes: int) -> list[tuple[K, V]]:
        check_capacity(capacity_bytes)
        self._capacity = capacity_bytes
        return self._evict() if self._used > capacity_bytes else []

    def items(self) -> Iterator[tuple[K, V, int]]:
        for key, (value, size, _) in self._data.items():
            yield key, value, size

    def pop_entry(self, key: K) -> tuple[V, int, float | None] | None:
        entry = self._data.pop(key, None)
        if entry is None:
            return None
        self._used -= entry[1]
        return entry

    def pop_coldest(self) -> tuple[K, V, int, float | None] | None:
        if not self._data:
            return None
        key, (value, size, cost) = self._data.popitem(last=False)
        self._used -= size
        return key, value, size, cost

    def _evict(self) -> list[tuple[K, V]]:
        # The entry just stored is at the end, and it alone fits, so the loop
        # stops before reaching it.
        data = self._data
        evicted: list[tuple[K, V]] = []
        while self._used > self._capacity:
            key, (value, size, _) = data.popitem(last=False)
            self._used -= size
            evicted.append((key, value))
        self._evictions += len(evicted)
        return evicted
