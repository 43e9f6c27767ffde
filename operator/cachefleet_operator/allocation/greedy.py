"""The L1 allocation's plan: each tenant's value of a hit, SLA feasibility in class order,
the greedy grant by marginal gain on the concave hulls, and what nobody gains from."""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from cachefleet_operator.allocation.arrays import _finite
from cachefleet_operator.allocation.columns import _CLASS_INDEX, _CLASS_WEIGHTS, _Columns
from cachefleet_operator.allocation.model import (
    CLASS_ORDER,
    DEFAULT_MISS_COST_S,
    EPS,
    NO_REUSE_HIT_RATIO,
    TenantMetrics,
)
from cachefleet_operator.allocation.result import _Beyond
from cachefleet_operator.allocation.shares import _class_shares, _water_fill
from cachefleet_operator.curves import (
    BoolArray,
    CurveTable,
    FloatArray,
    IntArray,
    LatencyTable,
    interpolate,
)


@dataclass(slots=True)
class _Plans:
    """Every tenant's working state of one allocation, as arrays (spec order)."""

    #: Utility per unit of hit ratio (class x pressure x rate x miss cost).
    values: FloatArray
    #: The curves allocation reads (no curve: none, or one behind no requests).
    table: CurveTable
    #: Every tenant's miss latency (upstream).
    misses: LatencyTable
    #: Why no share within bounds meets the tenant's SLA ("" when one does, or when no
    #: size does: those are in ``beyond``).
    cannot_meet: list[str]
    #: The tenants whose SLA no cache size meets, and why (None: none).
    beyond: _Beyond | None = None


def _plans(cols: _Columns, pressure: FloatArray) -> _Plans:
    misses = cols.misses
    # the same model server answers every tenant's misses: a tenant with none to
    # measure is valued at the others' mean miss latency (all of them, in the map's order)
    every = cols.metrics.misses
    known = every.mean[every.present].tolist()
    fleet = sum(known) / len(known) if known else DEFAULT_MISS_COST_S
    # requests per second planned for: observed, or the promised minimum
    rate = np.nan_to_num(np.fmax(cols.rps, _finite(cols.min_rps)), nan=0.0)
    # upstream seconds a hit saves: the tenant's mean miss latency, else the fleet's (never
    # its p95: a tenant that hits all the time has a p95 of hits, and valuing its hits at
    # that would give its cache away)
    cost = np.where(misses.present, np.maximum(misses.mean, 1e-6), fleet)
    values = _CLASS_WEIGHTS[cols.classes] * pressure * rate * cost
    # a curve behind no requests is no curve (almost always none such)
    table = cols.curves
    used = table.present & (table.requests > 0.0)
    if not np.array_equal(used, table.present):
        table = table.only(used)
    return _Plans(values, table, misses, [""] * len(cols.names))


def _undecided(plans: _Plans, shares: FloatArray, capacity: int) -> BoolArray:
    """No curve yet, or no reuse yet while all the data seen still fits in the share.

    A working set whose first round is not over looks like a scan. Until the
    tenant has shown more distinct bytes than its share holds, reuse within
    that share may still come; once it has, any reuse it has would have shown.
    """
    table = plans.table
    with np.errstate(invalid="ignore"):
        fits = table.footprint <= shares * capacity  # False where the footprint is unknown
    return ~table.present | ((table.max_hit < NO_REUSE_HIT_RATIO) & fits)


