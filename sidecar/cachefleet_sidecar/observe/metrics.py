"""The sidecar's Prometheus metrics: the per-tenant request metrics, and the registry.

The request metrics (requests, latency, evictions, savings, faults, policy
switches, admission) are defined here. State that a part owns is exposed by
that part, one collector each, read at scrape time: the L2 tier
(:meth:`l2.RedisL2.families`), the epochs (:meth:`upkeep.Upkeep.families`), the
L3 (:meth:`l3.SemanticTier.families`), GPU telemetry
(:meth:`telemetry.GpuTelemetry.collect`), client limits
(:meth:`server.Limiter.families`), the upstream pool
(:meth:`upstream.UpstreamPool.families`), the curves, admission and the
unlisted tenants' pool (:func:`reuse_families`, :func:`admission_families`,
:func:`guest_families` below). All of them are
registered in one place, :func:`compose.build`.

The hit path must not pay for metrics: counters and histogram buckets are
plain integers in per-tenant objects (an increment and a ``bisect``), and a
custom collector turns them into Prometheus families when ``/metrics`` is
scraped. Gauges that describe state (bytes, quotas, policy, Redis, GPU) are
read from their owners at scrape time through callbacks, so there is one
source of truth for each. Every series carries ``cache="<ns>/<name>"``.

Each :class:`SidecarMetrics` owns a fresh ``CollectorRegistry``: no process
singletons, nothing for tests to reset.

Tenant label values are bounded: known tenants (:meth:`SidecarMetrics.set_reserved`)
always get their own series; other tenants get one until ``max_tenant_series``
tenants have series, after which they are counted together under
``tenant="_other"`` (a name no tenant can have: tenant names start with a
letter or digit). Series of tenants idle for a while are dropped
(:meth:`SidecarMetrics.expire_idle`). :meth:`SidecarMetrics.exposition` yields
the text in pieces of about half a millisecond of work each, so the admin
server can give the event loop back between pieces: a scrape never holds the
hit path for long.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from cachefleet_common.contract.promql import (
    METRIC_ITL,
    METRIC_POLICY_CURVE_HITS,
    METRIC_POLICY_CURVE_REQUESTS,
    METRIC_REQUEST_DURATION,
    METRIC_REQUESTS,
    METRIC_REUSE_COLD_BYTES,
    METRIC_REUSE_DISTANCE,
    METRIC_SAVED_COST,
    METRIC_SAVED_MODEL_SECONDS,
    METRIC_SAVED_TOKENS,
    METRIC_TTFT,
    METRIC_UPSTREAM_DURATION,
)
from cachefleet_common.prices import Saved
from cachefleet_sidecar.adapt.admission import Admission
from cachefleet_sidecar.adapt.mrc import MissRatioCurves

#: Latency buckets (seconds): from an L1 hit (well under a millisecond) to a long generation.
BUCKETS: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

#: Label value of the tenants beyond ``max_tenant_series`` (not a valid tenant name).
OTHER_TENANT = "_other"
#: Default bound on tenants with their own series (known tenants come on top).
DEFAULT_MAX_TENANT_SERIES = 64
#: CPU time one piece of the /metrics text may take before the loop gets a turn, seconds.
PIECE_BUDGET_S = 0.0005

#: Models with their own savings series per tenant; more go under ``model="_other"``.
MAX_MODEL_SERIES = 16
#: Longest model label value (a longer name is cut).
MAX_MODEL_LABEL = 128

#: Time-to-first-token buckets (seconds): a first token in 0.25-0.5 s has a bucket of its own.
TTFT_BUCKETS: tuple[float, ...] = (
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0
)  # fmt: skip
#: Inter-token latency buckets (seconds): 10-50 ms split at 25 ms.
ITL_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0
)  # fmt: skip

TIERS = ("l1", "l2", "l3", "upstream")
RESULTS = ("hit", "miss", "bypass", "error")


class Histogram:
    """Bucket counts as plain ints; ``observe`` is a bisect and two adds."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(BUCKETS, seconds)] += 1
        self.sum += seconds

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        acc = 0
        for bound, count in zip(BUCKETS, self.counts, strict=False):
            acc += count
            out.append((repr(bound), float(acc)))
        out.append(("+Inf", float(acc + self.counts[-1])))
        return out


