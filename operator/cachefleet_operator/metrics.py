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
            "Worst tenant's p95 / SLA target, weighted by class (autoscaling holds it at 1).",
            ["cache", "cache_namespace", "cache_name"],
            registry=self.registry,
        )
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
