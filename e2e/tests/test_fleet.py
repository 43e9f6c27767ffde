"""The whole loop on the local fleet: metrics -> Prometheus -> operator -> Redis -> sidecars.

Real sidecar processes in front of a stand-in model server whose latency per
tenant the test controls, a real Prometheus scraping them, the real kopf
operator against the API emulator, real Redis.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import httpx
import pytest

from cachefleet_e2e.fleet import LocalFleet, TenantPlan

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.redis,
    pytest.mark.prometheus,
    pytest.mark.k8s_emulator,
    pytest.mark.slow,
    pytest.mark.timeout(180),
]

LOOP_TIMEOUT_S = 90.0


def shares(status: dict[str, Any]) -> dict[str, float]:
    return {t["name"]: float(t["share"]) for t in status.get("tenants") or []}


async def load(fleet: LocalFleet, stop: asyncio.Event) -> int:
    """Unique prompts for both tenants (all misses) until ``stop``."""
    counter = itertools.count()
    sent = 0
    async with httpx.AsyncClient(timeout=10.0) as client:

        async def worker(tenant: str) -> None:
            nonlocal sent
            while not stop.is_set():
                n = next(counter)
                url = fleet.sidecars[n % len(fleet.sidecars)].url
                body = {
                    "model": "demo-llm",
                    "messages": [{"role": "user", "content": f"q{n}"}],
                    "temperature": 0,
                }
                resp = await client.post(
                    url + "/v1/chat/completions", json=body, headers={"X-Tenant-ID": tenant}
                )
                assert resp.status_code == 200
                sent += 1

        await asyncio.gather(*(worker(t) for t in ("gold", "bronze") for _ in range(3)))
    return sent


async def test_a_tenant_missing_its_p95_gains_share_and_every_sidecar_applies_it() -> None:
    fleet = LocalFleet(
        pods=2,
        tenants=(
            # the model server is slow for gold: its p95 target cannot be met by misses
            TenantPlan("gold", "Guaranteed", 0.05, 0.0, 0.2, 0.9, upstream_latency_s=0.15),
            TenantPlan("bronze", "Standard", 2.0, 0.0, 0.0, 0.9, upstream_latency_s=0.005),
        ),
        rebalance_interval_s=2,
        metrics_window="10s",
    )
    with fleet.run():
        first = await asyncio.to_thread(fleet.wait_for_quotas)
        initial = shares(first)
        stop = asyncio.Event()
        driver = asyncio.create_task(load(fleet, stop))
        deadline = time.monotonic() + LOOP_TIMEOUT_S
        status: dict[str, Any] = {}
        try:
            while time.monotonic() < deadline:
                await asyncio.sleep(1.0)
                status = await asyncio.to_thread(fleet.status)
                gold = next((t for t in status.get("tenants") or [] if t["name"] == "gold"), {})
                observed = gold.get("observed") or {}
                if (
                    observed.get("p95Seconds") is not None
                    and gold.get("slaMet") is False
                    and shares(status)["gold"] > initial["gold"]
                ):
                    break
            else:
                pytest.fail(f"gold never gained share; last status: {status}")
        finally:
            stop.set()
            sent = await driver
        assert sent > 0
        # The operator read gold's p95 from Prometheus: it really is above target.
        assert observed["p95Seconds"] > 0.05
        assert shares(status)["bronze"] < initial["bronze"]
        # Every sidecar applies the new quotas (through Redis, no restart).
        final = await asyncio.to_thread(fleet.wait_for_quotas)
        gen = final["quotaGeneration"]
        l1 = {t["name"]: t["l1Bytes"] for t in final["tenants"]}
        for pod, sc_status in (await asyncio.to_thread(fleet.sidecar_status)).items():
            assert sc_status["quota_generation"] >= gen, pod
            assert sc_status["tenants"]["gold"]["l1_quota_bytes"] == l1["gold"], pod
        reasons = [e.get("reason") for e in fleet.events()]
        assert "QuotasChanged" in reasons
