"""The whole loop on the local fleet: curves -> Prometheus -> operator -> Redis -> sidecars.

Real sidecar processes in front of a stand-in model server, a real
Prometheus scraping them, the real kopf operator against the API emulator,
real Redis. Load is open-loop: each tenant sends at a fixed rate whatever
the answers' latency, so what the operator sees depends on the workload,
not on how fast this machine is.

The workload: ``loop`` cycles through a working set that its first
(class-only) share cannot hold, so under LRU it never hits; ``scan`` never
repeats a prompt and holds a Guaranteed floor. Only a share measured by gain
helps: the sidecars' miss-ratio curves show ``loop``'s working set, the
operator gives it the bytes, its L1 hit ratio rises, and every sidecar
applies the new quota.
"""

from __future__ import annotations

import asyncio
import contextlib
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
    pytest.mark.timeout(240),
]

#: Requests per second each tenant sends, whatever the latency of the answers.
RATE_PER_TENANT = 40.0
#: Safety net only: the loop normally closes in well under a minute.
LOOP_TIMEOUT_S = 150.0
L1_BYTES_PER_POD = 128 * 1024
#: The working set needs about this share of L1: more than ``loop``'s first (1/3) and the
#: first step towards its target (0.417: steps go half-way), less than the second (0.458).
WORKING_SET_SHARE = 0.44
#: A share at which the working set fits whole.
FITS_SHARE = 0.45


def shares(status: dict[str, Any]) -> dict[str, float]:
    return {t["name"]: float(t["share"]) for t in status.get("tenants") or []}


def body(prompt: str) -> dict[str, Any]:
    return {
        "model": "demo-llm",
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
    }


class OpenLoop:
    """Sends each tenant's requests at fixed times; records what answered each one."""

    def __init__(self, fleet: LocalFleet, working_set: int) -> None:
        self.fleet = fleet
        self.working_set = working_set
        self.results: list[tuple[float, str, int, str]] = []  # (sent at, tenant, status, x-cache)
        self.tasks: set[asyncio.Task[None]] = set()

    def prompt(self, tenant: str, n: int) -> str:
        return f"loop-{n % self.working_set}" if tenant == "loop" else f"scan-{n}"

    async def _send(self, client: httpx.AsyncClient, tenant: str, n: int, at: float) -> None:
        # odd working set + alternating pods: every pod sees every key of the loop
        sidecar = self.fleet.sidecars[n % len(self.fleet.sidecars)]
        try:
            resp = await client.post(
                sidecar.url + "/v1/chat/completions",
                json=body(self.prompt(tenant, n)),
                headers={"X-Tenant-ID": tenant},
            )
            self.results.append((at, tenant, resp.status_code, resp.headers.get("x-cache", "")))
        except httpx.HTTPError as exc:
            self.results.append((at, tenant, 0, type(exc).__name__))

    async def run(self, stop: asyncio.Event, limit_s: float) -> None:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=30.0, limits=limits) as client:
            start = time.monotonic()
            n = 0
            while not stop.is_set() and n / RATE_PER_TENANT < limit_s:
                due = start + n / RATE_PER_TENANT
                delay = due - time.monotonic()
                if delay > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), delay)
                    if stop.is_set():
                        break
                for tenant in ("loop", "scan"):
                    task = asyncio.create_task(self._send(client, tenant, n, due - start))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)
                n += 1
            if self.tasks:
                await asyncio.gather(*self.tasks)

    def l1_hit_ratio(self, tenant: str, since: float, until: float = float("inf")) -> float:
        seen = [r for r in self.results if r[1] == tenant and since <= r[0] < until]
        return sum(1 for r in seen if r[3] == "HIT-L1") / max(1, len(seen))


