"""Per-tenant metrics from Prometheus (thin adapter over prometheus-api-client).

The operator asks one question per rebalance: for this cache, each tenant's
p95 latency, hit ratio and request rate over a window (and the p95 of its
model answers' time to first token and inter-token latency), and what allocation by
gain needs: the reuse-distance histogram (the tenant's miss-ratio curve), the
latency of its misses (upstream) and of its hits, and its lookup rate (the
curve's true total, for the SHARDS-adj correction). The PromQL comes from
:mod:`cachefleet_common.contract.promql` (the metric names are the sidecar's).
prometheus-api-client is synchronous (``requests``), so queries run in a
worker thread with a timeout; every failure becomes :class:`MetricsUnavailable`.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import chain, compress, repeat
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np
import numpy.typing as npt

from cachefleet_common.contract.promql import (
    promql_cold_bytes,
    promql_hit_buckets,
    promql_hit_ratio,
    promql_itl_p95_seconds,
    promql_lookups,
    promql_p95_seconds,
    promql_policy_hits,
    promql_policy_requests,
    promql_policy_switches,
    promql_reuse_buckets,
    promql_rps,
    promql_saved_cost,
    promql_saved_model_seconds,
    promql_saved_tokens,
    promql_ttft_p95_seconds,
    promql_upstream_buckets,
)
from cachefleet_common.contract.urls import redact_url
from cachefleet_operator.allocation import MetricsTable, TenantMetrics
from cachefleet_operator.curves import CurveTable, FloatArray, HitCurve, LatencyDist, LatencyTable

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

    async def fetch(
        self, cache: str, window: str, curve_window: str | None = None
    ) -> Mapping[str, TenantMetrics]:
        """Tenant -> metrics (curves over ``curve_window``, default ``window``): a
        :class:`~cachefleet_operator.allocation.MetricsTable` from Prometheus, so that
        allocation reads its columns.

        Raises :class:`MetricsUnavailable`.
        """
        ...


#: Builds a source from (url, timeout seconds).
MetricsSourceFactory = Callable[[str, float], MetricsSource]


@dataclass(frozen=True, slots=True)
class PolicySwitches:
    """Sidecars (pods) that moved a tenant's L1 from one policy to another in a span."""

    tenant: str
    from_policy: str
    to_policy: str
    pods: int


@runtime_checkable
class PolicySwitchSource(Protocol):
    """A metrics source that also reports the sidecars' policy switches."""

    async def policy_switches(self, cache: str, span_s: float, at: float) -> list[PolicySwitches]:
        """Switches counted in the ``span_s`` seconds before ``at`` (Unix time).

        Raises :class:`MetricsUnavailable`.
        """
        ...


@runtime_checkable
class SavingsSource(Protocol):
    """A metrics source that also reports what cache hits saved the model."""

    async def savings(self, cache: str, window: str) -> dict[str, dict[str, float]]:
        """Tenant -> what cache hits saved over ``window`` (all pods and models): a
        :func:`savings_from` mapping. Raises :class:`MetricsUnavailable`.
        """
        ...


def savings_from(
    seconds: list[dict[str, Any]], tokens: list[dict[str, Any]], cost: list[dict[str, Any]]
) -> dict[str, dict[str, float]]:
    """Tenant -> {model_seconds, prompt_tokens, completion_tokens[, cost]} from the answers
    of the ``promql_saved_*`` queries (pure)."""
    out: dict[str, dict[str, float]] = {}
    for (tenant,), value in _samples(seconds, "tenant"):
        out.setdefault(tenant, {})["model_seconds"] = value
    for (tenant, kind), value in _samples(tokens, "tenant", "kind"):
        if kind in ("prompt", "completion"):
            out.setdefault(tenant, {})[f"{kind}_tokens"] = value
    for (tenant,), value in _samples(cost, "tenant"):
        out.setdefault(tenant, {})["cost"] = value
    return out


def policy_switches_from(result: list[dict[str, Any]]) -> list[PolicySwitches]:
    """The answer of :func:`~cachefleet_common.contract.promql.promql_policy_switches`, sorted."""
    found = [
        PolicySwitches(tenant, old, new, round(count))
        for (tenant, old, new), count in _samples(result, "tenant", "from_policy", "to_policy")
        if count >= 1
    ]
    return sorted(found, key=lambda s: (s.tenant, s.from_policy, s.to_policy))


