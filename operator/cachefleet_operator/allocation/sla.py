"""SLA weighting: how far each tenant is from its targets, the pressure that weights its
gain, and the words for what it meets or cannot."""

from __future__ import annotations

import math

import numpy as np

from cachefleet_operator.allocation.arrays import _finite, _or_none
from cachefleet_operator.allocation.columns import _Columns
from cachefleet_operator.allocation.model import (
    TenantDemand,
    TenantMetrics,
)
from cachefleet_operator.curves import (
    BoolArray,
    FloatArray,
    HitCurve,
    needed_hit_ratio_for,
)

#: observed/target below this counts as comfortably inside the SLA.
COMFORT_RATIO = 0.5
#: Pressure of a tenant comfortably inside every target (gives share back).
GIVE_BACK_PRESSURE = 0.5
#: Extra pressure per unit of shortfall above the target (p95 twice the target = 1 + GAIN).
SHORTFALL_GAIN = 2.0
#: Shortfall ratios are capped here so one broken tenant cannot take everything.
MAX_SHORTFALL_RATIO = 4.0


def _pressure_of(ratio: float) -> float:
    """Continuous pressure from observed/target (above 1 = target missed)."""
    if ratio <= COMFORT_RATIO:
        return GIVE_BACK_PRESSURE
    if ratio <= 1.0:
        # linear from GIVE_BACK_PRESSURE at COMFORT_RATIO to 1 at the target
        span = (ratio - COMFORT_RATIO) / (1.0 - COMFORT_RATIO)
        return GIVE_BACK_PRESSURE + (1.0 - GIVE_BACK_PRESSURE) * span
    return 1.0 + SHORTFALL_GAIN * (min(ratio, MAX_SHORTFALL_RATIO) - 1.0)


def _ratio(measured: float | None, target: float | None) -> float | None:
    """measured / target (None: either unknown)."""
    if measured is None or target is None or not math.isfinite(measured):
        return None
    return measured / target


def _slo_ratios(d: TenantDemand, m: TenantMetrics | None) -> tuple[float | None, float | None]:
    """(TTFT ratio, ITL ratio) of the model-answer targets; above 1 means missed."""
    if m is None:
        return None, None
    return _ratio(m.ttft_p95_s, d.ttft_target_s), _ratio(m.itl_p95_s, d.itl_target_s)


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
    known = [r for r in (*_sla_ratios(d, m), *_slo_ratios(d, m)) if r is not None]
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
    ttft, itl = _slo_ratios(d, m)
    for what, ratio, seen, target in (
        ("TTFT", ttft, m.ttft_p95_s, d.ttft_target_s),
        ("ITL", itl, m.itl_p95_s, d.itl_target_s),
    ):
        if ratio is not None and seen is not None and target is not None:
            rel = ">" if ratio > 1.0 else "<="
            parts.append(f"{what} p95 {seen:.3g}s {rel} target {target:.3g}s")
    if not parts:
        return "no SLA observations: share by traffic"
    worst = max(r for r in (lat, hit, ttft, itl) if r is not None)
    if worst > 1.0:
        prefix = "SLA missed"
    elif worst <= COMFORT_RATIO:
        prefix = "well within SLA"
    else:
        prefix = "SLA met"
    return f"{prefix}: " + ", ".join(parts)


def _pressure(ratio: FloatArray) -> FloatArray:
    """Vectorised :func:`_pressure_of`."""
    span = (ratio - COMFORT_RATIO) / (1.0 - COMFORT_RATIO)
    inside = GIVE_BACK_PRESSURE + (1.0 - GIVE_BACK_PRESSURE) * np.clip(span, 0.0, 1.0)
    above = 1.0 + SHORTFALL_GAIN * (np.minimum(ratio, MAX_SHORTFALL_RATIO) - 1.0)
    return np.where(ratio > 1.0, above, inside)


