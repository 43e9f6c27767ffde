"""Allocation of cache capacity among tenants by measured gain, under SLA constraints (pure).

Input: the tenants of an InferenceCache (class, SLA, share bounds), their
observed metrics (p95 latency, hit ratio, request rate, and what makes the
allocation cache-aware: the miss-ratio curve the sidecars measure, and the
latency of hits and of misses) and the shares currently in force. Output:
a share of capacity per tenant, as L1 bytes per pod and L2 bytes, with a
reason for each. ``docs/allocation.md`` gives the model and its reasoning.

1. **Floors** (``minShare``; none for BestEffort) are reserved first.
2. **SLA feasibility**, in class order (Guaranteed, Standard, BestEffort),
   cheapest first within a class: the smallest share at which the predicted
   hit ratio (the tenant's curve) meets ``minHitRatio`` and the predicted
   p95 (the hit/miss latency mix at that hit ratio) meets the target. A
   tenant whose SLA no cache size meets (a flat curve, compulsory misses, a
   slow model server) keeps its floor and is reported (``cannot_meet``).
3. **Marginal utility**: the rest goes greedily to the largest gain per
   share: class weight x SLA pressure x request rate x upstream seconds per
   miss x hit-ratio gain, on the concave hull of each curve (so a working
   set that pays off only once it fits is seen), within ``maxShare``.

Targets in time to first token and inter-token latency (``ttftP95Seconds``,
``itlP95Seconds``) are judged with the others (attainment: ``sla_met``, the
reason, ``SLAViolated``) but move no share: they measure the model server's
answers, which cache size does not make faster (hits are not in them); the
remedy is more replicas (:mod:`~cachefleet_operator.pressure`).
4. **What nobody gains from** is spread by class weight over tenants that
   show reuse or have no curve yet; a tenant with no reuse holds its floor.
5. **Stability**: with shares in force, the allocation moves only when the
   predicted gain exceeds ``min_gain`` of the current utility (or an SLA
   that cache can meet is missed), and then by ``smoothing`` of the way,
   tenant shares within ``hysteresis`` held.

Without any metrics (first sight, Prometheus down on the first reconcile)
shares follow classes: floors, then the rest by class weight
(:func:`class_shares`).

Invariants (property-tested): shares and bytes never exceed capacity,
floors and caps always hold, a flat curve never earns more than its floor,
scaling every tenant's traffic by k changes nothing.
"""

from __future__ import annotations

import copy
import heapq
import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from itertools import repeat
from operator import attrgetter
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from cachefleet_operator.curves import (
    BoolArray,
    CurveTable,
    FloatArray,
    HitCurve,
    IntArray,
    LatencyDist,
    LatencyTable,
    interpolate,
    needed_hit_ratio_for,
)

#: EWMA weight of the newest target share (1 = no smoothing).
DEFAULT_SMOOTHING = 0.5
#: A share moves only if its target differs by more than this fraction of it.
DEFAULT_HYSTERESIS = 0.2
#: Shares move only when the predicted utility gain exceeds this fraction of the current one.
DEFAULT_MIN_GAIN = 0.005


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
#: A curve whose best hit ratio is below this shows no reuse.
NO_REUSE_HIT_RATIO = 0.001
#: Upstream seconds per miss assumed when no latency is known.
DEFAULT_MISS_COST_S = 1.0
#: A share change smaller than this (fraction of capacity) is never worth a move.
ABSOLUTE_DEADBAND = 0.001
#: Tolerance for floating-point comparisons of shares.
EPS = 1e-12
#: A share within this of the one in force is the one in force (float rounding).
SNAP = 1e-9


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
    #: p95 time to first token and inter-token latency targets (judged, move no share).
    ttft_target_s: float | None = None
    itl_target_s: float | None = None


@dataclass(frozen=True, slots=True)
class TenantMetrics:
    """A tenant's observed metrics over the query window (``None`` = no data)."""

    p95_s: float | None = None
    hit_ratio: float | None = None
    rps: float | None = None
    #: Hit ratio by L1 bytes per pod (the sidecars' reuse-distance histogram).
    curve: HitCurve | None = None
    #: Upstream seconds of a miss.
    miss_latency: LatencyDist | None = None
    #: Latency of a hit (L1 and L2).
    hit_latency: LatencyDist | None = None
    #: Hit ratio by the bytes of one cache the fleet shares (the operator's replay of
    #: the fleet samples, :mod:`cachefleet_operator.fleet`): L2 sizes and reach.
    fleet_curve: HitCurve | None = None
    #: p95 time to first token and inter-token latency of model answers (not hits).
    ttft_p95_s: float | None = None
    itl_p95_s: float | None = None


