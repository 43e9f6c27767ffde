"""Routing across the local fleet: the stand-in gateway, ``cachefleet router``, simulated pods.

Real processes: four model-server simulators (an LRU KV prefix cache each,
vLLM's metric names), the router reading their ``/metrics`` and answering
the gateway over Envoy's ``ext_proc``. The same multi-turn conversations are
sent twice, open loop at a fixed, low rate (no pod queues, so what differs is
only where each turn lands): once round-robin, once through the picker.
What is asserted is what the pods counted, not how fast anything was.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from cachefleet_e2e import routing_demo
from cachefleet_e2e.gateway import Gateway

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(240)]

#: A small load: 12 conversations of 4 turns at 4 requests/s (about 12 s a mode).
LOAD = routing_demo.RoutingLoad(conversations=12, turns=4, rate=4.0, seed=5)


def test_the_picker_keeps_conversations_on_the_pods_that_hold_their_prefix() -> None:
    result = asyncio.run(routing_demo.compare(LOAD, progress=False))
    phases = {p["mode"]: p for p in result["phases"]}
    rr, ours = phases["round-robin"], phases["cachefleet"]
    for phase in (rr, ours):
        assert phase["errors"] == 0
        assert phase["requests"] == LOAD.conversations * LOAD.turns
        assert sum(p["requests"] for p in phase["per_pod"].values()) == phase["requests"]
    # round-robin spreads every conversation over every pod; each pod's cache cannot hold
    # them all, so later turns often find their history evicted
    assert ours["prefix_hit_ratio"] > rr["prefix_hit_ratio"] + 0.1


async def _one_request(gateway: Gateway, body: dict[str, object]) -> tuple[int, str]:
    runner, url = await routing_demo._serve_gateway(gateway)
    try:
        async with httpx.AsyncClient(timeout=30.0) as client:
            resp = await client.post(url + "/v1/chat/completions", json=body)
            return resp.status_code, resp.text
    finally:
        await runner.cleanup()
        await gateway.close()


def test_an_unreachable_picker_is_a_503_or_round_robin_with_fail_open(tmp_path: Path) -> None:
    body = LOAD.body(0, 0) | {"stream": False}
    with routing_demo.simulators(1, kv_blocks=100, prefill_rate=50_000.0, workdir=tmp_path) as sims:
        dead = "127.0.0.1:1"  # nothing listens on port 1 of loopback
        status, text = asyncio.run(_one_request(Gateway(picker=dead, endpoints=sims), body))
        assert status == 503
        assert "no endpoint picked" in text
        gateway = Gateway(picker=dead, endpoints=sims, fail_open=True)
        status, text = asyncio.run(_one_request(gateway, body))
        assert status == 200
        assert json.loads(text)["choices"][0]["message"]["content"]
        assert gateway.routed == {sims[0]: 1}


def test_the_demo_command_runs_the_routing_part_alone(tmp_path: Path) -> None:
    """``cachefleet demo --routing only`` end to end: its report and files."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cachefleet_operator.cli",
            "demo",
            "--routing",
            "only",
            "--no-plot",
            "--out",
            str(out),
            "--routing-conversations",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "cachefleet / round-robin mean TTFT" in proc.stdout
    written = json.loads((out / "routing.json").read_text())
    assert [p["mode"] for p in written["phases"]] == ["round-robin", "cachefleet"]
    assert written["load"]["conversations"] == 8
