"""Per-tenant rate limits, fleet-wide through a real Redis: requests, tokens, hits, outages.

Assertions are on counts and headers. Where a bound depends on how long a burst
took (a GCRA bucket refills while it runs), the test measures that time and
widens the bound by exactly the refill it allows: never a timing assertion.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from cachefleet_common.contract.acls import sidecar_acl
from cachefleet_common.contract.clients import redis_from_url
from cachefleet_common.limits import TenantLimits
from cachefleet_e2e.services import RedisServer
from cachefleet_sidecar.cache.handler import Handler
from cachefleet_sidecar.tenancy.limits_redis import RateLimiter

from .conftest import SETTLE_BOUND_S, RunningSidecar, SidecarFactory

pytestmark = pytest.mark.redis

RATE_HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests")
#: Requests a second the burst test sends (open loop).
RATE = 100.0
#: Generous: a limiter answer on a loaded machine must not fall back to the local share.
PATIENT_S = 5.0


def patient(pod: RunningSidecar) -> RateLimiter:
    rates = pod.sidecar.rates
    assert rates is not None
    rates.timeout_s = PATIENT_S
    return rates


async def metric(pod: RunningSidecar, tenant: str, reason: str) -> float:
    """``cachefleet_rate_limited_total`` of ``tenant`` and ``reason`` on ``pod``."""
    text = (await pod.admin.get("/metrics")).text
    for line in text.splitlines():
        if (
            line.startswith("cachefleet_rate_limited_total{")
            and f'tenant="{tenant}"' in line
            and f'reason="{reason}"' in line
        ):
            return float(line.split()[-1])
    return 0.0


async def test_two_pods_share_one_tenants_120_requests_per_minute(
    sidecar_factory: SidecarFactory, redis_url: str
) -> None:
    limits = {"tenant-a": TenantLimits(requests_per_minute=120)}
    pods = [
        await sidecar_factory(redis_url=redis_url, pod=f"pod-{i}", tenant_limits=limits)
        for i in range(2)
    ]
    for pod in pods:
        patient(pod)

    async def one(at: float, i: int, tenant: str) -> httpx.Response:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        return await pods[i % 2].chat(f"{tenant} question {i}", tenant=tenant)

    # open loop: 600 of tenant A's and 100 of B's requests sent at a fixed 100/s, whatever
    # the answers take, alternating between the two pods
    started = time.monotonic()
    answers = await asyncio.gather(
        *(one(started + i / RATE, i, "tenant-a") for i in range(600)),
        *(one(started + (6 * i + 3) / RATE, i, "tenant-b") for i in range(100)),
    )
    elapsed = time.monotonic() - started
    a, b = answers[:600], answers[600:]

    assert {r.status_code for r in b} == {200}  # unlimited: never refused, no headers
    assert not any(h in r.headers for r in b for h in RATE_HEADERS)
    passed = [r for r in a if r.status_code == 200]
    refused = [r for r in a if r.status_code == 429]
    assert len(passed) + len(refused) == 600
    # the bucket holds 120 (the documented burst) and refills 2 a second while the burst runs
    assert 120 <= len(passed) <= 120 + math.ceil(elapsed * 2) + 1, (len(passed), elapsed)
    for r in passed:  # a passing miss says where the tenant stands, as OpenAI's API does
        assert r.headers["x-cache"] == "MISS"
        assert r.headers["x-ratelimit-limit-requests"] == "120"
        assert 0 <= int(r.headers["x-ratelimit-remaining-requests"]) < 120
        assert r.headers["x-ratelimit-reset-requests"]
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        assert r.headers["x-ratelimit-limit-requests"] == "120"
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        assert r.headers["x-ratelimit-reset-requests"]
        error = r.json()["error"]
        assert (error["code"], error["type"]) == ("rate_limit_exceeded", "requests")
    # both pods refused some: the limit is the fleet's, not each pod's
    counted = [await metric(pod, "tenant-a", "requests") for pod in pods]
    assert sum(counted) == len(refused)
    assert all(n > 0 for n in counted), counted
    status = (await pods[0].admin.get("/status")).json()["rate_limits"]
    assert status["mode"] == "fleet"
    assert status["tenants"]["tenant-a"]["limits"] == {"requestsPerMinute": 120}
    assert status["tenants"]["tenant-a"]["refused"]["requests"] == counted[0]


class TokenUpstream:
    """A model server whose answers report ``usage``: prompt = characters / 4, completion =
    the request's ``max_tokens`` (or :attr:`completion` when it names none)."""

    def __init__(self) -> None:
        self.completion = 0
        self.calls = 0
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                upstream.calls += 1
                prompt = sum(len(m["content"]) for m in body["messages"]) // 4
                completion = body.get("max_tokens", upstream.completion)
                answer = json.dumps(
                    {
                        "id": f"c{upstream.calls}",
                        "object": "chat.completion",
                        "model": body["model"],
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": "ok"},
                                "finish_reason": "stop",
                            }
                        ],
                        "usage": {
                            "prompt_tokens": prompt,
                            "completion_tokens": completion,
                            "total_tokens": prompt + completion,
                        },
                    }
                ).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> TokenUpstream:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def token_upstream() -> Iterator[TokenUpstream]:
    with TokenUpstream() as up:
        yield up


