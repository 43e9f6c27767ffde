"""The allocator as it was before vectorising (reference for the property test only).

Per-tenant Python loops over the curves, exactly as committed before the
numpy rewrite of :mod:`cachefleet_operator.allocation`; the helpers that did
not change are imported from the package. ``test_allocation`` checks that
the package gives the same result as this on random inputs.
"""

# ruff: noqa
# mypy: ignore-errors

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from cachefleet_operator.allocation import (
    CLASS_ORDER,
    CLASS_WEIGHT,
    DEFAULT_MISS_COST_S,
    EPS,
    NO_REUSE_HIT_RATIO,
    SNAP,
    Allocation,
    AllocationParams,
    TenantAllocation,
    TenantDemand,
    TenantMetrics,
    class_shares,
    needed_hit_ratio,
)
from cachefleet_operator.allocation.arrays import _floats
from cachefleet_operator.allocation.columns import _CLASS_INDEX, _CLASS_WEIGHTS, _NO_METRICS
from cachefleet_operator.allocation.shares import (
    _bounds,
    _move,
    _refill,
    _to_bytes,
    _trim_overbooking,
    _water_fill,
)
from cachefleet_operator.allocation.sla import _pressure
from cachefleet_operator.curves import FloatArray, IntArray
from cachefleet_operator.curves import HitCurve


def _why_not(d: TenantDemand, m: TenantMetrics, curve: HitCurve) -> str:
    """Why no cache size meets the tenant's SLA, in words."""
    goals = []
    if d.p95_target_s is not None:
        goals.append(f"p95 {d.p95_target_s:.3g} s")
    if d.min_hit_ratio:
        goals.append(f"hit ratio {d.min_hit_ratio:.2f}")
    goal = " and ".join(goals) or "its SLA"
    slow = ""
    if m.miss_latency is not None and d.p95_target_s is not None:
        slow = f", a miss takes {m.miss_latency.mean():.3g} s on average"
    return (
        f"cache cannot meet its SLA: {curve.cold_ratio:.0%} of its requests are first-time "
        f"(at most {curve.max_hit_ratio:.0%} hits at any size){slow}: "
        f"no cache size meets {goal}"
    )


def _pressures(
    tenants: Sequence[TenantDemand], metrics: Mapping[str, TenantMetrics]
) -> tuple[FloatArray, list[bool | None]]:
    """SLA pressure (continuous, 1 at target) and attainment of every tenant."""
    get = metrics.get
    ms = [get(d.name, _NO_METRICS) for d in tenants]
    p95 = _floats([m.p95_s for m in ms])
    hit = _floats([m.hit_ratio for m in ms])
    p95_target = _floats([d.p95_target_s for d in tenants])
    min_hit = _floats([d.min_hit_ratio for d in tenants])
    with np.errstate(divide="ignore", invalid="ignore"):
        lat_ratio = p95 / p95_target
        hit_ratio = np.where(min_hit > 0.0, min_hit / np.maximum(hit, 1e-6), 0.0)
    hit_ratio = np.where(np.isnan(hit) | np.isnan(min_hit), np.nan, hit_ratio)
    worst = np.fmax(lat_ratio, hit_ratio)
    pressure = np.where(np.isnan(worst), 1.0, _pressure(np.nan_to_num(worst, nan=1.0)))
    met: list[bool | None] = [None if math.isnan(w) else w <= 1.0 + 1e-9 for w in worst.tolist()]
    return pressure, met


def _rate(d: TenantDemand, m: TenantMetrics) -> float:
    """Requests per second the allocation plans for (observed, or the promised minimum)."""
    rates = [r for r in (m.rps, d.min_rps) if r is not None and math.isfinite(r)]
    return max(rates) if rates else 0.0


def _miss_cost(m: TenantMetrics, fleet: float) -> float:
    """Upstream seconds a hit saves: the tenant's mean miss latency, else ``fleet``'s.

    Never the tenant's p95: a tenant that hits all the time has a p95 of hits,
    and valuing its hits at that would give its cache away.
    """
    if m.miss_latency is not None:
        return max(m.miss_latency.mean(), 1e-6)
    return fleet


