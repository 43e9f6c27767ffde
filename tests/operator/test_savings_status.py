"""The operator's savings in the InferenceCache status: SAVED column, status.savings, per tenant.

The reconciler runs against a real Redis (it publishes the quota table)
and a metrics source that answers the savings queries as Prometheus would
for the sidecars' counters.
"""

from __future__ import annotations

from typing import Any

import pytest

from cachefleet_operator.allocation import TenantMetrics
from cachefleet_operator.kubectl_plugin import views
from cachefleet_operator.metrics import OperatorMetrics
from cachefleet_operator.metrics_source import MetricsUnavailable
from cachefleet_operator.reconcile import Reconciler

pytestmark = pytest.mark.redis

NS, NAME = "default", "chat"


class Metrics:
    def __init__(self, savings: dict[str, dict[str, float]] | None) -> None:
        self._savings = savings
        self.windows: list[str] = []

    def factory(self, url: str, timeout_s: float) -> Metrics:
        return self

    async def fetch(
        self, cache: str, window: str, curve_window: str | None = None
    ) -> dict[str, TenantMetrics]:
        return {"gold": TenantMetrics(p95_s=0.1, hit_ratio=0.5, rps=10.0)}

    async def savings(self, cache: str, window: str) -> dict[str, dict[str, float]]:
        self.windows.append(window)
        if self._savings is None:
            raise MetricsUnavailable("PrometheusUnavailable", "down")
        return self._savings


def spec(redis_url: str) -> dict[str, Any]:
    return {
        "selector": {"matchLabels": {"cachefleet.io/cache": NAME}},
        "model": {"name": "m", "version": "v1"},
        "capacity": {"l1BytesPerPod": 2**20, "l2Bytes": 2**24},
        "redis": {"url": redis_url},
        "prometheus": {"url": "http://127.0.0.1:9", "window": "5m"},
        "tenants": [{"name": "gold"}, {"name": "free", "ttlSeconds": 30}],
    }


async def test_status_carries_the_savings_and_the_saved_column(redis_url: str) -> None:
    source = Metrics(
        {"gold": {"model_seconds": 9000.0, "prompt_tokens": 12000.0, "completion_tokens": 800.0}}
    )
    reconciler = Reconciler(metrics_source=source.factory, metrics=OperatorMetrics())
    outcome = await reconciler.reconcile(NS, NAME, 1, spec(redis_url), {})
    status = outcome.status
    assert source.windows == ["5m"]
    assert status["savedModelHours"] == 2.5
    assert status["savings"] == {
        "modelSeconds": 9000.0,
        "promptTokens": 12000,
        "completionTokens": 800,
    }
    by_name = {t["name"]: t for t in status["tenants"]}
    assert by_name["gold"]["savings"]["modelSeconds"] == 9000.0
    assert by_name["free"]["savings"]["modelSeconds"] == 0.0
    # kubectl cachefleet status shows them as the operator wrote them
    obj = {"metadata": {"name": NAME, "namespace": NS}, "spec": {}, "status": status}
    text = views.render_status([views.cache_view(obj)], 0.0)
    assert "SAVED MODEL SECONDS" in text
    assert "modelSeconds=9000" in text


async def test_no_savings_answer_leaves_the_column_empty_not_zero(redis_url: str) -> None:
    reconciler = Reconciler(metrics_source=Metrics(None).factory, metrics=OperatorMetrics())
    outcome = await reconciler.reconcile(NS, NAME, 1, spec(redis_url), {})
    assert "savedModelHours" not in outcome.status
    assert "savings" not in outcome.status
    assert outcome.result == "ok"  # savings are never a fault


async def test_the_cost_is_shown_in_the_currency_of_the_spec_prices(redis_url: str) -> None:
    source = Metrics({"gold": {"model_seconds": 60.0, "prompt_tokens": 2000.0, "cost": 0.75}})
    raw = spec(redis_url)
    raw["savings"] = {"currency": "EUR", "prices": [{"model": "m", "promptPer1k": 0.375}]}
    reconciler = Reconciler(metrics_source=source.factory, metrics=OperatorMetrics())
    status = (await reconciler.reconcile(NS, NAME, 1, raw, {})).status
    assert (status["savings"]["cost"], status["savings"]["currency"]) == (0.75, "EUR")
    by_name = {t["name"]: t for t in status["tenants"]}
    assert by_name["gold"]["savings"]["currency"] == "EUR"
    assert "currency" not in by_name["free"]["savings"]  # no cost, no currency
    # an invalid price is refused naming the field, as the API server would
    raw["savings"]["prices"][0]["promptPer1k"] = -1
    outcome = await reconciler.reconcile(NS, NAME, 2, raw, {})
    assert outcome.result != "ok"
    assert "spec.savings.prices[0].promptPer1k" in str(outcome.status)
