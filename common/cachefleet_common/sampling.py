"""The SHARDS sampler: the hash space, reuse histograms and the fixed-size sampler.

Shared by the sidecar (which samples each tenant's key stream, see
:mod:`cachefleet_sidecar.adapt.mrc`) and the operator (which replays the fleet
samples into one sampler per tenant): the hash bits, the bucket bounds and the
sampler are one fact on both sides. Pure: no I/O.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from dataclasses import dataclass

#: Bits of the key digest used for spatial sampling.
HASH_BITS = 24
HASH_SPACE = 1 << HASH_BITS
HASH_MASK = HASH_SPACE - 1
#: Where the sampling hash is taken from in the 128-bit key digest (bits
#: independent of those Python's dict uses for the L1 index).
HASH_SHIFT = 64
#: Keys tracked per tenant (SHARDS's s_max): ~150 bytes of state each.
DEFAULT_MAX_SAMPLES = 2048
#: Highest sampling rate (1: a tenant with fewer keys than ``max_samples`` is measured exactly).
DEFAULT_MAX_RATE = 1.0
#: Histogram bucket bounds (bytes of cache): half-powers of two, 4 KiB .. 16 GiB.
BUCKETS: tuple[float, ...] = tuple(float(round(2 ** (12 + i / 2))) for i in range(45))


class _Fenwick:
    """Prefix sums of bytes over access slots (1-based)."""

    __slots__ = ("size", "tree")

    def __init__(self, size: int) -> None:
        self.size = size
        self.tree = [0] * (size + 1)

    def add(self, slot: int, delta: int) -> None:
        tree, n = self.tree, self.size
        while slot <= n:
            tree[slot] += delta
            slot += slot & -slot

    def prefix(self, slot: int) -> int:
        tree, total = self.tree, 0
        while slot > 0:
            total += tree[slot]
            slot -= slot & -slot
        return total


@dataclass(frozen=True, slots=True)
class ReuseHistogram:
    """A snapshot of one tenant's estimated requests by the cache bytes they need."""

    #: Non-cumulative estimated requests per bucket of :data:`BUCKETS`, then ``+Inf``.
    counts: tuple[float, ...]
    #: Sum of the finite needed sizes (bytes), estimated.
    sum_bytes: float
    #: Current sampling rate (1 = every key tracked).
    rate: float
    #: Keys tracked now.
    tracked: int
    #: Estimated bytes of first accesses (distinct keys seen: the footprint so far).
    cold_bytes: float = 0.0

    def cumulative(self) -> list[tuple[float, float]]:
        """(upper bound, cumulative estimated requests), ``+Inf`` last."""
        out: list[tuple[float, float]] = []
        acc = 0.0
        for bound, count in zip((*BUCKETS, float("inf")), self.counts, strict=True):
            acc += count
            out.append((bound, acc))
        return out


