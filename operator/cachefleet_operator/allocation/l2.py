"""The L2 split: L2 bytes by marginal gain on the fleet curves, settled from those in force."""

from __future__ import annotations

import numpy as np

from cachefleet_operator.allocation.columns import _CLASS_WEIGHTS
from cachefleet_operator.allocation.greedy import _greedy, _Plans, _utility_of
from cachefleet_operator.allocation.level import _fill
from cachefleet_operator.allocation.model import EPS, NO_REUSE_HIT_RATIO, SNAP, AllocationParams
from cachefleet_operator.allocation.shares import (
    _move,
    _refill,
    _to_bytes,
    _trim_overbooking,
    _water_fill,
)
from cachefleet_operator.curves import (
    CurveTable,
    FloatArray,
    IntArray,
)


def _l2_bytes(
    plans: _Plans,
    fleet: CurveTable | None,
    shares: FloatArray,
    bounds: tuple[FloatArray, FloatArray],
    classes: IntArray,
    capacity: int,
    settle: tuple[FloatArray | None, AllocationParams] = (None, AllocationParams()),
) -> list[int]:
    """L2 bytes by marginal gain on the fleet curves; a tenant without one keeps its L1 share.

    The fleet curves are in bytes of one cache the fleet shares, which the L2
    is. Tenants with a fleet curve start from their floor and grow by the
    same lookahead greedy as L1 (:func:`_greedy`, valued alike); what no
    fleet curve gains from goes by class weight to those with fleet-wide
    reuse. With no fleet curve at all, L2 follows the L1 shares. ``settle``:
    every tenant's L2 bytes in force (NaN: none; None: no tenant's), from
    which the bytes of the tenants with a fleet curve move as the L1 shares
    do (:func:`_settle_l2`), and the allocation's parameters.
    """
    floors, caps = bounds
    if capacity <= 0 or fleet is None:  # the common case
        return _to_bytes(shares, floors, capacity)
    # a curve behind no requests is no curve (almost always none such)
    has = fleet.requests > 0.0
    if not has.any():
        return _to_bytes(shares, floors, capacity)
    table = fleet if np.array_equal(has, fleet.present) else fleet.only(has)
    l2 = np.where(has, floors, shares)
    l2_caps = np.where(has, caps, shares)
    # Where L2 holds every tenant's curve up to where it stops rising (within its cap),
    # the greedy would end there: take that at once (the common case: L2 is the big tier).
    with np.errstate(invalid="ignore"):
        full = np.minimum(l2_caps, table.size_for(table.max_hit) / capacity)
    full = np.where(has & (plans.values > 0.0), np.maximum(l2, np.nan_to_num(full)), l2)
    if float(full.sum()) <= 1.0 + EPS:
        l2 = full
    else:
        grows = has & (plans.values > 0.0)
        filled, within = _fill(table, plans.values, l2, l2_caps, capacity)
        l2 = np.where(grows, filled, l2)
        fleet_plans = _Plans(plans.values, table, plans.misses, [""] * len(l2))
        _greedy(fleet_plans, l2, l2_caps, capacity, within)
    left = 1.0 - float(l2.sum())
    if left > EPS:  # by class weight to those with fleet-wide reuse (else to every curve)
        reuse = has & (table.max_hit >= NO_REUSE_HIT_RATIO)
        weights = np.where(reuse if reuse.any() else has, _CLASS_WEIGHTS[classes], 0.0)
        _water_fill(l2, l2_caps, weights, left)
    in_force, params = settle
    if in_force is not None:
        bounds = (floors, l2_caps)
        l2 = _settle_l2(
            l2, in_force / capacity, table, plans.values, bounds, classes, params, capacity
        )
    return _to_bytes(l2, floors, capacity)


def _settle_l2(
    targets: FloatArray,
    in_force: FloatArray,
    table: CurveTable,
    values: FloatArray,
    bounds: tuple[FloatArray, FloatArray],
    classes: IntArray,
    params: AllocationParams,
    capacity: int,
) -> FloatArray:
    """The L2 shares of the tenants with a fleet curve (``table``'s rows) moved from those
    ``in_force`` (NaN: none) towards ``targets`` by the rule the L1 shares follow.

    They move only when the predicted gain on the fleet curves exceeds
    ``min_gain`` of the utility of the shares in force (or a tenant is new,
    or the bounds or the L2 capacity moved a share in force), and then
    ``smoothing`` of the way, none by less than :data:`ABSOLUTE_DEADBAND`
    (:func:`_move`); a tenant whose fleet curve shows no reuse never keeps
    more than its target. So a wobble of the fleet curves, which moves the
    targets a little, moves no byte. Tenants without a fleet curve keep their
    target (their L1 share).
    """
    floors, caps = bounds
    has = table.present
    known = has & ~np.isnan(in_force)
    prev = np.where(known, np.clip(np.nan_to_num(in_force), floors, caps), targets)
    # the spec's bounds or the L2 capacity moved a share in force: applied, not held (bytes
    # are whole: one at a floor or cap of no whole byte count is up to a byte off it)
    bounds_moved = bool(np.any(known & (np.abs(prev - in_force) > EPS + 1.0 / capacity)))
    _trim_overbooking(prev, floors, classes)
    moves = bounds_moved or bool(np.any(has & ~known))  # or a tenant is new: no gain to weigh
    if not moves:
        now_u = _utility_of(values, table, prev, capacity)
        target_u = _utility_of(values, table, targets, capacity)
        moves = target_u - now_u > params.min_gain * max(now_u, EPS)
    if moves:
        shares, _ = _move(targets, prev, floors, classes, params, has)
    else:
        shares = prev.copy()
    shrink = has & (table.max_hit < NO_REUSE_HIT_RATIO) & (shares > targets + EPS)
    if shrink.any():
        shares[shrink] = targets[shrink]
        _refill(shares, targets)
    shares = np.where(known, shares, targets)
    _trim_overbooking(shares, floors, classes)
    # a settled allocation is a fixed point: rounding must not make it wander
    return np.where(known & (np.abs(shares - prev) <= SNAP), prev, shares)