def _share_for_hit_ratio(curve: HitCurve, hit: float, capacity: int) -> float | None:
    """The smallest share of ``capacity`` whose predicted hit ratio reaches ``hit``."""
    if hit <= 0.0:
        return 0.0
    xs, ys = curve.xs, curve.ys
    k = bisect_left(ys, hit - 1e-12)  # the first point reaching it (hit ratios ascend)
    if k >= len(ys):
        return None
    x, y = xs[k], ys[k]
    prev_x, prev_y = (xs[k - 1], ys[k - 1]) if k > 0 else (0.0, 0.0)
    size = x if y <= prev_y else prev_x + (x - prev_x) * (hit - prev_y) / (y - prev_y)
    return size / capacity if capacity > 0 else None


@dataclass(slots=True)
class _Plan:
    """Per-tenant working state of one allocation."""

    value: float  # utility per unit of hit ratio (class x pressure x rate x miss cost)
    curve: HitCurve | None
    cannot_meet: str = ""


def _plans(
    tenants: Sequence[TenantDemand],
    metrics: Mapping[str, TenantMetrics],
    pressure: FloatArray,
) -> list[_Plan]:
    # the same model server answers every tenant's misses: a tenant with none to
    # measure is valued at the others' mean miss latency
    known = [m.miss_latency.mean() for m in metrics.values() if m.miss_latency is not None]
    fleet = sum(known) / len(known) if known else DEFAULT_MISS_COST_S
    out = []
    for i, d in enumerate(tenants):
        m = metrics.get(d.name, _NO_METRICS)
        curve = m.curve if m.curve is not None and m.curve.requests > 0 else None
        value = CLASS_WEIGHT[d.priority_class] * float(pressure[i]) * _rate(d, m)
        value *= _miss_cost(m, fleet)
        out.append(_Plan(value, curve))
    return out


def _undecided(plan: _Plan, share: float, capacity: int) -> bool:
    """No curve yet, or no reuse yet while all the data seen still fits in ``share``.

    A working set whose first round is not over looks like a scan. Until the
    tenant has shown more distinct bytes than its share holds, reuse within
    that share may still come; once it has, any reuse it has would have shown.
    """
    curve = plan.curve
    if curve is None:
        return True
    return (
        curve.max_hit_ratio < NO_REUSE_HIT_RATIO
        and curve.footprint_bytes is not None
        and curve.footprint_bytes <= share * capacity
    )


def _protected(
    tenants: Sequence[TenantDemand],
    metrics: Mapping[str, TenantMetrics],
    plans: Sequence[_Plan],
    previous: Mapping[str, float] | None,
    classes: IntArray,
    capacity: int,
) -> FloatArray:
    """Shares not to cut yet: min(share in force, class share) of undecided tenants."""
    class_targets, _, _ = class_shares(tenants, classes)
    out = np.zeros(len(tenants))
    if not previous:
        return out
    for i, (d, p) in enumerate(zip(tenants, plans, strict=True)):
        prev = previous.get(d.name)
        if prev is not None and d.name in metrics and _undecided(p, prev, capacity):
            out[i] = min(prev, float(class_targets[i]))
    return out


def _utility(plans: Sequence[_Plan], shares: FloatArray, capacity: int) -> float:
    return sum(
        p.value * p.curve.at(float(s) * capacity)
        for p, s in zip(plans, shares.tolist(), strict=True)
        if p.curve is not None
    )


def _meet_slas(
    tenants: Sequence[TenantDemand],
    metrics: Mapping[str, TenantMetrics],
    plans: list[_Plan],
    shares: FloatArray,
    caps: FloatArray,
    classes: IntArray,
    capacity: int,
) -> None:
    """Raise tenants to the smallest share that meets their SLA, class by class (in place)."""
    for cls in CLASS_ORDER:
        wants: list[tuple[float, int]] = []
        for i in np.flatnonzero(classes == _CLASS_INDEX[cls]).tolist():
            d, plan = tenants[i], plans[i]
            if plan.curve is None or (d.p95_target_s is None and not d.min_hit_ratio):
                continue
            m = metrics.get(d.name, _NO_METRICS)
            need = needed_hit_ratio(d, m)
            share = None if need is None else _share_for_hit_ratio(plan.curve, need, capacity)
            if share is None:
                plan.cannot_meet = _why_not(d, m, plan.curve)
                continue
            if share > caps[i] + EPS:
                plan.cannot_meet = (
                    f"its SLA needs {share:.1%} of the cache, above maxShare {caps[i]:.1%}"
                )
                continue
            if share > shares[i]:
                wants.append((share - float(shares[i]), i))
        for extra, i in sorted(wants):
            left = 1.0 - float(shares.sum())
            if extra <= left + EPS:
                shares[i] += min(extra, max(0.0, left))
            else:
                plans[i].cannot_meet = (
                    f"its SLA needs {shares[i] + extra:.1%} of the cache; "
                    "higher classes and floors leave too little"
                )