async def test_tokens_per_minute_refuses_past_the_budget_and_hits_are_still_served(
    sidecar_factory: SidecarFactory, redis_url: str, token_upstream: TokenUpstream
) -> None:
    limits = {"acme": TenantLimits(tokens_per_minute=10_000)}
    pod = await sidecar_factory(
        redis_url=redis_url, upstream=token_upstream.url, tenant_limits=limits
    )
    rates = patient(pod)
    await pod.confirmed()
    pod.steady()
    # 4000 characters (1000 tokens) + max_tokens 3000: charged 4000 at admission, used 4000
    prompts = [f"{i}" + "x" * 3999 for i in range(5)]
    answers = []
    for prompt in prompts:
        answers.append(await pod.chat(prompt, body={"max_tokens": 3000}))
        await pod.settled()  # the usage correction is fire-and-forget
    statuses = [r.status_code for r in answers]
    # 10,000 a minute hold two of them; the third would need 12 s of refill
    assert statuses[:2] == [200, 200]
    assert 429 in statuses[2:], statuses
    first = answers[0]
    assert first.headers["x-ratelimit-limit-tokens"] == "10000"
    assert int(first.headers["x-ratelimit-remaining-tokens"]) <= 6000
    refused = next(r for r in answers if r.status_code == 429)
    assert refused.headers["x-ratelimit-limit-tokens"] == "10000"
    assert int(refused.headers["x-ratelimit-remaining-tokens"]) < 4000
    assert refused.headers["x-ratelimit-reset-tokens"]
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["type"] == "tokens"
    assert "x-ratelimit-limit-requests" not in refused.headers  # no request limit set

    # over its budget, the tenant's cache hits are still served: they cost no tokens
    calls = token_upstream.calls
    for prompt in prompts[:2]:
        hit = await pod.chat(prompt, body={"max_tokens": 3000})
        assert hit.status_code == 200
        assert hit.headers["x-cache"].startswith("HIT")
    assert token_upstream.calls == calls
    assert await metric(pod, "acme", "tokens") == statuses.count(429)
    usage = (await pod.admin.get("/status")).json()["rate_limits"]["tenants"]["acme"]
    assert usage["limits"] == {"tokensPerMinute": 10000}
    assert usage["usage"]["tokens"]["limit"] == 10000
    assert rates.corrections_failed == 0


