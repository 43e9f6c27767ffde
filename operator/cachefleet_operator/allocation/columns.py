"""Every tenant as columns (numpy arrays over all tenants, spec order), read once per allocation."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from cachefleet_operator.allocation.arrays import _attr, _numbers
from cachefleet_operator.allocation.model import (
    CLASS_ORDER,
    CLASS_WEIGHT,
    MetricsTable,
    PriorityClass,
    TenantDemand,
    TenantMetrics,
)
from cachefleet_operator.curves import (
    CurveTable,
    FloatArray,
    IntArray,
    LatencyTable,
)

_NO_METRICS = TenantMetrics()


#: What :class:`_Columns` reads of every :class:`TenantDemand` as numbers, in its order.
_SPEC_NUMBERS = (
    "min_share", "max_share", "p95_target_s", "min_hit_ratio", "min_rps",
    "ttft_target_s", "itl_target_s",
)  # fmt: skip


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