class MetricsTable(Mapping[str, TenantMetrics]):
    """Every tenant's metrics as columns, built once where they are read; a mapping too.

    What :func:`allocate` reads, as arrays: the numbers, the curves
    (:class:`~cachefleet_operator.curves.CurveTable`), the latency histograms
    (:class:`~cachefleet_operator.curves.LatencyTable`), and the fleet curves.
    A metrics source returns one, so an allocation among thousands of tenants
    takes its rows by tenant name rather than reading thousands of objects.
    As a mapping, tenant -> :class:`TenantMetrics` (the objects it was built
    from), for everything that reads one tenant (status, reasons, tests).
    """

    def __init__(self, metrics: Mapping[str, TenantMetrics]) -> None:
        #: The objects given (None: built from columns, each tenant's made on demand).
        self._given: dict[str, TenantMetrics] | None = dict(metrics)
        ms = list(self._given.values())
        self._set_names(list(self._given))
        # one NaN more at the end: the row of a tenant without metrics (index -1)
        self.p95 = _floats([*_attr(ms, "p95_s"), None])
        self.hit_ratio = _floats([*_attr(ms, "hit_ratio"), None])
        self.rps = _floats([*_attr(ms, "rps"), None])
        self.ttft = _floats([*_attr(ms, "ttft_p95_s"), None])
        self.itl = _floats([*_attr(ms, "itl_p95_s"), None])
        self.curves = CurveTable(_attr(ms, "curve"))
        self.misses = LatencyTable(_attr(ms, "miss_latency"))
        self.hits = LatencyTable(_attr(ms, "hit_latency"))
        fleet: list[HitCurve | None] = _attr(ms, "fleet_curve")
        #: None when no tenant has a fleet curve (the common case).
        self.fleet = CurveTable(fleet) if any(fleet) else None

    def _set_names(self, names: list[str]) -> None:
        self.names = names
        self._row = dict(zip(names, range(len(names)), strict=True))
        self._views: dict[str, TenantMetrics] = {}

    @classmethod
    def from_columns(
        cls,
        names: list[str],
        numbers: tuple[FloatArray, FloatArray, FloatArray],
        curves: CurveTable,
        misses: LatencyTable,
        hits: LatencyTable,
        tokens: tuple[FloatArray, FloatArray] | None = None,
    ) -> MetricsTable:
        """From columns, rows in ``names``' order: (p95, hit ratio, rate) with NaN where
        unknown, the curves, the miss and hit latency histograms, and (TTFT p95, ITL p95)."""
        out = object.__new__(cls)
        out._given = None
        out._set_names(names)
        out.p95, out.hit_ratio, out.rps = (_finite(np.append(c, np.nan)) for c in numbers)
        if tokens is None:
            tokens = (np.full(len(names), np.nan), np.full(len(names), np.nan))
        out.ttft, out.itl = (_finite(np.append(c, np.nan)) for c in tokens)
        out.curves, out.misses, out.hits, out.fleet = curves, misses, hits, None
        return out

    @classmethod
    def of(cls, metrics: Mapping[str, TenantMetrics]) -> MetricsTable:
        """``metrics`` as a table (itself when it is one)."""
        return metrics if isinstance(metrics, MetricsTable) else cls(metrics)

    def with_fleet(self, curves: Mapping[str, HitCurve]) -> MetricsTable:
        """These metrics with the tenants' fleet curves (tenants not in ``curves``: unchanged)."""
        out = copy.copy(self)
        if not curves:
            return out
        out._views = {}
        if self._given is not None:
            out._given = {
                name: replace(m, fleet_curve=curves[name]) if name in curves else m
                for name, m in self._given.items()
            }
        fleet = list(map(curves.get, self.names))
        if self.fleet is not None:  # the ones the new curves do not replace
            fleet = [self.fleet.curve(i) if c is None else c for i, c in enumerate(fleet)]
        out.fleet = CurveTable(fleet) if any(fleet) else None
        return out

    def with_fleet_rows(self, names: Sequence[str], table: CurveTable) -> MetricsTable:
        """These metrics with fleet curves as a table whose rows are ``names``' (as
        :meth:`~cachefleet_operator.fleet.FleetCurves.table` gives them); what
        :meth:`with_fleet` does with their curves, without a curve object per tenant."""
        if self._given is not None or self.fleet is not None:
            found = zip(names, map(table.curve, range(len(names))), strict=True)
            return self.with_fleet({name: curve for name, curve in found if curve is not None})
        out = copy.copy(self)
        out._views = {}
        row = dict(zip(names, range(len(names)), strict=True))
        taken = table.take(np.fromiter(map(row.get, self.names, repeat(-1)), np.int64, len(self)))
        out.fleet = taken if taken.present.any() else None
        return out

    def rows_of(self, names: Sequence[str]) -> IntArray:
        """Each name's row (-1: no metrics)."""
        found = map(self._row.get, names, repeat(-1))
        return np.fromiter(found, dtype=np.int64, count=len(names))

    def __getitem__(self, name: str) -> TenantMetrics:
        if self._given is not None:
            return self._given[name]
        view = self._views.get(name)
        if view is None:
            i = self._row[name]
            p95, hit, rps = (float(c[i]) for c in (self.p95, self.hit_ratio, self.rps))
            view = self._views[name] = TenantMetrics(
                None if math.isnan(p95) else p95,
                None if math.isnan(hit) else hit,
                None if math.isnan(rps) else rps,
                self.curves.curve(i),
                self.misses.dist(i),
                self.hits.dist(i),
                None if self.fleet is None else self.fleet.curve(i),
                _or_nan(self.ttft[i]),
                _or_nan(self.itl[i]),
            )
        return view

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self._row

    def __repr__(self) -> str:
        return f"MetricsTable({dict(self)!r})"


