"""SLA-weighted allocation of cache capacity among tenants (pure: no I/O).

Input: the tenants of an InferenceCache (class, SLA, share bounds), their
observed metrics (p95 latency, hit ratio, request rate; any may be missing)
and the shares currently in force. Output: a share of capacity per tenant,
turned into L1 bytes per pod and L2 bytes, with a reason for each.

How a share is found:

1. **Demand weight** per tenant = class weight x traffic x SLA pressure x
   benefit. *Traffic* is the tenant's request rate (or its promised
   ``minRps`` if higher) relative to the fleet mean. *Pressure* is above 1
   when a target is missed (it grows with the shortfall), exactly 1 at the
   target and falls to 1/2 when the tenant is comfortably inside every
   target (it gives share back). *Benefit* is the expected gain from more
   cache: higher when the miss ratio is high. All three are continuous, so
   small metric noise makes small weight changes.
2. **Target shares**: every tenant first gets its floor (``minShare``; none
   for BestEffort). The rest of the capacity is handed out by weight, in
   class order (Guaranteed, then Standard, then BestEffort from what is
   left), never above ``maxShare``; capacity nobody wanted is water-filled
   by weight among tenants below their cap.
3. **Smoothing and hysteresis**: a share moves only when its target differs
   from it by more than ``hysteresis`` x the current share, and then only
   ``smoothing`` of the way (EWMA). If that overbooks capacity, the slack
   above floors is trimmed, BestEffort first; capacity freed by tenants
   that moved down goes to tenants held below their target.

Invariants (property-tested): shares and bytes never exceed capacity,
floors and caps always hold.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

#: EWMA weight of the newest target share (1 = no smoothing).
DEFAULT_SMOOTHING = 0.5
#: A share moves only if its target differs by more than this fraction of it.
DEFAULT_HYSTERESIS = 0.2


FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


class PriorityClass(StrEnum):
    """How a tenant competes for cache capacity."""

    GUARANTEED = "Guaranteed"
    STANDARD = "Standard"
    BEST_EFFORT = "BestEffort"


#: Relative weight of each class in the demand weight.
CLASS_WEIGHT: dict[PriorityClass, float] = {
    PriorityClass.GUARANTEED: 2.0,
    PriorityClass.STANDARD: 1.0,
    PriorityClass.BEST_EFFORT: 0.5,
}
#: Order in which classes are served from what is left after floors.
CLASS_ORDER = (PriorityClass.GUARANTEED, PriorityClass.STANDARD, PriorityClass.BEST_EFFORT)
#: observed/target below this counts as comfortably inside the SLA.
COMFORT_RATIO = 0.5
#: Pressure of a tenant comfortably inside every target (gives share back).
GIVE_BACK_PRESSURE = 0.5
#: Extra pressure per unit of shortfall above the target (p95 twice the target = 1 + GAIN).
SHORTFALL_GAIN = 2.0
#: Shortfall ratios are capped here so one broken tenant cannot take everything.
MAX_SHORTFALL_RATIO = 4.0
#: Traffic factor bounds (request rate relative to the fleet mean).
MIN_TRAFFIC = 0.1
MAX_TRAFFIC = 10.0
#: Benefit of more cache for a tenant that never misses (1 for one that always misses).
BENEFIT_FLOOR = 0.25
#: A share change smaller than this (fraction of capacity) is never worth a move.
ABSOLUTE_DEADBAND = 0.001
#: Tolerance for floating-point comparisons of shares.
EPS = 1e-12


@dataclass(frozen=True, slots=True)
class TenantDemand:
    """What allocation needs to know about one tenant from the spec."""

    name: str
    priority_class: PriorityClass = PriorityClass.STANDARD
    min_share: float = 0.0
    max_share: float = 1.0
    p95_target_s: float | None = None
    min_hit_ratio: float | None = None
    min_rps: float | None = None


@dataclass(frozen=True, slots=True)
class TenantMetrics:
    """A tenant's observed metrics over the query window (``None`` = no data)."""

    p95_s: float | None = None
    hit_ratio: float | None = None
    rps: float | None = None


@dataclass(frozen=True, slots=True)
class AllocationParams:
    """Tuning of the allocation; defaults match the CRD's defaults."""

    smoothing: float = DEFAULT_SMOOTHING
    hysteresis: float = DEFAULT_HYSTERESIS


class TenantAllocation(NamedTuple):
    """One tenant's result; ``note`` is ``floor``, ``cap``, ``held`` or empty."""

    name: str
    priority_class: PriorityClass
    share: float
    target: float
    weight: float
    l1_bytes: int
    l2_bytes: int
    sla_met: bool | None
    note: str


