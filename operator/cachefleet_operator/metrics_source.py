"""Per-tenant metrics from Prometheus (thin adapter over prometheus-api-client).

The operator asks one question per rebalance: for this cache, each tenant's
p95 latency, hit ratio and request rate over a window. The PromQL comes from
:mod:`cachefleet_sidecar.protocol` (the metric names are the sidecar's).
prometheus-api-client is synchronous (``requests``), so queries run in a
worker thread with a timeout; every failure becomes :class:`MetricsUnavailable`.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any, Protocol

from cachefleet_operator.allocation import TenantMetrics
from cachefleet_sidecar.protocol import promql_hit_ratio, promql_p95_seconds, promql_rps

#: Default timeout of one PromQL query, seconds.
DEFAULT_QUERY_TIMEOUT_S = 5.0


class MetricsUnavailable(Exception):
    """Prometheus could not answer; ``reason`` is a CamelCase condition reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class MetricsSource(Protocol):
    """Where per-tenant metrics come from (injectable)."""

    async def fetch(self, cache: str, window: str) -> dict[str, TenantMetrics]:
        """Tenant -> metrics; raises :class:`MetricsUnavailable`."""
        ...


#: Builds a source from (url, timeout seconds).
MetricsSourceFactory = Callable[[str, float], MetricsSource]


def _by_tenant(result: list[dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for sample in result:
        tenant = sample.get("metric", {}).get("tenant")
        try:
            value = float(sample["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        if tenant and math.isfinite(value):
            out[str(tenant)] = value
    return out


class PrometheusMetricsSource:
    """Reads the sidecars' metrics through a Prometheus server."""

    def __init__(self, url: str, timeout_s: float = DEFAULT_QUERY_TIMEOUT_S) -> None:
        from prometheus_api_client import PrometheusConnect
        from urllib3.util.retry import Retry

        self.url = url
        self.timeout_s = timeout_s
        # no client-side retries: they outlast the timeout below and turn every
        # failure (refused, unknown host, HTTP 5xx) into "timed out"; the
        # operator retries with its own backoff
        self._client = PrometheusConnect(
            url=url, disable_ssl=True, timeout=timeout_s, retry=Retry(total=0, redirect=3)
        )

    def _query(self, promql: str) -> dict[str, float]:
        return _by_tenant(self._client.custom_query(query=promql))

    async def _run(self, promql: str) -> dict[str, float]:
        try:
            return await asyncio.wait_for(
                asyncio.to_thread(self._query, promql), timeout=self.timeout_s + 1.0
            )
        except TimeoutError as exc:
            raise MetricsUnavailable(
                "PrometheusUnavailable", f"Prometheus at {self.url} timed out"
            ) from exc
        except Exception as exc:  # requests / client errors of every kind
            raise MetricsUnavailable(
                "PrometheusUnavailable", f"Prometheus at {self.url}: {_describe(exc)}"
            ) from exc

    async def fetch(self, cache: str, window: str) -> dict[str, TenantMetrics]:
        p95, hit, rps = await asyncio.gather(
            self._run(promql_p95_seconds(cache, window)),
            self._run(promql_hit_ratio(cache, window)),
            self._run(promql_rps(cache, window)),
        )
        tenants = set(p95) | set(hit) | set(rps)
        if not tenants:
            raise MetricsUnavailable(
                "NoMetrics", f"Prometheus at {self.url} has no sidecar metrics for {cache}"
            )
        return {
            t: TenantMetrics(p95_s=p95.get(t), hit_ratio=hit.get(t), rps=rps.get(t))
            for t in tenants
        }


def _describe(exc: BaseException) -> str:
    """What went wrong, in words: refused, unknown host, timed out, HTTP status, ..."""
    text = f"{type(exc).__name__}: {exc}"
    lowered = text.lower()
    if "connection refused" in lowered:
        return f"connection refused ({type(exc).__name__})"
    if "name or service not known" in lowered or "nodename nor servname" in lowered:
        return f"unknown host ({type(exc).__name__})"
    if "timed out" in lowered or "timeout" in lowered:
        return f"timed out ({type(exc).__name__})"
    return text


def prometheus_source(url: str, timeout_s: float) -> MetricsSource:
    """The default :data:`MetricsSourceFactory`."""
    return PrometheusMetricsSource(url, timeout_s)
