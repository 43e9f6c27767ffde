"""Byte-bounded LIRS replacement (Jiang & Zhang, SIGMETRICS 2002).

LIRS ranks blocks by inter-reference recency (IRR): the number of other
distinct blocks referenced between two consecutive references to a block.
Blocks with a small IRR form the LIR set and stay resident; the rest (HIR)
get a small share of the cache and are evicted first, so a one-time scan
cannot flush the hot set the way it flushes an LRU.

Structures, exactly as in the paper:

* stack ``S`` (an ``OrderedDict``; first = bottom, last = top): recency order
  of the LIR blocks and of the HIR blocks — resident or not ("ghosts") —
  referenced more recently than the least recent LIR block.
* queue ``Q`` (an ``OrderedDict``; first = front = next victim): the resident
  HIR blocks.
* Stack pruning keeps an LIR block at the bottom of ``S``: after the bottom
  changes, HIR blocks (and ghosts, which are then forgotten) are popped from
  the bottom until an LIR block is there (``S`` is empty while no block is
  LIR). So "an HIR block is in ``S``" means
  "its new IRR is smaller than the recency of the least recent LIR block".
* A reference to an LIR block moves it to the top of ``S`` (and prunes if it
  was the bottom). A reference to a resident HIR block in ``S`` switches it to
  LIR and demotes the bottom LIR block of ``S`` to the end of ``Q``; a resident
  HIR block not in ``S`` stays HIR and moves to the top of ``S`` and the end of
  ``Q``. A miss evicts from the front of ``Q`` (the victim stays in ``S`` as a
  ghost if it is there) and loads the block as HIR, or as LIR if it was a
  ghost in ``S`` (the status switch).

Byte-size adaptation (the paper counts blocks of one size):

* The HIR share is ``max(hir_ratio * capacity, mean entry size)`` bytes, at
  most the capacity; the mean is an exponentially weighted mean of the sizes
  ``put`` has seen (weight :data:`MEAN_SIZE_WEIGHT`), so a tiny cache still
  keeps about one entry's worth of HIR space. LIR capacity in bytes =
  capacity - HIR share.
* A new block becomes LIR while the LIR bytes have room for it (warm-up), as
  the first ``L_lirs`` blocks do in the paper. Whenever the LIR bytes exceed
  the LIR capacity (a status switch, a bigger replacement value, a resize),
  the bottom LIR block of ``S`` is demoted to the end of ``Q``, repeatedly.
* Eviction takes the front of ``Q`` until the resident bytes fit; if ``Q`` is
  empty (LIR blocks hold everything), the bottom LIR block is demoted first.
  The entry being stored is never its own victim.
* ``put`` on a resident key replaces the value, counts as a reference, and
  rebalances with the new size.

Caller-visible extras: ``get`` on a ghost returns ``None`` but records the
reference (the ghost moves to the top of ``S``), so the ``put`` that follows
the upstream fetch promotes the block to LIR even if other traffic ran in
between. Ghosts are bounded: at most ``ghost_factor`` (default 2) times the
number of resident entries; beyond that the oldest ghosts are forgotten
(removed from ``S``). Every operation is O(1) amortised: each block is pushed
onto ``S`` and ``Q`` once per reference and popped at most once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, Literal

from cachefleet_sidecar.policies.base import K, V, check_capacity, check_size

#: Default HIR share of the capacity, by bytes (the paper suggests ~1 %).
DEFAULT_HIR_RATIO = 0.01
#: Default bound on ghosts (non-resident HIR blocks in S) per resident entry.
DEFAULT_GHOST_FACTOR = 2.0
#: Weight of the newest size in the running mean entry size (the HIR floor).
MEAN_SIZE_WEIGHT = 1.0 / 64.0

_LIR = 0
_HIR = 1
_GHOST = 2
_STATUS_NAMES: dict[int, Literal["LIR", "HIR", "ghost"]] = {
    _LIR: "LIR",
    _HIR: "HIR",
    _GHOST: "ghost",
}


class _NoKey:
    """Sentinel for "no key" that compares unequal to every real key."""

    __slots__ = ()


_NO_KEY: Hashable = _NoKey()


class _Node(Generic[V]):
    __slots__ = ("cost", "size", "status", "value")

    def __init__(self, value: V, size: int, status: int, cost: float | None = None) -> None:
        self.value = value
        self.size = size
        self.status = status
        #: Not weighed by LIRS; kept so that a policy switch hands it on.
        self.cost = cost


#: The one node every ghost shares: a ghost keeps no value and no size.
_GHOST_NODE: _Node[Any] = _Node(None, 0, _GHOST)


@dataclass(frozen=True, slots=True)
class LirsSnapshot(Generic[K]):
    """The LIRS structures at one moment, for tests and debugging."""

    #: Stack S, bottom first: ``(key, "LIR" | "HIR" | "ghost")``.
    stack: tuple[tuple[K, str], ...]
    #: Queue Q of resident HIR blocks, front (next victim) first.
    queue: tuple[K, ...]


class LIRSPolicy(Generic[K, V]):
    """LIRS cache bounded by the sum of entry sizes in bytes."""

    __slots__ = (
        "_bottom",
        "_capacity",
        "_evictions",
        "_ghost_factor",
        "_ghosts",
        "_hir_ratio",
        "_lir_bytes",
        "_mean_size",
        "_q",
        "_resident",
        "_s",
        "_table",
        "_used",
    )

    name = "lirs"

    def __init__(
        self,
        capacity_bytes: int,
        *,
        hir_ratio: float = DEFAULT_HIR_RATIO,
        ghost_factor: float = DEFAULT_GHOST_FACTOR,
    ) -> None:
        check_capacity(capacity_bytes)
        if not 0.0 < hir_ratio < 1.0:
            raise ValueError(f"hir_ratio must be in (0, 1), got {hir_ratio}")
        if ghost_factor < 0.0:
            raise ValueError(f"ghost_factor must be >= 0, got {ghost_factor}")
        self._capacity = capacity_bytes
        self._hir_ratio = hir_ratio
        self._ghost_factor = ghost_factor
        self._table: dict[K, _Node[V]] = {}
        self._s: OrderedDict[K, _Node[V]] = OrderedDict()
        self._q: OrderedDict[K, _Node[V]] = OrderedDict()
        self._ghosts: OrderedDict[K, None] = OrderedDict()
        self._bottom: Hashable = _NO_KEY
        self._used = 0
        self._lir_bytes = 0
        self._resident = 0
        self._evictions = 0
        self._mean_size = 0.0

    # ------------------------------------------------------------- properties

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def evictions(self) -> int:
        return self._evictions

    @property
    def lir_bytes(self) -> int:
        """Bytes held by LIR blocks."""
        return self._lir_bytes

    @property
    def ghost_count(self) -> int:
        """Non-resident HIR blocks remembered in the stack S."""
        return len(self._ghosts)

    @property
    def lir_capacity_bytes(self) -> int:
        """Bytes the LIR set may hold: capacity minus the HIR share."""
        return self._lir_capacity(self._capacity, self._mean_size)

    def _lir_capacity(self, capacity: int, mean_size: float) -> int:
        hir = int(capacity * self._hir_ratio)
        if mean_size > hir:
            hir = int(mean_size)
        return capacity - hir if hir < capacity else 0

    def __len__(self) -> int:
        return self._resident

    def __contains__(self, key: object) -> bool:
        node = self._table.get(key)  # type: ignore[arg-type]
        return node is not None and node.status != _GHOST

    def __repr__(self) -> str:
        return (
            f"LIRSPolicy(entries={self._resident}, used_bytes={self._used}, "
            f"capacity_bytes={self._capacity}, lir_bytes={self._lir_bytes}, "
            f"ghosts={len(self._ghosts)})"
        )

    # ------------------------------------------------------------- operations

    def get(self, key: K) -> V | None:
        node = self._table.get(key)
        if node is None:
            return None
        status = node.status
        if status == _LIR:
            self._s.move_to_end(key)
            if key == self._bottom:
                self._prune()
            return node.value
        if status == _HIR:
            self._reference_hir(key, node, self.lir_capacity_bytes)
            return node.value
        # A ghost: record the reference so that the put that follows the miss
        # finds it in S and switches it to LIR.
        self._s.move_to_end(key)  # a ghost is never the bottom of S
        self._ghosts.move_to_end(key)
        return None

    def put(self, key: K, value: V, size: int, cost: float | None = None) -> list[tuple[K, V]]:
        if size < 0:
            check_size(size)
        capacity = self._capacity
        if size > capacity:
            return []
        mean = self._mean_size
        mean = mean + (size - mean) * MEAN_SIZE_WEIGHT if mean else float(size)
        self._mean_size = mean
        lir_capacity = self._lir_capacity(capacity, mean)
        table = self._table
        s = self._s
        node = table.get(key)
        if node is None:
            node = _Node(value, size, _HIR, cost)
            table[key] = node
            self._resident += 1
            self._used += size
            if self._lir_bytes + size <= lir_capacity:
                node.status = _LIR
                self._lir_bytes += size
                if not s:
                    self._bottom = key
                s[key] = node
            else:
                if s:  # an empty S holds no LIR block: pruning would pop it
                    s[key] = node
                self._q[key] = node
        elif node.status == _GHOST:
            # The status switch: a block whose ghost is still in S was
            # re-referenced within the LIR recency horizon. (A ghost is never
            # the bottom of S, so no pruning is due.)
            del self._ghosts[key]
            node = _Node(value, size, _LIR, cost)
            table[key] = node
            s[key] = node  # keeps its place for the move below
            s.move_to_end(key)
            self._resident += 1
            self._used += size
            self._lir_bytes += size
        else:
            self._used += size - node.size
            node.cost = cost
            if node.status == _LIR:
                self._lir_bytes += size - node.size
                node.size = size
                node.value = value
                s.move_to_end(key)
                if key == self._bottom:
                    self._prune()
            else:
                node.size = size
                node.value = value
                self._reference_hir(key, node, lir_capacity)
        return self._rebalance(key, lir_capacity)

    def remove(self, key: K) -> bool:
        node = self._table.pop(key, None)
        if node is None:
            return False
        status = node.status
        if status == _GHOST:
            del self._s[key]
            del self._ghosts[key]
            self._prune()
            return False
        self._resident -= 1
        self._used -= node.size
        if status == _LIR:
            self._lir_bytes -= node.size
            del self._s[key]
        else:
            del self._q[key]
            self._s.pop(key, None)
        self._prune()
        self._trim_ghosts()
        return True

    def clear(self) -> None:
        self._table.clear()
        self._s.clear()
        self._q.clear()
        self._ghosts.clear()
        self._bottom = _NO_KEY
        self._used = 0
        self._lir_bytes = 0
        self._resident = 0

    def resize(self, capacity_bytes: int) -> list[tuple[K, V]]:
        check_capacity(capacity_bytes)
        self._capacity = capacity_bytes
        return self._rebalance(_NO_KEY, self.lir_capacity_bytes)

    def items(self) -> Iterator[tuple[K, V, int]]:
        # Victims go in this order: Q from its front, then LIR blocks from the
        # bottom of S (each demoted to Q first).
        for key, node in self._q.items():
            yield key, node.value, node.size
        for key, node in self._s.items():
            if node.status == _LIR:
                yield key, node.value, node.size

    def pop_entry(self, key: K) -> tuple[V, int, float | None] | None:
        node = self._table.get(key)
        if node is None or node.status == _GHOST:
            return None
        self.remove(key)
        return node.value, node.size, node.cost

    def pop_coldest(self) -> tuple[K, V, int, float | None] | None:
        # The next victim: the front of Q, else the bottom LIR block of S.
        if self._q:
            key = next(iter(self._q))
        elif self._s:
            key = next(iter(self._s))  # pruned: the bottom of S is LIR
        else:
            return None
        node = self._table[key]
        self.remove(key)
        return key, node.value, node.size, node.cost

    # ----------------------------------------------------------- introspection

    def snapshot(self) -> LirsSnapshot[K]:
        """Copy of S and Q (O(n)); for tests and debugging, not the hit path."""
        return LirsSnapshot(
            stack=tuple((key, _STATUS_NAMES[node.status]) for key, node in self._s.items()),
            queue=tuple(self._q),
        )

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the structures are inconsistent (O(n))."""
        resident = [(k, n) for k, n in self._table.items() if n.status != _GHOST]
        lir = [(k, n) for k, n in resident if n.status == _LIR]
        assert self._resident == len(resident), "resident count"
        assert self._used == sum(n.size for _, n in resident), "used bytes"
        assert self._used <= self._capacity, "over capacity"
        assert self._lir_bytes == sum(n.size for _, n in lir), "LIR bytes"
        assert self._lir_bytes <= self.lir_capacity_bytes, "LIR over its share"
        for key, node in lir:
            assert self._s.get(key) is node, f"LIR {key!r} not in S"
        for key, node in self._q.items():
            assert node.status == _HIR, f"Q holds non-HIR {key!r}"
            assert self._table[key] is node, f"Q holds stale {key!r}"
        assert len(self._q) == len(resident) - len(lir), "Q is not the resident HIR set"
        for key, node in self._s.items():
            assert self._table.get(key) is node, f"S holds stale {key!r}"
        assert set(self._ghosts) == {k for k, n in self._s.items() if n.status == _GHOST}
        assert len(self._ghosts) <= self._ghost_factor * self._resident, "too many ghosts"
        if self._s:
            bottom_key, bottom = next(iter(self._s.items()))
            assert self._bottom == bottom_key, "cached bottom"
            assert bottom.status == _LIR, "S bottom is not LIR"
        else:
            assert self._bottom is _NO_KEY, "cached bottom of an empty S"

    # --------------------------------------------------------------- internals

    def _reference_hir(self, key: K, node: _Node[V], lir_capacity: int) -> None:
        """A reference to a resident HIR block (its size already up to date)."""
        s = self._s
        if key in s:
            s.move_to_end(key)
            del self._q[key]
            node.status = _LIR
            self._lir_bytes += node.size
            while self._lir_bytes > lir_capacity:
                self._demote_bottom_lir()
            self._prune()
        else:
            if s:  # an empty S means no LIR block: pruning would pop it at once
                s[key] = node
            self._q.move_to_end(key)

    def _prune(self) -> None:
        """Pop HIR blocks off the bottom of S until an LIR block is there."""
        s = self._s
        while s:
            key, node = next(iter(s.items()))
            if node.status == _LIR:
                self._bottom = key
                return
            del s[key]
            if node.status == _GHOST:
                del self._table[key]
                del self._ghosts[key]
        self._bottom = _NO_KEY

    def _demote_bottom_lir(self) -> None:
        """Move the least recent LIR block to the end of Q (it leaves S)."""
        key, node = self._s.popitem(last=False)
        node.status = _HIR
        self._lir_bytes -= node.size
        self._q[key] = node
        self._prune()

    def _rebalance(self, protect: Hashable, lir_capacity: int) -> list[tuple[K, V]]:
        """Restore the LIR share and the capacity; ``protect`` is not evicted.

        Evicting a block turns it into a ghost if it is in S: that never
        changes the bottom of S (an LIR block), so no pruning is due here.
        """
        while self._lir_bytes > lir_capacity:
            self._demote_bottom_lir()
        if self._used <= self._capacity:
            if len(self._ghosts) > self._ghost_factor * self._resident:
                self._trim_ghosts()
            return []
        q = self._q
        s = self._s
        table = self._table
        ghosts = self._ghosts
        evicted: list[tuple[K, V]] = []
        while self._used > self._capacity:
            if not q:
                self._demote_bottom_lir()
                continue
            key, node = q.popitem(last=False)
            if key == protect:
                if not q:
                    self._demote_bottom_lir()
                q[key] = node
                continue
            self._used -= node.size
            self._resident -= 1
            if key in s:
                s[key] = _GHOST_NODE
                table[key] = _GHOST_NODE
                ghosts[key] = None
            else:
                del table[key]
            evicted.append((key, node.value))
        self._evictions += len(evicted)
        if len(ghosts) > self._ghost_factor * self._resident:
            self._trim_ghosts()
        return evicted

    def _trim_ghosts(self) -> None:
        """Forget the oldest ghosts beyond ``ghost_factor`` x resident entries."""
        ghosts = self._ghosts
        limit = int(self._ghost_factor * self._resident)
        if len(ghosts) <= limit:
            return
        s = self._s
        table = self._table
        while len(ghosts) > limit:  # a ghost is never the bottom of S: no pruning
            key, _ = ghosts.popitem(last=False)
            del s[key]
            del table[key]
