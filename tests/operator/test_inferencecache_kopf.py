"""kopf + our handlers against the Kubernetes emulator, with real Redis and a fake metrics source.

What a user would notice: status and conditions after create, quotas in
Redis, Events when quotas move, Degraded when Prometheus or Redis is down
(last allocation kept), an invalid spec reported once with its field, and
Redis state removed on delete.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import redis

from cachefleet_common.contract.messages import QuotaAssignment
from cachefleet_common.contract.names import Policy, quotas_key, tombstone_key, usage_key
from cachefleet_common.contract.ops import TOMBSTONE_TTL_S
from cachefleet_e2e.fake_metrics import FakeMetrics
from cachefleet_operator.allocation import TenantMetrics
from cachefleet_operator.curves import HitCurve
from cachefleet_operator.metrics import OperatorMetrics
from cachefleet_operator.metrics_source import MetricsUnavailable, PolicySwitches
from cachefleet_operator.reconcile import Reconciler
from tests.operator.conftest import IC_PATH, NAMESPACE, EmulatorHandle, OperatorFactory, wait_for

pytestmark = [pytest.mark.k8s_emulator, pytest.mark.redis]

#: Bound on waiting for the operator to act, seconds.
ACT_TIMEOUT_S = 30.0  # generous: a loaded machine only waits longer
L1 = 100 * 2**20
L2 = 1000 * 2**20


def cache_body(name: str, redis_url: str, **spec_overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "selector": {"matchLabels": {"cachefleet.io/cache": name}},
        "model": {"name": "llama", "version": "v1"},
        "capacity": {"l1BytesPerPod": L1, "l2Bytes": L2},
        "redis": {"url": redis_url},
        "prometheus": {"url": "http://127.0.0.1:9", "window": "1m"},
        "rebalanceIntervalSeconds": 1,
        "tenants": [
            {
                "name": "gold",
                "priorityClass": "Guaranteed",
                "minShare": 0.3,
                "sla": {"p95LatencySeconds": 0.2},
            },
            {"name": "silver", "priorityClass": "Standard", "sla": {"p95LatencySeconds": 0.5}},
            {
                "name": "bronze",
                "priorityClass": "BestEffort",
                "maxShare": 0.3,
                "sla": {"p95LatencySeconds": 2.0},
            },
        ],
    }
    spec.update(spec_overrides)
    return {
        "apiVersion": "cachefleet.io/v1alpha1",
        "kind": "InferenceCache",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": spec,
    }


def concave() -> HitCurve:
    """Every tenant's curve: more cache always helps, less and less."""
    points = [(0.1 * L1, 300.0), (0.3 * L1, 600.0), (0.6 * L1, 800.0), (L1, 900.0)]
    curve = HitCurve.from_histogram([*points, (math.inf, 1000.0)])
    assert curve is not None
    return curve


def steady_metrics() -> dict[str, TenantMetrics]:
    return {
        "gold": TenantMetrics(p95_s=0.15, hit_ratio=0.5, rps=50.0, curve=concave()),
        "silver": TenantMetrics(p95_s=0.4, hit_ratio=0.5, rps=50.0, curve=concave()),
        "bronze": TenantMetrics(p95_s=1.5, hit_ratio=0.5, rps=50.0, curve=concave()),
    }


def conditions(obj: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in ((obj or {}).get("status") or {}).get("conditions") or []}


def shares(obj: dict[str, Any] | None) -> dict[str, float]:
    return {t["name"]: t["share"] for t in ((obj or {}).get("status") or {}).get("tenants") or []}


def stored_assignment(redis_url: str, cache: str) -> QuotaAssignment | None:
    client = redis.Redis.from_url(redis_url)
    try:
        raw = client.hget(quotas_key(cache), "assignment")
    finally:
        client.close()
    return None if raw is None else QuotaAssignment.model_validate_json(raw)


def make(fake: FakeMetrics) -> Reconciler:
    return Reconciler(metrics_source=fake.factory, metrics=OperatorMetrics())