def _best_extension(
    curve: HitCurve, value: float, lo: float, hi: float, capacity: int
) -> tuple[float, float] | None:
    """(utility per share, new share) of the best extension of ``lo`` up to ``hi``."""
    if hi - lo <= EPS:
        return None
    base = curve.at(lo * capacity)
    best: tuple[float, float] | None = None
    xs, ys = curve.xs, curve.ys
    # the candidate ends: every curve point strictly inside (lo, hi), then hi itself
    first = bisect_right(xs, lo * capacity)
    last = bisect_left(xs, hi * capacity, first)
    for k in range(first, last + 1):
        if k < last:
            to, hit = xs[k] / capacity, ys[k]
        else:
            to, hit = hi, curve.at(hi * capacity)
        if to - lo <= EPS:
            continue
        per = value * (hit - base) / (to - lo)
        if best is None or per > best[0] * (1.0 + 1e-9):
            best = (per, to)
    return best


def _greedy(plans: Sequence[_Plan], shares: FloatArray, caps: FloatArray, capacity: int) -> None:
    """Hand out what is left by marginal utility, looking ahead over cliffs (in place).

    UCP's lookahead (Qureshi & Patt, MICRO'06): each step gives the tenant
    with the best utility *per share* over any extension that still fits
    the extension that achieves it, so a working set that pays off only once
    it fits whole competes with its average gain up to the cliff (the slope
    of its concave hull) and is never left half-built on the cliff's side.
    Each tenant's best extension sits in a heap and is recomputed only when
    the tenant grew or its extension no longer fits what is left.
    """
    left = 1.0 - float(shares.sum())
    if left <= EPS or capacity <= 0:
        return
    active = [i for i, p in enumerate(plans) if p.curve is not None and p.value > 0.0]
    # gains this small relative to the largest tenant's value are noise
    noise = max((plans[i].value for i in active), default=0.0) * 1e-9

    def push(i: int) -> None:
        curve = plans[i].curve
        assert curve is not None
        lo = float(shares[i])
        found = _best_extension(curve, plans[i].value, lo, min(float(caps[i]), lo + left), capacity)
        if found is not None and found[0] > noise:
            heapq.heappush(heap, (-found[0], i, found[1]))

    heap: list[tuple[float, int, float]] = []
    for i in active:
        push(i)
    while heap and left > EPS:
        _, i, to = heapq.heappop(heap)
        grow = to - float(shares[i])
        if grow > left + EPS:  # no longer fits: its best within what is left
            push(i)
            continue
        shares[i] = to
        left -= grow
        push(i)


def _spread_rest(
    plans: Sequence[_Plan], shares: FloatArray, caps: FloatArray, classes: IntArray
) -> None:
    """Capacity no curve gains from: by class weight to tenants with reuse or no curve yet."""
    left = 1.0 - float(shares.sum())
    if left <= EPS:
        return
    eligible = np.array(
        [p.curve is None or p.curve.max_hit_ratio >= NO_REUSE_HIT_RATIO for p in plans]
    )
    weights = np.where(eligible, _CLASS_WEIGHTS[classes], 0.0)
    _water_fill(shares, caps, weights, left)