@dataclass(frozen=True, slots=True)
class AllocationParams:
    """Tuning of the allocation; defaults match the CRD's defaults."""

    smoothing: float = DEFAULT_SMOOTHING
    hysteresis: float = DEFAULT_HYSTERESIS
    min_gain: float = DEFAULT_MIN_GAIN


#: A tenant no cache size brings to its SLA: what the words about it are made of, numbers
#: only (p95 target, minHitRatio, mean miss seconds, cold ratio, best hit ratio of the
#: curve, whether those two are the fleet curve's; None: not set or not known), so that
#: thousands of them hold on to nothing else.
OutOfReach = tuple[float | None, float | None, float | None, float, float, bool]


class TenantAllocation(NamedTuple):
    """One tenant's result; ``note`` is ``floor``, ``cap``, ``held`` or empty.

    ``cannot_meet`` says why no share within bounds meets the tenant's SLA
    (empty when one does, or when nothing is known); ``predicted_hit_ratio``
    is the curve's hit ratio at the share (None without a curve).
    ``why_not`` is what ``cannot_meet`` is worded from: the words, or what
    they are made of when no cache size reaches the SLA (worded on demand:
    with thousands of tenants out of reach, wording them all would cost more
    than allocating).
    """

    name: str
    priority_class: PriorityClass
    share: float
    target: float
    weight: float
    l1_bytes: int
    l2_bytes: int
    sla_met: bool | None
    note: str
    why_not: str | OutOfReach = ""
    predicted_hit_ratio: float | None = None

    @property
    def cannot_meet(self) -> str:
        why = self.why_not
        return why if isinstance(why, str) else _why_not(*why)

    @property
    def beyond_any_size(self) -> bool:
        """No cache size reaches the SLA on the tenant's curve (not a matter of bounds)."""
        return not isinstance(self.why_not, str)


class Allocation:
    """The whole result; ``tenants`` in spec order.

    :func:`allocate` computes columns (one array or list per field, over all
    tenants); the rows (:class:`TenantAllocation`) are made from them when
    first read, and reasons are worded on demand (:meth:`reason`): both are
    for quotas, status and Events, not for the allocation itself. (For
    10,000 tenants, making the rows and the garbage collections that walk
    them take about half as long as the allocation.)
    """

    __slots__ = ("_columns", "_rows", "demands", "l1_capacity", "l2_capacity", "metrics")

    def __init__(
        self,
        tenants: Sequence[TenantAllocation] | _Result,
        l1_capacity: int,
        l2_capacity: int,
        demands: tuple[TenantDemand, ...] = (),
        metrics: Mapping[str, TenantMetrics] | None = None,
    ) -> None:
        self._columns = tenants if isinstance(tenants, _Result) else None
        self._rows = None if isinstance(tenants, _Result) else tuple(tenants)
        self.l1_capacity = l1_capacity
        self.l2_capacity = l2_capacity
        self.demands = demands
        self.metrics: Mapping[str, TenantMetrics] = {} if metrics is None else metrics

    @property
    def tenants(self) -> tuple[TenantAllocation, ...]:
        """Every tenant's row, in spec order (made once, when first read)."""
        if self._rows is None:
            assert self._columns is not None
            self._rows = self._columns.rows()
        return self._rows

    def _key(self) -> tuple[object, ...]:
        return (self.tenants, self.l1_capacity, self.l2_capacity, self.demands, self.metrics)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Allocation) and self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"Allocation(tenants={self.tenants!r}, l1_capacity={self.l1_capacity!r}, "
            f"l2_capacity={self.l2_capacity!r})"
        )

    def shares(self) -> dict[str, float]:
        if self._rows is None and self._columns is not None:  # without making the rows
            return dict(zip(self._columns.names, self._columns.shares.tolist(), strict=True))
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
            text += f"; held (target {t.target:.1%}: gain below threshold)"
        if t.predicted_hit_ratio is not None:
            text += f"; predicted hit ratio {t.predicted_hit_ratio:.2f}"
        if m is not None and m.fleet_curve is not None and m.fleet_curve.requests > 0:
            fleet = m.fleet_curve.at(t.l2_bytes)
            text += f"; fleet-wide with its L2 {fleet:.2f}"
        if t.cannot_meet and not t.sla_met:  # a tenant meeting its SLA is not told it cannot
            text += f"; {t.cannot_meet}"
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


