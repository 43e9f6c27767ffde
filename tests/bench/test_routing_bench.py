"""``cachefleet bench routing``: the replay's outcomes on a prefix-heavy trace, and its output.

The replay is a deterministic simulation, so its figures are facts of the
trace and the policies, not of this machine's speed: prefix-aware scoring must
beat round-robin there, and stay close to the oracle's KV hit ratio.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from cachefleet_bench import routing as bench
from cachefleet_bench.__main__ import BENCHMARKS

KEYS = {"policy", "kv_hit", "ttft_mean", "ttft_p50", "ttft_p95", "ttft_p99", "max_load_ratio"}


def write_trace(path: Path, requests: int = 600, seed: int = 7) -> None:
    """Multi-turn conversations over a few shared system prompts (Mooncake format)."""
    rng = random.Random(seed)
    next_block = 10_000
    systems = [list(range(s * 100, s * 100 + 6)) for s in range(4)]  # 4 apps, 6 blocks each
    conversations: list[list[int]] = []
    lines = []
    ts = 0.0
    for _ in range(requests):
        if conversations and rng.random() < 0.7:
            conv = rng.choice(conversations)
        else:
            conv = list(rng.choice(systems))
            conversations.append(conv)
        turn = rng.randint(1, 3)
        conv.extend(range(next_block, next_block + turn))  # the new turn's blocks
        next_block += turn
        ids = list(conv)
        tokens = 512 * (len(ids) - 1) + rng.randint(1, 512)
        lines.append(
            json.dumps(
                {"timestamp": int(ts), "input_length": tokens, "output_length": 8, "hash_ids": ids}
            )
        )
        ts += rng.expovariate(1 / 120.0)  # ms between arrivals
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def payload(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("routing")
    trace, out = tmp / "trace.jsonl", tmp / "out.json"
    write_trace(trace)
    argv = [
        "--trace", str(trace), "--json", str(out), "--pods", "4", "--kv-blocks", "150",
        "--prefill-rate", "40000", "--speed", "1", "--decision-picks", "0",
    ]  # fmt: skip
    assert bench.main(argv) == 0
    written: dict[str, Any] = json.loads(out.read_text())
    return written


@pytest.fixture(scope="module")
def results(payload: dict[str, Any]) -> dict[str, dict[str, float]]:
    rows = payload["results"]
    assert [r["policy"] for r in rows] == list(bench.POLICIES)
    for row in rows:
        assert set(row) == KEYS
    return {r["policy"]: r for r in rows}


def test_cachefleet_beats_round_robin_on_a_prefix_heavy_trace(
    results: dict[str, dict[str, float]],
) -> None:
    ours, rr = results["cachefleet"], results["round-robin"]
    assert ours["ttft_mean"] < 0.8 * rr["ttft_mean"]
    assert ours["kv_hit"] > rr["kv_hit"] + 0.1


def test_the_admission_rows_come_with_the_routing_rows(payload: dict[str, Any]) -> None:
    rows = {r["mode"]: r for r in payload["admission"]}
    assert set(rows) == {"fifo", "class-aware"}
    for row in rows.values():
        assert set(row) == {
            "mode",
            "guaranteed_misses",
            "guaranteed_ttft_p95",
            "guaranteed_ttft_p95_unloaded",
            "besteffort_shed_share",
            "hits_refused",
        }
        assert row["hits_refused"] == 0
        assert row["guaranteed_misses"] > 0
    assert rows["fifo"]["besteffort_shed_share"] == 0.0
    assert rows["class-aware"]["besteffort_shed_share"] > 0.0
    assert rows["class-aware"]["guaranteed_ttft_p95"] <= rows["fifo"]["guaranteed_ttft_p95"]
    assert "admission 0 hits refused" in payload["targets"]


def test_cachefleet_stays_near_the_oracles_kv_hit_ratio(
    results: dict[str, dict[str, float]],
) -> None:
    assert results["cachefleet"]["kv_hit"] >= results["precise"]["kv_hit"] - 0.05


def test_figures_are_consistent(results: dict[str, dict[str, float]]) -> None:
    for row in results.values():
        assert 0.0 <= row["kv_hit"] <= 1.0
        assert 0.0 <= row["ttft_p50"] <= row["ttft_p95"] <= row["ttft_p99"]
        assert row["max_load_ratio"] >= 1.0


def test_replay_is_deterministic(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, requests=150)
    requests = bench.load_trace(trace)
    first = bench.replay(requests, "cachefleet", pods=3, kv_blocks=50, prefill_rate=20000)
    assert bench.replay(requests, "cachefleet", pods=3, kv_blocks=50, prefill_rate=20000) == first


def test_a_bad_trace_line_names_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "hash_ids": "x"}\n')
    assert bench.main(["--trace", str(trace), "--decision-picks", "0"]) == 2
    assert "hash_ids" in capsys.readouterr().err


def test_unknown_policy_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--policies", "random", "--decision-picks", "0"]) == 2
    assert "--policies" in capsys.readouterr().err


def test_registered_with_a_quick_setting() -> None:
    module, _text, quick = BENCHMARKS["routing"]
    assert module == "cachefleet_bench.routing"
    assert quick == ("--quick",)


def test_replicas_that_share_nothing_still_beat_round_robin(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace)
    requests = bench.load_trace(trace)
    run = {
        policy: bench.replay(
            requests, policy, pods=4, kv_blocks=150, prefill_rate=40000, replicas=3
        )
        for policy in ("round-robin", "cachefleet")
    }
    assert run["cachefleet"].ttft_mean < 0.8 * run["round-robin"].ttft_mean
    assert run["cachefleet"].kv_hit > run["round-robin"].kv_hit + 0.1