@dataclass(frozen=True, slots=True)
class Allocation:
    """The whole result; ``tenants`` in spec order.

    Reasons are worded on demand (:meth:`reason`): they are for status and
    Events, not for the allocation itself.
    """

    tenants: tuple[TenantAllocation, ...]
    l1_capacity: int
    l2_capacity: int
    demands: tuple[TenantDemand, ...] = ()
    metrics: Mapping[str, TenantMetrics] = field(default_factory=dict)

    def shares(self) -> dict[str, float]:
        return {t.name: t.share for t in self.tenants}

    def by_name(self) -> dict[str, TenantAllocation]:
        return {t.name: t for t in self.tenants}

    def reason(self, index: int) -> str:
        """Why tenant number ``index`` has its share, in words."""
        t = self.tenants[index]
        d = self.demands[index]
        m = self.metrics.get(d.name) if self.metrics else None
        lat, hit = _sla_ratios(d, m)
        text = _describe(d, m, lat, hit, bool(self.metrics))
        if t.note == "floor":
            text += f"; at {d.priority_class.value} floor {t.share:.1%}"
        elif t.note == "cap":
            text += f"; capped at maxShare {t.share:.1%}"
        elif t.note == "held" and not self.metrics:
            text = "metrics unavailable: last allocation kept"
        elif t.note == "held":
            text += f"; held (target {t.target:.1%} within hysteresis)"
        return text

    def reasons(self) -> dict[str, str]:
        return {t.name: self.reason(i) for i, t in enumerate(self.tenants)}


@dataclass(frozen=True, slots=True)
class QuotaMove:
    """A tenant whose share changed (``None`` = absent before / after)."""

    name: str
    before: float | None
    after: float | None
    reason: str = field(default="")


# ---------------------------------------------------------------------- helpers


def _pressure_of(ratio: float) -> float:
    """Continuous pressure from observed/target (above 1 = target missed)."""
    if ratio <= COMFORT_RATIO:
        return GIVE_BACK_PRESSURE
    if ratio <= 1.0:
        # linear from GIVE_BACK_PRESSURE at COMFORT_RATIO to 1 at the target
        span = (ratio - COMFORT_RATIO) / (1.0 - COMFORT_RATIO)
        return GIVE_BACK_PRESSURE + (1.0 - GIVE_BACK_PRESSURE) * span
    return 1.0 + SHORTFALL_GAIN * (min(ratio, MAX_SHORTFALL_RATIO) - 1.0)


def _sla_ratios(d: TenantDemand, m: TenantMetrics | None) -> tuple[float | None, float | None]:
    """(latency ratio, hit ratio ratio); above 1 means the target is missed."""
    if m is None:
        return None, None
    lat = None
    if d.p95_target_s is not None and m.p95_s is not None and math.isfinite(m.p95_s):
        lat = m.p95_s / d.p95_target_s
    hit = None
    if d.min_hit_ratio is not None and m.hit_ratio is not None and math.isfinite(m.hit_ratio):
        hit = d.min_hit_ratio / max(m.hit_ratio, 1e-6) if d.min_hit_ratio > 0 else 0.0
    return lat, hit


def sla_met(d: TenantDemand, m: TenantMetrics | None) -> bool | None:
    """Whether every target with an observation is met; ``None`` when nothing is known."""
    lat, hit = _sla_ratios(d, m)
    known = [r for r in (lat, hit) if r is not None]
    if not known:
        return None
    return all(r <= 1.0 + 1e-9 for r in known)


def _describe(
    d: TenantDemand,
    m: TenantMetrics | None,
    lat: float | None,
    hit: float | None,
    any_metrics: bool,
) -> str:
    if m is None:
        return "no traffic seen: minimal demand" if any_metrics else "no metrics: share by class"
    parts = []
    if lat is not None and m.p95_s is not None and d.p95_target_s is not None:
        rel = ">" if lat > 1.0 else "<="
        parts.append(f"p95 {m.p95_s:.3g}s {rel} target {d.p95_target_s:.3g}s")
    if hit is not None and m.hit_ratio is not None and d.min_hit_ratio is not None:
        rel = "<" if hit > 1.0 else ">="
        parts.append(f"hit ratio {m.hit_ratio:.2f} {rel} min {d.min_hit_ratio:.2f}")
    if not parts:
        return "no SLA observations: share by traffic"
    worst = max(r for r in (lat, hit) if r is not None)
    if worst > 1.0:
        prefix = "SLA missed"
    elif worst <= COMFORT_RATIO:
        prefix = "well within SLA"
    else:
        prefix = "SLA met"
    return f"{prefix}: " + ", ".join(parts)