_NO_METRICS = TenantMetrics()
#: :attr:`TenantAllocation.note` values.
_NOTES = ("", "floor", "cap", "held")


def _attr(items: Iterable[object], name: str | attrgetter[Any]) -> list[Any]:
    """``[item.<name> for item in items]``, without a Python step per item."""
    return list(map(attrgetter(name) if isinstance(name, str) else name, items))


#: What :class:`_Columns` reads of every :class:`TenantDemand` as numbers, in its order.
_SPEC_NUMBERS = (
    "min_share", "max_share", "p95_target_s", "min_hit_ratio", "min_rps",
    "ttft_target_s", "itl_target_s",
)  # fmt: skip


def _numbers(items: Iterable[object], name: str) -> FloatArray:
    """The attribute ``name`` of every item as floats, ``None`` as NaN."""
    values = _attr(items, name)
    try:  # without a None, the same floats without numpy's look at every item's type first
        return np.fromiter(values, dtype=np.float64, count=len(values))
    except TypeError:  # a None
        return np.array(values, dtype=np.float64)


def _floats(values: list[float | None]) -> FloatArray:
    """An array with ``None`` and non-finite values as NaN."""
    out = np.array(values, dtype=np.float64)
    out[~np.isfinite(out)] = np.nan
    return out


def _or_none(values: npt.NDArray[Any], keep: BoolArray) -> list[Any]:
    """The values as Python objects where ``keep``, None elsewhere."""
    out = np.full(values.shape, None, dtype=object)
    out[keep] = values[keep]
    return out.tolist()  # type: ignore[no-any-return]


def _or_nan(value: np.float64) -> float | None:
    """A column's value as a float, None for NaN."""
    out = float(value)
    return None if math.isnan(out) else out


def _finite(values: FloatArray) -> FloatArray:
    """A copy with non-finite values as NaN."""
    out = values.copy()
    out[~np.isfinite(out)] = np.nan
    return out


_CLASS_INDEX = {cls: n for n, cls in enumerate(CLASS_ORDER)}
_CLASS_WEIGHTS = np.array([CLASS_WEIGHT[cls] for cls in CLASS_ORDER])


@dataclass(frozen=True, slots=True)
class _Columns:
    """The tenants' spec and metrics as columns (spec order), read once per allocation.

    Numbers are arrays with ``None`` and every non-finite value as NaN
    (``min_share``... as given); curves and histograms are tables whose
    rows are the tenants'.
    """

    tenants: tuple[TenantDemand, ...]
    names: list[str]
    priority_classes: list[PriorityClass]
    classes: IntArray
    min_share: FloatArray
    max_share: FloatArray
    p95_target: FloatArray
    min_hit: FloatArray
    min_rps: FloatArray
    #: TTFT and ITL targets (judged, move no share).
    ttft_target: FloatArray
    itl_target: FloatArray
    #: Every tenant's row in ``metrics`` (-1: none), and the metrics.
    rows: IntArray
    metrics: MetricsTable
    p95: FloatArray
    hit_ratio: FloatArray
    rps: FloatArray
    curves: CurveTable
    misses: LatencyTable
    hits: LatencyTable
    #: None when no tenant has a fleet curve.
    fleet: CurveTable | None
    #: Observed TTFT and ITL p95.
    ttft: FloatArray
    itl: FloatArray

    @classmethod
    def of(
        cls, tenants: tuple[TenantDemand, ...], metrics: Mapping[str, TenantMetrics]
    ) -> _Columns:
        names = _attr(tenants, "name")
        priority = _attr(tenants, "priority_class")
        # the spec's numbers: one array per attribute, None as NaN
        numbers = [_numbers(tenants, name) for name in _SPEC_NUMBERS]
        table = MetricsTable.of(metrics)
        rows = table.rows_of(names)
        return cls(
            tenants,
            names,
            priority,
            np.fromiter(map(_CLASS_INDEX.__getitem__, priority), dtype=np.int64, count=len(names)),
            numbers[0],
            numbers[1],
            numbers[2],
            numbers[3],
            numbers[4],
            numbers[5],
            numbers[6],
            rows,
            table,
            table.p95[rows],
            table.hit_ratio[rows],
            table.rps[rows],
            table.curves.take(rows),
            table.misses.take(rows),
            table.hits.take(rows),
            None if table.fleet is None else table.fleet.take(rows),
            table.ttft[rows],
            table.itl[rows],
        )


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