def test_create_publishes_quotas_and_reports_status(
    emulator: EmulatorHandle, operator_factory: OperatorFactory, redis_url: str
) -> None:
    fake = FakeMetrics()
    fake.data = steady_metrics()
    operator_factory(make(fake))
    emulator.create(IC_PATH, cache_body("chat", redis_url))

    obj = wait_for(
        lambda: (
            (o := emulator.get(f"{IC_PATH}/chat"))
            and conditions(o).get("Ready", {}).get("status") == "True"
            and o
        ),
        ACT_TIMEOUT_S,
        "Ready=True",
    )
    status = obj["status"]
    assert status["tenantCount"] == 3
    assert status["observedGeneration"] == 1
    assert status["slaAttainment"] == "3/3"
    assert conditions(obj)["Degraded"]["status"] == "False"
    assert conditions(obj)["SLAViolated"]["status"] == "False"
    assert shares(obj)["gold"] >= 0.3

    assignment = stored_assignment(redis_url, f"{NAMESPACE}/chat")
    assert assignment is not None
    assert set(assignment.tenants) == {"gold", "silver", "bronze"}
    assert sum(q.l1_bytes for q in assignment.tenants.values()) <= L1
    assert assignment.model_version == "v1"
    wait_for(
        lambda: "QuotasAssigned" in {e.get("reason") for e in emulator.events()},
        ACT_TIMEOUT_S,
        "QuotasAssigned event",
    )


def test_tenant_defaults_are_published_for_unlisted_tenants(
    emulator: EmulatorHandle, operator_factory: OperatorFactory, redis_url: str
) -> None:
    fake = FakeMetrics()
    fake.data = steady_metrics()
    operator_factory(make(fake))
    defaults = {"share": 0.2, "l2Share": 0.25, "priorityClass": "BestEffort", "policy": "sits"}
    emulator.create(IC_PATH, cache_body("saas", redis_url, tenantDefaults=defaults))
    assignment = wait_for(
        lambda: stored_assignment(redis_url, f"{NAMESPACE}/saas"), ACT_TIMEOUT_S, "quotas"
    )
    unlisted = assignment.default_tenant
    assert unlisted is not None
    assert (unlisted.l1_bytes, unlisted.l2_bytes) == (int(L1 * 0.2), int(L2 * 0.25))
    assert (unlisted.priority_class, unlisted.policy) == ("BestEffort", Policy.SITS)
    # The listed tenants share what the pools leave.
    assert sum(q.l1_bytes for q in assignment.tenants.values()) <= L1 - int(L1 * 0.2)
    assert sum(q.l2_bytes for q in assignment.tenants.values()) <= L2 - int(L2 * 0.25)


def wait_condition(
    emulator: EmulatorHandle, name: str, type_: str, status: str, reason: str | None = None
) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        obj = emulator.get(f"{IC_PATH}/{name}")
        cond = conditions(obj).get(type_, {})
        if cond.get("status") == status and (reason is None or cond.get("reason") == reason):
            return obj
        return None

    return wait_for(check, ACT_TIMEOUT_S, f"{type_}={status} ({reason})")  # type: ignore[no-any-return]


