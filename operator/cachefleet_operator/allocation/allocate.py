"""The entry points: :func:`allocate` (the steps in order), :func:`hold` (no metrics)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from cachefleet_operator.allocation.arrays import _finite, _floats
from cachefleet_operator.allocation.columns import _CLASS_INDEX, _Columns
from cachefleet_operator.allocation.greedy import (
    _greedy,
    _meet_slas,
    _Plans,
    _plans,
    _protected,
    _spread_rest,
    _undecided,
    _utility,
)
from cachefleet_operator.allocation.l2 import _l2_bytes
from cachefleet_operator.allocation.model import (
    EPS,
    NO_REUSE_HIT_RATIO,
    SNAP,
    AllocationParams,
    TenantDemand,
    TenantMetrics,
)
from cachefleet_operator.allocation.result import Allocation, TenantAllocation, _Result
from cachefleet_operator.allocation.shares import (
    _bounds,
    _bounds_of,
    _class_shares,
    _move,
    _refill,
    _to_bytes,
    _trim_overbooking,
)
from cachefleet_operator.allocation.sla import _pressures


def allocate(
    tenants: Sequence[TenantDemand],
    metrics: Mapping[str, TenantMetrics],
    previous: Mapping[str, float] | None,
    l1_capacity: int,
    l2_capacity: int,
    params: AllocationParams | None = None,
    previous_l2: Mapping[str, int] | None = None,
) -> Allocation:
    """Compute every tenant's share and bytes.

    ``metrics`` maps tenant -> observations: a :class:`MetricsTable` (what a
    metrics source returns; its columns are read as they are) or any mapping
    (made into one first). Empty when none are available: shares then
    follow classes and floors only; a tenant missing from a non-empty map
    is taken to have no traffic. ``previous`` maps tenant ->
    share in force (``None`` or missing tenants: the target at once).
    Curves are in L1 bytes per pod, so ``l1_capacity`` is the size they are
    read at; L2 bytes go by the fleet curves (:func:`_l2_bytes`; the L1
    shares for a tenant without one), moving from ``previous_l2`` (tenant ->
    L2 bytes in force) as the shares move from ``previous``. Per-tenant work
    is done on arrays (numpy), so 10,000 tenants with curves take tens of
    milliseconds.
    """
    params = params or AllocationParams()
    tenants = tuple(tenants)
    if not tenants:
        return Allocation((), l1_capacity, l2_capacity, tenants, metrics)
    return _allocate(tenants, metrics, previous, l1_capacity, l2_capacity, params, previous_l2)


def _allocate(
    tenants: tuple[TenantDemand, ...],
    metrics: Mapping[str, TenantMetrics],
    previous: Mapping[str, float] | None,
    l1_capacity: int,
    l2_capacity: int,
    params: AllocationParams,
    previous_l2: Mapping[str, int] | None,
) -> Allocation:
    cols = _Columns.of(tenants, metrics)
    names, classes = cols.names, cols.classes
    # shares in force, as given (None: NaN)
    in_force = (
        np.array(list(map(previous.get, names)), dtype=np.float64)
        if previous
        else np.full(len(names), np.nan)
    )
    pressure, met, missed = _pressures(cols)
    floors, caps = _bounds_of(cols.min_share, cols.max_share, classes)
    if not metrics:
        targets = _class_shares(floors, caps, classes)
        n = len(tenants)
        plans = _Plans(np.zeros(n), cols.curves, cols.misses, [""] * n)
    else:
        plans = _plans(cols, pressure)
        keep = _protected(cols, metrics, plans, previous, in_force, floors, caps, l1_capacity)
        targets = np.minimum(caps, np.maximum(floors, keep))
        _trim_overbooking(targets, floors, classes)
        _meet_slas(cols, plans, targets, caps, l1_capacity)
        _greedy(plans, targets, caps, l1_capacity)
        _spread_rest(plans, targets, caps, classes)

    measured = plans.table.present
    shares = targets.copy()
    held = np.zeros(len(tenants), dtype=bool)
    if previous:
        raw_prev = _finite(in_force)
        has_prev = ~np.isnan(raw_prev)
        prev = np.clip(np.where(has_prev, raw_prev, targets), floors, caps)
        _trim_overbooking(prev, floors, classes)
        # the spec's bounds moved a share in force: that change is applied, not held
        bounds_moved = bool(np.any(has_prev & (np.abs(prev - raw_prev) > EPS)))
        now_u, target_u = _utility(plans, prev, l1_capacity), _utility(plans, targets, l1_capacity)
        gain = target_u - now_u
        # An SLA that the target meets and the shares in force do not is always worth a move
        # (whether it can be met is read only when some tenant raised misses: most often none).
        raised = measured & (targets > prev + EPS) & missed
        sla_fix = False
        if raised.any():
            meetable = ~np.fromiter(map(bool, plans.cannot_meet), dtype=bool, count=len(names))
            if plans.beyond is not None:
                meetable[plans.beyond.rows] = False
            sla_fix = bool(np.any(raised & meetable))
        worth = (
            not metrics
            or sla_fix
            or bounds_moved
            or not has_prev.all()
            or gain > params.min_gain * max(now_u, EPS)
        )
        if worth:
            shares, held = _move(targets, prev, floors, classes, params, measured)
        else:
            shares, held = prev.copy(), np.abs(targets - prev) > EPS
        # A tenant without reuse never keeps more than its target (its floor), gain or not.
        no_reuse = (
            measured
            & (plans.table.max_hit < NO_REUSE_HIT_RATIO)
            & ~_undecided(plans, prev, l1_capacity)
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
    # L2 bytes in force, as given (None: NaN)
    l2_in_force = (
        np.array(list(map(previous_l2.get, names)), dtype=np.float64) if previous_l2 else None
    )
    l2 = _l2_bytes(
        plans, cols.fleet, shares, (floors, caps), classes, l2_capacity, (l2_in_force, params)
    )
    at_floor = (floors > 0.0) & (shares <= floors + EPS)
    at_cap = (caps < 1.0) & (shares >= caps - EPS)
    # the note's index in _NOTES (the same four strings for every row, not one each)
    notes = np.where(at_floor, 1, np.where(at_cap, 2, np.where(held, 3, 0)))
    result = _Result(
        names,
        cols.priority_classes,
        shares,
        targets,
        plans.values,
        l1,
        l2,
        met,
        notes,
        plans.cannot_meet,
        plans.beyond,
        plans.table,
        measured,
        l1_capacity,
    )
    return Allocation(result, l1_capacity, l2_capacity, tenants, metrics)


def hold(
    tenants: Sequence[TenantDemand],
    previous: Mapping[str, float],
    l1_capacity: int,
    l2_capacity: int,
    previous_l2: Mapping[str, int] | None = None,
) -> Allocation:
    """Keep the shares in force (metrics unavailable), within the spec's current bounds.

    Tenants without a previous share get their floor; if the spec's bounds
    changed so that the kept shares overbook capacity, slack is trimmed as in
    :func:`allocate`. L2 bytes in force (``previous_l2``) are kept alike; a
    tenant without any gets its share of L2.
    """
    tenants = tuple(tenants)
    if not tenants:
        return Allocation((), l1_capacity, l2_capacity, tenants, {})
    classes = np.array([_CLASS_INDEX[d.priority_class] for d in tenants], dtype=np.int64)
    floors, caps = _bounds(tenants, classes)
    prev = _floats([previous.get(d.name) for d in tenants])
    shares = np.clip(np.where(np.isnan(prev), floors, prev), floors, caps)
    _trim_overbooking(shares, floors, classes)
    l1 = _to_bytes(shares, floors, l1_capacity)
    l2_shares = shares
    if previous_l2 and l2_capacity > 0:
        kept = _floats([previous_l2.get(d.name) for d in tenants]) / l2_capacity
        l2_shares = np.clip(np.where(np.isnan(kept), shares, kept), floors, caps)
        _trim_overbooking(l2_shares, floors, classes)
    l2 = _to_bytes(l2_shares, floors, l2_capacity)
    out = tuple(
        TenantAllocation(d.name, d.priority_class, s, s, 0.0, a, b, None, "held")
        for d, s, a, b in zip(tenants, shares.tolist(), l1, l2, strict=True)
    )
    return Allocation(out, l1_capacity, l2_capacity, tenants, {})
