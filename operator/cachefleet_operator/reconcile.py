"""One reconcile of an InferenceCache, independent of kopf.

:class:`Reconciler` reads metrics, allocates, publishes to the sidecars and
returns an :class:`Outcome`: the status patch, the Events to emit and the
kind of failure, if any. ``handlers.py`` turns an Outcome into kopf terms
(status patch, ``kopf.event``, ``TemporaryError`` / ``PermanentError``), so
the logic here is tested with fakes and no Kubernetes at all.

Model version: when ``spec.model.version`` differs from the version in the
status, the model scope's epoch is advanced to one past the epoch the status
recorded with the old version (CAS, fence, announce, see
:mod:`cachefleet_operator.invalidation`; a reconcile whose status patch was
lost finds Redis already there and does not advance twice) and the reconcile waits up to
:data:`~cachefleet_operator.invalidation.MODEL_ACK_WAIT_S` for the
acknowledgements; status then shows ``modelVersion``, the epochs and
``sidecars.epochsInSync`` (re-read on every reconcile, so convergence shows
up even when it took longer). Every reconcile also merges the epochs of the
status back into Redis (max only), so a Redis that restarted without
persistence never goes back to older epochs.

Rate limits: every reconcile that publishes also reads the buckets the
sidecars keep for each tenant with ``limits`` (on Redis's clock) and writes
``status.tenants[].limits``: each limit, used, remaining, seconds to full
(:func:`~cachefleet_operator.cache_status.limits_usage`, the arithmetic of the
sidecars' ``x-ratelimit-*`` headers). A failed read leaves the usage out, never
a fault.

Fault policy: Prometheus unreachable or without data -> the last allocation
is kept (or a class-based one on first sight), ``Degraded``; Redis
unreachable -> nothing new is recorded as in force, ``Ready=False``,
``Degraded``; both are temporary. An invalid spec -> ``Ready=False`` with the
field named, a Warning Event, and a permanent failure (no retry storm).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from redis.exceptions import RedisError

from cachefleet_common.contract.fleet import decode_fleet_batch
from cachefleet_common.contract.messages import QuotaAssignment
from cachefleet_common.contract.names import cache_ref
from cachefleet_common.contract.ops import read_epochs, restore_epochs
from cachefleet_common.epochs import model_scope
from cachefleet_operator.allocation import (
    Allocation,
    AllocationParams,
    MetricsTable,
    TenantDemand,
    TenantMetrics,
    allocate,
    describe_moves,
    hold,
    quota_moves,
)
from cachefleet_operator.api import (
    Condition,
    ConditionStatus,
    InferenceCacheSpec,
    InferenceCacheStatus,
    RedisEndpoint,
    SidecarStatus,
    SpecError,
    TenantLimitsUsage,
    TenantSpec,
    listed_l1_bytes,
    listed_l2_bytes,
    parse_redis_endpoint,
    parse_spec,
)
from cachefleet_operator.assignment import (
    assignment_digest,
    build_assignment,
    demands_from_spec,
    slo_targets,
    tenant_limits,
)
from cachefleet_operator.cache_status import (
    DEGRADED,
    READY,
    SLA_VIOLATED,
    condition,
    limits_usage,
    policy_switch_events,
    previous_status,
    routing_status,
    saved_model_hours,
    savings_status,
    set_condition,
    shedding_events,
    sla_condition,
    tenant_status,
)
from cachefleet_operator.fleet import FleetCurves
from cachefleet_operator.invalidation import (
    MODEL_ACK_WAIT_S,
    InvalidatorFactory,
    redis_invalidator,
)
from cachefleet_operator.metrics import OperatorMetrics
from cachefleet_operator.metrics_source import (
    MetricsSource,
    MetricsSourceFactory,
    MetricsUnavailable,
    PolicySwitchSource,
    SavingsSource,
    prometheus_source,
)
from cachefleet_operator.outcome import (
    Event,
    Outcome,
    SecretUnavailable,
    now_rfc3339,
    parse_rfc3339,
)
from cachefleet_operator.pressure import TenantPressure, slo_pressure
from cachefleet_operator.publisher import (
    ControlPlane,
    ControlPlaneFactory,
    ControlPlaneUnavailable,
    redis_control_plane,
)
from cachefleet_operator.reach import (
    CACHE_CANNOT_MEET_SLA,
    ReachWarnings,
    reach_condition,
    reach_evidence,
    tenants_named,
    window_seconds,
)

log = logging.getLogger(__name__)

#: Share moves smaller than this (fraction of capacity) are not announced as Events.
EVENT_MIN_MOVE = 0.005
#: First retry delay after a temporary fault, seconds; doubles per retry.
RETRY_BASE_DELAY_S = 2.0
#: Longest retry delay after a temporary fault, seconds.
RETRY_MAX_DELAY_S = 60.0
#: Shortest span of policy switches worth a query: a reconcile sooner than this
#: after the last report leaves the span to the next one (nothing is lost).
POLICY_EVENTS_MIN_SPAN_S = 5.0
#: Longest span one reconcile reports (after a long outage, older switches are not).
POLICY_EVENTS_MAX_SPAN_S = 3600.0


class SecretReader(Protocol):
    """Reads one key of a Secret (injectable; the default uses the Kubernetes API)."""

    async def read(self, namespace: str, name: str, key: str) -> str: ...


def retry_delay(retry: int) -> float:
    """Backoff before retry number ``retry`` (0-based)."""
    return min(RETRY_MAX_DELAY_S, RETRY_BASE_DELAY_S * (2.0 ** max(0, min(retry, 16))))


async def _savings(
    source: MetricsSource | None, cache: str, spec: InferenceCacheSpec
) -> dict[str, dict[str, float]] | None:
    """Per-tenant savings over the window; None when unknown (never a fault)."""
    if source is None or not isinstance(source, SavingsSource):
        return None
    try:
        return await source.savings(cache, spec.prometheus.window)
    except MetricsUnavailable:
        return None


async def _read_limits_usage(
    plane: ControlPlane, cache: str, spec: InferenceCacheSpec
) -> dict[str, TenantLimitsUsage] | None:
    """Each limited tenant's usage against its limits, from the buckets the sidecars
    keep in Redis; None when there are none or they could not be read (never a fault:
    the quotas were published, the usage is only shown)."""
    limited = tenant_limits(spec)
    if not limited:
        return None
    try:
        now_ms, tats = await plane.rate_limit_state(cache, sorted(limited))
    except (ControlPlaneUnavailable, RedisError, OSError) as exc:
        log.debug("%s: rate-limit usage not read: %s", cache, exc)
        return None
    return {
        tenant: limits_usage(limits, tats.get(tenant, [0.0, 0.0, 0.0]), now_ms)
        for tenant, limits in limited.items()
    }


def _pressure(
    spec: InferenceCacheSpec,
    metrics: Mapping[str, TenantMetrics] | None,
    allocation: Allocation,
) -> float | None:
    """SLO pressure of the cache from this reconcile's metrics (None when unknown).

    Whether cache can still help a tenant comes from the allocation: no when no
    share within bounds meets its SLA (``cannot_meet``), yes when its curve
    says one does, unknown without a curve.
    """
    if metrics is None:
        return None
    by_name = allocation.by_name()

    def can_help(name: str) -> bool | None:
        t = by_name.get(name)
        if t is None or t.predicted_hit_ratio is None:
            return None
        return not t.why_not

    def pressure_of(t: TenantSpec) -> TenantPressure:
        m, sla = metrics.get(t.name), t.sla
        return TenantPressure(
            p95_s=None if m is None else m.p95_s,
            p95_target_s=sla.p95_latency_seconds if sla else None,
            priority_class=t.priority_class,
            cache_can_help=can_help(t.name),
            ttft_s=None if m is None else m.ttft_p95_s,
            ttft_target_s=sla.ttft_p95_seconds if sla else None,
            itl_s=None if m is None else m.itl_p95_s,
            itl_target_s=sla.itl_p95_seconds if sla else None,
        )

    return slo_pressure(map(pressure_of, spec.tenants))


@dataclasses.dataclass
class _Run:
    """One reconcile's inputs and what its steps found: faults, Events, conditions."""

    namespace: str
    name: str
    cache: str
    generation: int | None
    now: str
    spec: InferenceCacheSpec
    previous: InferenceCacheStatus
    conditions: list[Condition] = dataclasses.field(default_factory=list)
    faults: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    events: list[Event] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        tenants = self.previous.tenants or []
        self.prev_shares = {t.name: t.share for t in tenants}
        self.prev_l2 = {t.name: t.l2_bytes for t in tenants}
        self.demands = demands_from_spec(self.spec)

    def set_condition(self, type_: str, status: ConditionStatus, reason: str, message: str) -> None:
        self.conditions = set_condition(
            self.conditions, type_, status, reason, message, self.generation, self.now
        )