_NO_METRICS = TenantMetrics()


def _floats(values: list[float | None]) -> FloatArray:
    """An array with ``None`` and non-finite values as NaN."""
    out = np.array(values, dtype=np.float64)
    out[~np.isfinite(out)] = np.nan
    return out


_CLASS_INDEX = {cls: n for n, cls in enumerate(CLASS_ORDER)}
_CLASS_WEIGHTS = np.array([CLASS_WEIGHT[cls] for cls in CLASS_ORDER])


def _pressure(ratio: FloatArray) -> FloatArray:
    """Vectorised :func:`_pressure_of`."""
    span = (ratio - COMFORT_RATIO) / (1.0 - COMFORT_RATIO)
    inside = GIVE_BACK_PRESSURE + (1.0 - GIVE_BACK_PRESSURE) * np.clip(span, 0.0, 1.0)
    above = 1.0 + SHORTFALL_GAIN * (np.minimum(ratio, MAX_SHORTFALL_RATIO) - 1.0)
    return np.where(ratio > 1.0, above, inside)


def _weights(
    tenants: Sequence[TenantDemand], metrics: Mapping[str, TenantMetrics], classes: IntArray
) -> tuple[FloatArray, list[bool | None]]:
    """Demand weight and SLA attainment of every tenant (vectorised)."""
    get = metrics.get
    ms = [get(d.name, _NO_METRICS) for d in tenants]
    present = np.array([m is not _NO_METRICS for m in ms])
    p95 = _floats([m.p95_s for m in ms])
    hit = _floats([m.hit_ratio for m in ms])
    rps = _floats([m.rps for m in ms])
    p95_target = _floats([d.p95_target_s for d in tenants])
    min_hit = _floats([d.min_hit_ratio for d in tenants])
    min_rps = _floats([d.min_rps for d in tenants])

    rate = np.fmax(rps, np.where(np.isnan(rps), np.nan, min_rps))
    known = ~np.isnan(rate)
    mean_rate = float(rate[known].mean()) if known.any() else 0.0
    if mean_rate > 0.0:
        traffic = np.where(known, np.clip(rate / mean_rate, MIN_TRAFFIC, MAX_TRAFFIC), 1.0)
    else:
        traffic = np.ones(len(tenants))
    # a tenant with no series at all has no traffic when others have data
    traffic = np.where(present, traffic, MIN_TRAFFIC if metrics else 1.0)

    with np.errstate(divide="ignore", invalid="ignore"):
        lat_ratio = p95 / p95_target
        hit_ratio = np.where(min_hit > 0.0, min_hit / np.maximum(hit, 1e-6), 0.0)
    hit_ratio = np.where(np.isnan(hit) | np.isnan(min_hit), np.nan, hit_ratio)
    worst = np.fmax(lat_ratio, hit_ratio)
    pressure = np.where(np.isnan(worst), 1.0, _pressure(np.nan_to_num(worst, nan=1.0)))
    miss = 1.0 - np.clip(hit, 0.0, 1.0)
    benefit = np.where(np.isnan(hit), 1.0, BENEFIT_FLOOR + (1.0 - BENEFIT_FLOOR) * miss)
    weights = _CLASS_WEIGHTS[classes] * traffic * pressure * benefit
    met: list[bool | None] = [None if math.isnan(w) else w <= 1.0 + 1e-9 for w in worst.tolist()]
    return weights, met


def _bounds(tenants: Sequence[TenantDemand], classes: IntArray) -> tuple[FloatArray, FloatArray]:
    """Floors and caps, made consistent (floors fit in capacity, cap >= floor)."""
    floors = np.clip(np.array([d.min_share for d in tenants], dtype=float), 0.0, 1.0)
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
    caps = np.clip(np.array([d.max_share for d in tenants], dtype=float), 0.0, 1.0)
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
    tenants: Sequence[TenantDemand], weights: FloatArray, classes: IntArray
) -> tuple[FloatArray, FloatArray, FloatArray]:
    """(targets, floors, caps) before smoothing: floors, then weight in class order."""
    floors, caps = _bounds(tenants, classes)
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
    return shares, floors, caps


def _trim_overbooking(shares: FloatArray, floors: FloatArray, classes: IntArray) -> None:
    """Bring the sum back to capacity by cutting slack above floors, BestEffort first."""
    excess = float(shares.sum()) - 1.0
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


def _to_bytes(shares: FloatArray, floors: FloatArray, capacity: int) -> list[int]:
    out: list[int] = np.floor(shares * capacity).astype(np.int64).clip(0).tolist()
    over = sum(out) - capacity
    if over > 0:  # floating-point rounding only: take it from the largest slack
        slack = np.asarray(out) - np.floor(floors * capacity)
        i = int(np.argmax(slack))
        out[i] = max(0, out[i] - over)
    return out


