"""Shares within bounds: floors and caps by class, filling by weight, trimming overbooking,
the bounded step from the shares in force, and shares to bytes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cachefleet_operator.allocation.arrays import _numbers
from cachefleet_operator.allocation.columns import _CLASS_INDEX, _CLASS_WEIGHTS
from cachefleet_operator.allocation.model import (
    ABSOLUTE_DEADBAND,
    CLASS_ORDER,
    EPS,
    AllocationParams,
    PriorityClass,
    TenantDemand,
)
from cachefleet_operator.curves import (
    BoolArray,
    FloatArray,
    IntArray,
)


def class_shares(
    tenants: Sequence[TenantDemand], classes: IntArray
) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Shares by priority class alone (no metrics): floors, then class weight in class order.

    (targets, floors, caps).
    """
    floors, caps = _bounds(tenants, classes)
    return _class_shares(floors, caps, classes), floors, caps


def _class_shares(floors: FloatArray, caps: FloatArray, classes: IntArray) -> FloatArray:
    return target_shares(floors, caps, _CLASS_WEIGHTS[classes].astype(np.float64), classes)


def _bounds(tenants: Sequence[TenantDemand], classes: IntArray) -> tuple[FloatArray, FloatArray]:
    """Floors and caps, made consistent (floors fit in capacity, cap >= floor)."""
    return _bounds_of(_numbers(tenants, "min_share"), _numbers(tenants, "max_share"), classes)


def _bounds_of(
    min_share: FloatArray, max_share: FloatArray, classes: IntArray
) -> tuple[FloatArray, FloatArray]:
    """:func:`_bounds` from the columns."""
    floors = np.clip(min_share, 0.0, 1.0)
    floors[classes == _CLASS_INDEX[PriorityClass.BEST_EFFORT]] = 0.0
    # An invalid spec is refused before allocation; this only keeps the
    # invariants if one gets here anyway: Standard floors yield first.
    for cls in (PriorityClass.STANDARD, PriorityClass.GUARANTEED):
        total = float(floors.sum())
        if total <= 1.0:
            break
        mask = classes == _CLASS_INDEX[cls]
        in_cls = float(floors[mask].sum())
        if in_cls > 0.0:
            floors[mask] *= max(0.0, 1.0 - (total - in_cls)) / in_cls
    caps = np.clip(max_share, 0.0, 1.0)
    return floors, np.maximum(caps, floors)


def _water_fill(shares: FloatArray, caps: FloatArray, weights: FloatArray, amount: float) -> None:
    """Hand out ``amount`` by weight among tenants below their cap (in place).

    Finds the level L with sum(min(L * weight, headroom)) = amount: tenants
    sorted by headroom / weight saturate in that order.
    """
    headroom = caps - shares
    idx = np.flatnonzero((headroom > EPS) & (weights > 0.0))
    if idx.size == 0:
        return
    order = idx[np.argsort(headroom[idx] / weights[idx], kind="stable")]
    h, w = headroom[order], weights[order]
    saturated_before = np.concatenate(([0.0], np.cumsum(h)[:-1]))
    weight_from = np.cumsum(w[::-1])[::-1]
    level = (amount - saturated_before) / weight_from
    fits = level * w < h  # from the first k where this holds, nobody saturates
    if not fits.any():
        shares[order] = caps[order]
        return
    k = int(np.argmax(fits))
    lvl = max(0.0, float(level[k]))
    shares[order[:k]] = caps[order[:k]]
    shares[order[k:]] += np.minimum(lvl * w[k:], h[k:])


def target_shares(
    floors: FloatArray, caps: FloatArray, weights: FloatArray, classes: IntArray
) -> FloatArray:
    """Targets before smoothing: floors, then weight in class order."""
    shares = floors.copy()
    left = max(0.0, 1.0 - float(floors.sum()))
    total_weight = float(weights.sum())
    if total_weight > 0.0 and left > EPS:
        wants = np.maximum(0.0, np.minimum(weights / total_weight, caps) - floors)
        for cls in CLASS_ORDER:
            mask = classes == _CLASS_INDEX[cls]
            wanted = float(wants[mask].sum())
            if wanted <= 0.0 or left <= EPS:
                continue
            granted = min(left, wanted)
            shares[mask] = np.minimum(caps[mask], shares[mask] + wants[mask] * (granted / wanted))
            left -= granted
        if left > EPS:
            _water_fill(shares, caps, weights, left)
    return shares


def _trim_overbooking(shares: FloatArray, floors: FloatArray, classes: IntArray) -> None:
    """Bring the sum back to capacity by cutting slack above floors, BestEffort first."""
    excess = float(shares.sum()) - 1.0
    if excess <= EPS:  # rounding, not overbooking: leave settled shares exactly as they are
        return
    for cls in reversed(CLASS_ORDER):
        if excess <= 0.0:
            return
        mask = classes == _CLASS_INDEX[cls]
        slack = float((shares[mask] - floors[mask]).sum())
        if slack <= 0.0:
            continue
        cut = min(excess, slack)
        shares[mask] = floors[mask] + (shares[mask] - floors[mask]) * (1.0 - cut / slack)
        excess -= cut


def _refill(shares: FloatArray, targets: FloatArray) -> None:
    """Give capacity freed by tenants that moved down to those held below their target.

    Only when more than :data:`ABSOLUTE_DEADBAND` is free, so a settled
    allocation does not drift with metric noise.
    """
    free = 1.0 - float(shares.sum())
    if free <= ABSOLUTE_DEADBAND:
        return
    gaps = np.maximum(0.0, targets - shares)
    total_gap = float(gaps.sum())
    if total_gap <= EPS:
        return
    shares += gaps * min(1.0, free / total_gap)


def _move(
    targets: FloatArray,
    prev: FloatArray,
    floors: FloatArray,
    classes: IntArray,
    params: AllocationParams,
    measured: BoolArray,
) -> tuple[FloatArray, BoolArray]:
    """Shares one bounded step from ``prev`` towards ``targets``; (shares, held).

    A tenant with a curve moves whenever the move was found worth it (the
    gain test in :func:`allocate`); one without a curve keeps the older rule:
    it moves only when its target differs by more than ``hysteresis``.
    """
    delta = targets - prev
    band = np.where(measured, ABSOLUTE_DEADBAND, params.hysteresis * prev)
    inside = np.abs(delta) <= np.maximum(ABSOLUTE_DEADBAND, band)
    shares = np.where(inside, prev, prev + params.smoothing * delta)
    _trim_overbooking(shares, floors, classes)
    _refill(shares, targets)
    return shares, inside & (np.abs(delta) > EPS)


def _to_bytes(shares: FloatArray, floors: FloatArray, capacity: int) -> list[int]:
    out: list[int] = np.floor(shares * capacity).astype(np.int64).clip(0).tolist()
    over = sum(out) - capacity
    if over > 0:  # floating-point rounding only: take it from the largest slack
        slack = np.asarray(out) - np.floor(floors * capacity)
        i = int(np.argmax(slack))
        out[i] = max(0, out[i] - over)
    return out
