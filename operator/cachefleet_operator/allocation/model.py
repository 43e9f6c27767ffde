"""What allocation reads: the tenants' demands and metrics, its parameters and constants."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from itertools import repeat

import numpy as np

from cachefleet_operator.allocation.arrays import _attr, _finite, _floats, _or_nan
from cachefleet_operator.curves import (
    CurveTable,
    FloatArray,
    HitCurve,
    IntArray,
    LatencyDist,
    LatencyTable,
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
