"""Which L1 entry a key purge names (pure: no I/O).

A purge names an entry by the SHA-256 hex digest of its key (what L2 names
it by, and what ``X-Cache-Key`` shows); the L1 keys entries by a faster
128-bit hash of the same canonical form. :class:`PurgeIndex` maps the first
to the second for every entry put in L1 while Redis is on (the only time a
purge can arrive), so a sidecar can drop a purged entry from its L1.

The index is a superset of the L1's entries: evictions do not tell it, so it
may name entries that are gone (dropping those is a no-op). When it holds
more than ``limit`` digests it is swept: only the digests whose entry is
still in L1 stay (``alive``), so its size follows the L1's entry count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

#: Fewest digests the index holds before a sweep.
DEFAULT_INDEX_LIMIT = 65536


class PurgeIndex:
    """SHA-256 hex digest -> (tenant, L1 key) of entries put in L1."""

    def __init__(self, limit: int = DEFAULT_INDEX_LIMIT) -> None:
        self.limit = limit
        self._by_digest: dict[str, tuple[str, int]] = {}
        #: Sweeps run (each O(index size)).
        self.sweeps = 0

    def __len__(self) -> int:
        return len(self._by_digest)

    def add(self, digest: str, tenant: str, l1_key: int, alive: Callable[[str, int], bool]) -> None:
        """Remember ``digest``; sweep with ``alive(tenant, l1_key)`` once over the limit."""
        self._by_digest[digest] = (tenant, l1_key)
        if len(self._by_digest) > self.limit:
            self._by_digest = {d: tk for d, tk in self._by_digest.items() if alive(*tk)}
            self.sweeps += 1
            # the index follows the L1: room for twice what is resident now
            self.limit = max(self.limit, 2 * len(self._by_digest))

    def take(self, digests: Iterable[str]) -> list[tuple[str, int]]:
        """(tenant, L1 key) of each of ``digests`` that is indexed; they leave the index."""
        out: list[tuple[str, int]] = []
        for digest in digests:
            found = self._by_digest.pop(digest, None)
            if found is not None:
                out.append(found)
        return out

    def clear(self) -> None:
        self._by_digest.clear()
