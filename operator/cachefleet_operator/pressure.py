"""SLO pressure: one number per InferenceCache that autoscaling holds at 1 (pure).

The operator knows every tenant's SLA, so it publishes the signal the model
server should scale on (``cachefleet_operator_slo_pressure``), and the HPA /
KEDA only compare it with 1:

* each tenant contributes its worst ratio of measured / target over the
  targets it states and has an observation of (p95 latency, p95 time to
  first token, p95 inter-token latency), weighted by its class
  (:data:`CLASS_WEIGHT`: a Guaranteed tenant at its target is pressure 1, a
  BestEffort tenant only at twice its target);
* an SLA miss that cache can still fix (``cache_can_help`` True: the
  allocation can still move share to the tenant and expects it to help) is
  damped: only :data:`CACHE_HELP_DAMPING` of the excess over 1 counts, as
  rebalancing is the cheaper remedy. ``False`` or ``None`` (not known) count
  in full: more replicas are the remedy. TTFT and ITL always count in full:
  they time model answers, which cache does not make faster;
* the cache's pressure is the worst tenant's, ``None`` when no tenant has
  both a target and an observation of it (the series is then left out, and
  autoscalers keep the current replica count).

Under 1 the fleet has headroom (HPA: fewer replicas), 1 holds (within the
HPA's tolerance), over 1 asks for proportionally more replicas.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from cachefleet_operator.allocation import PriorityClass

#: Weight of a tenant's p95 / target by class.
CLASS_WEIGHT: dict[PriorityClass, float] = {
    PriorityClass.GUARANTEED: 1.0,
    PriorityClass.STANDARD: 0.8,
    PriorityClass.BEST_EFFORT: 0.5,
}
#: Fraction of an SLA miss's excess over 1 that counts while cache can still fix it.
CACHE_HELP_DAMPING = 0.5


@dataclass(frozen=True, slots=True)
class TenantPressure:
    """What the pressure of one tenant is computed from."""

    p95_s: float | None
    p95_target_s: float | None
    priority_class: PriorityClass = PriorityClass.STANDARD
    cache_can_help: bool | None = None
    #: p95 time to first token and inter-token latency of model answers, and their targets.
    ttft_s: float | None = None
    ttft_target_s: float | None = None
    itl_s: float | None = None
    itl_target_s: float | None = None


def _ratio(measured: float | None, target: float | None) -> float | None:
    if measured is None or target is None or target <= 0 or measured < 0:
        return None
    return measured / target


def tenant_pressure(t: TenantPressure) -> float | None:
    """One tenant's weighted worst measured / target, or None without a target that has
    an observation."""
    weight = CLASS_WEIGHT[t.priority_class]
    values = []
    p95 = _ratio(t.p95_s, t.p95_target_s)
    if p95 is not None:
        value = weight * p95
        if value > 1.0 and t.cache_can_help:
            value = 1.0 + (value - 1.0) * CACHE_HELP_DAMPING
        values.append(value)
    for ratio in (_ratio(t.ttft_s, t.ttft_target_s), _ratio(t.itl_s, t.itl_target_s)):
        if ratio is not None:
            values.append(weight * ratio)
    return max(values) if values else None


def slo_pressure(tenants: Iterable[TenantPressure]) -> float | None:
    """The cache's SLO pressure: its worst tenant's (None when nothing is known)."""
    values = [v for v in (tenant_pressure(t) for t in tenants) if v is not None]
    return max(values) if values else None