class ShardsSampler:
    """Fixed-size SHARDS for one tenant's key stream."""

    __slots__ = (
        "_heap",
        "_last",
        "_next_slot",
        "_total",
        "_tree",
        "cold_bytes",
        "counts",
        "max_samples",
        "sum_bytes",
        "threshold",
    )

    def __init__(
        self, max_samples: int = DEFAULT_MAX_SAMPLES, max_rate: float = DEFAULT_MAX_RATE
    ) -> None:
        if max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {max_samples}")
        if not 0.0 < max_rate <= 1.0:
            raise ValueError(f"max_rate must be in (0, 1], got {max_rate}")
        self.max_samples = max_samples
        #: Keys with a sampling hash below this are tracked.
        self.threshold = max(1, int(HASH_SPACE * max_rate))
        # key -> (slot of its last access, size at that access, hash)
        self._last: dict[int, tuple[int, int, int]] = {}
        self._heap: list[tuple[int, int]] = []  # (-hash, key): largest hash first
        self._tree = _Fenwick(64)
        self._next_slot = 1
        self._total = 0  # bytes of the tracked keys (= the tree's total)
        self.counts = [0.0] * (len(BUCKETS) + 1)
        self.sum_bytes = 0.0
        self.cold_bytes = 0.0

    @property
    def rate(self) -> float:
        return self.threshold / HASH_SPACE

    def __len__(self) -> int:
        """Keys tracked now."""
        return len(self._last)

    def shrink_to(self, max_samples: int) -> None:
        """Track at most ``max_samples`` keys from now on (the largest hashes go at once)."""
        self.max_samples = max(1, max_samples)
        while len(self._last) > self.max_samples:
            self.lower_threshold()

    def access(self, digest: int, size: int) -> None:
        """Record one access to the key with ``digest``, ``size`` bytes."""
        h = (digest >> HASH_SHIFT) & HASH_MASK
        if h < self.threshold:
            self.sample(digest, h, size)

    def sample(self, key: int, h: int, size: int) -> None:
        """Record an access of a key known to be sampled (``h`` below the threshold)."""
        if size < 1:
            size = 1
        weight = HASH_SPACE / self.threshold
        if self._next_slot > self._tree.size:
            self._compact()
        slot = self._next_slot
        self._next_slot = slot + 1
        tree = self._tree
        last = self._last.get(key)
        if last is None:
            self.counts[-1] += weight
            self.cold_bytes += size * weight
            self._last[key] = (slot, size, h)
            tree.add(slot, size)
            self._total += size
            heapq.heappush(self._heap, (-h, key))
            if len(self._last) > self.max_samples:
                self.lower_threshold()
            return
        old_slot, old_size, _ = last
        # bytes of the keys touched after old_slot: every slot after it is live or empty
        needed = (self._total - tree.prefix(old_slot)) * weight + size
        self.counts[bisect_left(BUCKETS, needed)] += weight
        self.sum_bytes += needed * weight
        tree.add(old_slot, -old_size)
        tree.add(slot, size)
        self._total += size - old_size
        self._last[key] = (slot, size, h)

    def lower_threshold(self, to: int | None = None) -> None:
        """Drop the largest-hash key(s) (or every key at or above ``to``); the threshold falls."""
        heap, last, tree = self._heap, self._last, self._tree
        top = -heap[0][0] if to is None else to
        self.threshold = max(1, top)
        while heap and -heap[0][0] >= top:
            _, key = heapq.heappop(heap)
            gone = last.pop(key, None)
            if gone is not None:
                tree.add(gone[0], -gone[1])
                self._total -= gone[1]

    def _compact(self) -> None:
        """Renumber the live slots 1..n in access order; grow the tree when half full.

        Amortised O(log n) per access: a compaction happens at most once per
        ``size - live`` accesses, and that is at least ``size / 2``.
        """
        live = sorted(self._last.items(), key=lambda kv: kv[1][0])
        size = self._tree.size
        while len(live) * 2 > size:
            size *= 2
        self._tree = tree = _Fenwick(size)
        for slot, (key, (_, entry_size, h)) in enumerate(live, start=1):
            self._last[key] = (slot, entry_size, h)
            tree.add(slot, entry_size)
        self._next_slot = len(live) + 1

    def snapshot(self) -> ReuseHistogram:
        return ReuseHistogram(
            tuple(self.counts), self.sum_bytes, self.rate, len(self._last), self.cold_bytes
        )


def hit_ratio_at(histogram: ReuseHistogram | list[tuple[float, float]], size: float) -> float:
    """Predicted LRU hit ratio with ``size`` bytes, from a (cumulative) histogram.

    Linear interpolation inside a bucket; 0 when there is nothing measured.
    """
    points = histogram.cumulative() if isinstance(histogram, ReuseHistogram) else histogram
    total = points[-1][1] if points else 0.0
    if total <= 0.0 or size <= 0.0:
        return 0.0
    below, lo_bound = 0.0, 0.0
    for bound, acc in points:
        if bound == float("inf"):
            break
        if size < bound:
            frac = (size - lo_bound) / (bound - lo_bound)
            return (below + frac * (acc - below)) / total
        below, lo_bound = acc, bound
    return below / total
