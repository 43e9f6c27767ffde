"""SITS: cachefleet's adaptive, cost- and size-aware L1 replacement policy.

No single classic policy is best at every cache size on LLM traffic: with a
small cache, quick demotion (LIRS, S3-FIFO, W-TinyLFU: new entries get a small
probationary share and leave it fast) wins; with a larger one, the second use
of an entry often comes after it has left a small probationary share, and
recency (LRU, ARC, GDSF) wins. SITS measures which regime the traffic is in
and moves between them continuously. ``docs/sits.md`` gives the reasoning and
the benchmark behind each part.

Structures (all byte-bounded; every key is in at most one of them):

* ``P`` (probation, an ``OrderedDict`` in recency order, first = coldest):
  resident entries referenced once since they were loaded.
* ``M`` (main, a CLOCK in insertion order): resident entries that proved
  reuse: hit while resident, or loaded again while their ghost was
  remembered. A hit in ``M`` only raises the entry's hit count (at most
  :data:`MAX_FREQ`, no reordering on the hit path); an entry that comes up
  for eviction with a count above 0 loses one and goes round again, as in
  S3-FIFO's main queue. That frequency is what keeps SITS near the best on
  Zipf-like popularity.
* ``GP`` / ``GM`` (ghosts, key -> size, oldest first): keys recently evicted
  from ``P`` / ``M``. A ghost keeps no value.

Reuse (LIRS's inter-reference recency). A key loaded again while it is a
ghost was re-referenced within a recency horizon of about twice the cache:
its reuse distance is short enough to be worth keeping, so it enters ``M``
directly, as a ghost in LIRS's stack S turns LIR. A key with no ghost enters
``P``, like a LIRS HIR block, once the cache is full; before that it enters
``M``, as LIRS's first blocks become LIR (warm-up).

Regime (ghost-driven balance, as ARC tunes its recency share). ``target_p``
is the number of bytes ``P`` may hold before eviction takes from ``P``
rather than from ``M``. A load that finds a ``GP`` ghost means ``P`` was too
small (the second use came just after the entry left probation): ``target_p``
grows by the entry's size, times ``|GM|/|GP|`` when ``GM`` is larger. A load
that finds a ``GM`` ghost means ``M`` was too small: ``target_p`` shrinks
symmetrically. A small ``target_p`` is the quick-demotion regime, a large one
the recency regime; the ghosts move it to whichever pays on the traffic in
front of it.

Cost and size. Each entry may carry a cost, the upstream seconds a hit saves
(the sidecar measures it on the miss that loaded the entry). When an entry
reaches the cold end of its queue as the next victim and its cost per byte
is above ``(2 - pressure)`` times the running mean cost per byte, it is
spared once: moved back to the warm end and marked, so it is evicted on its
next turn unless it is referenced first. ``pressure`` (0..1) is how
saturated the model server is (GPU telemetry): the busier the GPU, the more a
miss costs, and the more expensive entries are spared. With equal costs per
byte (or no costs) no entry is ever spared and SITS is exactly its
ghost-driven recency/quick-demotion core.

Regimes chosen by shadow caches. The ghost balance above is one regime
(*adaptive*); other traffic shapes reward other rules, and SITS runs three
more regimes on the same structures, switching by flags (no entry moves):

* *frozen* (loops and scans wider than the cache): new and ghost-reloaded
  keys all start on probation, and ``P`` gives way first whatever
  ``target_p`` says, so ``M`` keeps a fixed resident set, as LIRS keeps its
  LIR set (the adaptive balance lets ``M`` cycle there, as ARC does);
* *recency* (a working set replaced wholesale; conversations whose turns
  come back within about a cache): new keys enter ``M`` at once and a hit
  banks at most one extra round (a CLOCK, close to LRU), so the old set
  leaves fast; what ``P`` still holds gives way once its coldest entry is
  older than ``M``'s next victim (by their stamps), as one recency order;
* *stable* (independent draws from a fixed popularity, e.g. Zipf): as
  adaptive, but with a shorter ghost horizon (:data:`STABLE_HORIZON`, 1x the
  capacity, ARC's): a key evicted longer ago than that, counted in bytes
  evicted to its ghost list since, reloads as a new key (on probation, no
  balance step), and ``P`` gives way first whatever ``target_p`` says
  (quick demotion: a second use within the horizon is the way into ``M``).
  On independent draws a reuse beyond one capacity is the long tail of the
  popularity, and letting it into ``M`` (as the 2x horizon does, which
  Mooncake's conversations need) crowds out the popular keys.

Which regime the traffic rewards is measured, not guessed: one key in
:data:`SAMPLE_RATE` (by hash) also goes through four small *shadow* SITS
caches, one per regime, each ``1/SAMPLE_RATE`` of the capacity (spatial
sampling, as SHARDS does for miss-ratio curves); a cache of fewer than
``SAMPLE_RATE x MIN_SHADOW_ENTRIES`` entries when it first fills samples one
key in :data:`SMALL_SAMPLE_RATE` instead, so that its shadows still hold
enough keys to rank the regimes. Every
:data:`SELECT_EVERY` sampled accesses the regime whose shadow missed least
(counts halved each round, so the recent past weighs most; a lookup every
shadow missed, a first reference mostly, is not counted: it tells no regime
from another) takes over if it missed at least :data:`SELECT_MARGINS` less
than the regime in force (a cache that samples one key in
SMALL_SAMPLE_RATE counts every lookup, with :data:`SMALL_SELECT_MARGINS`).
*stable* differs from *adaptive* too little to be told apart over one
round: it stands in for *adaptive* only while its shadow missed at least
:data:`STABLE_MARGIN` less over the long run (counts halved every
:data:`STABLE_HALVING` rounds); out of *frozen* or *recency*, though, it
takes over as *adaptive* would, when its shadow beat the regime in force
over the last rounds. *frozen*, besides the round-by-round rule, stands in
for *adaptive* when its shadow hit at least :data:`FROZEN_HIT_MARGIN` more
over the long run: on a loop wider than the cache every regime misses
nearly everything, and a margin on the misses is met only once *adaptive*
has cycled to none at all. A shadow holds keys and sizes, no values.

Shifts (a working set replaced wholesale). The shadows compare regimes over
rounds, too slowly for the moment a working set is replaced: every access
the old regime keeps costs misses long after (with the new set on
probation, behind old entries that banked hits). So twice a round the hits
of the shadow of the regime in force over the last half round are checked:
when they fall under their running mean by more than half of it and by more
than four times their usual change from one probe to the next (measured:
bursty traffic swings widely and is not mistaken for a shift), SITS takes
*recency* at once, lets the hits banked in ``M`` by every entry queued
there before that half round lapse (O(1): an entry carries the probe number
of its entry into ``M`` and is checked when it comes up for eviction), lets
the older entries of ``P`` give way first (``target_p`` is cut to the
entries loaded since the collapse began), and restarts the shadows empty
(their contents are the old set too), so that the regimes are compared
afresh on the new set. The long-run counts keep what they learnt of the
traffic's shape and pause while the shadows refill.

Bounds and cost: ``GP`` and ``GM`` each hold at most ``ghost_factor x
capacity`` bytes of ghost sizes (default 2x); the shadows together about 4/16
of the main cache's key metadata (4/4 below 800 entries). Every operation is O(1)
amortised: a reference earns an entry at most one extra round in ``M`` and
at most one sparing for its cost; a detected shift allocates new shadows
(empty) and reads only the entries loaded into ``P`` during one probe.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Generic

from cachefleet_sidecar.policies.base import K, V, check_capacity, check_size

#: One key in this many feeds the shadow caches (spatial sampling on the key's hash).
SAMPLE_RATE = 16
#: A cache of fewer entries than ``SAMPLE_RATE x MIN_SHADOW_ENTRIES`` when it
#: first fills samples one key in SMALL_SAMPLE_RATE instead (benchmarked:
#: docs/sits.md): shadows of fewer than ~50 entries cannot rank the regimes.
MIN_SHADOW_ENTRIES = 50
SMALL_SAMPLE_RATE = 4
#: Sampled accesses between two regime choices (benchmarked: docs/sits.md).
SELECT_EVERY = 96
#: How much less (relative) a regime's shadow must miss than the regime in
#: force to take over, per regime: adaptive, frozen, recency. The misses
#: counted are those of the lookups some shadow hit (a lookup every regime
#: misses, a first reference mostly, tells none apart; benchmarked:
#: docs/sits.md).
SELECT_MARGINS = (0.10, 0.25, 0.25)
#: The same for a small cache (``SMALL_SAMPLE_RATE``), which counts the
#: misses of every sampled lookup: leaving some out moved its regimes on
#: noise (docs/sits.md).
SMALL_SELECT_MARGINS = (0.05, 0.05, 0.10)
#: Regime names, in the order of the shadows (the first three: SELECT_MARGINS).
REGIMES = ("adaptive", "frozen", "recency", "stable")
#: How much less (relative) the ``stable`` shadow must have missed than the
#: ``adaptive`` one over the long run (misses halved every
#: ``SELECT_EVERY x STABLE_HALVING`` sampled lookups) for ``stable`` to stand
#: in for ``adaptive`` (benchmarked: docs/sits.md).
STABLE_MARGIN = 0.015
#: Regime choices between two halvings of the long-run counts.
STABLE_HALVING = 21
#: ``frozen`` stands in for ``adaptive`` when its shadow hit at least this
#: much more (relative) than the ``adaptive`` one over the long run, and at
#: least FROZEN_MIN_HITS more: hits, not misses, as on a loop wider than the
#: cache every regime misses nearly everything (benchmarked: docs/sits.md).
FROZEN_HIT_MARGIN = 0.15
FROZEN_MIN_HITS = 4.0
#: Weight of the newest cost-per-byte in the running mean (the sparing bar).
MEAN_DENSITY_WEIGHT = 1.0 / 256.0
#: Hits an entry of M banks for extra rounds (a 2-bit counter, as S3-FIFO's).
MAX_FREQ = 3
#: Ghost bytes per ghost list, as a multiple of the capacity (benchmarked: docs/sits.md).
DEFAULT_GHOST_FACTOR = 2.0
#: Ghost horizon of the ``stable`` regime, as a multiple of the capacity: a
#: ghost evicted longer ago than this (in bytes evicted to its list since)
#: counts as no ghost there (benchmarked: docs/sits.md).
STABLE_HORIZON = 1.0
#: Probes per regime choice: twice a round, the hits of the shadow of the
#: regime in force over the last half round are checked for a collapse
#: (a working set replaced wholesale; benchmarked: docs/sits.md).
PROBES_PER_ROUND = 2
#: A probe's hits collapsed when they fall under their running mean by more
#: than COLLAPSE_DROP of it and by more than COLLAPSE_NOISE times the running
#: mean change from one probe to the next (the noise of the traffic itself).
COLLAPSE_DROP = 0.5
COLLAPSE_NOISE = 4.0
#: Weight of the newest probe in those running means.
COLLAPSE_WEIGHT = 0.125
#: The noise is taken as at least this share of the counting noise,
#: ``sqrt(mean)``: a few hits per probe that happened to vary little (a loop
#: wider than the cache, cycling) do not collapse to none.
COLLAPSE_NOISE_FLOOR = 0.5
#: Regime choices after a detected shift during which the long-run counts
#: pause (the shadows refill) and the detector relearns its level
#: (SHIFT_SETTLE x PROBES_PER_ROUND probes; also before the first detection).
SHIFT_SETTLE = 4


class _NoKey:
    """Sentinel for "no key" that compares unequal to every real key."""

    __slots__ = ()


_NO_KEY: Hashable = _NoKey()


class _Collapse:
    """Tells a collapse of the hits per probe from the traffic's own noise.

    Running means (weight :data:`COLLAPSE_WEIGHT`, plain means over the first
    probes) of the hits per probe and of the change from one probe to the
    next; the noise is measured, not assumed: bursty traffic (Mooncake's
    conversations) swings by more than a binomial count would, and the
    mean change grows with it; a few hits that vary little are still
    counting noise (:data:`COLLAPSE_NOISE_FLOOR`). Armed after
    ``SHIFT_SETTLE x PROBES_PER_ROUND`` probes.
    """

    __slots__ = ("count", "mean", "noise", "prev")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.mean = self.noise = self.prev = 0.0
        self.count = 0

    def collapsed(self, hits: float) -> bool:
        """Feed one probe's hits; True (and the means restart) on a collapse."""
        if self.count >= SHIFT_SETTLE * PROBES_PER_ROUND:
            drop = self.mean - hits
            noise = max(self.noise, COLLAPSE_NOISE_FLOOR * self.mean**0.5)
            if drop > COLLAPSE_DROP * self.mean and drop > COLLAPSE_NOISE * noise:
                self.reset()
                return True
        if self.count:
            weight = max(COLLAPSE_WEIGHT, 1.0 / self.count)
            self.noise += (abs(hits - self.prev) - self.noise) * weight
            self.mean += (hits - self.mean) * weight
        else:
            self.mean = hits
        self.prev = hits
        self.count += 1
        return False


