"""``CacheCannotMeetSLA``: the tenants whose SLA no share within bounds meets, named only
once the evidence held for rebalances in a row."""

from collections.abc import Mapping

from cachefleet_operator.allocation import (
    Allocation,
    fleet_hit_ratio,
    needed_hit_ratio,
)
from cachefleet_operator.api import (
    ConditionStatus,
)

#: True while some tenant's SLA is out of cache's reach (no share within bounds meets it).
CACHE_CANNOT_MEET_SLA = "CacheCannotMeetSLA"
#: Estimated requests a tenant's curve must stand on (over the curve window) before the
#: operator says cache cannot meet the tenant's SLA: a cold start's curve is all first
#: accesses, and says nothing yet about reuse.
REACH_MIN_REQUESTS = 1000.0
#: Rebalances in a row the evidence must hold before ``CacheCannotMeetSLA`` names a tenant
#: (so never on the first rebalance, and never for a transient dip).
REACH_REBALANCES = 3


def window_seconds(window: str) -> float:
    """Seconds of a PromQL window as the spec writes it (digits, then ``s``, ``m`` or ``h``)."""
    return float(window[:-1]) * {"s": 1.0, "m": 60.0, "h": 3600.0}[window[-1]]


def reach_evidence(
    allocation: Allocation,
    in_force: Mapping[str, float],
    window_s: float,
    min_requests: float = REACH_MIN_REQUESTS,
) -> set[str]:
    """Tenants whose SLA cache cannot meet, on this rebalance's evidence alone.

    The allocator's finding (``cannot_meet``, read on one pod's curve) counts
    only when the tenant does not meet its SLA now (one that does is within
    reach, whatever its curve says), its curve stands on at least
    ``min_requests`` estimated requests over the curve window (``window_s``),
    and, when the finding is that no cache size reaches the SLA, the fleet
    does not reach it either: neither the best of its fleet-wide curve (one
    cache the fleet shares, where a key's first access on a pod that L2
    answers is a hit; counted when it too stands on ``min_requests``) nor the
    pod curve's best plus the hits the fleet adds beyond it at the share in
    force (:func:`fleet_hit_ratio`, what the observed hit ratio shows) reaches
    the hit ratio the SLA needs.
    """
    demands = {d.name: d for d in allocation.demands}
    out = set()
    for t in allocation.tenants:
        m = allocation.metrics.get(t.name) if allocation.metrics else None
        if not t.why_not or t.sla_met or m is None or m.curve is None:
            continue
        if m.curve.requests * window_s < min_requests:
            continue
        if t.beyond_any_size:
            need = needed_hit_ratio(demands[t.name], m)
            size = in_force.get(t.name, t.share) * allocation.l1_capacity
            best = fleet_hit_ratio(m.curve, m.hit_ratio, size)
            fleet = m.fleet_curve
            if fleet is not None and fleet.requests * window_s >= min_requests:
                best = max(best, fleet.max_hit_ratio)
            if need is not None and best >= need - 1e-9:
                continue
        out.add(t.name)
    return out


class ReachWarnings:
    """Which tenants ``CacheCannotMeetSLA`` names: evidence that held for rebalances in a row.

    The count of rebalances in a row is kept per cache and tenant, in
    memory; a rebalance without the evidence (a curve reset, too few
    requests, the SLA met) starts it over. An operator that restarts has no
    counts: the tenants the condition already named are taken as confirmed
    (the condition is the record of that), every other starts from zero.
    """

    def __init__(
        self, min_requests: float = REACH_MIN_REQUESTS, rebalances: int = REACH_REBALANCES
    ) -> None:
        self.min_requests = min_requests
        self.rebalances = max(1, rebalances)
        self._counts: dict[str, dict[str, int]] = {}

    def observe(self, cache: str, evidence: set[str], named_before: set[str]) -> set[str]:
        """Record one rebalance's ``evidence``; the tenants now confirmed out of reach."""
        known = self._counts.get(cache)
        counts = {}
        for name in evidence:
            if known is not None:
                before = known.get(name, 0)
            else:
                before = self.rebalances - 1 if name in named_before else 0
            counts[name] = min(self.rebalances, before + 1)
        self._counts[cache] = counts
        return {name for name, n in counts.items() if n >= self.rebalances}

    def pending(self, cache: str) -> dict[str, int]:
        """Tenants with evidence not yet confirmed, and for how many rebalances it held."""
        counts = self._counts.get(cache, {})
        return {name: n for name, n in counts.items() if n < self.rebalances}

    def forget(self, cache: str) -> None:
        self._counts.pop(cache, None)


def reach_condition(
    allocation: Allocation, confirmed: set[str], pending: Mapping[str, int], needed: int
) -> tuple[ConditionStatus, str, str]:
    """(status, reason, message) of CacheCannotMeetSLA: which tenants and why."""
    out = [f"{t.name}: {t.cannot_meet}" for t in allocation.tenants if t.name in confirmed]
    if not out:
        message = "cache can meet every observed SLA"
        if pending:
            watched = ", ".join(f"{n} ({k}/{needed})" for n, k in sorted(pending.items())[:5])
            message += f"; out of reach in the last rebalances, not yet confirmed: {watched}"
        return ConditionStatus.FALSE, "WithinReach", message
    more = f" (and {len(out) - 5} more)" if len(out) > 5 else ""
    return ConditionStatus.TRUE, "SLAOutOfReach", "; ".join(out[:5]) + more


def tenants_named(message: str | None) -> set[str]:
    return {part.split(":", 1)[0] for part in (message or "").split("; ")}