def allocate(
    tenants: Sequence[TenantDemand],
    metrics: Mapping[str, TenantMetrics],
    previous: Mapping[str, float] | None,
    l1_capacity: int,
    l2_capacity: int,
    params: AllocationParams | None = None,
) -> Allocation:
    """Compute every tenant's share and bytes.

    ``metrics`` maps tenant -> observations (empty when none are available:
    shares then follow classes and floors only; a tenant missing from a
    non-empty map is taken to have no traffic). ``previous`` maps tenant ->
    share in force (``None`` or missing tenants: the target at once).
    Curves are in L1 bytes per pod, so ``l1_capacity`` is the size they are
    read at; L2 bytes follow the same shares.
    """
    params = params or AllocationParams()
    tenants = tuple(tenants)
    if not tenants:
        return Allocation((), l1_capacity, l2_capacity, tenants, metrics)
    classes = np.array([_CLASS_INDEX[d.priority_class] for d in tenants], dtype=np.int64)
    pressure, met = _pressures(tenants, metrics)
    if not metrics:
        targets, floors, caps = class_shares(tenants, classes)
        plans = [_Plan(0.0, None) for _ in tenants]
    else:
        floors, caps = _bounds(tenants, classes)
        plans = _plans(tenants, metrics, pressure)
        keep = _protected(tenants, metrics, plans, previous, classes, l1_capacity)
        targets = np.minimum(caps, np.maximum(floors, keep))
        _trim_overbooking(targets, floors, classes)
        _meet_slas(tenants, metrics, plans, targets, caps, classes, l1_capacity)
        _greedy(plans, targets, caps, l1_capacity)
        _spread_rest(plans, targets, caps, classes)

    shares = targets.copy()
    held = np.zeros(len(tenants), dtype=bool)
    if previous:
        raw_prev = _floats([previous.get(d.name) for d in tenants])
        has_prev = ~np.isnan(raw_prev)
        prev = np.clip(np.where(has_prev, raw_prev, targets), floors, caps)
        _trim_overbooking(prev, floors, classes)
        # the spec's bounds moved a share in force: that change is applied, not held
        bounds_moved = bool(np.any(has_prev & (np.abs(prev - raw_prev) > EPS)))
        now_u, target_u = _utility(plans, prev, l1_capacity), _utility(plans, targets, l1_capacity)
        gain = target_u - now_u
        # An SLA that the target meets and the shares in force do not is always worth a move.
        sla_fix = any(
            p.curve is not None and not p.cannot_meet and t > s + EPS and met[i] is False
            for i, (p, t, s) in enumerate(zip(plans, targets.tolist(), prev.tolist(), strict=True))
        )
        worth = (
            not metrics
            or sla_fix
            or bounds_moved
            or not has_prev.all()
            or gain > params.min_gain * max(now_u, EPS)
        )
        measured = np.array([p.curve is not None for p in plans])
        if worth:
            shares, held = _move(targets, prev, floors, classes, params, measured)
        else:
            shares, held = prev.copy(), np.abs(targets - prev) > EPS
        # A tenant without reuse never keeps more than its target (its floor), gain or not.
        no_reuse = np.array(
            [
                p.curve is not None
                and p.curve.max_hit_ratio < NO_REUSE_HIT_RATIO
                and not _undecided(p, s, l1_capacity)
                for p, s in zip(plans, prev.tolist(), strict=True)
            ]
        )
        shrink = no_reuse & (shares > targets + EPS)
        if shrink.any():
            shares[shrink] = targets[shrink]
            held[shrink] = False
            _refill(shares, targets)
        shares = np.where(has_prev, shares, targets)
        _trim_overbooking(shares, floors, classes)
        # a settled allocation is a fixed point: rounding must not make it wander
        shares = np.where(has_prev & (np.abs(shares - prev) <= SNAP), prev, shares)

    l1 = _to_bytes(shares, floors, l1_capacity)
    l2 = _to_bytes(shares, floors, l2_capacity)
    at_floor = (floors > 0.0) & (shares <= floors + EPS)
    at_cap = (caps < 1.0) & (shares >= caps - EPS)
    notes = np.where(at_floor, "floor", np.where(at_cap, "cap", np.where(held, "held", "")))
    predicted = [
        None if p.curve is None else round(p.curve.at(s * l1_capacity), 4)
        for p, s in zip(plans, shares.tolist(), strict=True)
    ]
    out = tuple(
        map(
            TenantAllocation,
            [d.name for d in tenants],
            [d.priority_class for d in tenants],
            shares.tolist(),
            targets.tolist(),
            [p.value for p in plans],
            l1,
            l2,
            met,
            notes.tolist(),
            [p.cannot_meet for p in plans],
            predicted,
        )
    )
    return Allocation(out, l1_capacity, l2_capacity, tenants, metrics)