# --------------------------------------------------------------------------- API


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
    share in force (``None`` or missing tenants: no smoothing for them).
    """
    params = params or AllocationParams()
    tenants = tuple(tenants)
    if not tenants:
        return Allocation((), l1_capacity, l2_capacity, tenants, metrics)
    classes = np.array([_CLASS_INDEX[d.priority_class] for d in tenants], dtype=np.int64)
    weights, met = _weights(tenants, metrics, classes)
    targets, floors, caps = target_shares(tenants, weights, classes)

    shares = targets.copy()
    held = np.zeros(len(tenants), dtype=bool)
    if previous:
        prev = _floats([previous.get(d.name) for d in tenants])
        has_prev = ~np.isnan(prev)
        prev = np.clip(np.where(has_prev, prev, targets), floors, caps)
        delta = targets - prev
        inside = np.abs(delta) <= np.maximum(ABSOLUTE_DEADBAND, params.hysteresis * prev)
        moved = prev + params.smoothing * delta
        shares = np.where(has_prev, np.where(inside, prev, moved), targets)
        held = has_prev & inside & (np.abs(delta) > EPS)
        _trim_overbooking(shares, floors, classes)
        _refill(shares, targets)

    l1 = _to_bytes(shares, floors, l1_capacity)
    l2 = _to_bytes(shares, floors, l2_capacity)
    at_floor = (floors > 0.0) & (shares <= floors + EPS)
    at_cap = (caps < 1.0) & (shares >= caps - EPS)
    notes = np.where(at_floor, "floor", np.where(at_cap, "cap", np.where(held, "held", "")))
    out = tuple(
        map(
            TenantAllocation,
            [d.name for d in tenants],
            [d.priority_class for d in tenants],
            shares.tolist(),
            targets.tolist(),
            weights.tolist(),
            l1,
            l2,
            met,
            notes.tolist(),
        )
    )
    return Allocation(out, l1_capacity, l2_capacity, tenants, metrics)


def hold(
    tenants: Sequence[TenantDemand],
    previous: Mapping[str, float],
    l1_capacity: int,
    l2_capacity: int,
) -> Allocation:
    """Keep the shares in force (metrics unavailable), within the spec's current bounds.

    Tenants without a previous share get their floor; if the spec's bounds
    changed so that the kept shares overbook capacity, slack is trimmed as in
    :func:`allocate`.
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
    l2 = _to_bytes(shares, floors, l2_capacity)
    out = tuple(
        TenantAllocation(d.name, d.priority_class, s, s, 0.0, a, b, None, "held")
        for d, s, a, b in zip(tenants, shares.tolist(), l1, l2, strict=True)
    )
    return Allocation(out, l1_capacity, l2_capacity, tenants, {})


def quota_moves(
    previous: Mapping[str, float] | None, allocation: Allocation, min_change: float = EPS
) -> list[QuotaMove]:
    """Tenants whose share changed by more than ``min_change``, biggest move first."""
    prev = dict(previous or {})
    moves: list[QuotaMove] = []
    for i, t in enumerate(allocation.tenants):
        before = prev.pop(t.name, None)
        if before is None or abs(t.share - before) > min_change:
            moves.append(QuotaMove(t.name, before, t.share, allocation.reason(i)))
    moves.extend(QuotaMove(name, share, None, "tenant removed") for name, share in prev.items())

    def size(m: QuotaMove) -> float:
        return abs((m.after or 0.0) - (m.before or 0.0))

    moves.sort(key=size, reverse=True)
    return moves


def _pct(share: float | None) -> str:
    return "none" if share is None else f"{share:.1%}"


def describe_moves(moves: Iterable[QuotaMove], limit: int = 10) -> str:
    """A one-line Event message: who gained, who lost, and why."""
    gained, lost = [], []
    for m in moves:
        text = f"{m.name} {_pct(m.before)}->{_pct(m.after)} ({m.reason})"
        if (m.after or 0.0) >= (m.before or 0.0):
            gained.append(text)
        else:
            lost.append(text)
    parts = []
    if gained:
        more = f" and {len(gained) - limit} more" if len(gained) > limit else ""
        parts.append("gained: " + "; ".join(gained[:limit]) + more)
    if lost:
        more = f" and {len(lost) - limit} more" if len(lost) > limit else ""
        parts.append("lost: " + "; ".join(lost[:limit]) + more)
    return " | ".join(parts) if parts else "no change"
