"""The admission replay (``cachefleet bench routing``'s "admission" rows) on a trace slice.

Deterministic: simulated time only. What is asserted is what the replay must
show on any slice: FIFO refuses nothing, class-aware admission refuses no
cache hit, sheds BestEffort and keeps Guaranteed far below FIFO's TTFT.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cachefleet_bench.admission_replay import (
    DEFAULT_TRACE,
    TraceError,
    admission_rows,
    classify,
    load_trace,
    main,
)

TRACE_FILE = DEFAULT_TRACE
FIELDS = {
    "mode",
    "guaranteed_misses",
    "guaranteed_ttft_p95",
    "guaranteed_ttft_p95_unloaded",
    "besteffort_shed_share",
    "hits_refused",
}

pytestmark = [
    pytest.mark.bench,
    pytest.mark.skipif(not TRACE_FILE.exists(), reason="the shared Mooncake trace"),
]


def rows() -> list[dict[str, object]]:
    return admission_rows(TRACE_FILE, pods=4, kv_blocks=1000, prefill_rate=20000.0, limit=600)


def test_rows_have_the_schema_and_are_deterministic() -> None:
    first = rows()
    assert [r["mode"] for r in first] == ["fifo", "class-aware"]
    assert all(set(r) == FIELDS for r in first)
    assert first == rows()


def test_class_aware_sheds_besteffort_never_a_hit_and_protects_guaranteed() -> None:
    fifo, aware = rows()
    assert fifo["hits_refused"] == aware["hits_refused"] == 0
    assert fifo["besteffort_shed_share"] == 0.0
    assert 0.0 < aware["besteffort_shed_share"] <= 1.0  # type: ignore[operator]
    assert fifo["guaranteed_ttft_p95_unloaded"] == aware["guaranteed_ttft_p95_unloaded"]
    # at 1.5x overload FIFO's queues grow without bound; admission bounds them
    assert aware["guaranteed_ttft_p95"] < fifo["guaranteed_ttft_p95"] / 3  # type: ignore[operator]


def test_classes_follow_conversations_in_the_intended_shares() -> None:
    reqs = load_trace(TRACE_FILE)
    # on the synthetic trace no block is shared by many conversations: the first one names it
    by_first = {r.blocks[0]: r.cls for r in reqs}
    assert all(r.cls == by_first[r.blocks[0]] for r in reqs)  # a conversation keeps its class
    shares = {
        c: sum(1 for v in by_first.values() if v == c) / len(by_first) for c in by_first.values()
    }
    assert shares["Guaranteed"] == pytest.approx(0.2, abs=0.03)
    assert shares["Standard"] == pytest.approx(0.5, abs=0.03)
    assert classify(7, seed=0) == classify(7, seed=0)
    assert sum(r.hit for r in reqs) > 0  # exact repeats exist: the response cache is exercised


def test_bad_trace_and_bad_arguments_are_named(tmp_path: Path) -> None:
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "hash_ids": [1]}\n{"timestamp": 1}\n')
    with pytest.raises(TraceError, match=r"t\.jsonl:2"):
        load_trace(bad)
    with pytest.raises(ValueError, match="prefill_rate"):
        admission_rows(TRACE_FILE, pods=2, kv_blocks=10, prefill_rate=0)
    assert main(["--trace", str(bad)]) == 2


def test_sidecars_read_their_pods_at_the_poll_period_and_explain_adds_up() -> None:
    # A reading at every event (poll 0) lets a parked Standard request go the moment
    # a prefill ends; at the gate's 0.5 s period the pod can sit idle until the next
    # reading, so fewer Guaranteed requests find a Standard prefill running and more
    # Standard requests wait out their bound.
    explained: dict[float, dict[str, object]] = {}
    for poll_s in (0.0, 0.5):
        found: list[dict[str, object]] = []
        _, aware = admission_rows(
            TRACE_FILE,
            pods=4,
            kv_blocks=1000,
            prefill_rate=20000.0,
            limit=600,
            poll_s=poll_s,
            explain=found,
        )
        assert aware["hits_refused"] == 0
        assert [e["mode"] for e in found] == ["fifo", "class-aware"]
        detail = found[1]
        ratio = aware["guaranteed_ttft_p95"] / aware["guaranteed_ttft_p95_unloaded"]  # type: ignore[operator]
        assert detail["guaranteed_ratio"] == pytest.approx(ratio, abs=0.002)
        assert detail["no_residual"] <= detail["guaranteed_ratio"]  # type: ignore[operator]
        assert detail["besteffort_refused"] == round(
            aware["besteffort_shed_share"] * detail["besteffort_misses"]  # type: ignore[operator]
        )
        assert found[0]["standard_refused_share"] == 0.0  # FIFO refuses nobody
        explained[poll_s] = detail
    every, polled = explained[0.0], explained[0.5]
    meeting = "guaranteed_meeting_a_running_standard"
    assert polled[meeting] < every[meeting]  # type: ignore[operator]
    assert polled["standard_timeouts"] > every["standard_timeouts"]  # type: ignore[operator]
    with pytest.raises(ValueError, match="poll_s"):
        admission_rows(TRACE_FILE, pods=2, kv_blocks=10, prefill_rate=1.0, poll_s=-1)
