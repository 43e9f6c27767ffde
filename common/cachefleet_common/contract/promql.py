"""Metric names the sidecar exports and the PromQL the operator reads them back with.

Every sidecar series carries the label ``cache="<namespace>/<name>"``.
"""

from __future__ import annotations

METRIC_REQUESTS = "cachefleet_requests_total"
#: Histogram (seconds), labels cache, tenant, tier: whole request as the
#: client saw it.
METRIC_REQUEST_DURATION = "cachefleet_request_duration_seconds"
#: Histogram (seconds), labels cache, tenant: upstream call only.
METRIC_UPSTREAM_DURATION = "cachefleet_upstream_duration_seconds"
#: Histogram (seconds), labels cache, tenant, model: time to first token of model
#: answers (misses and bypasses, not hits): the first SSE data event of a streamed
#: answer, the whole answer otherwise, from the request's arrival.
METRIC_TTFT = "cachefleet_ttft_seconds"
#: Histogram (seconds), labels cache, tenant, model: inter-token latency, the mean gap
#: between the data events of one streamed model answer (one observation per answer).
METRIC_ITL = "cachefleet_itl_seconds"


#: Histogram (bytes of cache), labels cache, tenant: estimated requests by the
#: LRU partition size that would have made them hits (SHARDS-sampled reuse
#: distances, :mod:`cachefleet_sidecar.adapt.mrc`); first accesses only in ``+Inf``.
METRIC_REUSE_DISTANCE = "cachefleet_reuse_distance_bytes"


#: Counter (bytes), labels cache, tenant: estimated bytes of first accesses (the
#: distinct data a tenant has shown; with no reuse yet, whether it could still fit).
METRIC_REUSE_COLD_BYTES = "cachefleet_reuse_cold_bytes_total"


def promql_cold_bytes(cache: str, window: str) -> str:
    """Per-tenant bytes of first accesses over ``window``, added over pods."""
    return f'sum by (tenant) (increase({METRIC_REUSE_COLD_BYTES}{{cache="{cache}"}}[{window}]))'


#: Counter, labels cache, tenant, policy, size_bytes: estimated hits of a tenant's own
#: (non-LRU) policy simulated at ``size_bytes`` on the SHARDS sample.
METRIC_POLICY_CURVE_HITS = "cachefleet_policy_curve_hits_total"
#: Counter, labels cache, tenant, policy: estimated requests behind those hits.
METRIC_POLICY_CURVE_REQUESTS = "cachefleet_policy_curve_requests_total"


def _summed_rate(by: str, selector: str, window: str) -> str:
    """``sum by (<by>) (rate(<selector>[<window>]))``: a per-tenant series added over pods."""
    return f"sum by ({by}) (rate({selector}[{window}]))"


def promql_policy_hits(cache: str, window: str) -> str:
    """Per-tenant, per-policy mini-simulation hits by size, added over pods."""
    sel = f'{METRIC_POLICY_CURVE_HITS}{{cache="{cache}"}}'
    return _summed_rate("tenant, policy, size_bytes", sel, window)


def promql_policy_requests(cache: str, window: str) -> str:
    """Per-tenant, per-policy mini-simulation requests, added over pods."""
    return _summed_rate(
        "tenant, policy", f'{METRIC_POLICY_CURVE_REQUESTS}{{cache="{cache}"}}', window
    )


def promql_reuse_buckets(cache: str, window: str) -> str:
    """Per-tenant reuse-distance buckets, added over pods (the miss-ratio curve's data)."""
    return _summed_rate("tenant, le", f'{METRIC_REUSE_DISTANCE}_bucket{{cache="{cache}"}}', window)


def promql_upstream_buckets(cache: str, window: str) -> str:
    """Per-tenant upstream latency buckets (what a miss costs)."""
    sel = f'{METRIC_UPSTREAM_DURATION}_bucket{{cache="{cache}"}}'
    return _summed_rate("tenant, le", sel, window)


def promql_hit_buckets(cache: str, window: str) -> str:
    """Per-tenant latency buckets of hits (L1 and L2)."""
    sel = f'{METRIC_REQUEST_DURATION}_bucket{{cache="{cache}",tier=~"l1|l2"}}'
    return _summed_rate("tenant, le", sel, window)


def promql_lookups(cache: str, window: str) -> str:
    """Per-tenant cacheable lookups per second (hits and misses): the curve's true total."""
    sel = f'{METRIC_REQUESTS}{{cache="{cache}",result=~"hit|miss"}}'
    return _summed_rate("tenant", sel, window)


