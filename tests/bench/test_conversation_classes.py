"""Admission classes per conversation, on Mooncake's conversation trace (shipped with the bench).

The traces carry no conversation id; :func:`cachefleet_bench.mooncake.conversation_ids`
names one. Before it, the admission replay classed a request by its first block, which
every request of the conversation trace shares: one class for all, no Guaranteed traffic.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachefleet_bench import routing
from cachefleet_bench.admission_replay import CLASSES, GUARANTEED, admission_rows, load_trace
from cachefleet_bench.mooncake import CONVERSATION_TRACE, conversation_ids

pytestmark = pytest.mark.bench


def test_the_conversation_trace_has_guaranteed_traffic_by_conversation() -> None:
    """Every request of Mooncake's conversation trace starts with block 0: classes by the first
    block gave every request one class, and the class-aware row had no Guaranteed traffic."""
    reqs = load_trace(CONVERSATION_TRACE, limit=3000)
    assert {r.blocks[0] for r in reqs} == {0}
    by_conversation: dict[int, str] = {}
    for r in reqs:  # a conversation (its second block here) keeps one class over its turns
        assert by_conversation.setdefault(r.blocks[1], r.cls) == r.cls
    shares = {c: list(by_conversation.values()).count(c) / len(by_conversation) for c in CLASSES}
    assert shares[GUARANTEED] == pytest.approx(0.2, abs=0.04)
    _fifo, aware = admission_rows(
        CONVERSATION_TRACE, pods=4, kv_blocks=1000, prefill_rate=20000.0, limit=3000
    )
    assert aware["guaranteed_misses"] > 100  # type: ignore[operator]
    assert aware["guaranteed_ttft_p95_unloaded"] > 0  # type: ignore[operator]


def test_a_conversation_is_its_first_block_not_shared_by_many() -> None:
    system = [0]
    prompts = [(*system, 100 + c, 1000 + c * 10 + t) for c in range(40) for t in range(3)]
    ids = conversation_ids(prompts)
    assert ids == [100 + c for c in range(40) for _t in range(3)]
    # a system prompt of three blocks: the chain forks after its last one
    long_system = [(0, 1, 2, 100 + c, 1000 + c) for c in range(40)]
    assert conversation_ids(long_system) == [100 + c for c in range(40)]
    few = [(0, 100 + c, 7) for c in range(5)]  # five conversations: block 0 is theirs
    assert conversation_ids(few) == [0] * 5
    assert conversation_ids([(), (0,)]) == [None, 0]


def test_routing_bench_takes_the_trace_by_name_and_routes_conversations_as_sessions(
    tmp_path: Path,
) -> None:
    """``--trace conversation`` names the shipped trace; session-hash hashes the conversation
    (by the first block, which every request shares, one pod took every request)."""
    out = tmp_path / "routing.json"
    argv = ["--trace", "conversation", "--limit", "1500", "--policies", "session-hash"]
    assert (
        routing.main([*argv, "--decision-picks", "0", "--overload", "0", "--json", str(out)]) == 0
    )
    (row,) = json.loads(out.read_text())["results"]
    assert row["max_load_ratio"] < 2.0  # 8.0: every request on one of the 8 pods