#: Bisection steps of :func:`_fill_level` (over a 1e12 range of levels: 2.6e-5 apart).
FILL_LEVEL_STEPS = 20
#: How far (log of the level) :func:`_fill_level` looks on either side of its estimate when
#: the estimate's bracket misses the level: each a full pass over every row.
_LEVEL_WIDENING = (1e-4, 1e-2, 1.0)


def _prefixes(counts: IntArray, width: int) -> BoolArray:
    """``np.arange(width) < counts[:, None]`` (every count in 0..width): each row copied
    from a table of the width + 1 such rows, not compared column by column (numpy
    compares short rows broadcast against a column at a tenth of the speed)."""
    table = np.arange(width) < np.arange(width + 1)[:, None]
    out: BoolArray = np.take(table, counts, axis=0)
    return out


class _Level(NamedTuple):
    """Every row's share and choice at one level (its log), and whether their total fits."""

    at: float
    shares: FloatArray
    picks: IntArray
    fits: bool


def _fill_level(
    table: CurveTable, values: FloatArray, lo: FloatArray, hi: FloatArray, capacity: int
) -> FloatArray:
    """:func:`_fill`'s shares."""
    return _fill(table, values, lo, hi, capacity)[0]


def _fill(
    table: CurveTable, values: FloatArray, lo: FloatArray, hi: FloatArray, capacity: int
) -> tuple[FloatArray, tuple[BoolArray, float] | None]:
    """Shares from ``lo`` (up to ``hi``) at the lowest utility level that still fits, and
    what it tells :func:`_greedy` (its ``within``; None: nothing).

    At a level λ (utility per share) each tenant takes the curve point (or
    ``lo`` or ``hi``) maximising ``value · hit - λ · share``: the vertices of
    its concave hull whose segments are steeper than λ. The greedy grants
    hull segments steepest first, so the shares at the lowest λ whose total
    fits (found by bisection, all tenants at once) are what it would have
    granted before the first segment that no longer fits; :func:`_greedy`
    finishes from there in a few steps instead of one per segment.

    The bisection's path (its levels are midpoints, each decided by whether
    the total fits) is fixed by where the total first fits, and the total
    only falls as the level rises. So an estimate of that level from every
    tenant's hull segments (:class:`_Segments`) predicts the path; the two
    ends of its last bracket are computed exactly, and every decision on the
    path follows from them. Where the estimate misses, each level still
    undecided is computed exactly, each tenant only between its choices at
    the nearest levels known on either side. The shares are those of
    computing every level of the path over every tenant, bit for bit
    (tested against such a full scan). A tenant whose choice is the same at
    a lower level known (exactly) takes there what it takes at the level
    found: none of its extensions from it is steeper than that lower level,
    which the greedy is told (the tenants whose choice moves, and that level).
    """
    cap = float(capacity)
    rows, width = table.rows, table.xs.shape[1]
    # the candidates: each row's sizes strictly between lo and hi (ascending: a run of
    # columns, first to last - 1)
    if table.shared_xs is not None:
        row = table.shared_xs / cap
        xs = np.broadcast_to(row, table.xs.shape)
        first = np.searchsorted(row, lo, side="right")
        last = np.searchsorted(row, hi, side="left")
    else:
        xs = table.xs / cap
        first = np.count_nonzero(xs <= lo[:, None], axis=1)
        last = np.count_nonzero(xs < hi[:, None], axis=1)
    outside = _prefixes(first, width) | ~_prefixes(last, width)
    # values x hit ratio of every candidate, the part of each score no level changes
    gains = values[:, None] * table.ys
    gains[outside] = -np.inf  # never chosen
    at_lo, at_hi = table.at(lo * cap), table.at(hi * cap)
    gain_lo, gain_hi = values * at_lo, values * at_hi
    flat_gains = gains.ravel()
    # one matrix for the scores, the chords and the steps (C order: read flat too)
    work = np.empty(gains.shape)

    def size(at: IntArray, col: IntArray) -> FloatArray:
        """The sizes of rows ``at`` in columns ``col``."""
        return row[col] if table.shared_xs is not None else xs[at, col]

    def choose(
        level: float, at: IntArray, inner: FloatArray, col: IntArray
    ) -> tuple[FloatArray, IntArray]:
        """(shares, choices) of rows ``at`` from their best column's score and index: -1
        for ``lo``, the column, or ``width`` for ``hi``, whichever scores best (first on
        ties)."""
        best_lo = gain_lo[at] - level * lo[at]
        best_hi = gain_hi[at] - level * hi[at]
        to_lo = ~(inner > best_lo)
        to_hi = best_hi > np.maximum(best_lo, inner)
        got = np.where(to_hi, hi[at], np.where(to_lo, lo[at], size(at, col)))
        return got, np.where(to_hi, width, np.where(to_lo, -1, col))

    def take_every(level: float) -> tuple[FloatArray, IntArray]:
        """Every row's (share, choice) at ``level``, scoring every column."""
        # (one row of sizes when shared: no matrix of them)
        scaled = level * (row if table.shared_xs is not None else xs)
        score = np.subtract(gains, scaled, out=work)
        k = np.argmax(score, axis=1)  # the first best: the smallest share on a tie
        return choose(level, rows, score[rows, k], k)

    def take(level: float, at: IntArray, lower: IntArray, upper: IntArray, into: _Level) -> None:
        """Rows ``at``'s shares and choices at ``level`` into ``into``'s arrays, scoring
        each row's columns ``lower`` to ``upper`` only (all rows' cells in one flat array),
        or every cell while most rows still move (gathering would cost more)."""
        spans = upper - lower + 1
        total = int(spans.sum())
        if total == 0:
            return
        if 2 * total > gains.size:
            every, their = take_every(level)
            into.shares[at], into.picks[at] = every[at], their[at]
            return
        starts = np.cumsum(spans) - spans
        cols = np.repeat(lower - starts, spans) + np.arange(total)
        owners = np.repeat(at, spans)
        score = flat_gains[owners * width + cols] - level * size(owners, cols)
        best = np.maximum.reduceat(score, starts)
        # the first best of each row (as argmax: the smallest share on a tie)
        found = np.flatnonzero(score == np.repeat(best, spans))
        col = cols[found[np.searchsorted(found, starts)]]
        into.shares[at], into.picks[at] = choose(level, at, best, col)

    #: Levels computed exactly so far, by level.
    known: list[_Level] = []

    def evaluate(at: float) -> _Level:
        """Every row at level ``exp(at)``, exactly. A tenant's choice only moves to smaller
        shares as the level rises: one that takes the same at the nearest known levels on
        either side takes it in between, and the others take a column between those two
        levels' (-1 and width: lo and hi, which are always weighed)."""
        below = [k for k in known if k.at < at]
        above = [k for k in known if k.at > at]
        level = math.exp(at)
        if below and above:
            under, over = below[-1], above[0]
            moving = np.flatnonzero(under.picks != over.picks)
            found = _Level(at, over.shares.copy(), over.picks.copy(), False)
            lower = np.maximum(over.picks[moving], 0)
            take(level, moving, lower, np.minimum(under.picks[moving], width - 1), found)
        else:
            shares, picks = take_every(level)
            found = _Level(at, shares, picks, False)
        found = found._replace(fits=float(found.shares.sum()) <= 1.0)
        known.insert(len(below), found)
        return found

    def fits(at: float) -> bool:
        """Whether the total fits at level ``exp(at)``: from the known levels where they
        decide it, else computed."""
        for k in known:
            if (k.fits and k.at <= at) or (not k.fits and k.at >= at):
                return k.fits
        return evaluate(at).fits

    with np.errstate(invalid="ignore", divide="ignore"):
        slopes = values * (np.maximum(at_hi, table.max_hit) - at_lo) / np.maximum(hi - lo, EPS)
    top = float(np.max(slopes, initial=0.0))
    if top <= 0.0 or not math.isfinite(top):
        return lo, None
    # (in logs where a tiny top's 1e-12 would underflow)
    bottom = math.log(top * 1e-12) if top * 1e-12 > 0.0 else math.log(top) + math.log(1e-12)
    high, low = math.log(top * 2.0), bottom
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        # each candidate's chord from ``lo`` (-inf elsewhere)
        chords = np.subtract(gains, gain_lo[:, None], out=work)
        chords /= xs - lo[:, None]
    chords[outside] = -np.inf
    reach = np.argmax(chords, axis=1)  # the first steepest chord's candidate
    chord = chords[rows, reach]
    with np.errstate(invalid="ignore"):  # (each row's steepest chord: the one argmax found)
        steepest = np.fmax(np.maximum(chord, 0.0), slopes)

    def keeps_lo() -> float:
        """A level where every tenant keeps ``lo``: twice the steepest step from it (the top
        of the bracket when a curve is steeper near ``lo`` than its chord to its best)."""
        return math.log(2.0 * float(np.nanmax(steepest, initial=top)))

    def bracket(decide: Callable[[float], bool]) -> tuple[float, float] | None:
        """The bisection's last bracket (its low and high ends, as logs) with the
        decisions ``decide`` makes; None where the lowest level fits."""
        if decide(low):
            return None
        lower, upper = low, high if decide(high) else keeps_lo()
        for _ in range(FILL_LEVEL_STEPS):
            mid = (upper + lower) / 2.0
            if decide(mid):
                upper = mid
            else:
                lower = mid
        return lower, upper

    segments = _Segments(gains, xs, reach, chord, lo, work)
    guess = segments.guess(1.0 - float(lo.sum()))
    if math.isfinite(guess):
        predicted = bracket(lambda at: at >= guess)
        for at in (low,) if predicted is None else predicted:
            evaluate(at)
        for step in _LEVEL_WIDENING:  # the estimate missed: known levels on either side
            fitting = [k.fits for k in known]
            if all(fitting) == any(fitting):
                evaluate(guess - step if all(fitting) else guess + step)
    end = bracket(fits)
    at = low if end is None else end[1]
    found = next((k for k in known if k.at == at), None) or evaluate(at)
    under = [k for k in known if k.at < at]
    if end is None or not under:
        return found.shares, None
    return found.shares, (under[-1].picks != found.picks, math.exp(under[-1].at))


