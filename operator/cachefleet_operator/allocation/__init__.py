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

The package's modules, in the order of the steps: :mod:`.model` (the
inputs, parameters and constants), :mod:`.columns` (the tenants as arrays),
:mod:`.sla` (the SLA weighting and its words), :mod:`.shares` (floors, caps,
class weights, the bounded step), :mod:`.greedy` (SLA feasibility and the
greedy by gain), :mod:`.level` (the fill by gain at one level, all tenants at
once), :mod:`.l2` (the L2 split), :mod:`.result` (the rows and reasons),
:mod:`.allocate` (the entry points) and :mod:`.moves` (the explanation of a
reallocation). What is imported here is the public surface.
"""

from cachefleet_operator.allocation.allocate import allocate, hold
from cachefleet_operator.allocation.model import (
    ABSOLUTE_DEADBAND,
    CLASS_ORDER,
    CLASS_WEIGHT,
    DEFAULT_HYSTERESIS,
    DEFAULT_MIN_GAIN,
    DEFAULT_MISS_COST_S,
    DEFAULT_SMOOTHING,
    EPS,
    NO_REUSE_HIT_RATIO,
    SNAP,
    AllocationParams,
    MetricsTable,
    OutOfReach,
    PriorityClass,
    TenantDemand,
    TenantMetrics,
)
from cachefleet_operator.allocation.moves import describe_moves, quota_moves
from cachefleet_operator.allocation.result import Allocation, QuotaMove, TenantAllocation
from cachefleet_operator.allocation.shares import class_shares, target_shares
from cachefleet_operator.allocation.sla import (
    COMFORT_RATIO,
    GIVE_BACK_PRESSURE,
    MAX_SHORTFALL_RATIO,
    SHORTFALL_GAIN,
    fleet_hit_ratio,
    needed_hit_ratio,
    sla_met,
)

__all__ = [
    "ABSOLUTE_DEADBAND",
    "CLASS_ORDER",
    "CLASS_WEIGHT",
    "COMFORT_RATIO",
    "DEFAULT_HYSTERESIS",
    "DEFAULT_MIN_GAIN",
    "DEFAULT_MISS_COST_S",
    "DEFAULT_SMOOTHING",
    "EPS",
    "GIVE_BACK_PRESSURE",
    "MAX_SHORTFALL_RATIO",
    "NO_REUSE_HIT_RATIO",
    "SHORTFALL_GAIN",
    "SNAP",
    "Allocation",
    "AllocationParams",
    "MetricsTable",
    "OutOfReach",
    "PriorityClass",
    "QuotaMove",
    "TenantAllocation",
    "TenantDemand",
    "TenantMetrics",
    "allocate",
    "class_shares",
    "describe_moves",
    "fleet_hit_ratio",
    "hold",
    "needed_hit_ratio",
    "quota_moves",
    "sla_met",
    "target_shares",
]