async def test_the_answers_usage_corrects_a_small_estimate(
    sidecar_factory: SidecarFactory, redis_url: str, token_upstream: TokenUpstream
) -> None:
    limits = {"acme": TenantLimits(tokens_per_minute=10_000)}
    pod = await sidecar_factory(
        redis_url=redis_url, upstream=token_upstream.url, tenant_limits=limits
    )
    patient(pod)
    token_upstream.completion = 6000  # short prompts (estimated 10 tokens), long answers
    statuses = []
    for i in range(4):
        statuses.append((await pod.chat(f"{i:02d}" + "y" * 38)).status_code)
        await pod.settled()
    # 6010 used, then 6010 more (the bucket in debt): the third needs ~12 s of refill
    assert statuses[:2] == [200, 200]
    assert statuses[2] == 429, statuses


async def test_hits_count_as_requests_only_with_the_flag(
    sidecar_factory: SidecarFactory, redis_url: str
) -> None:
    limits = {"acme": TenantLimits(requests_per_minute=3)}
    plain = await sidecar_factory(redis_url=redis_url, pod="plain", tenant_limits=limits)
    await plain.confirmed()
    plain.steady()
    patient(plain)
    answers = [await plain.chat("same question") for _ in range(10)]
    assert [r.status_code for r in answers] == [200] * 10  # one miss, nine free hits
    assert [r.headers["x-cache"] for r in answers[1:]] == ["HIT-L1"] * 9
    plain_rates = plain.sidecar.rates
    assert plain_rates is not None
    assert plain_rates.admitted == {"acme": 1}  # the limiter saw the miss only
    assert type(plain.sidecar.handler).fast is Handler.fast  # the hit path as without limits

    counting = await sidecar_factory(
        redis_url=redis_url,
        pod="counting",
        tenant_limits={"other": TenantLimits(requests_per_minute=3)},
        limits_count_hits=True,
    )
    await counting.confirmed()
    counting.steady()
    patient(counting)
    answers = [await counting.chat("again", tenant="other") for _ in range(6)]
    statuses = [r.status_code for r in answers]
    assert statuses[:3] == [200, 200, 200]  # a miss and two hits use the three
    assert statuses.count(429) >= 2  # one more refills in 20 s at most
    assert answers[1].headers["x-cache"].startswith("HIT")
    # an unlimited tenant's hits on the counting pod are not touched
    unlimited = [await counting.chat("again", tenant="free") for _ in range(5)]
    assert [r.status_code for r in unlimited] == [200] * 5


async def test_redis_down_each_pod_enforces_its_share_and_never_errs(
    sidecar_factory: SidecarFactory,
) -> None:
    limits = {"acme": TenantLimits(requests_per_minute=20)}
    with RedisServer() as redis:
        pods = [
            await sidecar_factory(redis_url=redis.url, pod=f"pod-{i}", tenant_limits=limits)
            for i in range(2)
        ]
        for pod in pods:  # both heartbeats registered, counted by each pod
            rates = patient(pod)
            deadline = time.monotonic() + SETTLE_BOUND_S
            while rates.live_pods != 2:
                assert time.monotonic() < deadline, f"live pods: {rates.live_pods}"
                await asyncio.sleep(0.05)
                await rates.refresh_members()
            assert (await pod.chat("before", tenant="acme")).status_code == 200
        redis.kill()

        pod = pods[0]
        rates = patient(pod)
        rates.timeout_s = 0.5
        started = time.monotonic()
        answers = [await pod.chat(f"during {i}", tenant="acme") for i in range(30)]
        elapsed = time.monotonic() - started
        free = [await pod.chat(f"free {i}", tenant="other") for i in range(5)]
        statuses = [r.status_code for r in answers]
        assert set(statuses) <= {200, 429}  # never a 5xx for the client
        assert {r.status_code for r in free} == {200}
        # this pod's share: 20 / 2 live pods = 10 a minute, one more every 6 s
        assert 10 <= statuses.count(200) <= 10 + math.ceil(elapsed / 6) + 1, (statuses, elapsed)
        refused = next(r for r in answers if r.status_code == 429)
        assert refused.headers["x-ratelimit-limit-requests"] == "10"
        assert "share" in refused.json()["error"]["message"]
        status = (await pod.admin.get("/status")).json()["rate_limits"]
        assert status["mode"] == "local"
        assert status["local_share"] == "1/2"
        assert status["redis_error"]
        assert "cachefleet_rate_limit_local{" in (await pod.admin.get("/metrics")).text