class _Segments:
    """Every tenant's hull, as segments, for an estimate of the level at which the shares of
    :func:`_fill_level` fit.

    A tenant's segments: the chord from ``lo`` to its steepest point (``reach``, with
    slope ``chord``), then from point to point up to its last candidate (``gains`` is
    -inf past it); a segment is taken at every level below its slope. Exact where a
    curve is concave past its steepest chord (but for rounding).
    """

    def __init__(
        self,
        gains: FloatArray,
        xs: FloatArray,
        reach: IntArray,
        chord: FloatArray,
        lo: FloatArray,
        work: FloatArray,
    ) -> None:
        n, width = gains.shape
        steps = work[:, : width - 1]
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            gaps = np.diff(xs[:1] if xs.strides[0] == 0 else xs, axis=1)  # a row when shared
            # every neighbours' difference in one run over the flat matrices (-inf - -inf:
            # outside); the one across the end of each row falls outside ``steps``
            flat = gains.reshape(-1)
            np.subtract(flat[1:], flat[:-1], out=work.reshape(-1)[:-1])
            steps /= gaps
        # segment k (ending at column k + 1) from k = reach on; one ending past the last
        # candidate is never steeper than a level (-inf - x is -inf, -inf - -inf NaN)
        self.after = ~_prefixes(reach, width - 1)
        self.steps, self.gaps = steps, np.broadcast_to(gaps, steps.shape)
        with np.errstate(invalid="ignore"):
            chorded = (chord > 0.0) & np.isfinite(chord)
        self.chord = chord[chorded]
        self.reached = (xs[np.arange(n), reach] - lo)[chorded]

    def around(self, lower: float, upper: float) -> tuple[float, FloatArray, FloatArray]:
        """The width of every segment steeper than ``upper``, and the (slopes, widths) of
        those with a slope in (lower, upper]: one look at every segment."""
        with np.errstate(invalid="ignore"):
            steeper = (self.steps > upper) & self.after
            inside = (self.steps > lower) & self.after & ~steeper
        chords = (self.chord > lower) & (self.chord <= upper)
        taken = float(np.sum(self.gaps, where=steeper)) + float(
            self.reached[self.chord > upper].sum()
        )
        slopes = np.concatenate([self.steps[inside], self.chord[chords]])
        widths = np.concatenate([self.gaps[inside], self.reached[chords]])
        return taken, slopes, widths

    def guess(self, need: float) -> float:
        """The log of the slope of the segment whose taking makes the widths taken exceed
        ``need``, segments taken steepest first (+inf: ``need`` < 0; the last one's when
        none does)."""
        if need < 0.0:
            return math.inf
        # where a sample of the rows overflows, then every segment near that
        step = max(1, self.steps.shape[0] // _GUESS_SAMPLE)
        sample = _Segments.__new__(_Segments)
        sample.steps, sample.gaps = self.steps[::step], self.gaps[::step]
        sample.after = self.after[::step]
        sample.chord, sample.reached = self.chord[::step], self.reached[::step]
        near = _overflowing(*sample.around(0.0, math.inf)[1:], need / step, 0.0)
        for spread in _GUESS_SPREADS:
            taken, slopes, widths = self.around(near / spread, near * spread)
            if taken > need or taken + float(widths.sum()) <= need:
                continue
            return math.log(_overflowing(slopes, widths, need, taken))
        _, slopes, widths = self.around(0.0, math.inf)
        if float(widths.sum()) <= need:
            return -math.inf
        return math.log(_overflowing(slopes, widths, need, 0.0))


#: Rows :meth:`_Segments.guess` reads first, to estimate where to look among all.
_GUESS_SAMPLE = 500
#: How far (a factor of the slope) :meth:`_Segments.guess` looks around the sample's
#: estimate, in turn, before it looks at every segment.
_GUESS_SPREADS = (1.05, 1.3, 3.0)


def _overflowing(slopes: FloatArray, widths: FloatArray, need: float, taken: float) -> float:
    """The slope of the segment whose taking makes ``taken`` plus the widths taken exceed
    ``need``, steepest first (the last one when none does)."""
    if slopes.size == 0:
        return 1.0
    order = np.argsort(-slopes)  # (ties in any order: the same slope)
    k = int(np.searchsorted(taken + np.cumsum(widths[order]), need, side="right"))
    return float(slopes[order[min(k, order.size - 1)]])


def _rounded(values: FloatArray, keep: BoolArray) -> list[float | None]:
    """``round(value, 4)`` where ``keep``, else None, as Python rounds (without a call per value).

    ``rint(v * 1e4) / 1e4`` is the double nearest the same multiple of 1e-4
    as Python's ``round``, except where ``v * 1e4`` is within its rounding
    of a half: those few are rounded by Python.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = values * 1e4
        near_half = np.abs(scaled - np.floor(scaled) - 0.5) < 1e-6
    out: list[float | None] = _or_none(np.rint(scaled) / 1e4, keep)
    huge = ~(np.abs(scaled) < 1e15)  # or not finite
    for i in np.flatnonzero(keep & (near_half | huge)).tolist():
        out[i] = round(float(values[i]), 4)
    return out


def _to_bytes(shares: FloatArray, floors: FloatArray, capacity: int) -> list[int]:
    out: list[int] = np.floor(shares * capacity).astype(np.int64).clip(0).tolist()
    over = sum(out) - capacity
    if over > 0:  # floating-point rounding only: take it from the largest slack
        slack = np.asarray(out) - np.floor(floors * capacity)
        i = int(np.argmax(slack))
        out[i] = max(0, out[i] - over)
    return out


# --------------------------------------------------------------------------- API


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


class _Beyond(NamedTuple):
    """The tenants (``rows``) whose SLA no cache size meets, with what their
    :data:`OutOfReach` is made of (NaN, or ``miss_known`` False: not set or not known)."""

    rows: IntArray
    p95_target: FloatArray
    min_hit: FloatArray
    miss_mean: FloatArray
    miss_known: BoolArray
    cold: FloatArray
    best: FloatArray
    fleet_wide: BoolArray

    def why_not(self) -> list[OutOfReach]:
        return list(
            zip(
                _or_none(self.p95_target, ~np.isnan(self.p95_target)),
                _or_none(self.min_hit, ~np.isnan(self.min_hit)),
                _or_none(self.miss_mean, self.miss_known),
                self.cold.tolist(),
                self.best.tolist(),
                self.fleet_wide.tolist(),
                strict=True,
            )
        )


@dataclass(frozen=True, slots=True)
class _Result:
    """An allocation's columns (spec order), from which :attr:`Allocation.tenants` is made."""

    names: list[str]
    priority_classes: list[PriorityClass]
    shares: FloatArray
    targets: FloatArray
    weights: FloatArray
    l1: list[int]
    l2: list[int]
    met: list[bool | None]
    #: Each row's index in :data:`_NOTES`.
    notes: IntArray
    cannot_meet: list[str]
    beyond: _Beyond | None
    #: The curves, read at each share for the predicted hit ratios of the rows ``measured``.
    table: CurveTable
    measured: BoolArray
    l1_capacity: int

    def rows(self) -> tuple[TenantAllocation, ...]:
        why: list[str | OutOfReach] = list(self.cannot_meet)
        if self.beyond is not None:
            for i, out_of_reach in zip(
                self.beyond.rows.tolist(), self.beyond.why_not(), strict=True
            ):
                why[i] = out_of_reach
        predicted = _rounded(self.table.at(self.shares * self.l1_capacity), self.measured)
        # tuple.__new__ over rows: what TenantAllocation._make does, without a call per tenant
        return tuple(
            map(
                tuple.__new__,
                repeat(TenantAllocation),
                zip(
                    self.names,
                    self.priority_classes,
                    self.shares.tolist(),
                    self.targets.tolist(),
                    self.weights.tolist(),
                    self.l1,
                    self.l2,
                    self.met,
                    list(map(_NOTES.__getitem__, self.notes.tolist())),
                    why,
                    predicted,
                    strict=True,
                ),
            )
        )


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