def _protected(
    cols: _Columns,
    metrics: Mapping[str, TenantMetrics],
    plans: _Plans,
    previous: Mapping[str, float] | None,
    in_force: FloatArray,
    floors: FloatArray,
    caps: FloatArray,
    capacity: int,
) -> FloatArray:
    """Shares not to cut yet: min(share in force, class share) of undecided tenants.

    ``in_force`` is every tenant's share in ``previous`` (NaN: none).
    """
    names, table = cols.names, plans.table
    # only a tenant with metrics and no curve or no reuse may be undecided: most often none
    may = (cols.rows >= 0) & (~table.present | (table.max_hit < NO_REUSE_HIT_RATIO))
    if not previous or not may.any():
        return np.zeros(len(names))
    known = np.array(list(map(previous.__contains__, names)))
    prev = np.where(known, in_force, 0.0)
    keep = known & may & _undecided(plans, prev, capacity)
    if not keep.any():  # (no class shares to weigh)
        return np.zeros(len(names))
    class_targets = _class_shares(floors, caps, cols.classes)
    return np.where(keep, np.minimum(prev, class_targets), 0.0)


def _utility(plans: _Plans, shares: FloatArray, capacity: int) -> float:
    return _utility_of(plans.values, plans.table, shares, capacity)


def _utility_of(values: FloatArray, table: CurveTable, shares: FloatArray, capacity: int) -> float:
    """Value x predicted hit ratio, summed over the tenants with a curve in ``table``."""
    hits = table.at(shares * capacity)
    products = (values * hits)[table.present]
    return float(sum(products.tolist()))  # in spec order, one by one