def test_missed_p95_moves_quota_and_emits_event(
    emulator: EmulatorHandle, operator_factory: OperatorFactory, redis_url: str
) -> None:
    fake = FakeMetrics()
    fake.data = steady_metrics()
    operator_factory(make(fake))
    emulator.create(IC_PATH, cache_body("chat", redis_url))
    before = shares(wait_condition(emulator, "chat", "Ready", "True"))
    generation = stored_assignment(redis_url, f"{NAMESPACE}/chat").generation  # type: ignore[union-attr]

    # 3x its target: its hits are worth more now, and its curve says more cache gives more
    fake.data["silver"] = TenantMetrics(p95_s=1.5, hit_ratio=0.5, rps=50.0, curve=concave())
    obj = wait_condition(emulator, "chat", "SLAViolated", "True")
    assert "silver" in conditions(obj)["SLAViolated"]["message"]
    after = wait_for(
        lambda: (s := shares(emulator.get(f"{IC_PATH}/chat")))["silver"] > before["silver"] and s,
        ACT_TIMEOUT_S,
        "silver gains share",
    )
    assert after["gold"] >= 0.3
    moved = wait_for(
        lambda: [e for e in emulator.events() if e.get("reason") == "QuotasChanged"],
        ACT_TIMEOUT_S,
        "QuotasChanged event",
    )
    assert "gained: silver" in moved[-1]["message"]
    assert "p95 1.5s > target 0.5s" in moved[-1]["message"]
    newer = stored_assignment(redis_url, f"{NAMESPACE}/chat")
    assert newer is not None
    assert newer.generation > generation


def test_prometheus_down_keeps_last_allocation_and_degrades(
    emulator: EmulatorHandle, operator_factory: OperatorFactory, redis_url: str
) -> None:
    fake = FakeMetrics()
    fake.data = steady_metrics()
    operator_factory(make(fake))
    emulator.create(IC_PATH, cache_body("chat", redis_url))
    before = shares(wait_condition(emulator, "chat", "Ready", "True"))

    fake.error = MetricsUnavailable("PrometheusUnavailable", "connection refused")
    obj = wait_condition(emulator, "chat", "Degraded", "True", "PrometheusUnavailable")
    assert "last allocation kept" in conditions(obj)["Degraded"]["message"]
    assert conditions(obj)["Ready"]["status"] == "True"
    assert shares(obj) == before
    warnings = wait_for(
        lambda: [e for e in emulator.events() if e.get("reason") == "PrometheusUnavailable"],
        ACT_TIMEOUT_S,
        "PrometheusUnavailable event",
    )
    assert warnings[0]["type"] == "Warning"

    fake.error = None
    wait_condition(emulator, "chat", "Degraded", "False")