@dataclasses.dataclass
class _Published:
    """What publishing the quotas found: whether Redis took them, at which generation, the
    sidecars, the limits usage, the epochs' status fields and their Events."""

    quota_generation: int
    sidecars: SidecarStatus | None
    published: bool = False
    usage: dict[str, TenantLimitsUsage] | None = None
    epoch_status: dict[str, Any] = dataclasses.field(default_factory=dict)
    events: list[Event] = dataclasses.field(default_factory=list)


class Reconciler:
    """Reconciles InferenceCaches; every I/O dependency is injected."""

    def __init__(
        self,
        *,
        metrics_source: MetricsSourceFactory = prometheus_source,
        control_plane: ControlPlaneFactory = redis_control_plane,
        secrets: SecretReader | None = None,
        metrics: OperatorMetrics | None = None,
        clock: Callable[[], float] = time.time,
        invalidator: InvalidatorFactory | None = None,
        policy_events_min_span_s: float = POLICY_EVENTS_MIN_SPAN_S,
        reach: ReachWarnings | None = None,
        fleet: FleetCurves | None = None,
    ) -> None:
        self.reach = reach or ReachWarnings()
        #: Fleet-wide curves per cache, fed from the sidecars' fleet-sample stream.
        self.fleet = fleet or FleetCurves()
        self.invalidator = invalidator or redis_invalidator
        self.metrics_source = metrics_source
        self.control_plane = control_plane
        self.secrets = secrets
        self.metrics = metrics or OperatorMetrics()
        self.clock = clock
        self.policy_events_min_span_s = policy_events_min_span_s

    async def redis_url(self, namespace: str, spec: InferenceCacheSpec | RedisEndpoint) -> str:
        redis = spec if isinstance(spec, RedisEndpoint) else spec.redis
        if redis.url is not None:
            return redis.url
        ref = redis.secret_ref
        if ref is None or self.secrets is None:
            raise SecretUnavailable("no Secret reader configured for spec.redis.secretRef")
        return await self.secrets.read(namespace, ref.name, ref.key)

    async def reconcile(
        self,
        namespace: str,
        name: str,
        generation: int | None,
        raw_spec: Mapping[str, Any],
        raw_status: Mapping[str, Any] | None,
        trigger: str = "change",
    ) -> Outcome:
        started = time.perf_counter()
        outcome = await self._reconcile(namespace, name, generation, raw_spec, raw_status)
        self.metrics.reconcile_duration.labels(trigger, outcome.result).observe(
            time.perf_counter() - started
        )
        return outcome

    async def _reconcile(
        self,
        namespace: str,
        name: str,
        generation: int | None,
        raw_spec: Mapping[str, Any],
        raw_status: Mapping[str, Any] | None,
    ) -> Outcome:
        now = now_rfc3339(self.clock)
        previous = previous_status(raw_status)
        conditions = list(previous.conditions or [])
        try:
            spec = parse_spec(dict(raw_spec))
        except SpecError as exc:
            return self._invalid(exc, conditions, generation, now)
        cache = cache_ref(namespace, name)
        run = _Run(namespace, name, cache, generation, now, spec, previous, conditions)
        source, metrics = await self._read_metrics(run)
        allocation = self._allocate(run, metrics)
        self.metrics.set_slo_pressure(namespace, name, _pressure(spec, metrics, allocation))
        self.metrics.set_slo_targets(run.cache, slo_targets(spec))
        assignment = build_assignment(spec, allocation)
        digest = assignment_digest(assignment)
        quota_generation = previous.quota_generation or 0
        if digest != previous.quota_digest:
            quota_generation += 1
        published = await self._publish(run, assignment, quota_generation)
        run.events.extend(published.events)
        status: dict[str, Any] = {"observedGeneration": generation, **published.epoch_status}
        routing = routing_status(name, spec)
        if routing is not None or previous.routing is not None:
            status["routing"] = routing.wire() if routing is not None else None  # None clears
        if published.published:
            status.update(await self._report(run, source, metrics, allocation, digest, published))
        else:
            run.set_condition(
                READY,
                ConditionStatus.FALSE,
                "RedisUnavailable",
                "quotas could not be published; sidecars keep the last ones",
            )
        self._report_faults(run, metrics is not None)
        status["conditions"] = [c.wire() for c in run.conditions]
        outcome = Outcome(
            status=status, events=run.events, result="ok", applied=published.published
        )
        if run.faults:
            outcome.failure = "temporary"
            outcome.failure_message = "; ".join(f"{r}: {m}" for r, m in run.faults)
            outcome.result = "degraded"
        return outcome

    async def _read_metrics(
        self, run: _Run
    ) -> tuple[MetricsSource | None, Mapping[str, TenantMetrics] | None]:
        """The tenants' metrics from Prometheus (None when unavailable: a fault), with
        each tenant's fleet-wide curve."""
        spec = run.spec
        metrics: Mapping[str, TenantMetrics] | None
        source: MetricsSource | None = None
        try:
            source = self.metrics_source(str(spec.prometheus.url), spec.prometheus.timeout_seconds)
            metrics = await source.fetch(
                run.cache, spec.prometheus.window, spec.prometheus.curve_window
            )
        except MetricsUnavailable as exc:
            metrics = None
            run.faults.append((exc.reason, exc.message))
            self.metrics.reconcile_errors.labels(exc.reason).inc()
        if metrics:
            metrics = await self._with_fleet_curves(
                run.namespace, spec, run.cache, run.demands, metrics
            )
        return source, metrics

    def _allocate(self, run: _Run, metrics: Mapping[str, TenantMetrics] | None) -> Allocation:
        """By the metrics; without them the shares in force are held (or, on first sight,
        follow the classes)."""
        spec = run.spec
        l1_bytes, l2_bytes = listed_l1_bytes(spec), listed_l2_bytes(spec)
        if metrics is not None:
            params = AllocationParams(
                spec.allocation.smoothing, spec.allocation.hysteresis, spec.allocation.min_gain
            )
            return allocate(
                run.demands,
                metrics,
                run.prev_shares or None,
                l1_bytes,
                l2_bytes,
                params,
                run.prev_l2 or None,
            )
        if run.prev_shares:
            return hold(run.demands, run.prev_shares, l1_bytes, l2_bytes, run.prev_l2)
        return allocate(run.demands, {}, None, l1_bytes, l2_bytes)

    async def _publish(
        self, run: _Run, assignment: QuotaAssignment, quota_generation: int
    ) -> _Published:
        """Publish the quotas to Redis (past a newer generation Redis knows, when the status
        was lost), then read the sidecars, their limits usage and the epochs; Redis out of
        reach is a fault and nothing published."""
        cache, out = run.cache, _Published(quota_generation, run.previous.sidecars)
        try:
            url = await self.redis_url(run.namespace, run.spec)
            plane = self.control_plane(url)
            stored = await plane.publish(
                cache, assignment.model_copy(update={"generation": quota_generation})
            )
            if stored > quota_generation:  # Redis knows a newer one (status was lost)
                quota_generation = out.quota_generation = stored + 1
                stored = await plane.publish(
                    cache, assignment.model_copy(update={"generation": quota_generation})
                )
            out.published = stored == quota_generation
            members = await plane.live_members(cache)
            out.usage = await _read_limits_usage(plane, cache, run.spec)
            out.epoch_status, epochs_in_sync, out.events = await self._epochs(
                url, cache, run.spec, run.previous
            )
            shedding = sorted(m.pod for m in members if m.shedding)
            out.sidecars = SidecarStatus(
                seen=len(members),
                in_sync=sum(1 for m in members if m.quota_generation >= quota_generation),
                epochs_in_sync=epochs_in_sync,
                shedding=shedding or None,
            )
            out.events += shedding_events(run.previous.sidecars, shedding)
        except (ControlPlaneUnavailable, SecretUnavailable, RedisError, OSError) as exc:
            run.faults.append(("RedisUnavailable", str(exc)))
            self.metrics.reconcile_errors.labels("RedisUnavailable").inc()
        return out

    async def _report(
        self,
        run: _Run,
        source: MetricsSource | None,
        metrics: Mapping[str, TenantMetrics] | None,
        allocation: Allocation,
        digest: str,
        published: _Published,
    ) -> dict[str, Any]:
        """What a published allocation adds to the status: the policy-switch and quota
        Events, the tenants' rows and savings, the SLA and reach conditions, Ready."""
        status: dict[str, Any] = {}
        switch_events, events_until = await self._policy_switches(
            source, run.cache, run.previous, run.now
        )
        run.events.extend(switch_events)
        if events_until is not None:
            status["policyEventsUntil"] = events_until
        self._quota_events(run, allocation)
        sla_status, sla_reason, sla_message, attainment = sla_condition(allocation)
        saved = await _savings(source, run.cache, run.spec) if metrics is not None else None
        spec, sidecars = run.spec, published.sidecars
        currency = spec.savings.currency if spec.savings is not None else None
        state = InferenceCacheStatus(
            quota_generation=published.quota_generation,
            quota_digest=digest,
            last_rebalance_time=run.now,
            tenant_count=len(allocation.tenants),
            sla_attainment=attainment,
            saved_model_hours=saved_model_hours(saved),
            savings=None if saved is None else savings_status(saved.values(), currency),
            tenants=tenant_status(allocation, saved, currency, published.usage),
            sidecars=sidecars,
        )
        status.update(state.wire())
        if metrics is not None:
            run.set_condition(SLA_VIOLATED, sla_status, sla_reason, sla_message)
            self._report_reach(run, allocation)
        ready_msg = f"quota generation {published.quota_generation} published"
        if sidecars is not None:
            ready_msg += f"; {sidecars.in_sync}/{sidecars.seen} sidecars in sync"
        run.set_condition(READY, ConditionStatus.TRUE, "QuotasPublished", ready_msg)
        return status

    def _quota_events(self, run: _Run, allocation: Allocation) -> None:
        """An Event of the shares that moved (and the metrics of who gained or lost), or of
        the first assignment."""
        moves = quota_moves(run.prev_shares or None, allocation, EVENT_MIN_MOVE)
        if moves and run.prev_shares:
            gained = sum(1 for m in moves if (m.after or 0.0) >= (m.before or 0.0))
            self.metrics.allocation_changes.labels("gained").inc(gained)
            self.metrics.allocation_changes.labels("lost").inc(len(moves) - gained)
            run.events.append(Event("Normal", "QuotasChanged", describe_moves(moves)))
        elif not run.prev_shares and allocation.tenants:
            run.events.append(
                Event("Normal", "QuotasAssigned", describe_moves(quota_moves(None, allocation)))
            )

    def _report_reach(self, run: _Run, allocation: Allocation) -> None:
        """``CacheCannotMeetSLA`` from this rebalance's evidence and the rebalances before,
        and a Warning when the set of tenants out of reach changes."""
        before = condition(run.conditions, CACHE_CANNOT_MEET_SLA)
        named = (
            tenants_named(before.message)
            if before is not None and before.status == ConditionStatus.TRUE
            else set()
        )
        evidence = reach_evidence(
            allocation,
            run.prev_shares,
            window_seconds(run.spec.prometheus.curve_window),
            self.reach.min_requests,
        )
        confirmed = self.reach.observe(run.cache, evidence, named)
        reach = reach_condition(
            allocation, confirmed, self.reach.pending(run.cache), self.reach.rebalances
        )
        run.set_condition(CACHE_CANNOT_MEET_SLA, *reach)
        # an Event when the set of tenants out of reach changes, not on every number
        if reach[0] == ConditionStatus.TRUE and (
            before is None
            or before.status != ConditionStatus.TRUE
            or tenants_named(before.message) != tenants_named(reach[2])
        ):
            run.events.append(Event("Warning", reach[1], reach[2]))

    @staticmethod
    def _report_faults(run: _Run, has_metrics: bool) -> None:
        """``Degraded`` with the faults (a Warning when it turns or its reason changes), or
        healthy."""
        was_degraded = condition(run.conditions, DEGRADED)
        if not run.faults:
            run.set_condition(
                DEGRADED, ConditionStatus.FALSE, "Healthy", "metrics read and quotas published"
            )
            return
        reason = run.faults[0][0] if len(run.faults) == 1 else "MultipleFaults"
        message = "; ".join(f"{r}: {m}" for r, m in run.faults)
        if not has_metrics:
            message += " (last allocation kept)" if run.prev_shares else " (class-based allocation)"
        run.set_condition(DEGRADED, ConditionStatus.TRUE, reason, message)
        if (
            was_degraded is None
            or was_degraded.status != ConditionStatus.TRUE
            or was_degraded.reason != reason
        ):
            run.events.append(Event("Warning", reason, message))

    async def _with_fleet_curves(
        self,
        namespace: str,
        spec: InferenceCacheSpec,
        cache: str,
        demands: Iterable[TenantDemand],
        metrics: Mapping[str, TenantMetrics],
    ) -> Mapping[str, TenantMetrics]:
        """``metrics`` with each tenant's fleet-wide curve, from the batches new since the
        last rebalance. Redis down or a batch that is not one: the curves go on from
        what was read before (never a fault of the reconcile; publishing reports Redis)."""
        payloads: list[bytes] = []
        last = None
        try:
            url = await self.redis_url(namespace, spec)
            payloads, last = await self.control_plane(url).fleet_batches(
                cache, self.fleet.after(cache)
            )
        except (ControlPlaneUnavailable, SecretUnavailable, RedisError, OSError) as exc:
            log.debug("%s: fleet samples not read: %s", cache, exc)
        batches = []
        for raw in payloads:
            try:
                batches.append(decode_fleet_batch(raw))
            except ValueError:
                self.fleet.ignored += 1
        names = set(metrics) | {d.name for d in demands}
        self.fleet.ingest(cache, batches, last, names, spec.fleet_sample_rate)
        window_s = window_seconds(spec.prometheus.curve_window)
        if isinstance(metrics, MetricsTable):  # from Prometheus: columns all the way
            return metrics.with_fleet_rows(*self.fleet.table(cache, window_s))
        curves = self.fleet.curves(cache, window_s)
        return {
            name: dataclasses.replace(m, fleet_curve=curves[name]) if name in curves else m
            for name, m in metrics.items()
        }

    async def _policy_switches(
        self,
        source: MetricsSource | None,
        cache: str,
        previous: InferenceCacheStatus,
        now: str,
    ) -> tuple[list[Event], str | None]:
        """Events for the sidecars' policy switches since the last report, and the new mark.

        Spans tile time: each starts at ``status.policyEventsUntil`` and ends
        now, so a switch is reported once. The first reconcile only sets the
        mark (switches from before the operator watched are not news); a
        failed or too short query leaves the mark, so the next one covers it.
        """
        if source is None or not isinstance(source, PolicySwitchSource):
            return [], None
        at = parse_rfc3339(now)
        since = parse_rfc3339(previous.policy_events_until)
        if at is None or since is None:
            return [], now
        span = at - since
        if span < self.policy_events_min_span_s:
            return [], None
        try:
            found = await source.policy_switches(cache, min(span, POLICY_EVENTS_MAX_SPAN_S), at)
        except MetricsUnavailable:
            return [], None
        return policy_switch_events(found), now

    async def _epochs(
        self, url: str, cache: str, spec: InferenceCacheSpec, previous: InferenceCacheStatus
    ) -> tuple[dict[str, Any], int, list[Event]]:
        """Restore, advance on a model-version change, and measure convergence.

        Returns (status fields, live sidecars that acknowledged the current
        epochs, Events).
        """
        events: list[Event] = []
        known = dict(previous.epochs or {})
        scope = model_scope(spec.model.name)
        invalidator = self.invalidator(url, cache)
        try:
            if known:
                await restore_epochs(invalidator.client, cache, known)
            old_version = previous.model_version
            if old_version is not None and old_version != spec.model.version:
                # The status records the version and the epochs together, so the change
                # is one advance past the recorded epoch: a reconcile whose status patch
                # was lost (or an operator that restarted) finds Redis already there and
                # does not advance again.
                intended = int(known.get(scope, 0)) + 1
                epoch, cas_at, advanced = await invalidator.advance_to(scope, intended)
                result = await invalidator.await_acks(
                    scope, epoch, timeout_s=MODEL_ACK_WAIT_S, started_at=cas_at
                )
                message = (
                    f"model {spec.model.name} {old_version} -> {spec.model.version}: "
                    f"{scope} {'advanced' if advanced else 'already advanced'} to epoch "
                    f"{result.epoch}; {result.acks}/{result.expected} sidecars acknowledged"
                )
                if result.propagation_s is not None:
                    message += f" in {result.propagation_s * 1000:.1f} ms"
                else:
                    message += f", still waiting for {', '.join(result.lagging)}"
                events.append(Event("Normal", "ModelVersionChanged", message))
            epochs = await read_epochs(invalidator.client, cache)
            acked, _lagging = await invalidator.progress(epochs)
        finally:
            await invalidator.aclose()
        return {"modelVersion": spec.model.version, "epochs": epochs}, len(acked), events

    def _invalid(
        self, exc: SpecError, conditions: list[Condition], generation: int | None, now: str
    ) -> Outcome:
        self.metrics.reconcile_errors.labels("InvalidSpec").inc()
        message = f"{exc.field}: {exc.message}"
        conditions = set_condition(
            conditions, READY, ConditionStatus.FALSE, "InvalidSpec", message, generation, now
        )
        conditions = set_condition(
            conditions, DEGRADED, ConditionStatus.TRUE, "InvalidSpec", message, generation, now
        )
        return Outcome(
            status={
                "observedGeneration": generation,
                "conditions": [c.wire() for c in conditions],
            },
            events=[Event("Warning", "InvalidSpec", message)],
            failure="permanent",
            failure_message=message,
            result="invalid",
        )

    async def cleanup(
        self, namespace: str, name: str, raw_spec: Mapping[str, Any], uid: str = ""
    ) -> int:
        """Remove the cache's Redis state; raises ControlPlaneUnavailable / SpecError.

        Only ``spec.redis`` has to be valid: a spec broken elsewhere still
        names the Redis that holds the state.
        """
        try:
            endpoint: InferenceCacheSpec | RedisEndpoint = parse_spec(dict(raw_spec))
        except SpecError:
            endpoint = parse_redis_endpoint(raw_spec.get("redis"))
        self.metrics.set_slo_pressure(namespace, name, None)
        self.reach.forget(cache_ref(namespace, name))
        self.fleet.forget(cache_ref(namespace, name))
        url = await self.redis_url(namespace, endpoint)
        return await self.control_plane(url).delete_cache_state(cache_ref(namespace, name), uid)