async def test_the_limiter_runs_under_the_sidecars_least_privilege_acl(
    sidecar_factory: SidecarFactory, redis_url: str
) -> None:
    admin = redis_from_url(redis_url)
    user, password = "cf-limits", "limits-pw-0b7d"
    try:
        await admin.execute_command(
            "ACL", "SETUSER", user, "reset", "on", f">{password}", *sidecar_acl("test/cache")
        )
        await admin.execute_command("ACL", "LOG", "RESET")
        url = redis_url.replace("redis://", f"redis://{user}:{password}@", 1)
        pod = await sidecar_factory(
            redis_url=url, tenant_limits={"acme": TenantLimits(2, 1000, 10_000)}
        )
        rates = patient(pod)
        answers = [await pod.chat(f"q{i}") for i in range(3)]
        await pod.settled()
        await rates.refresh_members()
        assert [r.status_code for r in answers] == [200, 200, 429]
        assert answers[0].headers["x-ratelimit-remaining-requests"] == "1"
        assert rates.live_pods == 1
        assert rates.corrections_failed == 0
        assert not rates.redis_error
        assert await admin.execute_command("ACL", "LOG") == []
    finally:
        await admin.execute_command("ACL", "DELUSER", user)
        await admin.aclose()


async def test_a_client_that_honours_retry_after_gets_through(
    sidecar_factory: SidecarFactory, redis_url: str
) -> None:
    """What the OpenAI SDK's retries do (the ``openai`` package is not installed here):
    sleep ``Retry-After``, ask again; the limiter lets the retry through."""
    pod = await sidecar_factory(
        redis_url=redis_url, tenant_limits={"acme": TenantLimits(requests_per_minute=60)}
    )
    patient(pod)
    statuses = []
    for i in range(300):  # until refused: the bucket refills one a second meanwhile
        refused = await pod.chat(f"fill {i}")
        statuses.append(refused.status_code)
        if refused.status_code == 429:
            break
    assert statuses[:60] == [200] * 60
    assert statuses[-1] == 429
    wait = int(refused.headers["retry-after"])
    assert wait == 1  # 60 a minute: one more each second
    for _ in range(3):  # the SDK's default is two retries; one is enough here
        await asyncio.sleep(wait)
        retried = await pod.chat(f"fill {i}")
        if retried.status_code == 200:
            break
        wait = int(retried.headers["retry-after"])
    assert retried.status_code == 200
    assert retried.headers["x-cache"] == "MISS"


async def test_limits_hold_on_redis_standalone_and_cluster(
    sidecar_factory: SidecarFactory, any_redis: str
) -> None:
    limits = {"acme": TenantLimits(requests_per_minute=5, tokens_per_day=1_000_000)}
    pods = [
        await sidecar_factory(redis_url=any_redis, pod=f"pod-{i}", tenant_limits=limits)
        for i in range(2)
    ]
    rates = [patient(pod) for pod in pods]
    answers = [await pods[i % 2].chat(f"q{i}") for i in range(8)]
    await asyncio.gather(*(pod.settled() for pod in pods))
    statuses = [r.status_code for r in answers]
    assert statuses[:5] == [200] * 5  # one bucket for both pods: 5, then a 12 s refill
    assert statuses.count(429) >= 2
    assert answers[4].headers["x-ratelimit-remaining-requests"] == "0"
    assert answers[0].headers["x-ratelimit-limit-tokens-day"] == "1000000"
    assert all(not r.redis_error and r.local_decisions == 0 for r in rates)
    assert all(r.corrections_failed == 0 for r in rates)