def test_spec_edit_during_a_prometheus_outage_applies_at_once(
    emulator: EmulatorHandle,
    operator_factory: OperatorFactory,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Configuration does not wait for metrics: no retry backoff between an edit and Redis.

    The fault backoff is made far longer than the wait below, so an edit
    queued behind it could not pass; Prometheus is down from the start.
    """
    from cachefleet_operator import reconcile

    monkeypatch.setattr(reconcile, "RETRY_BASE_DELAY_S", 120.0)
    monkeypatch.setattr(reconcile, "RETRY_MAX_DELAY_S", 120.0)
    fake = FakeMetrics()
    fake.error = MetricsUnavailable("PrometheusUnavailable", "connection refused")
    operator_factory(make(fake))
    # no rebalance timer to pick the edit up either
    emulator.create(IC_PATH, cache_body("chat", redis_url, rebalanceIntervalSeconds=3600))
    wait_condition(emulator, "chat", "Degraded", "True", "PrometheusUnavailable")
    wait_condition(emulator, "chat", "Ready", "True")
    first = stored_assignment(redis_url, f"{NAMESPACE}/chat")
    assert first is not None
    assert first.model_version == "v1"

    emulator.patch(f"{IC_PATH}/chat", {"spec": {"model": {"name": "llama", "version": "v2"}}})
    wait_for(
        lambda: (
            (a := stored_assignment(redis_url, f"{NAMESPACE}/chat")) and a.model_version == "v2"
        ),
        ACT_TIMEOUT_S,
        "the edit published while Prometheus is down",
    )
    # one bump for v1, one for the edit, and the first assignment announced once
    wait_for(
        lambda: (
            ((emulator.get(f"{IC_PATH}/chat") or {}).get("status") or {}).get("quotaGeneration")
            == 2
        ),
        ACT_TIMEOUT_S,
        "status of the edit",
    )
    assigned = [e for e in emulator.events() if e.get("reason") == "QuotasAssigned"]
    assert len(assigned) == 1


def test_redis_down_is_not_ready_and_recovers(
    emulator: EmulatorHandle, operator_factory: OperatorFactory, redis_url: str
) -> None:
    fake = FakeMetrics()
    fake.data = steady_metrics()
    operator_factory(make(fake))
    emulator.create(IC_PATH, cache_body("chat", "redis://127.0.0.1:1/0"))
    obj = wait_condition(emulator, "chat", "Ready", "False", "RedisUnavailable")
    assert conditions(obj)["Degraded"]["reason"] == "RedisUnavailable"
    assert not shares(obj)  # nothing recorded as in force

    emulator.patch(f"{IC_PATH}/chat", {"spec": {"redis": {"url": redis_url}}})
    obj = wait_condition(emulator, "chat", "Ready", "True")
    assert obj["status"]["observedGeneration"] == 2
    assert stored_assignment(redis_url, f"{NAMESPACE}/chat") is not None


def test_routing_names_its_pool_in_status_and_clears_when_off(
    emulator: EmulatorHandle, operator_factory: OperatorFactory, redis_url: str
) -> None:
    """``kubectl get icache -o wide`` shows the pool: the chart's (named after the cache) or
    the referenced one; routing switched off leaves no pool behind."""
    fake = FakeMetrics()
    fake.data = steady_metrics()
    operator_factory(make(fake))
    emulator.create(IC_PATH, cache_body("chat", redis_url, routing={"enabled": True}))

    def routing() -> Any:
        return ((emulator.get(f"{IC_PATH}/chat") or {}).get("status") or {}).get("routing")

    wait_for(
        lambda: routing() == {"pool": "chat", "poolSource": "Rendered"},
        ACT_TIMEOUT_S,
        "the rendered pool in status",
    )
    emulator.patch(
        f"{IC_PATH}/chat",
        {"spec": {"routing": {"enabled": True, "inferencePoolRef": {"name": "llama-pool"}}}},
    )
    wait_for(
        lambda: routing() == {"pool": "llama-pool", "poolSource": "Referenced"},
        ACT_TIMEOUT_S,
        "the referenced pool in status",
    )
    emulator.patch(f"{IC_PATH}/chat", {"spec": {"routing": {"enabled": False}}})
    # the reference left behind by the merge patch is refused, naming the field
    wait_condition(emulator, "chat", "Ready", "False", "InvalidSpec")
    emulator.patch(f"{IC_PATH}/chat", {"spec": {"routing": {"inferencePoolRef": None}}})
    wait_condition(emulator, "chat", "Ready", "True")
    wait_for(lambda: routing() is None, ACT_TIMEOUT_S, "no pool once routing is off")


def test_invalid_spec_is_reported_once_with_the_field(
    emulator: EmulatorHandle, operator_factory: OperatorFactory, redis_url: str
) -> None:
    fake = FakeMetrics()
    fake.data = steady_metrics()
    operator_factory(make(fake))
    body = cache_body("chat", redis_url)
    body["spec"]["tenants"][1]["minShare"] = 0.6
    body["spec"]["tenants"][1]["maxShare"] = 0.5  # the CRD's CEL rule would refuse this
    emulator.create(IC_PATH, body)
    obj = wait_condition(emulator, "chat", "Ready", "False", "InvalidSpec")
    message = conditions(obj)["Ready"]["message"]
    assert message.startswith("spec.tenants[1]")
    assert "minShare must not exceed maxShare" in message
    wait_for(
        lambda: [e for e in emulator.events() if e.get("reason") == "InvalidSpec"],
        ACT_TIMEOUT_S,
        "InvalidSpec event",
    )
    time.sleep(2.5)  # several timer ticks: no retries, no new events, no Prometheus queries
    invalid_events = [e for e in emulator.events() if e.get("reason") == "InvalidSpec"]
    assert len(invalid_events) == 1
    assert fake.calls == 0


def test_delete_removes_redis_state_even_with_an_invalid_spec(
    emulator: EmulatorHandle, operator_factory: OperatorFactory, redis_url: str
) -> None:
    fake = FakeMetrics()
    fake.data = steady_metrics()
    operator_factory(make(fake))
    emulator.create(IC_PATH, cache_body("chat", redis_url))
    wait_condition(emulator, "chat", "Ready", "True")
    cache = f"{NAMESPACE}/chat"
    client = redis.Redis.from_url(redis_url)
    try:
        client.set(usage_key(cache, "gold"), "1")
        client.set(usage_key(f"{NAMESPACE}/other", "gold"), "1")
        # the spec goes bad (only spec.redis is needed to clean up)
        emulator.patch(f"{IC_PATH}/chat", {"spec": {"tenantz": []}})
        wait_condition(emulator, "chat", "Ready", "False")
        emulator.delete(f"{IC_PATH}/chat")
        wait_for(lambda: emulator.get(f"{IC_PATH}/chat") is None, ACT_TIMEOUT_S, "object gone")
        left = sorted(k.decode() for k in client.scan_iter(match="cf:*"))
        ttl = client.ttl(tombstone_key(cache))
    finally:
        client.close()
    # nothing of the cache but its tombstone, which expires on its own
    assert left == sorted([usage_key(f"{NAMESPACE}/other", "gold"), tombstone_key(cache)])
    assert 0 < ttl <= TOMBSTONE_TTL_S


class FakeSwitchMetrics(FakeMetrics):
    """Also answers the policy-switch query: ``pending`` once, then nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: list[PolicySwitches] = []
        self.spans: list[tuple[float, float]] = []  # (span_s, at) of each query

    async def policy_switches(self, cache: str, span_s: float, at: float) -> list[PolicySwitches]:
        assert cache == f"{NAMESPACE}/chat"
        self.spans.append((span_s, at))
        found, self.pending = self.pending, []
        return found


def test_policy_switches_and_rollbacks_become_events_once(
    emulator: EmulatorHandle, operator_factory: OperatorFactory, redis_url: str
) -> None:
    fake = FakeSwitchMetrics()
    fake.data = steady_metrics()
    operator_factory(
        Reconciler(
            metrics_source=fake.factory, metrics=OperatorMetrics(), policy_events_min_span_s=1.0
        )
    )
    emulator.create(IC_PATH, cache_body("chat", redis_url))
    wait_condition(emulator, "chat", "Ready", "True")
    # The first reconcile only sets the mark; switches older than that are not news.
    wait_for(lambda: fake.spans, ACT_TIMEOUT_S, "a policy-switch query")
    fake.pending = [
        PolicySwitches("gold", "lirs", "sits", 2),
        PolicySwitches("silver", "sits", "lirs", 1),
    ]
    wait_for(lambda: not fake.pending, ACT_TIMEOUT_S, "the switches read")
    reported = len(fake.spans)
    wait_for(lambda: len(fake.spans) >= reported + 2, ACT_TIMEOUT_S, "two more queries")

    events = [e for e in emulator.events() if e.get("reason", "").startswith("Policy")]
    assert sorted((e["reason"], e["type"]) for e in events) == [
        ("PolicyRolledBack", "Normal"),
        ("PolicySwitched", "Normal"),
    ]  # once each, though the operator kept reconciling
    messages = {e["reason"]: e["message"] for e in events}
    assert messages["PolicySwitched"].startswith(
        "tenant gold: L1 policy switched lirs -> sits on 2 pods"
    )
    assert messages["PolicyRolledBack"].startswith(
        "tenant silver: L1 policy rolled back sits -> lirs on 1 pod "
    )
    # Each span starts where the one before ended: nothing counted twice or skipped.
    for (_, before), (span, at) in zip(fake.spans, fake.spans[1:], strict=False):
        assert at - span == pytest.approx(before)
    status = emulator.get(f"{IC_PATH}/chat")["status"]  # type: ignore[index]
    assert status["policyEventsUntil"].endswith("Z")