def _pressures(cols: _Columns) -> tuple[FloatArray, list[bool | None], BoolArray]:
    """SLA pressure (continuous, 1 at target), attainment (None: unknown), and who misses.

    Pressure and who misses read the targets cache size moves (p95, hit ratio);
    attainment reads every target stated, TTFT and ITL too.
    """
    p95, hit = cols.p95, cols.hit_ratio
    p95_target = _finite(cols.p95_target)
    min_hit = _finite(cols.min_hit)
    with np.errstate(divide="ignore", invalid="ignore"):
        lat_ratio = p95 / p95_target
        hit_ratio = np.where(min_hit > 0.0, min_hit / np.maximum(hit, 1e-6), 0.0)
    hit_ratio = np.where(np.isnan(hit) | np.isnan(min_hit), np.nan, hit_ratio)
    worst = np.fmax(lat_ratio, hit_ratio)
    pressure = np.where(np.isnan(worst), 1.0, _pressure(np.nan_to_num(worst, nan=1.0)))
    known = ~np.isnan(worst)
    within = worst <= 1.0 + 1e-9
    with np.errstate(divide="ignore", invalid="ignore"):
        judged = np.fmax(
            np.fmax(worst, cols.ttft / _finite(cols.ttft_target)),
            cols.itl / _finite(cols.itl_target),
        )
    met: list[bool | None] = _or_none(judged <= 1.0 + 1e-9, ~np.isnan(judged))
    return pressure, met, known & ~within


def needed_hit_ratio(d: TenantDemand, m: TenantMetrics) -> float | None:
    """The lowest hit ratio at which the tenant's SLA is predicted met (None: none is).

    ``minHitRatio`` directly; the p95 target through the hit/miss latency mix:
    with a share ``h`` of hits, the fraction of requests within the target is
    ``h * F_hit(t) + (1 - h) * F_miss(t)``, at least 0.95 from
    ``h = (0.95 - F_miss(t)) / (F_hit(t) - F_miss(t))`` on (see
    :func:`~cachefleet_operator.curves.needed_hit_ratio_for`).
    """
    need = d.min_hit_ratio or 0.0
    target = d.p95_target_s
    if target is None or m.miss_latency is None:
        return need
    for_p95 = needed_hit_ratio_for(target, m.hit_latency, m.miss_latency)
    return None if for_p95 is None else max(need, for_p95)


def fleet_hit_ratio(curve: HitCurve, observed: float | None, size: float) -> float:
    """The best hit ratio the fleet can reach: the curve's best plus what only the fleet adds.

    A curve is measured per pod: a key's first access on each pod counts as
    cold there, though L2 (shared by the fleet) may answer it. The observed
    hit ratio counts hits at every tier, fleet-wide; what it has above the
    curve's prediction at the size in force (``size`` L1 bytes per pod) is
    reuse only the fleet sees, and more L1 does not take it away.
    """
    if observed is None or not math.isfinite(observed):
        return curve.max_hit_ratio
    return min(1.0, curve.max_hit_ratio + max(0.0, observed - curve.at(size)))


def _why_not(
    p95_target_s: float | None,
    min_hit_ratio: float | None,
    miss_mean_s: float | None,
    cold_ratio: float,
    max_hit_ratio: float,
    fleet_wide: bool = False,
) -> str:
    """Why no cache size meets the tenant's SLA, in words (from an :data:`OutOfReach`; the
    fleet's numbers when it reuses more than one pod sees)."""
    where = " fleet-wide" if fleet_wide else ""
    goals = []
    if p95_target_s is not None:
        goals.append(f"p95 {p95_target_s:.3g} s")
    if min_hit_ratio:
        goals.append(f"hit ratio {min_hit_ratio:.2f}")
    goal = " and ".join(goals) or "its SLA"
    slow = ""
    if miss_mean_s is not None and p95_target_s is not None:
        slow = f", a miss takes {miss_mean_s:.3g} s on average"
    return (
        f"cache cannot meet its SLA: {cold_ratio:.0%} of its requests are first-time"
        f"{where} (at most {max_hit_ratio:.0%} hits at any size){slow}: "
        f"no cache size meets {goal}"
    )
