"""SLO autoscaling as the HPA controller and KEDA compute it, on the rendered manifests.

The chain: the operator's ``cachefleet_operator_slo_pressure`` (computed by
:func:`cachefleet_operator.pressure.slo_pressure` from per-tenant p95s and
targets, exported with the labels the selector uses) -> prometheus-adapter's
external rule (deploy/prometheus-adapter-values.yaml) or KEDA's Prometheus
trigger -> the HPA controller's replica calculation. The formulas below are
the HPA controller's for External metrics (replica_calculator.go, default
tolerance 0.1) and KEDA's mapping of ``metricType`` onto the HPA target it
creates; they run on the objects the chart renders, for a fleet under, at
and over its SLO.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from cachefleet_operator.allocation import PriorityClass
from cachefleet_operator.metrics import OperatorMetrics
from cachefleet_operator.pressure import TenantPressure, slo_pressure
from tests.chart.test_chart import KUBE_VERSION, kinds, render

ROOT = Path(__file__).resolve().parents[2]
#: The HPA controller's default --horizontal-pod-autoscaler-tolerance.
HPA_TOLERANCE = 0.1
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
CACHE_NS, CACHE_NAME = "inference", "llama-chat"
BASE = {
    "targetDeployment": "vllm",
    "cache": f"{CACHE_NS}/{CACHE_NAME}",
    "minReplicas": 1,
    "maxReplicas": 20,
}


def quantity(text: str | float) -> float:
    text = str(text)
    return float(text[:-1]) / 1000.0 if text.endswith("m") else float(text)


def hpa_replicas(current: int, metric: float, target: dict[str, Any], lo: int, hi: int) -> int:
    """The HPA controller's desired replicas for one External metric."""
    if target["type"] == "Value":
        ratio = metric / quantity(target["value"])
        desired = current if abs(1.0 - ratio) <= HPA_TOLERANCE else math.ceil(ratio * current)
    elif target["type"] == "AverageValue":
        per_pod = quantity(target["averageValue"])
        ratio = metric / (per_pod * current)
        desired = current if abs(1.0 - ratio) <= HPA_TOLERANCE else math.ceil(metric / per_pod)
    else:
        raise AssertionError(f"unsupported target {target}")
    return max(lo, min(hi, desired))


def keda_hpa_target(trigger: dict[str, Any]) -> dict[str, Any]:
    """The HPA target KEDA creates for a trigger (metricType defaults to AverageValue)."""
    kind = trigger.get("metricType", "AverageValue")
    threshold = trigger["metadata"]["threshold"]
    key = "value" if kind == "Value" else "averageValue"
    return {"type": kind, key: threshold}


def exported(pressure: float | None) -> float | None:
    """The value the adapter's rule selects: the operator's gauge for the HPA's labels."""
    metrics = OperatorMetrics()
    metrics.set_slo_pressure(CACHE_NS, CACHE_NAME, pressure)
    return metrics.registry.get_sample_value(
        "cachefleet_operator_slo_pressure",
        {
            "cache": f"{CACHE_NS}/{CACHE_NAME}",
            "cache_namespace": CACHE_NS,
            "cache_name": CACHE_NAME,
        },
    )


def fleet(p95_gold: float, p95_bronze: float) -> float | None:
    return slo_pressure(
        [
            TenantPressure(p95_gold, 0.2, PriorityClass.GUARANTEED),
            TenantPressure(p95_bronze, 1.0, PriorityClass.BEST_EFFORT),
            TenantPressure(None, 0.5, PriorityClass.STANDARD),  # no observations yet
        ]
    )


SCENARIOS = [
    pytest.param(0.1, 0.5, 4, 2, id="under-slo-scales-in"),
    pytest.param(0.2, 0.5, 4, 4, id="at-slo-holds"),
    pytest.param(0.21, 0.5, 4, 4, id="within-tolerance-holds"),
    pytest.param(0.4, 0.5, 4, 8, id="over-slo-scales-out"),
    pytest.param(0.1, 3.0, 4, 6, id="best-effort-far-over-counts-half"),
]


@pytest.mark.parametrize(("gold", "bronze", "current", "expected"), SCENARIOS)
def test_hpa_scales_on_slo_pressure(
    gold: float, bronze: float, current: int, expected: int
) -> None:
    (hpa,) = kinds(render({"autoscaling": {**BASE, "mode": "hpa"}})["docs"])[
        "HorizontalPodAutoscaler"
    ]
    spec = hpa["spec"]
    (metric,) = spec["metrics"]
    assert metric["external"]["metric"]["name"] == "cachefleet_operator_slo_pressure"
    value = exported(fleet(gold, bronze))
    assert value is not None
    got = hpa_replicas(
        current, value, metric["external"]["target"], spec["minReplicas"], spec["maxReplicas"]
    )
    assert got == expected


