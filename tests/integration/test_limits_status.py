"""Usage against limits in the InferenceCache status: requests through a limited sidecar,
then a reconcile against the same real Redis, shows where each bucket stands.

The reconciler runs without kopf (as in test_reach_condition.py); the sidecar is the
real one, enforcing the same limits through the script. A bucket refills while the
test runs, so the bounds are widened by exactly the refill the measured time allows:
never a timing assertion.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any

import pytest

from cachefleet_common.contract.acls import operator_acl
from cachefleet_common.contract.clients import redis_from_url
from cachefleet_common.contract.lua import RATE_LIMIT_LUA
from cachefleet_common.contract.names import cache_ref, rate_limit_key
from cachefleet_common.limits import DAY_S, TenantLimits
from cachefleet_e2e.fake_metrics import FakeMetrics
from cachefleet_operator.cache_status import limits_usage
from cachefleet_operator.metrics import OperatorMetrics
from cachefleet_operator.publisher import ControlPlaneUnavailable, RedisControlPlane
from cachefleet_operator.reconcile import Reconciler

from .conftest import SidecarFactory

pytestmark = pytest.mark.redis

#: The cache the sidecar fixture names ("test/cache").
NAMESPACE, NAME = "test", "cache"
#: Generous: a limiter answer on a loaded machine must not fall back to the local share.
PATIENT_S = 5.0
RPM = 6  # one request back every 10 s
TPD = int(DAY_S)  # one token back every second
#: Tokens each answer of the stand-in model server reports (5 prompt + 3 completion).
TOKENS_PER_ANSWER = 8


def spec(redis_url: str) -> dict[str, Any]:
    return {
        "selector": {"matchLabels": {"cachefleet.io/cache": NAME}},
        "model": {"name": "m1", "version": "v1"},
        "capacity": {"l1BytesPerPod": 8 * 2**20, "l2Bytes": 2**24},
        "redis": {"url": redis_url},
        "prometheus": {"url": "http://127.0.0.1:9", "window": "5m"},
        "tenants": [
            {"name": "tenant-a", "limits": {"requestsPerMinute": RPM, "tokensPerDay": TPD}},
            {"name": "tenant-b"},
        ],
    }


def tenant(status: dict[str, Any], name: str) -> dict[str, Any]:
    return next(t for t in status["tenants"] if t["name"] == name)


async def test_requests_through_a_limited_sidecar_show_in_the_status(
    sidecar_factory: SidecarFactory, redis_url: str
) -> None:
    limits = {"tenant-a": TenantLimits(requests_per_minute=RPM, tokens_per_day=TPD)}
    pod = await sidecar_factory(redis_url=redis_url, tenant_limits=limits, patient=True)
    assert pod.sidecar.rates is not None
    pod.sidecar.rates.timeout_s = PATIENT_S
    reconciler = Reconciler(metrics_source=FakeMetrics().factory, metrics=OperatorMetrics())

    # before any request: every bucket full
    outcome = await reconciler.reconcile(NAMESPACE, NAME, 1, spec(redis_url), {})
    assert outcome.result == "ok", outcome.failure_message
    before = tenant(outcome.status, "tenant-a")["limits"]
    assert before == {
        "requestsPerMinute": {"limit": RPM, "used": 0, "remaining": RPM, "resetSeconds": 0.0},
        "tokensPerDay": {"limit": TPD, "used": 0, "remaining": TPD, "resetSeconds": 0.0},
    }
    assert "limits" not in tenant(outcome.status, "tenant-b")

    started = time.monotonic()
    answers = [await pod.chat(f"question {i}", tenant="tenant-a") for i in range(RPM + 3)]
    for i in range(3):
        assert (await pod.chat(f"question {i}", tenant="tenant-b")).status_code == 200
    await pod.settled()  # the token corrections (the answers' usage) are in
    passed = sum(1 for r in answers if r.status_code == 200)
    refused = sum(1 for r in answers if r.status_code == 429)
    assert passed + refused == len(answers)
    assert refused > 0

    status = {**outcome.status}
    outcome = await reconciler.reconcile(NAMESPACE, NAME, 1, spec(redis_url), status)
    elapsed = time.monotonic() - started
    assert outcome.result == "ok", outcome.failure_message
    usage = tenant(outcome.status, "tenant-a")["limits"]

    requests = usage["requestsPerMinute"]
    assert requests["limit"] == RPM
    assert requests["used"] + requests["remaining"] == RPM
    # what passed is in the bucket, less what refilled since (one every 10 s)
    refill = math.ceil(elapsed * RPM / 60.0)
    assert passed - refill <= requests["used"] <= passed, (requests, passed, elapsed)
    assert 0 < requests["resetSeconds"] <= 60.0

    tokens = usage["tokensPerDay"]
    spent = passed * TOKENS_PER_ANSWER  # each estimate corrected to the answer's usage
    assert tokens["used"] + tokens["remaining"] == TPD
    assert spent - math.ceil(elapsed) <= tokens["used"] <= spent, (tokens, spent, elapsed)
    assert "limits" not in tenant(outcome.status, "tenant-b")

    # the sidecar's own view of the same buckets agrees (its last decision, earlier)
    seen = (await pod.admin.get("/status")).json()["rate_limits"]["tenants"]["tenant-a"]
    assert seen["usage"]["requests"]["remaining"] <= requests["remaining"]


async def test_the_operator_reads_the_scripts_buckets_on_standalone_and_cluster(
    any_redis: str,
) -> None:
    """What the operator reads is what the script answered (its ``remaining``), on Redis
    Cluster too (each tenant's key in its own slot, the clock from any node)."""
    cache = cache_ref(NAMESPACE, NAME)
    per_10s = TenantLimits(requests_per_minute=6, tokens_per_day=8640)  # one back every 10 s
    client = redis_from_url(any_redis)
    try:
        started = time.monotonic()
        reply = await client.eval(  # type: ignore[misc]
            RATE_LIMIT_LUA,
            1,
            rate_limit_key(cache, "tenant-a"),
            "take",
            *(6, 60_000, 2, 0, 60_000, 0, 8640, 86_400_000, 300),
        )
    finally:
        await client.aclose()
    assert int(reply[0]) == 1
    said = {"requestsPerMinute": int(reply[1]), "tokensPerDay": int(reply[7])}
    assert said == {"requestsPerMinute": 4, "tokensPerDay": 8340}

    now_ms, tats = await RedisControlPlane(any_redis).rate_limit_state(
        cache, ["tenant-a", "tenant-b"]
    )
    gap = time.monotonic() - started
    assert tats["tenant-b"] == [0.0, 0.0, 0.0]  # never seen: full buckets
    assert abs(now_ms / 1000.0 - time.time()) < 60.0  # Redis's clock, in milliseconds
    read = limits_usage(per_10s, tats["tenant-a"], now_ms).wire()
    refill = math.ceil(gap / 10.0)
    for field, remaining in said.items():
        assert remaining <= read[field]["remaining"] <= remaining + refill, (field, read, gap)
    assert read["requestsPerMinute"]["used"] == 6 - read["requestsPerMinute"]["remaining"]


async def test_the_operators_acl_user_may_read_the_buckets(redis_url: str) -> None:
    """Under the least-privilege rules of docs/security.md (TIME and HMGET are the
    operator's), nothing is refused."""
    admin = redis_from_url(redis_url)
    password = "operator-pw-5d1a"
    try:
        await admin.execute_command(
            "ACL", "SETUSER", "cf-operator", "reset", "on", f">{password}", *operator_acl()
        )
        await admin.execute_command("ACL", "LOG", "RESET")
        key = rate_limit_key(cache_ref(NAMESPACE, NAME), "tenant-a")
        await admin.hset(key, mapping={"r": "5.000"})
        user_url = redis_url.replace("redis://", f"redis://cf-operator:{password}@", 1)
        now_ms, tats = await RedisControlPlane(user_url).rate_limit_state(
            cache_ref(NAMESPACE, NAME), ["tenant-a"]
        )
        assert tats == {"tenant-a": [5.0, 0.0, 0.0]}
        assert now_ms > 0
        assert await admin.execute_command("ACL", "LOG") == []
    finally:
        await admin.execute_command("ACL", "DELUSER", "cf-operator")
        await admin.aclose()


class BucketsUnreadable(RedisControlPlane):
    """Publishes as usual; reading the buckets fails."""

    async def rate_limit_state(
        self, cache: str, tenants: Iterable[str]
    ) -> tuple[float, dict[str, list[float]]]:
        raise ControlPlaneUnavailable("buckets unreadable")


async def test_buckets_that_cannot_be_read_leave_the_usage_out_never_a_fault(
    redis_url: str,
) -> None:
    reconciler = Reconciler(
        metrics_source=FakeMetrics().factory,
        metrics=OperatorMetrics(),
        control_plane=BucketsUnreadable,
    )
    outcome = await reconciler.reconcile(NAMESPACE, NAME, 1, spec(redis_url), {})
    assert (outcome.result, outcome.failure) == ("ok", None)
    assert outcome.applied
    assert "limits" not in tenant(outcome.status, "tenant-a")
    degraded = next(c for c in outcome.status["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "False"