async def entry_bytes(fleet: LocalFleet) -> int:
    """L1 bytes one answer of the stand-in model server takes (measured, not assumed)."""
    async with httpx.AsyncClient(timeout=10.0) as client:
        resp = await client.post(
            fleet.sidecars[0].url + "/v1/chat/completions",
            json=body("probe"),
            headers={"X-Tenant-ID": "loop"},
        )
        assert resp.status_code == 200
    status = (await asyncio.to_thread(fleet.sidecar_status))["pod-0"]
    probe = status["tenants"]["loop"]
    assert probe["l1_entries"] == 1
    return int(probe["l1_bytes"])


async def test_a_working_set_that_needs_more_cache_gets_it_on_every_sidecar() -> None:
    fleet = LocalFleet(
        pods=2,
        tenants=(
            TenantPlan("scan", "Guaranteed", 2.0, 0.0, 0.5, 1.0, upstream_latency_s=0.01),
            TenantPlan("loop", "Standard", 2.0, 0.0, 0.02, 0.9, upstream_latency_s=0.01),
        ),
        l1_bytes_per_pod=L1_BYTES_PER_POD,
        rebalance_interval_s=2,
        metrics_window="10s",
        default_policy="lru",
    )
    with fleet.run():
        first = await asyncio.to_thread(fleet.wait_for_quotas)
        initial = shares(first)
        size = await entry_bytes(fleet)
        working_set = int(WORKING_SET_SHARE * L1_BYTES_PER_POD / size) | 1  # odd
        # the class-only first share cannot hold the working set: LRU never hits
        assert initial["loop"] * L1_BYTES_PER_POD < working_set * size

        load = OpenLoop(fleet, working_set)
        stop = asyncio.Event()
        driver = asyncio.create_task(load.run(stop, LOOP_TIMEOUT_S))
        started = time.monotonic()
        status: dict[str, Any] = {}
        grown_at: float | None = None
        changed_at: float | None = None
        try:
            while time.monotonic() - started < LOOP_TIMEOUT_S:
                await asyncio.sleep(1.0)
                status = await asyncio.to_thread(fleet.status)
                now = time.monotonic() - started
                if changed_at is None and shares(status).get("loop") != initial["loop"]:
                    changed_at = now
                if grown_at is None and shares(status).get("loop", 0.0) > FITS_SHARE:
                    grown_at = now
                # a full cycle of the working set after the share grew: hits must show
                cycle_s = 2 * working_set / RATE_PER_TENANT
                if grown_at is not None and now > grown_at + 3 * cycle_s:
                    break
            else:
                pytest.fail(f"loop never got its working set's share; last status: {status}")
        finally:
            stop.set()
            await driver

        assert load.results
        assert all(r[2] == 200 for r in load.results), "every request answered"
        final_shares = shares(status)
        assert final_shares["loop"] > initial["loop"]
        assert final_shares["scan"] >= 0.5 - 1e-9  # the Guaranteed floor holds
        # and it was worth it: loop hits in L1 once the share grew, not before
        assert grown_at is not None
        assert changed_at is not None
        # until its share first moved it could not hold the working set: LRU went round it
        before = load.l1_hit_ratio("loop", 0.0, changed_at)
        after = load.l1_hit_ratio("loop", grown_at + 2 * cycle_s)
        assert before < 0.2, before
        assert after > 0.8, after
        assert load.l1_hit_ratio("scan", 0.0) == 0.0
        loop_status = next(t for t in status["tenants"] if t["name"] == "loop")
        assert "predicted hit ratio" in loop_status["reason"]

        # Every sidecar applies the new quotas (through Redis, no restart).
        final = await asyncio.to_thread(fleet.wait_for_quotas)
        gen = final["quotaGeneration"]
        l1 = {t["name"]: t["l1Bytes"] for t in final["tenants"]}
        for pod, sc_status in (await asyncio.to_thread(fleet.sidecar_status)).items():
            assert sc_status["quota_generation"] >= gen, pod
            assert sc_status["tenants"]["loop"]["l1_quota_bytes"] == l1["loop"], pod
        reasons = [e.get("reason") for e in fleet.events()]
        assert "QuotasChanged" in reasons