class _Node(Generic[V]):
    __slots__ = ("cost", "freq", "main", "size", "spared", "stamp", "value")

    def __init__(self, value: V, size: int, cost: float | None, main: bool, stamp: int) -> None:
        self.value = value
        self.stamp = stamp
        self.size = size
        self.cost = cost
        self.main = main
        self.spared = False
        self.freq = 0


class SITSPolicy(Generic[K, V]):
    """SITS cache bounded by the sum of entry sizes in bytes."""

    __slots__ = (
        "_capacity",
        "_collapse",
        "_evictions",
        "_frozen",
        "_ghost_factor",
        "_gm",
        "_gm_bytes",
        "_gm_clock",
        "_gp",
        "_gp_bytes",
        "_gp_clock",
        "_horizon",
        "_index",
        "_lapse_before",
        "_long_misses",
        "_long_samples",
        "_m",
        "_m_bytes",
        "_margins",
        "_max_freq",
        "_mean_density",
        "_p",
        "_p_bytes",
        "_pressure",
        "_probe_every",
        "_probe_misses",
        "_probes",
        "_rate",
        "_rate_chosen",
        "_recency",
        "_sampled",
        "_select_every",
        "_shadow_misses",
        "_shadows",
        "_since_shift",
        "_stable",
        "_target_p",
        "shifts",
        "spared",
    )

    name = "sits"

    def __init__(
        self,
        capacity_bytes: int,
        *,
        ghost_factor: float = DEFAULT_GHOST_FACTOR,
        pressure: float = 0.0,
        regime: str = "adaptive",
        shadows: bool = True,
    ) -> None:
        check_capacity(capacity_bytes)
        if ghost_factor < 0.0:
            raise ValueError(f"ghost_factor must be >= 0, got {ghost_factor}")
        self._capacity = capacity_bytes
        self._ghost_factor = ghost_factor
        self._p: OrderedDict[K, _Node[V]] = OrderedDict()
        self._m: OrderedDict[K, _Node[V]] = OrderedDict()
        #: Ghosts: key -> (size, bytes evicted to that list before it).
        self._gp: OrderedDict[K, tuple[int, int]] = OrderedDict()
        self._gm: OrderedDict[K, tuple[int, int]] = OrderedDict()
        self._gp_clock = 0
        self._gm_clock = 0
        self._p_bytes = 0
        self._m_bytes = 0
        self._gp_bytes = 0
        self._gm_bytes = 0
        self._target_p = 0.0
        self._evictions = 0
        self._mean_density = 0.0
        self._pressure = 0.0
        self.pressure = pressure
        #: Evictions deferred for an entry's cost (a counter).
        self.spared = 0
        if regime not in REGIMES:
            raise ValueError(f"regime must be one of {', '.join(REGIMES)}, got {regime!r}")
        self._frozen = False
        self._recency = False
        self._stable = False
        self._index = 0
        self._max_freq = MAX_FREQ
        self._horizon = float("inf")
        self._set_regime(REGIMES.index(regime))
        #: One key in ``_rate`` feeds the shadows; chosen when the cache
        #: first fills (``_choose_rate``), until then SAMPLE_RATE.
        self._rate = SAMPLE_RATE
        self._rate_chosen = not shadows
        self._select_every = SELECT_EVERY
        self._margins = SELECT_MARGINS
        #: One shadow per regime (none inside a shadow).
        self._shadows: list[SITSPolicy[K, bool]] = []
        self._shadow_misses = [0.0] * len(REGIMES)
        #: Long-run misses of the adaptive, stable and frozen shadows, and
        #: the sampled lookups they count (halved every STABLE_HALVING rounds).
        self._long_misses = [0.0, 0.0, 0.0]
        self._sampled = 0
        self._long_samples = 0.0
        #: Shift detection: the in-force shadow's misses in the current probe,
        #: probes so far (an entry queued in M is stamped with it), the first
        #: stamp whose banked hits still count, regime choices since the last
        #: shift.
        self._collapse = _Collapse()
        self._probe_misses = 0
        self._probe_every = SELECT_EVERY // PROBES_PER_ROUND
        self._probes = 0
        self._lapse_before = 0
        self._since_shift = SHIFT_SETTLE
        #: Working sets replaced wholesale, as detected (a counter).
        self.shifts = 0
        if shadows:
            self._new_shadows()

    # ------------------------------------------------------------- properties

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._p_bytes + self._m_bytes

    @property
    def evictions(self) -> int:
        return self._evictions

    @property
    def target_p_bytes(self) -> int:
        """Bytes the probationary queue may hold before ``M`` gives way."""
        return int(self._target_p)

    @property
    def regime(self) -> str:
        """The regime in force: ``adaptive``, ``frozen``, ``recency`` or ``stable`` (module doc)."""
        if self._frozen:
            return "frozen"
        if self._recency:
            return "recency"
        return "stable" if self._stable else "adaptive"

    @property
    def shadow_sample_rate(self) -> int:
        """One key in this many feeds the shadows (0 without shadows)."""
        return self._rate if self._shadows else 0

    @property
    def probation_bytes(self) -> int:
        return self._p_bytes

    @property
    def ghost_bytes(self) -> int:
        return self._gp_bytes + self._gm_bytes

    @property
    def pressure(self) -> float:
        """Model-server saturation in [0, 1]; raises the weight of cost."""
        return self._pressure

    @pressure.setter
    def pressure(self, value: float) -> None:
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"pressure must be in [0, 1], got {value}")
        self._pressure = float(value)

    def __len__(self) -> int:
        return len(self._p) + len(self._m)

    def __contains__(self, key: object) -> bool:
        return key in self._m or key in self._p

    def __repr__(self) -> str:
        return (
            f"SITSPolicy(entries={len(self)}, used_bytes={self.used_bytes}, "
            f"capacity_bytes={self._capacity}, target_p={int(self._target_p)}, "
            f"p_bytes={self._p_bytes}, ghosts={len(self._gp) + len(self._gm)})"
        )

    # ------------------------------------------------------------- operations

    def get(self, key: K) -> V | None:
        if self._shadows and hash(key) % self._rate == 0:
            self._shadow_get(key)
        m = self._m
        node = m.get(key)
        if node is not None:
            # CLOCK, not LRU: a hit only counts (no reordering on the hit path).
            if node.freq < self._max_freq:
                node.freq += 1
            node.spared = False
            return node.value
        node = self._p.get(key)
        if node is None:
            return None
        # Reuse while on probation: the entry proved itself, it joins M.
        del self._p[key]
        self._p_bytes -= node.size
        node.main = True
        node.spared = False
        node.stamp = self._probes
        m[key] = node
        self._m_bytes += node.size
        return node.value

    def put(self, key: K, value: V, size: int, cost: float | None = None) -> list[tuple[K, V]]:
        if size < 0:
            check_size(size)
        if size > self._capacity:
            return []
        if cost is not None and cost > 0.0 and size > 0:
            density = cost / size
            mean = self._mean_density
            self._mean_density = mean + (density - mean) * MEAN_DENSITY_WEIGHT if mean else density
        m = self._m
        node = m.get(key)
        if node is None:
            node = self._p.get(key)
        if node is not None:
            # Replacing a resident entry counts as a reference.
            if node.main:
                self._m_bytes += size - node.size
                m.move_to_end(key)
            else:
                del self._p[key]
                self._p_bytes -= node.size
                node.main = True
                m[key] = node
                self._m_bytes += size
            node.value = value
            node.size = size
            node.cost = cost
            node.spared = False
            node.stamp = self._probes
            return self._evict(key)
        if self._shadows and hash(key) % self._rate == 0:
            for shadow in self._shadows:
                if key not in shadow:
                    shadow.put(key, True, size)
        frozen = self._frozen
        ghost = self._gp.pop(key, None)
        if ghost is not None:
            self._gp_bytes -= ghost[0]
            if self._gp_clock - ghost[1] > self._horizon:
                ghost = None  # beyond the regime's horizon: no ghost
        if ghost is not None:
            # Second use just after leaving probation: P was too small.
            if not frozen:
                ratio = self._gm_bytes / self._gp_bytes if self._gp_bytes else 1.0
                step = size * ratio if ratio > 1.0 else size
                self._target_p = min(float(self._capacity), self._target_p + step)
            main = not frozen
        else:
            ghost = self._gm.pop(key, None)
            if ghost is not None:
                self._gm_bytes -= ghost[0]
                if self._gm_clock - ghost[1] > self._horizon:
                    ghost = None
            if ghost is not None:
                # Reuse just beyond M's reach: M was too small.
                if not frozen:
                    ratio = self._gp_bytes / self._gm_bytes if self._gm_bytes else 1.0
                    step = size * ratio if ratio > 1.0 else size
                    self._target_p = max(0.0, self._target_p - step)
                main = not frozen
            else:
                # Warm-up: while the cache has room, new entries go to M, as
                # LIRS's first blocks become LIR; once it is full they start
                # on probation.
                main = self._recency or self._p_bytes + self._m_bytes + size <= self._capacity
        node = _Node(value, size, cost, main, self._probes)
        if main:
            m[key] = node
            self._m_bytes += size
        else:
            self._p[key] = node
            self._p_bytes += size
        return self._evict(key)

    def remove(self, key: K) -> bool:
        for shadow in self._shadows:  # an invalidated entry is gone for them too
            shadow.remove(key)
        node = self._m.pop(key, None)
        if node is not None:
            self._m_bytes -= node.size
            return True
        node = self._p.pop(key, None)
        if node is not None:
            self._p_bytes -= node.size
            return True
        ghost = self._gp.pop(key, None)
        if ghost is not None:
            self._gp_bytes -= ghost[0]
        ghost = self._gm.pop(key, None)
        if ghost is not None:
            self._gm_bytes -= ghost[0]
        return False

    def clear(self) -> None:
        for shadow in self._shadows:
            shadow.clear()
        self._collapse.reset()  # the hits start again from nothing: no shift
        self._p.clear()
        self._m.clear()
        self._gp.clear()
        self._gm.clear()
        self._p_bytes = self._m_bytes = self._gp_bytes = self._gm_bytes = 0

    def resize(self, capacity_bytes: int) -> list[tuple[K, V]]:
        check_capacity(capacity_bytes)
        old = self._capacity
        self._capacity = capacity_bytes
        for shadow in self._shadows:
            shadow.resize(capacity_bytes // self._rate)
        # The learnt balance carries over as a share of the new capacity.
        self._target_p = self._target_p * capacity_bytes / old if old else 0.0
        self._set_regime(REGIMES.index(self.regime))  # the horizon follows the capacity
        evicted = self._evict(_NO_KEY)
        self._trim_ghosts()
        return evicted

    def items(self) -> Iterator[tuple[K, V, int]]:
        # Coldest first, approximately the order of eviction: P, then M by
        # hit count (M's queue order within a count). O(n log n): migration only.
        for key, node in self._p.items():
            yield key, node.value, node.size
        for key, node in sorted(self._m.items(), key=lambda item: item[1].freq):
            yield key, node.value, node.size

    def pop_entry(self, key: K) -> tuple[V, int, float | None] | None:
        node = self._m.pop(key, None)
        if node is not None:
            self._m_bytes -= node.size
        else:
            node = self._p.pop(key, None)
            if node is None:
                return None
            self._p_bytes -= node.size
        return node.value, node.size, node.cost

    def pop_coldest(self) -> tuple[K, V, int, float | None] | None:
        # P first, then M's CLOCK (an entry with hits left goes round again,
        # losing one: each hit buys at most one extra pass, so O(1) amortised).
        if self._p:
            key, node = self._p.popitem(last=False)
            self._p_bytes -= node.size
            return key, node.value, node.size, node.cost
        m = self._m
        while m:
            key, node = m.popitem(last=False)
            if node.freq:
                node.freq -= 1
                m[key] = node
                continue
            self._m_bytes -= node.size
            return key, node.value, node.size, node.cost
        return None

    # ----------------------------------------------------------- introspection

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the structures are inconsistent (O(n))."""
        assert self._p_bytes == sum(n.size for n in self._p.values()), "P bytes"
        assert self._m_bytes == sum(n.size for n in self._m.values()), "M bytes"
        assert self._gp_bytes == sum(g[0] for g in self._gp.values()), "GP bytes"
        assert self._gm_bytes == sum(g[0] for g in self._gm.values()), "GM bytes"
        assert self.used_bytes <= self._capacity, "over capacity"
        assert all(not n.main for n in self._p.values()), "M entry in P"
        assert all(n.main for n in self._m.values()), "P entry in M"
        assert not (self._p.keys() & self._m.keys()), "key in P and M"
        resident = self._p.keys() | self._m.keys()
        assert not (resident & self._gp.keys()), "resident key in GP"
        assert not (resident & self._gm.keys()), "resident key in GM"
        assert not (self._gp.keys() & self._gm.keys()), "key in both ghost lists"
        bound = self._ghost_factor * self._capacity
        assert self._gp_bytes <= bound, "GP over its bound"
        assert self._gm_bytes <= bound, "GM over its bound"
        assert 0.0 <= self._target_p <= self._capacity, "target_p out of range"
        assert all(0 <= n.freq <= MAX_FREQ for n in self._m.values()), "hit count"
        assert all(n.freq == 0 for n in self._p.values()), "hit count on probation"
        assert self._frozen + self._recency + self._stable <= 1, "two regimes at once"
        assert self._max_freq == (1 if self._recency else MAX_FREQ), "hit bound of the regime"
        assert self._index == REGIMES.index(self.regime), "regime index"
        assert self._lapse_before <= self._probes, "lapse ahead of the probes"
        assert all(n.stamp <= self._probes for n in self._m.values()), "stamp ahead of the probes"
        for shadow in self._shadows:
            assert not shadow._shadows, "a shadow with shadows"
            assert shadow.capacity_bytes == self._capacity // self._rate, "shadow capacity"
            shadow.check_invariants()

    # --------------------------------------------------------------- internals

    def _spare(self, node: _Node[V]) -> bool:
        """True if ``node`` is worth one more turn for its cost per byte."""
        if node.spared or node.cost is None or node.size <= 0:
            return False
        return node.cost > (2.0 - self._pressure) * self._mean_density * node.size

    def _evict(self, protect: Hashable) -> list[tuple[K, V]]:
        """Evict until the bytes fit; ``protect`` (the entry being stored) stays."""
        capacity = self._capacity
        if self._p_bytes + self._m_bytes <= capacity:
            return []
        if not self._rate_chosen:
            self._choose_rate()
        p = self._p
        m = self._m
        evicted: list[tuple[K, V]] = []
        # Bounded: every pass evicts or spares an entry (at most once each
        # until it is referenced again).
        # frozen and stable: P gives way first (stable keeps learning target_p
        # for adaptive, but a fixed popularity rewards quick demotion).
        target = 0.0 if self._frozen or self._stable else self._target_p
        recency = self._recency
        while self._p_bytes + self._m_bytes > capacity:
            queue = p if p and (self._p_bytes > target or not m) else m
            # recency feeds M only: P holds what was loaded before it took
            # over, and gives way when its coldest entry came in before M's
            # next one did (both stamped on entry), else P's leftovers sat
            # under target_p for good (~10 % of the cache on Mooncake's
            # conversation trace at 20 %).
            if (
                recency
                and queue is m
                and p
                and next(iter(p.values())).stamp < next(iter(m.values())).stamp
            ):
                queue = p
            key, node = queue.popitem(last=False)
            if key == protect:
                # The entry being stored reached the front: behind it are only
                # spared entries (each spared once), or nothing, and then the
                # other queue is not empty (the entry alone fits).
                queue[key] = node
                if len(queue) == 1:
                    queue = m if queue is p else p
                key, node = queue.popitem(last=False)
            if node.freq and node.main:
                if node.stamp >= self._lapse_before:
                    # Hit since its last pass: one more round in M per hit (up
                    # to the regime's bound: hits banked under another regime
                    # lapse).
                    node.freq = min(node.freq, self._max_freq) - 1
                    queue[key] = node
                    continue
                node.freq = 0  # queued in M before a detected shift: its hits lapse
            if node.cost is not None and not node.spared and self._spare(node):
                node.spared = True
                self.spared += 1
                queue[key] = node
                continue
            size = node.size
            if node.main:
                self._m_bytes -= size
                self._gm[key] = (size, self._gm_clock)
                self._gm_bytes += size
                self._gm_clock += size
            else:
                self._p_bytes -= size
                self._gp[key] = (size, self._gp_clock)
                self._gp_bytes += size
                self._gp_clock += size
            evicted.append((key, node.value))
        self._evictions += len(evicted)
        bound = self._ghost_factor * capacity
        if self._gp_bytes > bound or self._gm_bytes > bound:
            self._trim_ghosts()
        return evicted

    def _set_regime(self, index: int) -> None:
        self._index = index
        self._frozen = index == 1
        self._recency = index == 2
        self._stable = index == 3
        self._max_freq = 1 if self._recency else MAX_FREQ
        # A ghost list holds at most ghost_factor x capacity bytes: a horizon
        # that long is the list itself (no check; ghosts removed from the
        # middle let older ones stay a little longer than their age says).
        factor = STABLE_HORIZON if index == 3 else self._ghost_factor
        self._horizon = factor * self._capacity if factor < self._ghost_factor else float("inf")

    def _shadow_get(self, key: K) -> None:
        """A sampled lookup: through every shadow, and now and then a regime choice."""
        node = self._m.get(key) or self._p.get(key)
        misses = self._shadow_misses
        # While the shadows refill after a shift, the long-run counts pause.
        long = self._long_misses if self._since_shift >= SHIFT_SETTLE else [0.0, 0.0, 0.0]
        in_force = self._index
        missed = []
        for i, shadow in enumerate(self._shadows):
            if shadow.get(key) is None:
                missed.append(i)
                if i == 0:
                    long[0] += 1.0
                elif i == 3:
                    long[1] += 1.0
                elif i == 1:
                    long[2] += 1.0
                if i == in_force:
                    self._probe_misses += 1
                if node is not None:  # else the put that follows the miss loads it
                    shadow.put(key, True, node.size)
        if len(missed) < len(misses) or self._rate != SAMPLE_RATE:
            # A lookup every shadow missed (a first reference, mostly) is no
            # evidence for the round's choice: on Mooncake's conversation
            # trace 63 % of the accesses are first references, and a margin
            # on all misses left a regime that missed ~10 % less of the rest
            # unchosen for rounds on end. A small cache (shadows of 50-200
            # keys, one key in SMALL_SAMPLE_RATE) counts every lookup, with
            # its own margins: left out there, they moved its regimes on noise.
            for i in missed:
                misses[i] += 1.0
        self._sampled += 1
        if self._since_shift >= SHIFT_SETTLE:
            self._long_samples += 1.0
        if self._sampled % self._probe_every == 0:
            hits = self._probe_every - self._probe_misses
            self._probe_misses = 0
            self._probes += 1
            if self._collapse.collapsed(hits):
                self._shift()
                return
        if self._sampled % self._select_every == 0:
            self._since_shift += 1
            # The first three regimes by the recent misses of their shadows
            # (counts halved every round, lookups every shadow missed left
            # out); "stable" stands for "adaptive" when its shadow missed less
            # over the long run (it differs from "adaptive" by too little to
            # be told apart over one round), and "frozen" when its shadow hit
            # more over the long run (on a loop wider than the cache all miss
            # nearly everything: a margin on the misses is met late).
            current = 0 if self._stable else self._index
            best = min(range(3), key=misses.__getitem__)
            margins = self._margins
            if misses[best] < misses[current] * (1.0 - margins[best]):
                current = best
            elif current and misses[3] < misses[current] * (1.0 - margins[0]):
                # Out of frozen or recency, stable may take over at once (as
                # adaptive would): after a working set was replaced, recency
                # paid for the switch and stable pays for the steady state.
                current = 3
            if current == 0:
                # The long run: frozen by its hits (a loop wider than the
                # cache), else stable by its misses (a fixed popularity).
                samples = self._long_samples
                frozen_hits = samples - long[2]
                adaptive_hits = samples - long[0]
                if frozen_hits > adaptive_hits * (1.0 + FROZEN_HIT_MARGIN) + FROZEN_MIN_HITS:
                    current = 1
                elif long[1] < long[0] * (1.0 - STABLE_MARGIN):
                    current = 3
            self._set_regime(current)
            for i in range(len(misses)):
                misses[i] /= 2
            if self._sampled % (self._select_every * STABLE_HALVING) == 0:
                self._long_misses = [count / 2 for count in self._long_misses]
                self._long_samples /= 2

    def _shift(self) -> None:
        """The hits collapsed: a working set was replaced wholesale (module doc).

        Recency takes over at once (the new set enters M without waiting for
        a round); the hits banked in M by entries queued before the probe
        that collapsed lapse as they come up (O(1): by their stamp), so the
        old set leaves in one pass, and probation's older entries give way
        first; the shadows restart empty, as their contents are the old set
        too; the long-run counts keep what they learnt of the traffic's
        shape and pause while the shadows refill.
        """
        self.shifts += 1
        self._since_shift = 0
        self._set_regime(2)
        if self._shadows:
            self._new_shadows()
        self._shadow_misses = [0.0] * len(REGIMES)
        self._lapse_before = self._probes - 1
        # Probation keeps room for its entries loaded since the collapse
        # began (the new set, at its tail) and no more: the older ones give
        # way first (else recency, which feeds M only, would keep them for
        # as long as the old balance said). O(entries loaded in one probe).
        fresh = 0
        for node in reversed(self._p.values()):
            if node.stamp < self._lapse_before:
                break
            fresh += node.size
        self._target_p = float(fresh)

    def _new_shadows(self) -> None:
        self._shadows = [
            SITSPolicy(
                self._capacity // self._rate,
                ghost_factor=self._ghost_factor,
                regime=name,
                shadows=False,
            )
            for name in REGIMES
        ]

    def _choose_rate(self) -> None:
        """When the cache first overflows: a denser sample if the shadows would be tiny.

        At 1/SAMPLE_RATE a cache that holds fewer than ``SAMPLE_RATE x
        MIN_SHADOW_ENTRIES`` entries (the one that overflows it aside) has
        shadows too small to rank the regimes (docs/sits.md); it samples one
        key in SMALL_SAMPLE_RATE instead, and chooses a regime after as many
        accesses as before (SELECT_EVERY x SAMPLE_RATE / SMALL_SAMPLE_RATE
        samples). The shadows start afresh at the new rate.
        """
        self._rate_chosen = True
        if len(self) > SAMPLE_RATE * MIN_SHADOW_ENTRIES:
            return
        self._rate = SMALL_SAMPLE_RATE
        self._margins = SMALL_SELECT_MARGINS
        self._select_every = SELECT_EVERY * SAMPLE_RATE // SMALL_SAMPLE_RATE
        self._probe_every = self._select_every // PROBES_PER_ROUND
        self._new_shadows()
        self._shadow_misses = [0.0] * len(REGIMES)
        self._long_misses = [0.0, 0.0, 0.0]
        self._long_samples = 0.0
        self._sampled = 0
        self._probe_misses = 0
        self._collapse.reset()

    def _trim_ghosts(self) -> None:
        bound = self._ghost_factor * self._capacity
        gp = self._gp
        while self._gp_bytes > bound:
            self._gp_bytes -= gp.popitem(last=False)[1][0]
        gm = self._gm
        while self._gm_bytes > bound:
            self._gm_bytes -= gm.popitem(last=False)[1][0]