def _needed_hit_ratios(cols: _Columns, misses: LatencyTable) -> FloatArray:
    """:func:`needed_hit_ratio` of every tenant (NaN: no hit ratio meets its SLA)."""
    need = np.nan_to_num(cols.min_hit, nan=0.0)  # None: 0
    target = cols.p95_target
    hits = cols.hits
    q = 0.95
    f_miss = misses.cdf(target)
    f_hit = np.where(hits.present, hits.cdf(target), 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        mixed = np.minimum(1.0, (q - f_miss) / (f_hit - f_miss))
    for_p95 = np.where(f_miss >= q, 0.0, np.where((f_hit < q) | (f_hit <= f_miss), np.nan, mixed))
    with_p95 = ~np.isnan(target) & misses.present
    return np.where(with_p95, np.maximum(need, for_p95), need)


def _meet_slas(
    cols: _Columns,
    plans: _Plans,
    shares: FloatArray,
    caps: FloatArray,
    capacity: int,
) -> None:
    """Raise tenants to the smallest share that meets their SLA, class by class (in place)."""
    min_hit = np.nan_to_num(cols.min_hit, nan=0.0)
    has_sla = ~np.isnan(cols.p95_target) | (min_hit != 0.0)
    asks = has_sla & plans.table.present
    if not asks.any():
        return
    need = _needed_hit_ratios(cols, plans.misses)
    if capacity > 0:
        with np.errstate(invalid="ignore"):
            wanted = plans.table.size_for(np.nan_to_num(need, nan=2.0)) / capacity
        wanted[np.isnan(need)] = np.nan
    else:
        wanted = np.full(len(shares), np.nan)
    cannot = plans.cannot_meet
    beyond = np.flatnonzero(asks & np.isnan(wanted))  # has a curve: asks
    if beyond.size:  # kept as numbers, made into rows' OutOfReach (and words) on demand
        cold = plans.table.cold[beyond]
        best = plans.table.max_hit[beyond]
        fleet_wide = np.zeros(beyond.size, dtype=bool)
        # the fleet's numbers where it reuses more (a curve's best is its last point)
        if cols.fleet is not None:
            more = cols.fleet.present[beyond] & (cols.fleet.max_hit[beyond] > best)
            best[more], cold[more] = cols.fleet.max_hit[beyond][more], cols.fleet.cold[beyond][more]
            fleet_wide = more
        plans.beyond = _Beyond(
            beyond,
            cols.p95_target[beyond],
            cols.min_hit[beyond],
            plans.misses.mean[beyond],
            plans.misses.present[beyond],
            cold,
            best,
            fleet_wide,
        )
    with np.errstate(invalid="ignore"):
        above_cap = asks & (wanted > caps + EPS)
    for i in np.flatnonzero(above_cap).tolist():
        cannot[i] = f"its SLA needs {wanted[i]:.1%} of the cache, above maxShare {caps[i]:.1%}"
    classes = cols.classes
    for cls in CLASS_ORDER:
        with np.errstate(invalid="ignore"):
            grows = asks & (classes == _CLASS_INDEX[cls]) & ~above_cap & (wanted > shares)
        idx = np.flatnonzero(grows)
        if idx.size == 0:
            continue
        extra = wanted[idx] - shares[idx]
        order = np.lexsort((idx, extra))  # cheapest first, then spec order
        _grant(shares, idx[order], extra[order], cannot)


def _grant(shares: FloatArray, idx: IntArray, extra: FloatArray, cannot: list[str]) -> None:
    """Grant ``extra`` to tenants ``idx`` in that order while capacity is left (in place).

    What is left is the capacity minus the sum of shares, as summed before
    each grant; a run of grants whose total stays far inside what is left
    (1e-9: a thousand times any rounding of that sum) is granted at once, since
    every one of them fits whole; the rest one by one. Once one does not fit,
    none after it (dearer) does.
    """
    n, k = idx.size, 0
    while k < n:
        left = 1.0 - float(shares.sum())
        run = np.cumsum(extra[k:])
        sure = int(np.searchsorted(run, left - 1e-9, side="right"))
        if sure > 0:
            shares[idx[k : k + sure]] += extra[k : k + sure]
            k += sure
            continue
        if extra[k] <= left + EPS:
            shares[idx[k]] += min(float(extra[k]), max(0.0, left))
            k += 1
            continue
        for j in range(k, n):
            i = int(idx[j])
            cannot[i] = (
                f"its SLA needs {shares[i] + extra[j]:.1%} of the cache; "
                "higher classes and floors leave too little"
            )
        return


def _best_extension(
    points: tuple[list[float], list[float]], value: float, lo: float, hi: float, capacity: int
) -> tuple[float, float] | None:
    """(utility per share, new share) of the best extension of ``lo`` up to ``hi``.

    One tenant's :meth:`~cachefleet_operator.curves.CurveTable.best_extensions`
    (the same scan, for the steps of :func:`_greedy` after the first), on its
    curve's ``points`` (sizes, hit ratios).
    """
    if hi - lo <= EPS:
        return None
    xs, ys = points
    base = interpolate(xs, ys, lo * capacity)
    best: tuple[float, float] | None = None
    # the candidate ends: every curve point strictly inside (lo, hi), then hi itself
    first = bisect_right(xs, lo * capacity)
    last = bisect_left(xs, hi * capacity, first)
    for k in range(first, last + 1):
        if k < last:
            to, hit = xs[k] / capacity, ys[k]
        else:
            to, hit = hi, interpolate(xs, ys, hi * capacity)
        if to - lo <= EPS:
            continue
        per = value * (hit - base) / (to - lo)
        if best is None or per > best[0] * (1.0 + 1e-9):
            best = (per, to)
    return best


#: How much steeper than the bound :func:`_greedy` is given the rows it leaves out must be
#: before it takes from the others first (float rounding of the same slopes, with room).
_WITHIN_MARGIN = 1e-6


def _greedy(
    plans: _Plans,
    shares: FloatArray,
    caps: FloatArray,
    capacity: int,
    within: tuple[BoolArray, float] | None = None,
) -> None:
    """Hand out what is left by marginal utility, looking ahead over cliffs (in place).

    UCP's lookahead (Qureshi & Patt, MICRO'06): each step gives the tenant
    with the best utility *per share* over any extension that still fits
    the extension that achieves it, so a working set that pays off only once
    it fits whole competes with its average gain up to the cliff (the slope
    of its concave hull) and is never left half-built on the cliff's side.
    Each tenant's best extension is computed at once for all of them to
    start with, and recomputed only when the tenant grew or its extension no
    longer fits what is left. The first ones wait sorted, best first (few are
    ever taken: sorting them beats making a heap of them all); the recomputed
    ones wait in a heap; each step takes the better of the two fronts, in the
    order one heap of them all would give.

    ``within`` (rows, bound): no tenant outside ``rows`` has an extension
    worth more than ``bound`` per share (what :func:`_fill` knows of the
    tenants whose choice its last bracket does not move). Their first
    extensions are computed only once the best offer left is worth no more
    than that (with a margin for rounding), as they were at the start, and
    join the sorted front: the same steps, in the same order, as without.
    """
    left = 1.0 - float(shares.sum())
    if left <= EPS or capacity <= 0:
        return
    values, table = plans.values, plans.table
    active = np.flatnonzero(plans.table.present & (values > 0.0))
    if active.size == 0:
        return
    # gains this small relative to the largest tenant's value are noise
    noise = float(values[active].max()) * 1e-9
    hi = np.minimum(caps, shares + left)
    later: IntArray | None = None
    if within is not None:
        rows, bound = within
        later, active = active[~rows[active]], active[rows[active]]
        cutoff = bound * (1.0 + _WITHIN_MARGIN)

    def firsts(of: IntArray) -> tuple[FloatArray, IntArray, FloatArray]:
        """The first offers of ``of`` (keys, tenants, ends), as the heap orders them."""
        per, to = plans.table.best_extensions(values, shares, hi, capacity, of)
        with np.errstate(invalid="ignore"):
            kept = per > noise  # NaN (no extension) is not
        keys, ids, ends = -per[kept], of[kept], to[kept]
        order = np.lexsort((ids, keys))  # as the heap orders (key, tenant)
        return keys[order], ids[order], ends[order]

    first_keys, first_ids, first_ends = firsts(active)
    heap: list[tuple[float, int, float]] = []

    def first_offer(k: int) -> tuple[float, int, float] | None:
        if k >= first_keys.size:
            return None
        return (float(first_keys[k]), int(first_ids[k]), float(first_ends[k]))

    def push(i: int) -> None:
        lo = float(shares[i])
        found = _best_extension(
            table.points(i), float(values[i]), lo, min(float(caps[i]), lo + left), capacity
        )
        if found is not None and found[0] > noise:
            heapq.heappush(heap, (-found[0], i, found[1]))

    k = 0
    front = first_offer(k)
    while left > EPS:
        if later is not None:
            best = min(front or (math.inf,), heap[0] if heap else (math.inf,))[0]
            if -best <= cutoff:  # the rows left out may compete from here: their first offers
                # (their shares and ``hi`` are as at the start) join the front
                keys, ids, ends = firsts(later)
                first_keys = np.concatenate([first_keys[k:], keys])
                first_ids = np.concatenate([first_ids[k:], ids])
                first_ends = np.concatenate([first_ends[k:], ends])
                order = np.lexsort((first_ids, first_keys))
                first_keys, first_ids, first_ends = (
                    first_keys[order],
                    first_ids[order],
                    first_ends[order],
                )
                later, k = None, 0
                front = first_offer(k)
                continue
        if front is not None and (not heap or front < heap[0]):
            _, i, end = front
            k += 1
            front = first_offer(k)
        elif heap:
            _, i, end = heapq.heappop(heap)
        else:
            break
        grow = end - float(shares[i])
        if grow > left + EPS:  # no longer fits: its best within what is left
            push(i)
            continue
        shares[i] = end
        left -= grow
        push(i)


def _spread_rest(plans: _Plans, shares: FloatArray, caps: FloatArray, classes: IntArray) -> None:
    """Capacity no curve gains from: by class weight to tenants with reuse or no curve yet."""
    left = 1.0 - float(shares.sum())
    if left <= EPS:
        return
    table = plans.table
    eligible = ~table.present | (table.max_hit >= NO_REUSE_HIT_RATIO)
    weights = np.where(eligible, _CLASS_WEIGHTS[classes], 0.0)
    _water_fill(shares, caps, weights, left)
