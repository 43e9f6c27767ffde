"""What allocation returns: each tenant's row, the whole allocation, and the reasons in words."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import NamedTuple

import numpy as np

from cachefleet_operator.allocation.arrays import _or_none
from cachefleet_operator.allocation.model import (
    OutOfReach,
    PriorityClass,
    TenantDemand,
    TenantMetrics,
)
from cachefleet_operator.allocation.sla import _describe, _sla_ratios, _why_not
from cachefleet_operator.curves import (
    BoolArray,
    CurveTable,
    FloatArray,
    IntArray,
)


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


#: :attr:`TenantAllocation.note` values.
_NOTES = ("", "floor", "cap", "held")


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
