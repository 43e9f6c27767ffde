"""The sidecar's data path against a stand-in upstream (L1 only, no Redis)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cachefleet_common.contract.messages import QuotaAssignment, TenantQuota
from cachefleet_common.contract.names import Policy
from cachefleet_e2e.fake_upstream import FakeUpstream

from .conftest import RunningSidecar, SidecarFactory

CHAT = "/v1/chat/completions"


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in a Prometheus text exposition, or None."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


def answer(resp: httpx.Response) -> str:
    return str(resp.json()["choices"][0]["message"]["content"])


async def test_second_identical_request_is_an_l1_hit(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    first = await sidecar.chat("what is a cache?")
    second = await sidecar.chat("what is a cache?")
    assert first.status_code == second.status_code == 200
    assert first.headers["x-cache"] == "MISS"
    assert second.headers["x-cache"] == "HIT-L1"
    assert answer(first) == answer(second)
    assert second.headers["content-type"] == "application/json"
    assert upstream.calls[CHAT] == 1


async def test_semantically_equal_requests_share_one_entry(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    first = await sidecar.chat("hello world")
    # Same request: other field order, formatting, JSON escapes, 0.0 for 0, a dropped field.
    raw = (
        '{"temperature": 0.0, "messages":[{"content":"hello \\u0077orld","role":"user"}],'
        '   "model":"m1", "user": "someone-else"}'
    )
    second = await sidecar.client.post(
        CHAT, content=raw, headers={"X-Tenant-ID": "acme", "content-type": "application/json"}
    )
    assert second.headers["x-cache"] == "HIT-L1"
    assert answer(second) == answer(first)
    # Text is keyed byte for byte: outer and inner whitespace both count.
    assert (await sidecar.chat("hello  world")).headers["x-cache"] == "MISS"
    assert (await sidecar.chat("  hello world \n")).headers["x-cache"] == "MISS"
    # A temperature near 0 is not 0: not deterministic, not cached, never served 0's answer.
    near = await sidecar.chat("hello world", body={"temperature": 0.0000001})
    assert near.headers["x-cache"] == "BYPASS"
    assert upstream.calls[CHAT] == 4


async def test_collapse_whitespace_option_merges_inner_whitespace(
    sidecar_factory: SidecarFactory,
) -> None:
    sc = await sidecar_factory(collapse_whitespace=True)
    await sc.chat("hello world")
    assert (await sc.chat(" hello \n  world ")).headers["x-cache"] == "HIT-L1"


async def test_whitespace_collapse_is_a_per_tenant_option(sidecar: RunningSidecar) -> None:
    sidecar.sidecar.quotas.apply(
        QuotaAssignment(
            generation=1,
            tenants={
                "prose": TenantQuota(l1_bytes=1 << 20, l2_bytes=0, collapse_whitespace=True),
                "code": TenantQuota(l1_bytes=1 << 20, l2_bytes=0),
            },
        )
    )
    for tenant, expected in (("prose", "HIT-L1"), ("code", "MISS")):
        await sidecar.chat("def f():\n    return 1", tenant=tenant)
        again = await sidecar.chat("def f(): return 1", tenant=tenant)
        assert again.headers["x-cache"] == expected, tenant


async def test_one_tenants_entry_is_never_served_to_another(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    a = await sidecar.chat("shared prompt", tenant="alpha")
    b = await sidecar.chat("shared prompt", tenant="beta")
    assert a.headers["x-cache"] == b.headers["x-cache"] == "MISS"
    assert answer(a) != answer(b)
    assert (await sidecar.chat("shared prompt", tenant="beta")).headers["x-cache"] == "HIT-L1"
    assert upstream.calls[CHAT] == 2
    metrics = (await sidecar.admin.get("/metrics")).text
    assert metric(metrics, "cachefleet_cross_tenant_hits_total", cache="test/cache") == 0


async def test_model_version_scopes_the_key(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    v1 = await sidecar_factory(model_version="v1")
    await v1.chat("q")
    assert (await v1.chat("q")).headers["x-cache"] == "HIT-L1"
    v1.sidecar.keying.model_version = "v2"
    assert (await v1.chat("q")).headers["x-cache"] == "MISS"


async def test_only_deterministic_requests_are_cached(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    hot = {"temperature": 0.7}
    r1 = await sidecar.chat("creative", body=hot)
    r2 = await sidecar.chat("creative", body=hot)
    assert r1.headers["x-cache"] == r2.headers["x-cache"] == "BYPASS"
    assert answer(r1) != answer(r2)
    seeded = {"temperature": 0.7, "seed": 42}
    await sidecar.chat("creative", body=seeded)
    assert (await sidecar.chat("creative", body=seeded)).headers["x-cache"] == "HIT-L1"


async def test_nondeterministic_caching_can_be_widened(sidecar_factory: SidecarFactory) -> None:
    sc = await sidecar_factory(cache_nondeterministic=True)
    await sc.chat("creative", body={"temperature": 0.7})
    assert (await sc.chat("creative", body={"temperature": 0.7})).headers["x-cache"] == "HIT-L1"


async def test_cache_control_no_cache_and_no_store(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    await sidecar.chat("cc")
    fresh = await sidecar.chat("cc", headers={"Cache-Control": "no-cache"})
    assert fresh.headers["x-cache"] == "MISS"
    assert upstream.calls[CHAT] == 2
    # no-cache refreshed the entry: the next plain request hits the fresh answer.
    assert answer(await sidecar.chat("cc")) == answer(fresh)
    ns = await sidecar.chat("nostore", headers={"Cache-Control": "no-store"})
    assert ns.headers["x-cache"] == "MISS"
    assert (await sidecar.chat("nostore")).headers["x-cache"] == "MISS"
    both = await sidecar.chat("cc", headers={"Cache-Control": "no-cache, no-store"})
    assert both.headers["x-cache"] == "BYPASS"


async def test_upstream_errors_are_forwarded_and_never_cached(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    upstream.fail_next, upstream.fail_status = 1, 503
    failed = await sidecar.chat("flaky")
    assert failed.status_code == 503
    assert failed.json() == {"error": {"message": "injected failure"}}
    ok = await sidecar.chat("flaky")
    assert ok.status_code == 200
    assert ok.headers["x-cache"] == "MISS"


async def test_invalid_json_from_upstream_is_forwarded_not_cached(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    upstream.invalid_json_next = 1
    odd = await sidecar.chat("odd")
    assert odd.content == b"this is not json"
    assert (await sidecar.chat("odd")).headers["x-cache"] == "MISS"


async def test_truncated_upstream_body_is_not_cached(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    upstream.truncate_next = 1
    broken = await sidecar.chat("trunc")
    assert broken.status_code == 502
    assert "incomplete" in broken.json()["error"]["message"]
    again = await sidecar.chat("trunc")
    assert again.status_code == 200
    assert again.headers["x-cache"] == "MISS"


async def test_unparseable_request_goes_upstream_untouched(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    resp = await sidecar.client.post(CHAT, content=b"{not json", headers={"X-Tenant-ID": "acme"})
    assert resp.status_code == 400  # the upstream's own answer
    assert resp.headers["x-cache"] == "BYPASS"
    assert upstream.calls[CHAT] == 1


async def test_other_paths_pass_through_untouched(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    # Identity applies to every path (docs/security.md): the request names its tenant.
    headers = {"X-Custom": "yes", "X-Tenant-ID": "acme"}
    resp = await sidecar.client.get("/v1/models?status=418", headers=headers)
    assert resp.status_code == 418
    assert resp.headers["x-cache"] == "BYPASS"
    assert resp.headers["x-upstream"] == "fake"
    echo = resp.json()
    assert echo["path"] == "/v1/models?status=418"
    assert echo["headers"]["x-custom"] == "yes"
    put = await sidecar.client.put("/admin/thing", content=b"payload", headers=headers)
    assert put.json()["method"] == "PUT"
    assert put.json()["body"] == "payload"


async def test_sse_stream_is_stored_and_replayed(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    first = await sidecar.chat("stream me", body={"stream": True})
    assert first.headers["x-cache"] == "MISS"
    assert first.headers["content-type"] == "text/event-stream"
    second = await sidecar.chat("stream me", body={"stream": True})
    assert second.headers["x-cache"] == "HIT-L1"
    assert second.headers["content-type"] == "text/event-stream"
    assert second.content == first.content
    events = [line for line in second.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert len(events) == 4
    # The non-streamed form of the same request is a different entry.
    assert (await sidecar.chat("stream me")).headers["x-cache"] == "MISS"


async def test_broken_stream_is_not_cached(sidecar: RunningSidecar, upstream: FakeUpstream) -> None:
    upstream.break_stream_next = 1
    with pytest.raises(httpx.HTTPError):
        await sidecar.chat("broken", body={"stream": True})
    again = await sidecar.chat("broken", body={"stream": True})
    assert again.headers["x-cache"] == "MISS"
    assert again.text.endswith("data: [DONE]\n\n")


async def test_concurrent_identical_misses_make_one_upstream_call(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    upstream.default_latency_s = 0.3
    results = await asyncio.gather(*(sidecar.chat("popular") for _ in range(8)))
    assert upstream.calls[CHAT] == 1
    assert {answer(r) for r in results} == {answer(results[0])}
    assert all(r.status_code == 200 for r in results)
    metrics = (await sidecar.admin.get("/metrics")).text
    assert metric(metrics, "cachefleet_single_flight_joins_total") == 7


async def test_tenant_resolution(sidecar_factory: SidecarFactory, upstream: FakeUpstream) -> None:
    strict = await sidecar_factory()
    missing = await strict.chat("x", tenant=None)
    assert missing.status_code == 403
    assert "X-Tenant-ID" in missing.json()["error"]["message"]
    bad = await strict.chat("x", tenant="no spaces allowed")
    assert bad.status_code == 400
    assert upstream.calls[CHAT] == 0

    lenient = await sidecar_factory(default_tenant="shared", tenants=("alpha",))
    assert (await lenient.chat("x", tenant=None)).status_code == 200
    # An unknown tenant is mapped to the default one.
    assert (await lenient.chat("x", tenant="stranger")).headers["x-cache"] == "HIT-L1"

    closed = await sidecar_factory(tenants=("alpha",))
    refused = await closed.chat("x", tenant="stranger")
    assert refused.status_code == 403
    assert "unknown tenant" in refused.json()["error"]["message"]

    keyed = await sidecar_factory(api_keys={"sk-alpha": "alpha"})
    ok = await keyed.chat("x", tenant=None, headers={"Authorization": "Bearer sk-alpha"})
    assert ok.status_code == 200
    assert "alpha" in keyed.sidecar.l1.stats()


async def test_one_tenant_cannot_evict_another_within_its_share(
    sidecar_factory: SidecarFactory,
) -> None:
    sc = await sidecar_factory(l1_bytes=64 * 1024)
    await sc.chat("keep me", tenant="quiet")
    await sc.chat("noise 0", tenant="noisy")  # both tenants active: equal shares
    for i in range(1, 200):
        await sc.chat(f"noise {i}", tenant="noisy")
    stats = sc.sidecar.l1.stats()
    assert stats["noisy"].evictions > 0
    assert stats["noisy"].used_bytes <= stats["noisy"].capacity_bytes
    assert (await sc.chat("keep me", tenant="quiet")).headers["x-cache"] == "HIT-L1"


async def test_operator_quotas_apply(sidecar_factory: SidecarFactory) -> None:
    sc = await sidecar_factory()
    sc.sidecar.quotas.apply(
        QuotaAssignment(
            generation=3,
            default_policy=Policy.LIRS,
            tenants={
                "gold": TenantQuota(l1_bytes=4 * 1024 * 1024, l2_bytes=1 << 20),
                "bronze": TenantQuota(l1_bytes=0, l2_bytes=0, policy=Policy.LRU),
            },
        )
    )
    await sc.chat("q", tenant="gold")
    await sc.chat("q", tenant="bronze")
    assert (await sc.chat("q", tenant="gold")).headers["x-cache"] == "HIT-L1"
    assert (await sc.chat("q", tenant="bronze")).headers["x-cache"] == "MISS"  # zero quota
    assert (await sc.chat("q", tenant="stranger")).status_code == 403
    status = (await sc.admin.get("/status")).json()
    assert status["quota_generation"] == 3
    assert status["tenants"]["gold"]["policy"] == "lirs"
    assert status["tenants"]["gold"]["l1_quota_bytes"] == 4 * 1024 * 1024
    # An older generation is ignored.
    sc.sidecar.quotas.apply(QuotaAssignment(generation=2))
    assert sc.sidecar.tenants.quota_generation == 3


async def test_admin_endpoints(sidecar: RunningSidecar, upstream: FakeUpstream) -> None:
    await sidecar.chat("m")
    await sidecar.chat("m")
    assert (await sidecar.admin.get("/healthz")).status_code == 200
    assert (await sidecar.admin.get("/readyz")).status_code == 200
    status = (await sidecar.admin.get("/status")).json()
    assert status["tenants"]["acme"]["l1_entries"] == 1
    assert status["redis"] is None
    assert status["gpu_telemetry"]["available"] is False
    text = (await sidecar.admin.get("/metrics")).text
    acme = {"cache": "test/cache", "tenant": "acme"}
    assert metric(text, "cachefleet_requests_total", **acme, tier="l1", result="hit") == 1
    assert metric(text, "cachefleet_requests_total", **acme, tier="upstream", result="miss") == 1
    count = metric(text, "cachefleet_request_duration_seconds_count", **acme, tier="l1")
    assert count == 1
    assert metric(text, "cachefleet_upstream_duration_seconds_count", **acme) == 1
    used = metric(text, "cachefleet_cache_bytes", **acme, tier="l1")
    assert used is not None
    assert used > 0
    assert metric(text, "cachefleet_cache_quota_bytes", **acme, tier="l1") == 8 * 1024 * 1024
    assert "cachefleet_gpu_telemetry_available 0.0" in text
    # The proxy port passes /metrics through to the model server.
    proxied = await sidecar.client.get("/metrics", headers={"X-Tenant-ID": "acme"})
    assert proxied.json()["path"] == "/metrics"


async def test_readyz_follows_the_upstream(sidecar_factory: SidecarFactory) -> None:
    sc = await sidecar_factory(upstream="http://127.0.0.1:9")  # discard port: refused
    ready = await sc.admin.get("/readyz")
    assert ready.status_code == 503
    down = await sc.chat("x")
    assert down.status_code == 502
    assert "upstream unavailable" in down.json()["error"]["message"]
    assert (await sc.admin.get("/healthz")).status_code == 200


async def test_graceful_shutdown_finishes_in_flight(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    sc = await sidecar_factory()
    upstream.default_latency_s = 1.0
    pending = asyncio.create_task(sc.chat("slow"))
    # in flight: it reached the upstream (bounded; a sleep could stop the server first)
    deadline = time.monotonic() + 20.0
    while upstream.calls[CHAT] < 1:
        assert time.monotonic() < deadline, "the request never reached the upstream"
        await asyncio.sleep(0.01)
    await sc.server.stop(grace_s=20.0)
    resp = await pending
    assert resp.status_code == 200
    with pytest.raises(httpx.ConnectError):
        await httpx.AsyncClient().post(sc.url + CHAT, json={})


async def test_admin_on_main_port_when_admin_listen_is_off(
    sidecar_factory: SidecarFactory,
) -> None:
    sc = await sidecar_factory(admin_listen=None)
    status = await sc.client.get("/status")
    assert json.loads(status.content)["cache"] == "test/cache"


async def test_a_tenant_gets_sits_through_its_quota(sidecar: RunningSidecar) -> None:
    sidecar.sidecar.quotas.apply(
        QuotaAssignment(
            generation=1,
            tenants={"t": TenantQuota(l1_bytes=1 << 20, l2_bytes=0, policy=Policy.SITS)},
        )
    )
    await sidecar.chat("x", tenant="t")
    assert (await sidecar.chat("x", tenant="t")).headers["x-cache"] == "HIT-L1"
    assert sidecar.sidecar.l1.stats()["t"].policy == "sits"
    status = json.loads((await sidecar.admin.get("/status")).content)
    assert status["tenants"]["t"]["policy"] == "sits"


async def test_a_silent_upstream_times_out_with_504(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    sc = await sidecar_factory(upstream_timeout_s=0.3)
    upstream.default_latency_s = 1.5
    resp = await sc.chat("slow")
    assert resp.status_code == 504
    assert "silent" in resp.json()["error"]["message"]
    # the healthy call: a loaded machine must not time it out
    sc.sidecar.upstream.read_timeout_s = 20.0
    upstream.default_latency_s = 0
    assert (await sc.chat("fast")).status_code == 200