class Buckets:
    """A histogram over given bounds (TTFT, ITL); ``observe`` is a bisect and two adds."""

    __slots__ = ("bounds", "counts", "le", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.le = (*(repr(bound) for bound in bounds), "+Inf")
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        acc = 0
        for le, count in zip(self.le, self.counts, strict=True):
            acc += count
            out.append((le, float(acc)))
        return out


@dataclass(slots=True)
class ModelAnswers:
    """Time to first token and inter-token latency of one model's answers to one tenant."""

    ttft: Buckets = field(default_factory=lambda: Buckets(TTFT_BUCKETS))
    itl: Buckets = field(default_factory=lambda: Buckets(ITL_BUCKETS))


_V = TypeVar("_V")


def _model_label(labels: dict[str, _V], model: str) -> str:
    """``model`` as a label value: cut to :data:`MAX_MODEL_LABEL`, ``_none`` when empty,
    ``_other`` once ``labels`` holds :data:`MAX_MODEL_SERIES` others."""
    label = model[:MAX_MODEL_LABEL] or "_none"
    if len(labels) >= MAX_MODEL_SERIES and label not in labels:
        return OTHER_TENANT
    return label


@dataclass(slots=True)
class TenantMetrics:
    """Everything counted per tenant; bound once, updated without locks."""

    requests: dict[tuple[str, str], int] = field(default_factory=dict)
    latency: dict[str, Histogram] = field(default_factory=dict)
    upstream: Histogram = field(default_factory=Histogram)
    evictions: dict[str, int] = field(default_factory=dict)
    #: L3 shadow-mode comparisons by outcome (agree, disagree, error).
    shadow: dict[str, int] = field(default_factory=dict)
    #: What hits saved the model, by model (at most :data:`MAX_MODEL_SERIES`, then "_other").
    saved: dict[str, Saved] = field(default_factory=dict)
    #: Cache-Control directives the tenant may not use, ignored, by directive.
    ignored: dict[str, int] = field(default_factory=dict)
    #: TTFT and ITL of model answers (not hits), by model (bounded as ``saved``).
    answers: dict[str, ModelAnswers] = field(default_factory=dict)

    def request(self, tier: str, result: str, seconds: float) -> None:
        key = (tier, result)
        self.requests[key] = self.requests.get(key, 0) + 1
        self.histogram(tier).observe(seconds)

    def histogram(self, tier: str) -> Histogram:
        """The latency histogram of ``tier``'s requests."""
        hist = self.latency.get(tier)
        if hist is None:
            hist = self.latency[tier] = Histogram()
        return hist

    def evicted(self, tier: str, count: int) -> None:
        if count:
            self.evictions[tier] = self.evictions.get(tier, 0) + count

    def saving(self, model: str) -> Saved:
        """The savings counters of ``model`` (label bounded, see :data:`MAX_MODEL_SERIES`)."""
        found = self.saved.get(model)
        if found is None:
            label = _model_label(self.saved, model)
            found = self.saved.get(label)
            if found is None:
                found = self.saved[label] = Saved()
        return found

    def answered(self, model: str, ttft_s: float, itl_s: float | None) -> None:
        """Count a model answer: its time to first token and, when streamed with two
        tokens or more, its mean inter-token latency (model label bounded as ``saving``)."""
        found = self.answers.get(model)
        if found is None:
            label = _model_label(self.answers, model)
            found = self.answers.get(label)
            if found is None:
                found = self.answers[label] = ModelAnswers()
        found.ttft.observe(ttft_s)
        if itl_s is not None:
            found.itl.observe(itl_s)

    def directive_ignored(self, directive: str) -> None:
        self.ignored[directive] = self.ignored.get(directive, 0) + 1

    def shadow_compared(self, outcome: str) -> None:
        """Count one L3 shadow comparison (its would-be hit against upstream's answer)."""
        self.shadow[outcome] = self.shadow.get(outcome, 0) + 1


@dataclass(frozen=True, slots=True)
class TierUsage:
    """Bytes used and quota of one tenant in one tier."""

    tenant: str
    tier: str
    used_bytes: int
    quota_bytes: int
    policy: str | None = None


class SidecarMetrics:
    """All sidecar metrics for one cache, with its own registry."""

    def __init__(self, cache: str, max_tenant_series: int = DEFAULT_MAX_TENANT_SERIES) -> None:
        self.cache = cache
        self.max_tenant_series = max_tenant_series
        self.reserved: frozenset[str] = frozenset()
        self.tenants: dict[str, TenantMetrics] = {}
        #: Coarse clock for idleness (advanced with :meth:`expire_idle`) and last use per tenant.
        self.tick = 0
        self._seen: dict[str, int] = {}
        self.cache_faults: dict[str, int] = {}
        self.single_flight_joins = 0
        self.cross_tenant_hits = 0
        #: Requests whose identity was refused or overridden, by reason.
        self.identity_mismatches: dict[str, int] = {}
        self.policy_switches: dict[tuple[str, str, str], int] = {}
        #: Admission refusals by (tenant, class, reason), and Standard waits by tenant.
        self.admission_refusals: dict[tuple[str, str, str], int] = {}
        self.admission_waits: dict[str, int] = {}
        #: Requests the rate limits refused, by (tenant, reason) (docs/rate-limits.md).
        self.rate_limited_requests: dict[tuple[str, str], int] = {}
        self.usage_source: Callable[[], Iterable[TierUsage]] = list
        self.gauge_sources: list[Callable[[], Iterable[Metric]]] = []
        #: Called before the counters are read (:meth:`flush`): whoever counts in batches
        #: (the L1 hits' book) applies what it holds, so a scrape is exact.
        self.flushers: list[Callable[[], None]] = []
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    def flush(self) -> None:
        """Apply every batch of counts not applied yet (before the counters are read)."""
        for flush in self.flushers:
            flush()

    def tenant(self, tenant: str) -> TenantMetrics:
        tm = self.tenants.get(tenant)
        if tm is None:
            if len(self.tenants) >= self.max_tenant_series and tenant not in self.reserved:
                tenant = OTHER_TENANT
                tm = self.tenants.get(tenant)
            if tm is None:
                tm = self.tenants[tenant] = TenantMetrics()
        self._seen[tenant] = self.tick
        return tm

    def set_reserved(self, tenants: Iterable[str]) -> None:
        """Tenants that always get their own series (the known ones: a bounded set)."""
        self.reserved = frozenset(tenants)

    def forget(self, tenant: str) -> None:
        """Drop a tenant's series (it expired; a later request starts them again from 0)."""
        self.tenants.pop(tenant, None)
        self._seen.pop(tenant, None)
        self.admission_waits.pop(tenant, None)
        for key in [k for k in self.admission_refusals if k[0] == tenant]:
            del self.admission_refusals[key]
        for limited in [k for k in self.rate_limited_requests if k[0] == tenant]:
            del self.rate_limited_requests[limited]

    def _label(self, tenant: str) -> str:
        """The tenant label value under the series bound (as :meth:`tenant` decides it)."""
        if (
            tenant in self.tenants
            or tenant in self.reserved
            or len(self.tenants) < self.max_tenant_series
        ):
            return tenant
        return OTHER_TENANT

    def admission_refused(self, tenant: str, priority_class: str, reason: str) -> None:
        """Count a request admission refused (docs/admission.md)."""
        key = (self._label(tenant), priority_class, reason)
        self.admission_refusals[key] = self.admission_refusals.get(key, 0) + 1

    def rate_limited(self, tenant: str, reason: str) -> None:
        """Count a request the rate limits refused (reason: the bucket: requests, tokens,
        tokens_per_day)."""
        key = (self._label(tenant), reason)
        self.rate_limited_requests[key] = self.rate_limited_requests.get(key, 0) + 1

    def admission_waited(self, tenant: str) -> None:
        """Count a Standard request that had to wait for room."""
        label = self._label(tenant)
        self.admission_waits[label] = self.admission_waits.get(label, 0) + 1

    def expire_idle(self, max_idle_ticks: int) -> list[str]:
        """Advance the clock; drop series of tenants unused for more than ``max_idle_ticks``."""
        self.tick += 1
        limit = self.tick - max_idle_ticks
        gone = [t for t, seen in self._seen.items() if seen < limit]
        for tenant in gone:
            self.forget(tenant)
        return gone

    def fault(self, kind: str) -> None:
        """Count a cache fault that was absorbed (request served upstream)."""
        self.cache_faults[kind] = self.cache_faults.get(kind, 0) + 1

    def identity_mismatch(self, reason: str) -> None:
        """Count a request whose claimed identity was refused or overridden (docs/security.md)."""
        self.identity_mismatches[reason] = self.identity_mismatches.get(reason, 0) + 1

    def policy_switch(self, tenant: str, old: str, new: str) -> None:
        key = (tenant, old, new)
        self.policy_switches[key] = self.policy_switches.get(key, 0) + 1

    def forget_policy_switches(self, tenant: str) -> None:
        """Drop a tenant's switch series (its L1 partition expired; not read as a switch)."""
        for key in [k for k in self.policy_switches if k[0] == tenant]:
            del self.policy_switches[key]

    def expect_policy_switches(self, tenant: str, policy: str, target: str) -> None:
        """Export ``tenant``'s switch (policy -> target) and rollback series at 0 until used.

        A counter series that first appears at 1 shows Prometheus no change, so
        the operator would never see a tenant's first switch (docs/sits.md).
        """
        self.policy_switches.setdefault((tenant, policy, target), 0)
        self.policy_switches.setdefault((tenant, target, policy), 0)

    def render(self) -> bytes:
        return b"".join(self.exposition())

    def exposition(self, budget_s: float = PIECE_BUDGET_S) -> Iterator[bytes]:
        """The text exposition in pieces, each made in about ``budget_s`` of CPU.

        The per-tenant families (the bulk) are formatted here directly, a
        tenant at a time, and a piece is cut whenever its budget is spent;
        each family keeps one HELP/TYPE header. Everything else comes last,
        in one piece from ``prometheus_client``.
        """
        self.flush()
        tenants = list(self.tenants.items())
        clock = time.perf_counter
        for name, kind, help_text, lines_of in _TENANT_TEXT:
            out = [f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n"]
            started = clock()
            for tenant, tm in tenants:
                out += lines_of(f'cache="{_esc(self.cache)}",tenant="{_esc(tenant)}"', tm)
                if clock() - started >= budget_s:
                    yield "".join(out).encode()
                    out = []
                    started = clock()
            if out:
                yield "".join(out).encode()
        yield generate_latest(_Families(_Collector(self).shared()))


def _esc(value: str) -> str:
    """A label value escaped for the text format."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


_LE = (*(repr(bound) for bound in BUCKETS), "+Inf")


def _histogram_lines(
    name: str, labels: str, hist: Histogram | Buckets, les: tuple[str, ...] = _LE
) -> list[str]:
    out = []
    acc = 0
    for le, count in zip(les, hist.counts, strict=True):
        acc += count
        out.append(f'{name}_bucket{{{labels},le="{le}"}} {acc}\n')
    out.append(f"{name}_count{{{labels}}} {acc}\n")
    out.append(f"{name}_sum{{{labels}}} {hist.sum!r}\n")
    return out


def _requests_text(labels: str, tm: TenantMetrics) -> list[str]:
    return [
        f'{METRIC_REQUESTS}{{{labels},tier="{tier}",result="{result}"}} {count}\n'
        for (tier, result), count in list(tm.requests.items())
    ]


def _latency_text(labels: str, tm: TenantMetrics) -> list[str]:
    out: list[str] = []
    for tier, hist in list(tm.latency.items()):
        out += _histogram_lines(METRIC_REQUEST_DURATION, f'{labels},tier="{tier}"', hist)
    return out


def _upstream_text(labels: str, tm: TenantMetrics) -> list[str]:
    if not any(tm.upstream.counts):
        return []
    return _histogram_lines(METRIC_UPSTREAM_DURATION, labels, tm.upstream)


def _evictions_text(labels: str, tm: TenantMetrics) -> list[str]:
    return [
        f'cachefleet_evictions_total{{{labels},tier="{tier}"}} {count}\n'
        for tier, count in list(tm.evictions.items())
    ]


def _shadow_text(labels: str, tm: TenantMetrics) -> list[str]:
    return [
        f'{METRIC_L3_SHADOW}{{{labels},outcome="{outcome}"}} {count}\n'
        for outcome, count in list(tm.shadow.items())
    ]


def _saved_text(labels: str, tm: TenantMetrics) -> list[str]:
    out = []
    for model, saved in list(tm.saved.items()):
        where = f'{labels},model="{_esc(model)}"'
        prompt, completion = saved.prompt_tokens, saved.completion_tokens
        out.append(f'{METRIC_SAVED_TOKENS}{{{where},kind="prompt"}} {prompt}\n')
        out.append(f'{METRIC_SAVED_TOKENS}{{{where},kind="completion"}} {completion}\n')
    return out


def _saved_seconds_text(labels: str, tm: TenantMetrics) -> list[str]:
    return [
        f'{METRIC_SAVED_MODEL_SECONDS}{{{labels},model="{_esc(m)}"}} {s.model_seconds!r}\n'
        for m, s in list(tm.saved.items())
    ]


def _saved_cost_text(labels: str, tm: TenantMetrics) -> list[str]:
    return [
        f'{METRIC_SAVED_COST}{{{labels},model="{_esc(m)}"}} {s.cost!r}\n'
        for m, s in list(tm.saved.items())
        if s.cost
    ]


def _ttft_text(labels: str, tm: TenantMetrics) -> list[str]:
    out: list[str] = []
    for model, answers in list(tm.answers.items()):
        hist = answers.ttft
        out += _histogram_lines(METRIC_TTFT, f'{labels},model="{_esc(model)}"', hist, hist.le)
    return out


def _itl_text(labels: str, tm: TenantMetrics) -> list[str]:
    out: list[str] = []
    for model, answers in list(tm.answers.items()):
        hist = answers.itl
        if any(hist.counts):
            out += _histogram_lines(METRIC_ITL, f'{labels},model="{_esc(model)}"', hist, hist.le)
    return out


def _ignored_text(labels: str, tm: TenantMetrics) -> list[str]:
    return [
        f'{METRIC_DIRECTIVES_IGNORED}{{{labels},directive="{d}"}} {count}\n'
        for d, count in list(tm.ignored.items())
    ]


METRIC_DIRECTIVES_IGNORED = "cachefleet_cache_control_ignored_total"
HELP_SAVED_TOKENS = (
    "Tokens not sent to the model because a cache hit answered, by model and kind "
    "(prompt, completion: the usage of the stored answer)."
)
HELP_SAVED_SECONDS = (
    "Model seconds cache hits avoided: the upstream time recorded when each entry was filled."
)
HELP_SAVED_COST = (
    "What the tokens cache hits saved would have cost, by the --price-table prices "
    "(per 1k tokens; no currency)."
)
HELP_DIRECTIVES_IGNORED = (
    "Cache-Control request directives ignored because the tenant may not use them "
    "(InferenceCache tenants[].cacheControl)."
)
METRIC_L3_SHADOW = "cachefleet_l3_shadow_comparisons_total"
HELP_L3_SHADOW = (
    "L3 shadow mode: would-be L3 hits sent upstream, by whether upstream's answer agreed "
    "with the one L3 would have served (agree, disagree, error: not comparable)."
)
HELP_REQUESTS = "Requests by tenant, the tier that answered and the result."
HELP_LATENCY = "Request latency as the client saw it, by tier that answered."
HELP_UPSTREAM = "Latency of upstream (model server) calls."
HELP_EVICTIONS = "Entries evicted to stay within a tenant's quota."
HELP_TTFT = (
    "Time to first token of model answers (misses and bypasses, 2xx; not hits), by model: "
    "from the request's arrival to the first SSE data event, the whole answer when not streamed."
)
HELP_ITL = (
    "Inter-token latency of streamed model answers with two data events or more, by model: "
    "the mean gap between the answer's data events."
)

#: The per-tenant families as text: (name, type, help, lines of one tenant).
_TENANT_TEXT: tuple[tuple[str, str, str, Callable[[str, TenantMetrics], list[str]]], ...] = (
    (METRIC_REQUESTS, "counter", HELP_REQUESTS, _requests_text),
    (METRIC_REQUEST_DURATION, "histogram", HELP_LATENCY, _latency_text),
    (METRIC_UPSTREAM_DURATION, "histogram", HELP_UPSTREAM, _upstream_text),
    ("cachefleet_evictions_total", "counter", HELP_EVICTIONS, _evictions_text),
    (METRIC_L3_SHADOW, "counter", HELP_L3_SHADOW, _shadow_text),
    (METRIC_SAVED_TOKENS, "counter", HELP_SAVED_TOKENS, _saved_text),
    (METRIC_SAVED_MODEL_SECONDS, "counter", HELP_SAVED_SECONDS, _saved_seconds_text),
    (METRIC_SAVED_COST, "counter", HELP_SAVED_COST, _saved_cost_text),
    (METRIC_DIRECTIVES_IGNORED, "counter", HELP_DIRECTIVES_IGNORED, _ignored_text),
    (METRIC_TTFT, "histogram", HELP_TTFT, _ttft_text),
    (METRIC_ITL, "histogram", HELP_ITL, _itl_text),
)


class _Families:
    """A registry stand-in that collects given families (for ``generate_latest``)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


TenantItems = Sequence[tuple[str, TenantMetrics]]


def _requests(cache: str, tenants: TenantItems) -> Metric:
    reqs = CounterMetricFamily(
        METRIC_REQUESTS.removesuffix("_total"),
        HELP_REQUESTS,
        labels=["cache", "tenant", "tier", "result"],
    )
    for tenant, tm in tenants:
        for (tier, result), count in list(tm.requests.items()):
            reqs.add_metric([cache, tenant, tier, result], count)
    return reqs


def _latency(cache: str, tenants: TenantItems) -> Metric:
    lat = HistogramMetricFamily(
        METRIC_REQUEST_DURATION,
        HELP_LATENCY,
        labels=["cache", "tenant", "tier"],
        unit="",
    )
    for tenant, tm in tenants:
        for tier, hist in list(tm.latency.items()):
            lat.add_metric([cache, tenant, tier], hist.cumulative(), hist.sum)
    return lat


def _upstream(cache: str, tenants: TenantItems) -> Metric:
    up = HistogramMetricFamily(
        METRIC_UPSTREAM_DURATION,
        HELP_UPSTREAM,
        labels=["cache", "tenant"],
    )
    for tenant, tm in tenants:
        if any(tm.upstream.counts):
            up.add_metric([cache, tenant], tm.upstream.cumulative(), tm.upstream.sum)
    return up


def _evictions(cache: str, tenants: TenantItems) -> Metric:
    ev = CounterMetricFamily(
        "cachefleet_evictions",
        HELP_EVICTIONS,
        labels=["cache", "tenant", "tier"],
    )
    for tenant, tm in tenants:
        for tier, count in list(tm.evictions.items()):
            ev.add_metric([cache, tenant, tier], count)
    return ev


def _saved(cache: str, tenants: TenantItems) -> Metric:
    fam = CounterMetricFamily(
        METRIC_SAVED_TOKENS.removesuffix("_total"),
        HELP_SAVED_TOKENS,
        labels=["cache", "tenant", "model", "kind"],
    )
    for tenant, tm in tenants:
        for model, saved in list(tm.saved.items()):
            fam.add_metric([cache, tenant, model, "prompt"], saved.prompt_tokens)
            fam.add_metric([cache, tenant, model, "completion"], saved.completion_tokens)
    return fam


def _saved_seconds(cache: str, tenants: TenantItems) -> Metric:
    fam = CounterMetricFamily(
        METRIC_SAVED_MODEL_SECONDS.removesuffix("_total"),
        HELP_SAVED_SECONDS,
        labels=["cache", "tenant", "model"],
    )
    for tenant, tm in tenants:
        for model, saved in list(tm.saved.items()):
            fam.add_metric([cache, tenant, model], saved.model_seconds)
    return fam


def _saved_cost(cache: str, tenants: TenantItems) -> Metric:
    fam = CounterMetricFamily(
        METRIC_SAVED_COST.removesuffix("_total"),
        HELP_SAVED_COST,
        labels=["cache", "tenant", "model"],
    )
    for tenant, tm in tenants:
        for model, saved in list(tm.saved.items()):
            if saved.cost:
                fam.add_metric([cache, tenant, model], saved.cost)
    return fam


def _ignored(cache: str, tenants: TenantItems) -> Metric:
    fam = CounterMetricFamily(
        METRIC_DIRECTIVES_IGNORED.removesuffix("_total"),
        HELP_DIRECTIVES_IGNORED,
        labels=["cache", "tenant", "directive"],
    )
    for tenant, tm in tenants:
        for directive, count in list(tm.ignored.items()):
            fam.add_metric([cache, tenant, directive], count)
    return fam


def _token_family(name: str, help_text: str, part: str) -> Callable[[str, TenantItems], Metric]:
    """The TTFT or ITL family (``part``: the :class:`ModelAnswers` field)."""

    def build(cache: str, tenants: TenantItems) -> Metric:
        fam = HistogramMetricFamily(name, help_text, labels=["cache", "tenant", "model"])
        for tenant, tm in tenants:
            for model, answers in list(tm.answers.items()):
                hist: Buckets = getattr(answers, part)
                if any(hist.counts) or part == "ttft":
                    fam.add_metric([cache, tenant, model], hist.cumulative(), hist.sum)
        return fam

    return build


_TENANT_FAMILIES: tuple[Callable[[str, TenantItems], Metric], ...] = (
    _requests,
    _latency,
    _upstream,
    _evictions,
    _saved,
    _saved_seconds,
    _saved_cost,
    _ignored,
    _token_family(METRIC_TTFT, HELP_TTFT, "ttft"),
    _token_family(METRIC_ITL, HELP_ITL, "itl"),
)


class _Collector(Collector):
    def __init__(self, metrics: SidecarMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        self.m.flush()
        tenants = list(self.m.tenants.items())
        for build in _TENANT_FAMILIES:
            yield build(self.m.cache, tenants)
        yield from self.shared()

    def shared(self) -> Iterator[Metric]:
        """Every family that is not a per-tenant request counter or histogram."""
        m = self.m
        cache = m.cache

        used = GaugeMetricFamily(
            "cachefleet_cache_bytes",
            "Bytes in cache by tenant and tier.",
            labels=["cache", "tenant", "tier"],
        )
        quota = GaugeMetricFamily(
            "cachefleet_cache_quota_bytes",
            "Byte quota by tenant and tier.",
            labels=["cache", "tenant", "tier"],
        )
        policy = GaugeMetricFamily(
            "cachefleet_policy_info",
            "L1 policy in force for a tenant (1 for the policy in force).",
            labels=["cache", "tenant", "policy"],
        )
        # A tenant without series of its own (beyond the bound) is summed into _other,
        # so the byte gauges name no more tenants than the request counters do.
        sums: dict[tuple[str, str], list[int]] = {}
        policies: set[tuple[str, str]] = set()
        for u in m.usage_source():
            label = u.tenant if u.tenant in m.tenants or u.tenant in m.reserved else OTHER_TENANT
            both = sums.setdefault((label, u.tier), [0, 0])
            both[0] += u.used_bytes
            both[1] += u.quota_bytes
            if u.policy is not None:
                policies.add((label, u.policy))
        for (label, tier), (used_bytes, quota_bytes) in sums.items():
            used.add_metric([cache, label, tier], used_bytes)
            quota.add_metric([cache, label, tier], quota_bytes)
        for label, name in sorted(policies):
            policy.add_metric([cache, label, name], 1)
        yield from (used, quota, policy)

        switches = CounterMetricFamily(
            "cachefleet_policy_switches",
            "L1 policy switches by tenant.",
            labels=["cache", "tenant", "from_policy", "to_policy"],
        )
        for (tenant, old, new), count in list(m.policy_switches.items()):
            switches.add_metric([cache, tenant, old, new], count)
        faults = CounterMetricFamily(
            "cachefleet_cache_faults",
            "Cache faults absorbed by serving from upstream, by kind.",
            labels=["cache", "kind"],
        )
        for kind, count in list(m.cache_faults.items()):
            faults.add_metric([cache, kind], count)
        joins = CounterMetricFamily(
            "cachefleet_single_flight_joins",
            "Requests that waited for an identical in-flight miss instead of calling upstream.",
            labels=["cache"],
        )
        joins.add_metric([cache], m.single_flight_joins)
        contamination = CounterMetricFamily(
            "cachefleet_cross_tenant_hits",
            "Cache hits whose entry belongs to another tenant than the authenticated requester "
            "(the CTCCI numerator); caught by the owner check, not served (must be 0).",
            labels=["cache"],
        )
        contamination.add_metric([cache], m.cross_tenant_hits)
        mismatches = CounterMetricFamily(
            "cachefleet_identity_mismatches",
            "Requests whose claimed tenant was refused or overridden, by reason "
            "(header_ignored, untrusted_header, missing_key, invalid_key, ambiguous).",
            labels=["cache", "reason"],
        )
        for reason, count in list(m.identity_mismatches.items()):
            mismatches.add_metric([cache, reason], count)
        yield from (switches, faults, joins, contamination, mismatches)
        refused = CounterMetricFamily(
            "cachefleet_admission_refused",
            "Requests admission refused while the model server was saturated, by tenant, class "
            "and reason (saturated_queue, saturated_kv: 429 BestEffort; queue_full: 429, "
            "queue_timeout: 503 Standard).",
            labels=["cache", "tenant", "class", "reason"],
        )
        for (tenant, cls, reason), count in list(m.admission_refusals.items()):
            refused.add_metric([cache, tenant, cls, reason], count)
        waited = CounterMetricFamily(
            "cachefleet_admission_waited",
            "Standard requests that waited for room at the saturated model server, by tenant.",
            labels=["cache", "tenant"],
        )
        for tenant, count in list(m.admission_waits.items()):
            waited.add_metric([cache, tenant], count)
        yield from (refused, waited)
        limited = CounterMetricFamily(
            "cachefleet_rate_limited",
            "Requests refused with 429 by the per-tenant rate limits, by tenant and reason "
            "(requests, tokens, tokens_per_day).",
            labels=["cache", "tenant", "reason"],
        )
        for (tenant, reason), count in list(m.rate_limited_requests.items()):
            limited.add_metric([cache, tenant, reason], count)
        yield limited
        for source in m.gauge_sources:
            yield from source()


@dataclass(frozen=True, slots=True)
class GuestPool:
    """The unlisted tenants ("guests", ``tenantDefaults``) as one pod sees them."""

    #: Unlisted tenants holding an L1 partition on this pod.
    guests: int
    #: The L2 pool's (bytes used, limit), fleet-wide as last read; None: no L2 pool.
    l2: tuple[int, int] | None


def guest_families(cache: str, source: Callable[[], GuestPool | None]) -> Iterator[Metric]:
    """The guests' gauges, read at scrape time; none while unlisted tenants are not admitted."""
    pool = source()
    if pool is None:
        return
    guests = GaugeMetricFamily(
        "cachefleet_guests",
        "Unlisted tenants (tenantDefaults, --guest-share) holding an L1 partition on this pod.",
        labels=["cache"],
    )
    guests.add_metric([cache], pool.guests)
    yield guests
    if pool.l2 is None:
        return
    used = GaugeMetricFamily(
        "cachefleet_guest_pool_bytes",
        "Bytes the unlisted tenants' pool holds, by tier (l2: fleet-wide, the same on every "
        "pod: aggregate with max, not sum).",
        labels=["cache", "tier"],
    )
    used.add_metric([cache, "l2"], pool.l2[0])
    quota = GaugeMetricFamily(
        "cachefleet_guest_pool_quota_bytes",
        "Byte quota of the unlisted tenants' pool, by tier (l2: tenantDefaults.l2Share of "
        "the fleet's L2, fleet-wide).",
        labels=["cache", "tier"],
    )
    quota.add_metric([cache, "l2"], pool.l2[1])
    yield from (used, quota)


def admission_families(cache: str, state: Admission) -> Iterator[Metric]:
    """The admission state of one sidecar's model server, read at scrape time."""
    shedding = GaugeMetricFamily(
        "cachefleet_admission_shedding",
        "1 while the model server is saturated and admission sheds or queues misses.",
        labels=["cache"],
    )
    shedding.add_metric([cache], 0.0 if state.shedding_since is None else 1.0)
    queued = GaugeMetricFamily(
        "cachefleet_admission_queued_requests",
        "Standard requests waiting in the sidecar for room at the model server.",
        labels=["cache"],
    )
    queued.add_metric([cache], state.queued)
    starts = CounterMetricFamily(
        "cachefleet_admission_shedding_starts",
        "Times shedding started (the model server became saturated).",
        labels=["cache"],
    )
    starts.add_metric([cache], state.shedding_starts)
    faults = CounterMetricFamily(
        "cachefleet_admission_metrics_faults",
        "Readings of the model server's /metrics that failed (each taken as not saturated).",
        labels=["cache"],
    )
    faults.add_metric([cache], state.faults)
    yield from (shedding, queued, starts, faults)


def reuse_families(cache: str, curves: MissRatioCurves) -> Iterator[Metric]:
    """The per-tenant reuse-distance histograms (:data:`METRIC_REUSE_DISTANCE`)."""
    family = HistogramMetricFamily(
        METRIC_REUSE_DISTANCE,
        "Estimated cacheable requests by the LRU partition bytes that would have made them "
        "hits (SHARDS sample; first accesses only in +Inf).",
        labels=["cache", "tenant"],
    )
    cold = CounterMetricFamily(
        METRIC_REUSE_COLD_BYTES.removesuffix("_total"),
        "Estimated bytes of first accesses: how much distinct data a tenant has shown.",
        labels=["cache", "tenant"],
    )
    sampled = GaugeMetricFamily(
        "cachefleet_mrc_sampling_ratio",
        "Share of a tenant's keys its miss-ratio curve tracks (SHARDS rate).",
        labels=["cache", "tenant"],
    )
    for tenant, snap in curves.snapshots():
        buckets = [
            ("+Inf" if bound == float("inf") else repr(bound), count)
            for bound, count in snap.cumulative()
        ]
        family.add_metric([cache, tenant], buckets, snap.sum_bytes)
        sampled.add_metric([cache, tenant], snap.rate)
        cold.add_metric([cache, tenant], snap.cold_bytes)
    yield from (family, cold, sampled)
    hits = CounterMetricFamily(
        METRIC_POLICY_CURVE_HITS.removesuffix("_total"),
        "Estimated hits of the tenant's own policy simulated at size_bytes (mini-simulation).",
        labels=["cache", "tenant", "policy", "size_bytes"],
    )
    looked = CounterMetricFamily(
        METRIC_POLICY_CURVE_REQUESTS.removesuffix("_total"),
        "Estimated requests behind the mini-simulation's hits.",
        labels=["cache", "tenant", "policy"],
    )
    for tenant, curve in curves.policy_curves():
        for size, count in zip(curve.sizes, curve.hits, strict=True):
            hits.add_metric([cache, tenant, curve.policy, str(size)], count)
        looked.add_metric([cache, tenant, curve.policy], curve.requests)
    yield from (hits, looked)