def _samples(result: list[dict[str, Any]], *labels: str) -> Iterator[tuple[tuple[str, ...], float]]:
    """(values of ``labels``, sample value) of a query result; malformed samples skipped."""
    for sample in result:
        metric = sample.get("metric", {})
        try:
            key = tuple(str(metric[name]) for name in labels)
            value = float(sample["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        if all(key) and math.isfinite(value):
            yield key, value


def _by_tenant(result: list[dict[str, Any]]) -> dict[str, float]:
    """tenant -> value from a ``sum by (tenant)`` vector."""
    return {tenant: value for (tenant,), value in _samples(result, "tenant")}


def _pairs(
    result: list[dict[str, Any]], *group: str, x: str
) -> dict[tuple[str, ...], list[tuple[float, float]]]:
    """``group`` values -> [(label ``x`` as a number, value)] ("+Inf" parses as inf)."""
    out: dict[tuple[str, ...], list[tuple[float, float]]] = {}
    for (*key, raw), value in _samples(result, *group, x):
        try:
            out.setdefault(tuple(key), []).append((float(raw), value))
        except ValueError:
            continue
    return out


def _buckets_by_tenant(result: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """tenant -> [(le, cumulative count)] from a ``sum by (tenant, le)`` vector."""
    return {key[0]: pairs for key, pairs in _pairs(result, "tenant", x="le").items()}


def _by_tenant_policy(
    result: list[dict[str, Any]], label: str
) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """tenant -> policy -> [(label value, value)] from a ``sum by (tenant, policy, label)``."""
    out: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for (tenant, policy), pairs in _pairs(result, "tenant", "policy", x=label).items():
        out.setdefault(tenant, {})[policy] = pairs
    return out


def _by_tenant_policy_scalar(result: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """tenant -> policy -> value from a ``sum by (tenant, policy)`` vector."""
    out: dict[str, dict[str, float]] = {}
    for (tenant, policy), value in _samples(result, "tenant", "policy"):
        out.setdefault(tenant, {})[policy] = value
    return out


def tenant_metrics(
    p95: dict[str, float],
    hit: dict[str, float],
    rps: dict[str, float],
    reuse: dict[str, list[tuple[float, float]]],
    upstream: dict[str, list[tuple[float, float]]],
    hits: dict[str, list[tuple[float, float]]],
    lookups: dict[str, float],
    cold_bytes: dict[str, float] | None = None,
    policy_hits: dict[str, dict[str, list[tuple[float, float]]]] | None = None,
    policy_requests: dict[str, dict[str, float]] | None = None,
    ttft: dict[str, float] | None = None,
    itl: dict[str, float] | None = None,
) -> MetricsTable:
    """Assemble per-tenant metrics from the query results (pure; tested without Prometheus).

    A tenant's curve is its own policy's (mini-simulation) where the sidecars
    measure one — the policy with the most requests, i.e. the one most pods
    run — and the LRU curve of the reuse histogram otherwise. The result is
    a table, built as columns straight from the buckets (all tenants' at
    once where they share their bounds, as the sidecars' do), and a mapping
    whose values are what :class:`~cachefleet_operator.curves.HitCurve` and
    :class:`~cachefleet_operator.curves.LatencyDist` make of each tenant's.
    """
    names = list(dict.fromkeys([*p95, *hit, *rps]))  # in the answers' order: the same every time
    n = len(names)
    footprints = cold_bytes or {}

    def column(values: dict[str, float]) -> npt.NDArray[np.float64]:
        return np.fromiter(map(values.get, names, repeat(math.nan)), dtype=np.float64, count=n)

    def curves_of(rows: list[int], bounds: FloatArray, counts: FloatArray) -> CurveTable:
        chosen = [names[i] for i in rows]
        requests = np.fromiter(map(lookups.get, chosen, repeat(math.nan)), np.float64, len(rows))
        footprint = np.fromiter(
            map(footprints.get, chosen, repeat(math.nan)), np.float64, len(rows)
        )
        return CurveTable.from_histograms(bounds, counts, requests, footprint)

    def curve_of(i: int) -> HitCurve | None:
        t = names[i]
        return HitCurve.from_histogram(reuse[t], lookups.get(t), footprints.get(t))

    curves = _table(names, reuse, curves_of, lambda rows: CurveTable(list(map(curve_of, rows))))
    curves = _with_simulated(names, curves, policy_hits or {}, policy_requests or {}, footprints)

    def latency(by_tenant: dict[str, list[tuple[float, float]]]) -> LatencyTable:
        return _table(
            names,
            by_tenant,
            lambda rows, bounds, counts: LatencyTable.from_buckets(bounds, counts),
            lambda rows: LatencyTable(
                [LatencyDist.from_buckets(by_tenant[names[i]]) for i in rows]
            ),
        )

    numbers = (column(p95), column(hit), column(rps))
    tokens = (column(ttft or {}), column(itl or {}))
    return MetricsTable.from_columns(
        names, numbers, curves, latency(upstream), latency(hits), tokens
    )


_Table = TypeVar("_Table", CurveTable, LatencyTable)
#: Sets of bucket bounds read as columns, each at once (the sidecars' are fixed: one per
#: histogram); rows with others are read one by one.
_BOUND_SETS = 16


def _table(
    names: list[str],
    buckets: dict[str, list[tuple[float, float]]],
    alike: Callable[[list[int], FloatArray, FloatArray], _Table],
    one_by_one: Callable[[list[int]], _Table],
) -> _Table:
    """A table with a row per name (none where ``buckets`` has none): the rows whose
    buckets have the same bounds (each set of them: the sidecars' are fixed) with every
    count finite by ``alike`` (rows, bounds, counts), all at once; the others by
    ``one_by_one`` (rows)."""
    rows = [i for i, t in enumerate(names) if t in buckets]
    lists = [buckets[names[i]] for i in rows]
    k = len(lists[0]) if lists else 0
    same = (np.fromiter(map(len, lists), dtype=np.int64, count=len(lists)) == k).tolist()
    alike_rows = np.array(list(compress(rows, same)), dtype=np.int64)
    flat = np.fromiter(
        chain.from_iterable(chain.from_iterable(compress(lists, same))),
        dtype=np.float64,
        count=2 * k * alike_rows.size,
    ).reshape(alike_rows.size, k, 2)
    parts: list[_Table] = []
    order: list[int] = []
    if k and alike_rows.size:
        finite = np.isfinite(flat[:, :, 1]).all(axis=1)
        left = np.ones(alike_rows.size, dtype=bool)  # not yet in a set of bounds
        for _ in range(_BOUND_SETS):
            if not left.any():
                break
            first = int(np.argmax(left))  # the first row left: its bounds, and the rows alike
            bounds = flat[first, :, 0]
            group = left & (flat[:, :, 0] == bounds).all(axis=1)
            group[first] = True  # NaN bounds equal none, not even their own
            left &= ~group
            if np.isnan(bounds).any() or np.unique(bounds).size != k:
                continue
            chosen = np.flatnonzero(group & finite)
            if chosen.size:
                parts.append(alike(alike_rows[chosen].tolist(), bounds, flat[chosen, :, 1]))
                order.extend(alike_rows[chosen].tolist())
    others = sorted(set(rows) - set(order))
    if others or not parts:
        parts.append(one_by_one(others))
        order.extend(others)
    # row r of the stacked parts is name order[r]; a name without buckets: no row (-1)
    index = np.full(len(names), -1, dtype=np.int64)
    index[np.array(order, dtype=np.int64)] = np.arange(len(order))
    stacked = type(parts[0]).stack(parts)
    if len(order) == len(names) and order == sorted(order):  # every name, in order: as is
        return stacked
    return stacked.take(index)


def _with_simulated(
    names: list[str],
    curves: CurveTable,
    policy_hits: dict[str, dict[str, list[tuple[float, float]]]],
    policy_requests: dict[str, dict[str, float]],
    footprints: dict[str, float],
) -> CurveTable:
    """``curves`` with the curve of each tenant's own policy where the sidecars simulate it."""
    replaced: dict[int, HitCurve] = {}
    for i, t in enumerate(names) if policy_requests else ():
        by_policy = policy_requests.get(t)
        if not by_policy:
            continue
        policy = max(by_policy, key=lambda name: by_policy[name])
        simulated = HitCurve.from_hits(
            (policy_hits.get(t) or {}).get(policy, []),
            by_policy[policy],
            cold_ratio=float(curves.cold[i]) if curves.present[i] else None,
            footprint_bytes=footprints.get(t),
        )
        if simulated is not None:
            replaced[i] = simulated
    if not replaced:
        return curves
    at = sorted(replaced)
    index = np.arange(len(names))
    index[at] = len(names) + np.arange(len(at))
    return CurveTable.stack([curves, CurveTable([replaced[i] for i in at])]).take(index)


class PrometheusMetricsSource:
    """Reads the sidecars' metrics through a Prometheus server."""

    def __init__(self, url: str, timeout_s: float = DEFAULT_QUERY_TIMEOUT_S) -> None:
        from prometheus_api_client import PrometheusConnect
        from urllib3.util.retry import Retry

        self.url = url
        #: The URL as messages (conditions, Events, logs) show it: without credentials.
        self.where = redact_url(url)
        self.timeout_s = timeout_s
        # no client-side retries: they outlast the timeout below and turn every
        # failure (refused, unknown host, HTTP 5xx) into "timed out"; the
        # operator retries with its own backoff
        self._client = PrometheusConnect(
            url=url, disable_ssl=True, timeout=timeout_s, retry=Retry(total=0, redirect=3)
        )

    def _query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        params = None if at is None else {"time": f"{at:.3f}"}
        result: list[dict[str, Any]] = self._client.custom_query(query=promql, params=params)
        return result

    async def _run(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        try:
            return await asyncio.wait_for(
                asyncio.to_thread(self._query, promql, at), timeout=self.timeout_s + 1.0
            )
        except TimeoutError as exc:
            raise MetricsUnavailable(
                "PrometheusUnavailable", f"Prometheus at {self.where} timed out"
            ) from exc
        except Exception as exc:  # requests / client errors of every kind
            raise MetricsUnavailable(
                "PrometheusUnavailable", f"Prometheus at {self.where}: {_describe(exc)}"
            ) from exc

    async def fetch(self, cache: str, window: str, curve_window: str | None = None) -> MetricsTable:
        curve_window = curve_window or window
        results = await asyncio.gather(
            self._run(promql_p95_seconds(cache, window)),
            self._run(promql_hit_ratio(cache, window)),
            self._run(promql_rps(cache, window)),
            self._run(promql_reuse_buckets(cache, curve_window)),
            self._run(promql_upstream_buckets(cache, curve_window)),
            self._run(promql_hit_buckets(cache, window)),
            self._run(promql_lookups(cache, curve_window)),
            self._run(promql_cold_bytes(cache, curve_window)),
            self._run(promql_policy_hits(cache, curve_window)),
            self._run(promql_policy_requests(cache, curve_window)),
            self._run(promql_ttft_p95_seconds(cache, window)),
            self._run(promql_itl_p95_seconds(cache, window)),
        )
        p95, hit, rps = (_by_tenant(r) for r in results[:3])
        reuse, upstream, hits = (_buckets_by_tenant(r) for r in results[3:6])
        lookups, cold = _by_tenant(results[6]), _by_tenant(results[7])
        metrics = tenant_metrics(
            p95,
            hit,
            rps,
            reuse,
            upstream,
            hits,
            lookups,
            cold,
            _by_tenant_policy(results[8], "size_bytes"),
            _by_tenant_policy_scalar(results[9]),
            _by_tenant(results[10]),
            _by_tenant(results[11]),
        )
        if not metrics:
            raise MetricsUnavailable(
                "NoMetrics", f"Prometheus at {self.where} has no sidecar metrics for {cache}"
            )
        return metrics

    async def savings(self, cache: str, window: str) -> dict[str, dict[str, float]]:
        seconds, tokens, cost = await asyncio.gather(
            self._run(promql_saved_model_seconds(cache, window)),
            self._run(promql_saved_tokens(cache, window)),
            self._run(promql_saved_cost(cache, window)),
        )
        return savings_from(seconds, tokens, cost)

    async def policy_switches(self, cache: str, span_s: float, at: float) -> list[PolicySwitches]:
        span = f"{max(1, round(span_s * 1000))}ms"
        return policy_switches_from(await self._run(promql_policy_switches(cache, span), at))


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
