"""The operator's own Prometheus metrics (reconcile duration, errors, quota moves).

One :class:`OperatorMetrics` per operator, built on an injected
``CollectorRegistry`` so tests get a fresh one each time; ``run.py`` serves
it on ``--metrics-port`` beside the ``/healthz`` liveness endpoint.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: Buckets of the reconcile duration histogram, seconds.
RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

#: Bounded values of the ``result`` label.
RESULTS = ("ok", "degraded", "invalid", "error")


#: Invalidation propagation buckets, seconds (a loopback fleet acks in milliseconds).
PROPAGATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class OperatorMetrics:
    """Metrics of the control loop; label values are bounded (result, reason, kind)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.reconcile_duration = Histogram(
            "cachefleet_operator_reconcile_duration_seconds",
            "Time to reconcile one InferenceCache (metrics, allocation, publish, status).",
            ["trigger", "result"],
            buckets=RECONCILE_BUCKETS,
            registry=self.registry,
        )
        self.reconcile_errors = Counter(
            "cachefleet_operator_reconcile_errors_total",
            "Reconciles that could not complete, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.invalidations = Counter(
            "cachefleet_operator_invalidations_total",
            "CacheInvalidations finished, by result (completed | failed).",
            ["result"],
            registry=self.registry,
        )
        self.invalidation_propagation = Histogram(
            "cachefleet_operator_invalidation_propagation_seconds",
            "Time from the epoch CAS to the last sidecar acknowledgement.",
            buckets=PROPAGATION_BUCKETS,
            registry=self.registry,
        )
        # one series per InferenceCache (bounded by the caches the operator watches);
        # cache_namespace / cache_name are valid label values for an HPA selector,
        # cache (<namespace>/<name>) is not
        self.slo_pressure = Gauge(
            "cachefleet_operator_slo_pressure",
            "Worst tenant's measured / SLA target (p95 latency, TTFT, ITL: those it states), "
            "weighted by class (autoscaling holds it at 1).",
            ["cache", "cache_namespace", "cache_name"],
            registry=self.registry,
        )
        # one series per tenant and target it states (bounded by the specs the operator
        # reads): what the chart's per-tenant TTFT / ITL alerts compare with
        self.slo_targets = Gauge(
            "cachefleet_operator_tenant_slo_target_seconds",
            "A tenant's SLA target as its InferenceCache states it, by objective "
            "(latency: p95LatencySeconds, ttft: ttftP95Seconds, itl: itlP95Seconds).",
            ["cache", "tenant", "objective"],
            registry=self.registry,
        )
        self._targets_of: dict[str, set[tuple[str, str]]] = {}
        self.allocation_changes = Counter(
            "cachefleet_operator_allocation_changes_total",
            "Tenant quota moves published to the sidecars.",
            ["direction"],
            registry=self.registry,
        )

    def set_slo_pressure(self, namespace: str, name: str, value: float | None) -> None:
        """Publish (or, when unknown, withdraw) the SLO pressure of one InferenceCache."""
        labels = (f"{namespace}/{name}", namespace, name)
        if value is None:
            with contextlib.suppress(KeyError):
                self.slo_pressure.remove(*labels)
        else:
            self.slo_pressure.labels(*labels).set(value)

    def set_slo_targets(self, cache: str, targets: dict[tuple[str, str], float]) -> None:
        """Publish one InferenceCache's targets, (tenant, objective) -> seconds; series of
        targets no longer stated are withdrawn."""
        for tenant, objective in self._targets_of.get(cache, set()) - targets.keys():
            with contextlib.suppress(KeyError):
                self.slo_targets.remove(cache, tenant, objective)
        for (tenant, objective), seconds in targets.items():
            self.slo_targets.labels(cache, tenant, objective).set(seconds)
        self._targets_of[cache] = set(targets)