@pytest.mark.parametrize(("gold", "bronze", "current", "expected"), SCENARIOS)
def test_keda_scales_like_the_hpa(gold: float, bronze: float, current: int, expected: int) -> None:
    (so,) = kinds(render({"autoscaling": {**BASE, "mode": "keda"}})["docs"])["ScaledObject"]
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert f'cache_namespace="{CACHE_NS}",cache_name="{CACHE_NAME}"' in trigger["metadata"]["query"]
    value = exported(fleet(gold, bronze))
    assert value is not None
    lo, hi = so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]
    assert hpa_replicas(current, value, keda_hpa_target(trigger), lo, hi) == expected


def test_keda_without_metric_type_would_collapse_to_one_replica() -> None:
    """Why the trigger says metricType Value: AverageValue ignores the current count."""
    trigger = {"metadata": {"threshold": "1"}}  # no metricType
    under = exported(fleet(0.1, 0.5))
    assert under is not None
    assert hpa_replicas(8, under, keda_hpa_target(trigger), 1, 20) == 1
    assert hpa_replicas(1, under, keda_hpa_target(trigger), 1, 20) == 1  # and never back up


def test_unknown_pressure_exports_no_series() -> None:
    assert fleet(None, None) is None  # type: ignore[arg-type]
    assert exported(None) is None  # the HPA then keeps the current count


@pytest.mark.parametrize("mode", ["hpa", "keda"])
def test_objects_live_with_the_model_deployment_and_select_validly(mode: str) -> None:
    docs = render({"autoscaling": {**BASE, "mode": mode}})["docs"]
    kind = "HorizontalPodAutoscaler" if mode == "hpa" else "ScaledObject"
    (obj,) = kinds(docs)[kind]
    # a scaleTargetRef has no namespace: the object must sit in the Deployment's
    assert obj["metadata"]["namespace"] == CACHE_NS
    assert obj["spec"]["scaleTargetRef"]["name"] == "vllm"
    assert len(obj["metadata"]["name"]) <= 63
    if mode == "hpa":
        kubernetes_validate.validate(obj, KUBE_VERSION.rsplit(".", 1)[0], strict=True)
        labels = obj["spec"]["metrics"][0]["external"]["metric"]["selector"]["matchLabels"]
        assert labels == {"cache_namespace": CACHE_NS, "cache_name": CACHE_NAME}
        assert all(LABEL_VALUE.match(v) and len(v) <= 63 for v in labels.values())


SATURATION_ON = {"monitoring": {"prometheusOperator": True, "modelServers": {"enabled": True}}}


def test_adapter_rules_serve_the_metrics_the_hpa_asks_for() -> None:
    values = yaml.safe_load((ROOT / "deploy" / "prometheus-adapter-values.yaml").read_text())
    rules = {r["name"]["as"]: r for r in values["rules"]["external"]}
    both = {**BASE, "mode": "hpa", "signals": ["sloPressure", "poolSaturation"]}
    (hpa,) = kinds(render({"autoscaling": both, **SATURATION_ON})["docs"])[
        "HorizontalPodAutoscaler"
    ]
    (rule_obj,) = kinds(render(SATURATION_ON)["docs"])["PrometheusRule"]
    recorded = {
        r["record"] for g in rule_obj["spec"]["groups"] for r in g["rules"] if "record" in r
    }
    names = [m["external"]["metric"]["name"] for m in hpa["spec"]["metrics"]]
    assert names == ["cachefleet_operator_slo_pressure", "cachefleet_pool_saturation"]
    for name in names:
        rule = rules[name]
        series = rule["seriesQuery"].split("{", 1)[0]
        # the adapter reads the operator's gauge or the chart's own recorded series
        assert series == name or series in recorded, series
        # namespaced to the HPA's namespace through the cache's own namespace label
        assert rule["resources"]["overrides"] == {"cache_namespace": {"resource": "namespace"}}
        # one series per cache reaches the HPA: never a sum over tenants, pods or replicas
        assert rule["metricsQuery"].startswith("max(")
        assert "by (cache_namespace, cache_name)" in rule["metricsQuery"]
    assert set(rules) == set(names)


def test_notes_name_the_signal_and_the_adapter() -> None:
    notes = render({"autoscaling": {**BASE, "mode": "hpa"}})["notes"]
    assert "cachefleet_operator_slo_pressure" in notes
    assert "deploy/prometheus-adapter-values.yaml" in notes
    assert f"namespace\n{CACHE_NS}" in notes or f"namespace {CACHE_NS}" in notes
