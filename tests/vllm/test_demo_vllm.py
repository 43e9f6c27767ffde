"""``make demo-vllm``'s comparison, small, on the tier's servers: both routers deliver every
request to a real vLLM server and the report's counters are vLLM's own, per phase."""

from __future__ import annotations

from cachefleet_e2e.routing_demo_vllm import VllmLoad, compare_on
from cachefleet_e2e.vllm_server import SERVED_MODEL, VllmServer
from tests.vllm.conftest import finished, healthy

CONVERSATIONS, TURNS = 3, 3


async def test_both_routers_reach_real_servers_and_report_vllms_counters(
    vllm_pool: list[VllmServer],
) -> None:
    servers = [await healthy(server) for server in vllm_pool]
    # Short prompts: the tier's servers take 1024 tokens at most.
    load = VllmLoad(
        model=SERVED_MODEL,
        conversations=CONVERSATIONS,
        turns=TURNS,
        system_prompts=1,
        system_chars=1000,
        turn_chars=200,
        rate=8.0,
    )
    before = sum([await finished(server) for server in servers])
    result = await compare_on(servers, load, progress=False)

    requests = CONVERSATIONS * TURNS
    assert [p["mode"] for p in result["phases"]] == ["round-robin", "cachefleet"]
    for phase in result["phases"]:
        assert (phase["requests"], phase["errors"]) == (requests, 0), phase
        pods = phase["per_pod"].values()
        assert sum(p["requests"] for p in pods) == requests
        # vLLM's own counters moved in this phase: every prompt was looked up.
        assert sum(p["prompt_tokens"] for p in pods) > 0
        assert sum(p["prefix_queries"] for p in pods) == sum(p["prompt_tokens"] for p in pods)
        assert 0 <= phase["prefix_hit_ratio"] <= 1
    round_robin = result["phases"][0]["per_pod"].values()
    assert sorted(p["requests"] for p in round_robin) == [TURNS] * len(servers)
    assert sum([await finished(server) for server in servers]) == before + 2 * requests
