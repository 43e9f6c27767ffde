"""``bench routing``'s ``cachefleet-kv`` row: the default profile fed by the pods' own KV
events (the precise index), against the oracle that knows every pod's cache."""

from __future__ import annotations

from pathlib import Path

from cachefleet_bench import routing as bench

from .test_routing_bench import write_trace


def test_kv_events_bring_cachefleet_to_the_oracles_hit_ratio(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace)
    requests = bench.load_trace(trace)
    run = {
        policy: bench.replay(requests, policy, pods=4, kv_blocks=150, prefill_rate=40000)
        for policy in ("round-robin", "cachefleet-kv", "precise")
    }
    assert run["cachefleet-kv"].kv_hit >= run["precise"].kv_hit - 0.03
    assert run["cachefleet-kv"].ttft_mean < 0.8 * run["round-robin"].ttft_mean


def test_the_pods_events_mirror_their_caches(tmp_path: Path) -> None:
    """Every pod's precise index equals its simulated cache after a replay (stores,
    evictions and the per-message bound all applied)."""
    trace = tmp_path / "t.jsonl"
    write_trace(trace, requests=300)
    requests = bench.load_trace(trace)
    addresses = [f"pod-{i}:8000" for i in range(3)]
    pods = {a: bench.Pod(40, 40000.0) for a in addresses}
    index = bench.KvIndex(max_blocks=40)
    bench.kv_events(pods, index)
    for i, request in enumerate(requests):
        pods[addresses[i % 3]].insert(request.blocks)
    for address, pod in pods.items():
        assert index.blocks(address) == len(pod.cache)
        for request in requests[-20:]:
            found = index.matched(address, request.blocks)
            assert found is not None
            assert found[0] == pod.matched(request.blocks)