def promql_p95_seconds(cache: str, window: str) -> str:
    """Per-tenant p95 of request latency over ``window`` (e.g. ``"1m"``)."""
    return (
        "histogram_quantile(0.95, sum by (tenant, le) "
        f'(rate({METRIC_REQUEST_DURATION}_bucket{{cache="{cache}"}}[{window}])))'
    )


def promql_ttft_p95_seconds(cache: str, window: str) -> str:
    """Per-tenant p95 of time to first token over ``window`` (models and pods added)."""
    return (
        "histogram_quantile(0.95, sum by (tenant, le) "
        f'(rate({METRIC_TTFT}_bucket{{cache="{cache}"}}[{window}])))'
    )


def promql_itl_p95_seconds(cache: str, window: str) -> str:
    """Per-tenant p95 of streamed answers' mean inter-token latency over ``window``."""
    return (
        "histogram_quantile(0.95, sum by (tenant, le) "
        f'(rate({METRIC_ITL}_bucket{{cache="{cache}"}}[{window}])))'
    )


def promql_hit_ratio(cache: str, window: str) -> str:
    """Per-tenant hit ratio (hits over hits + misses; bypasses excluded).

    A tenant with misses but no hit series yet gets 0, not "no data".
    """
    sel = f'cache="{cache}"'
    hits = f'sum by (tenant) (rate({METRIC_REQUESTS}{{{sel},result="hit"}}[{window}]))'
    looked = f'sum by (tenant) (rate({METRIC_REQUESTS}{{{sel},result=~"hit|miss"}}[{window}]))'
    return f"({hits} or ({looked} * 0)) / {looked}"


def promql_rps(cache: str, window: str) -> str:
    """Per-tenant request rate (all results)."""
    return f'sum by (tenant) (rate({METRIC_REQUESTS}{{cache="{cache}"}}[{window}]))'


#: Counter, labels cache, tenant, from_policy, to_policy: L1 policy switches of a
#: sidecar's switching engine (to ``sits``) and their rollbacks (from ``sits``). The
#: sidecar exports each tenant's two series at 0 before its first switch, so that
#: a first switch is a change Prometheus can see (docs/sits.md).
METRIC_POLICY_SWITCHES = "cachefleet_policy_switches_total"


#: Counter (seconds), labels cache, tenant, model: upstream seconds cache hits avoided
#: (each entry records the upstream time of its fill; a hit adds it).
METRIC_SAVED_MODEL_SECONDS = "cachefleet_saved_model_seconds_total"
#: Counter (tokens), labels cache, tenant, model, kind (prompt, completion): tokens
#: cache hits kept from the model (the usage of the stored answers).
METRIC_SAVED_TOKENS = "cachefleet_saved_tokens_total"


#: Counter (price units), labels cache, tenant, model: what the saved tokens cost by
#: the sidecar's --price-table.
METRIC_SAVED_COST = "cachefleet_saved_cost_total"


def promql_saved_model_seconds(cache: str, window: str) -> str:
    """Per-tenant model seconds cache hits saved over ``window``, added over pods and models."""
    sel = f'{METRIC_SAVED_MODEL_SECONDS}{{cache="{cache}"}}'
    return f"sum by (tenant) (increase({sel}[{window}]))"


def promql_saved_tokens(cache: str, window: str) -> str:
    """Per-tenant, per-kind (prompt, completion) tokens saved over ``window``."""
    sel = f'{METRIC_SAVED_TOKENS}{{cache="{cache}"}}'
    return f"sum by (tenant, kind) (increase({sel}[{window}]))"


def promql_saved_cost(cache: str, window: str) -> str:
    """Per-tenant price of the saved tokens over ``window`` (sidecars with a price table)."""
    return f'sum by (tenant) (increase({METRIC_SAVED_COST}{{cache="{cache}"}}[{window}]))'


def promql_policy_switches(cache: str, span: str) -> str:
    """Per tenant and (from, to): how many series (pods) counted a switch over ``span``.

    Each series' value now minus its value ``span`` ago (``offset``), not
    ``increase()``: evaluated at instants that tile time (each query's span
    starts where the last one ended), these differences add up exactly, with no
    change lost between two scrapes that straddle a boundary. A series new
    within the span counts if it is above 0; a counter reset is not counted.
    """
    x = f'{METRIC_POLICY_SWITCHES}{{cache="{cache}"}}'
    return (
        "count by (tenant, from_policy, to_policy) "
        f"((({x} - ({x} offset {span})) > 0) or ({x} > 0 unless ({x} offset {span})))"
    )
