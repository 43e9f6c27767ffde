"""Per-request Cache-Control, Age, X-Cache-Key, per-tenant TTLs and savings, through a sidecar.

Black-box: a real sidecar in front of the stand-in upstream; what a client
sees (status, headers, upstream calls) and what /metrics and /status say.
Times are whole seconds and waited for by bounded polling, never raced.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import pytest

from cachefleet_common.contract.messages import QuotaAssignment, TenantQuota
from cachefleet_common.contract.names import entry_key
from cachefleet_e2e.fake_upstream import FakeUpstream

from .conftest import RunningSidecar, SidecarFactory
from .test_sidecar import CHAT, answer, metric

HEX64 = re.compile(r"^[0-9a-f]{64}$")


def quotas(generation: int = 1, **tenants: TenantQuota) -> QuotaAssignment:
    return QuotaAssignment(generation=generation, tenants=tenants)


def quota(**fields: object) -> TenantQuota:
    return TenantQuota(l1_bytes=4 << 20, l2_bytes=1 << 20, **fields)  # type: ignore[arg-type]


async def hit_aged(
    sc: RunningSidecar, content: str, age: int, timeout_s: float = 15.0, tenant: str = "acme"
) -> httpx.Response:
    """Ask until an L1 hit says ``Age`` >= ``age`` (bounded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        resp = await sc.chat(content, tenant=tenant)
        assert resp.headers["x-cache"] == "HIT-L1"
        if int(resp.headers["age"]) >= age:
            return resp
        await asyncio.sleep(0.2)
    raise AssertionError(f"no hit with Age >= {age} within {timeout_s}s")


async def test_hits_say_their_age_and_every_cacheable_answer_its_key(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    first = await sidecar.chat("how old?")
    assert first.headers["x-cache"] == "MISS"
    assert "age" not in first.headers
    key = first.headers["x-cache-key"]
    assert HEX64.match(key)
    second = await sidecar.chat("how old?")
    assert second.headers["x-cache"] == "HIT-L1"
    assert second.headers["x-cache-key"] == key
    assert int(second.headers["age"]) in (0, 1)
    older = await hit_aged(sidecar, "how old?", 1)
    assert answer(older) == answer(first)
    assert int(older.headers["age"]) >= 1
    # another request is another entry, another key; an uncacheable one has none
    other = await sidecar.chat("something else")
    assert other.headers["x-cache-key"] != key
    hot = await sidecar.chat("hot", body={"temperature": 0.9})
    assert hot.headers["x-cache"] == "BYPASS"
    assert "x-cache-key" not in hot.headers
    assert upstream.calls[CHAT] == 3


async def test_requests_that_share_a_miss_get_its_key_and_no_age(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    upstream.default_latency_s = 0.3
    results = await asyncio.gather(*(sidecar.chat("shared miss") for _ in range(4)))
    assert upstream.calls[CHAT] == 1
    assert {r.headers["x-cache"] for r in results} == {"MISS"}
    assert len({r.headers["x-cache-key"] for r in results}) == 1
    assert not [r for r in results if "age" in r.headers]


async def test_max_age_accepts_only_a_young_enough_entry(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    await sidecar.chat("fresh enough?")
    await hit_aged(sidecar, "fresh enough?", 1)
    ok = await sidecar.chat("fresh enough?", headers={"Cache-Control": "max-age=3600"})
    assert ok.headers["x-cache"] == "HIT-L1"
    assert upstream.calls[CHAT] == 1
    refreshed = await sidecar.chat("fresh enough?", headers={"Cache-Control": "max-age=0"})
    assert refreshed.headers["x-cache"] == "MISS"
    assert upstream.calls[CHAT] == 2
    # the answer refreshed the entry: the next plain request hits it, young again
    again = await sidecar.chat("fresh enough?")
    assert again.headers["x-cache"] == "HIT-L1"
    assert answer(again) == answer(refreshed)
    assert int(again.headers["age"]) in (0, 1)


async def test_only_if_cached_answers_504_and_sends_nothing_upstream(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    only = {"Cache-Control": "only-if-cached"}
    missing = await sidecar.chat("never asked", headers=only)
    assert missing.status_code == 504
    assert missing.json()["error"]["type"] == "cachefleet_not_cached"
    uncacheable = await sidecar.chat("hot", body={"temperature": 1.0}, headers=only)
    assert uncacheable.status_code == 504
    assert upstream.calls[CHAT] == 0
    await sidecar.chat("asked once")
    cached = await sidecar.chat("asked once", headers=only)
    assert cached.status_code == 200
    assert cached.headers["x-cache"] == "HIT-L1"
    # with a max-age the entry is too old for: 504, still nothing sent
    await hit_aged(sidecar, "asked once", 1)
    too_old = await sidecar.chat(
        "asked once", headers={"Cache-Control": "only-if-cached, max-age=0"}
    )
    assert too_old.status_code == 504
    assert upstream.calls[CHAT] == 1


async def test_a_tenant_that_may_not_bypass_has_its_directives_ignored_and_counted(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    sidecar.sidecar.quotas.apply(
        quotas(
            acme=quota(allow_bypass=False, allow_max_age=False),
            free=quota(),
        )
    )
    await sidecar.chat("q")
    for directive in ("no-cache", "no-store", "max-age=0"):
        resp = await sidecar.chat("q", headers={"Cache-Control": directive})
        assert resp.headers["x-cache"] == "HIT-L1", directive
    assert upstream.calls[CHAT] == 1
    # the tenant that may bypass does
    await sidecar.chat("q", tenant="free")
    assert (await sidecar.chat("q", tenant="free", headers={"Cache-Control": "no-cache"})).headers[
        "x-cache"
    ] == "MISS"
    text = (await sidecar.admin.get("/metrics")).text
    name = "cachefleet_cache_control_ignored_total"
    for directive in ("no-cache", "no-store", "max-age"):
        assert metric(text, name, tenant="acme", directive=directive) == 1
    assert metric(text, name, tenant="free", directive="no-cache") is None


async def test_ttl_per_tenant_in_l1(sidecar: RunningSidecar, upstream: FakeUpstream) -> None:
    sidecar.sidecar.quotas.apply(quotas(acme=quota(ttl_seconds=1), slow=quota()))
    first = await sidecar.chat("ttl", tenant="acme")
    await sidecar.chat("ttl", tenant="slow")
    # acme's entry is served only while younger than 1 s: then it is a miss, refilled
    deadline = time.monotonic() + 15.0
    while True:
        resp = await sidecar.chat("ttl", tenant="acme")
        if resp.headers["x-cache"] == "MISS":
            break
        assert resp.headers["x-cache"] == "HIT-L1"
        assert resp.headers["age"] == "0"  # never an entry older than the TTL
        assert time.monotonic() < deadline, "the entry outlived its TTL"
        await asyncio.sleep(0.1)
    assert answer(resp) != answer(first)
    # the other tenant's entry, as old, is still served past acme's TTL (it was filled
    # a moment after acme's, so its Age may still read 0 when acme's ran out: asked again)
    await hit_aged(sidecar, "ttl", 1, tenant="slow")


async def test_lowering_a_tenants_ttl_stops_its_older_entries_at_once(
    sidecar: RunningSidecar,
) -> None:
    await sidecar.chat("long lived")
    await hit_aged(sidecar, "long lived", 1)
    sidecar.sidecar.quotas.apply(quotas(acme=quota(ttl_seconds=1)))
    assert (await sidecar.chat("long lived")).headers["x-cache"] == "MISS"


async def test_savings_after_plain_and_streamed_hits(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream, tmp_path: Path
) -> None:
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"m1": {"prompt": 1.0, "completion": 2.0}}))
    from cachefleet_common.prices import load_price_table

    sc = await sidecar_factory(price_table=load_price_table(str(prices)))
    upstream.default_latency_s = 0.05
    await sc.chat("saved")
    for _ in range(3):
        assert (await sc.chat("saved")).headers["x-cache"] == "HIT-L1"
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    await sc.chat("streamed", body=stream)
    replay = await sc.chat("streamed", body=stream)
    assert replay.headers["x-cache"] == "HIT-L1"
    assert '"usage"' in replay.text
    # a stream without usage saves its model time, and no tokens
    await sc.chat("no usage", body={"stream": True})
    assert (await sc.chat("no usage", body={"stream": True})).headers["x-cache"] == "HIT-L1"
    text = (await sc.admin.get("/metrics")).text
    labels = {"tenant": "acme", "model": "m1"}
    tokens = "cachefleet_saved_tokens_total"
    assert metric(text, tokens, **labels, kind="prompt") == 4 * 5
    assert metric(text, tokens, **labels, kind="completion") == 4 * 3
    seconds = metric(text, "cachefleet_saved_model_seconds_total", **labels)
    assert seconds is not None
    assert seconds >= 5 * 0.05  # five hits, each saved its fill's upstream time
    cost = metric(text, "cachefleet_saved_cost_total", **labels)
    assert cost is not None
    assert abs(cost - 4 * (5 * 1.0 + 3 * 2.0) / 1000) < 1e-9
    status = (await sc.admin.get("/status")).json()
    saved = status["savings"]["acme"]["m1"]
    assert (saved["hits"], saved["prompt_tokens"], saved["completion_tokens"]) == (5, 20, 12)
    assert status["saved"]["prompt_tokens"] == 20
    assert status["saved"]["priced"] is True
    assert upstream.calls[CHAT] == 3
    # the demo's report reads the same /status of every pod
    from cachefleet_e2e.demo import savings_by_tenant

    two_pods = savings_by_tenant({"pod-a": status, "pod-b": status})
    assert two_pods["acme"]["hits"] == 2 * 5
    assert two_pods["acme"]["prompt_tokens"] == 2 * 20


async def test_a_bad_price_table_is_refused_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cachefleet_sidecar.config import parse_args

    bad = tmp_path / "prices.json"
    bad.write_text(json.dumps({"m1": {"prompt": -1}}))
    with pytest.raises(SystemExit):
        parse_args(["--price-table", str(bad)])
    assert "--price-table: 'm1'.prompt: must be a finite number >= 0" in capsys.readouterr().err
    good = tmp_path / "ok.json"
    good.write_text(json.dumps({"*": {"prompt": 0.5, "completion": 1.5}}))
    assert parse_args(["--price-table", str(good), "--ttl", "30"]).caching.price_table == {
        "*": (0.5, 1.5)
    }
    # the JSON itself (how the operator passes spec.savings.prices), checked alike
    inline = json.dumps({"m1": {"prompt": 1.0, "completion": 2.0}})
    assert parse_args(["--price-table", inline]).caching.price_table == {"m1": (1.0, 2.0)}
    with pytest.raises(SystemExit):
        parse_args(["--price-table", '{"m1": {"prompt": -1}}'])
    assert "--price-table: 'm1'.prompt: must be a finite number >= 0" in capsys.readouterr().err


@pytest.mark.redis
async def test_ttl_and_age_hold_through_l2_and_the_key_names_the_redis_entry(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream, redis_url: str
) -> None:
    from redis.asyncio import Redis

    bound = {"staleness_bound_s": 60.0, "ttl_s": 2.0}
    # patient: a loaded machine must not drop the write (50 ms budget) the test reads
    pod_a = await sidecar_factory(redis_url=redis_url, pod="pod-a", patient=True, **bound)
    started = time.monotonic()
    first = await pod_a.chat("shared ttl")
    key = first.headers["x-cache-key"]
    await pod_a.stored()
    # the digest X-Cache-Key gives is the one the entry's Redis key is named by
    entry = entry_key("test/cache", "acme", key)
    async with Redis.from_url(redis_url) as r:
        exists, pttl = await r.exists(entry), await r.pttl(entry)
    if time.monotonic() - started < 2.0:  # written since `started`: surely not expired yet
        assert exists == 1
        assert 0 < pttl <= 2000  # the write's expiry follows the TTL
    pod_b = await sidecar_factory(redis_url=redis_url, pod="pod-b", patient=True, **bound)
    from_b = await pod_b.chat("shared ttl")
    if from_b.headers["x-cache"] == "HIT-L2":  # unless the 2 s passed on a loaded machine
        assert from_b.headers["x-cache-key"] == key
        assert int(from_b.headers["age"]) <= 1
        assert answer(from_b) == answer(first)
    # no pod serves it once 2 s old: a third pod, started after that, misses
    deadline = time.monotonic() + 20.0
    while True:
        resp = await pod_b.chat("shared ttl")
        if resp.headers["x-cache"] == "MISS":
            break
        assert int(resp.headers["age"]) < 2
        assert time.monotonic() < deadline, "an entry outlived the TTL"
        await asyncio.sleep(0.1)


async def wait_until(predicate: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout_s}s")


async def test_l3_serves_a_neighbour_only_within_the_ttl_and_counts_its_savings(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    from .test_semantic import PARA, Q, semantic_sidecar

    sc = await semantic_sidecar(sidecar_factory, ttl_s=3.0)
    started = time.monotonic()
    first = await sc.chat(Q)
    para = await sc.chat(PARA)
    if time.monotonic() - started < 2.5:  # the entry is surely younger than its TTL
        assert para.headers["x-cache"] == "HIT-L3"
        assert para.headers["x-cache-key"] == first.headers["x-cache-key"]  # the entry served
        assert int(para.headers["age"]) <= 2
        text = (await sc.admin.get("/metrics")).text
        assert metric(text, "cachefleet_saved_tokens_total", tenant="acme", kind="prompt") == 5
    # once the neighbour is older than the TTL, L3 no longer answers with it
    deadline = time.monotonic() + 20.0
    for n in range(1000):
        resp = await sc.chat(f"{PARA} {'?' * (n % 3 + 1)}")
        if resp.headers["x-cache"] != "HIT-L3":
            break
        assert int(resp.headers["age"]) < 3, "L3 served an entry older than the TTL"
        assert time.monotonic() < deadline
        await asyncio.sleep(0.2)
    assert resp.headers["x-cache"] == "MISS"


@pytest.mark.parametrize(
    "path",
    ["/v1//chat/completions", "/v1/chat/completions/", "/V1/chat/completions", "/v1/models"],
)
async def test_only_if_cached_on_a_path_nothing_is_cached_for_is_504(
    sidecar: RunningSidecar, upstream: FakeUpstream, path: str
) -> None:
    """Issue 34 (7): a variant of a cached path was forwarded to the model despite
    ``only-if-cached``; nothing is ever cached there, so the answer is 504."""
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    headers = {"X-Tenant-ID": "acme", "Cache-Control": "only-if-cached"}
    if path == "/v1/models":
        resp = await sidecar.client.get(path, headers=headers)
    else:
        resp = await sidecar.client.post(path, json=body, headers=headers)
    assert resp.status_code == 504
    assert resp.json()["error"]["type"] == "cachefleet_not_cached"
    assert sum(upstream.calls.values()) == 0
    # without the directive the same request still goes through
    del headers["Cache-Control"]
    if path != "/v1/models":
        assert (await sidecar.client.post(path, json=body, headers=headers)).status_code == 200
        assert sum(upstream.calls.values()) == 1


async def test_cache_control_field_lines_combine(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    """Issue 34 (7): only the first ``Cache-Control`` line was read, so ``only-if-cached``
    on a second line went to the model. Field lines are one list (RFC 9110 5.3)."""
    body = {"model": "m1", "messages": [{"role": "user", "content": "two lines"}]}
    headers = [
        ("X-Tenant-ID", "acme"),
        ("Cache-Control", "max-age=600"),
        ("Cache-Control", "only-if-cached"),
    ]
    resp = await sidecar.client.post("/v1/chat/completions", json=body, headers=headers)
    assert resp.status_code == 504
    assert upstream.calls[CHAT] == 0
    await sidecar.chat("two lines bypassed")
    split = [("X-Tenant-ID", "acme"), ("Cache-Control", "private"), ("Cache-Control", "no-cache")]
    body["messages"][0]["content"] = "two lines bypassed"  # type: ignore[index]
    body["temperature"] = 0
    again = await sidecar.client.post("/v1/chat/completions", json=body, headers=split)
    assert again.headers["x-cache"] == "MISS"  # the second line's no-cache is obeyed
    assert upstream.calls[CHAT] == 2


async def test_max_age_zero_follows_the_bypass_allowance(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    """Issue 34 (7): a tenant with ``allowBypass: false`` (and freshness allowed) bypassed
    the cache with ``max-age=0`` (3 model calls for 3 requests)."""
    sidecar.sidecar.quotas.apply(quotas(acme=quota(allow_bypass=False), free=quota()))
    await sidecar.chat("q")
    for _ in range(3):
        resp = await sidecar.chat("q", headers={"Cache-Control": "max-age=0"})
        assert resp.headers["x-cache"] == "HIT-L1"
    assert upstream.calls[CHAT] == 1
    text = (await sidecar.admin.get("/metrics")).text
    name = "cachefleet_cache_control_ignored_total"
    assert metric(text, name, tenant="acme", directive="max-age") == 3
    # a tenant that may bypass refreshes the entry with it, as with no-cache
    await sidecar.chat("q", tenant="free")
    resp = await sidecar.chat("q", tenant="free", headers={"Cache-Control": "max-age=0"})
    assert resp.headers["x-cache"] == "MISS"
    assert upstream.calls[CHAT] == 3
