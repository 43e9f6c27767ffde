"""Smoke test of ``cachefleet bench hit``: every measured request is an answered hit."""

from __future__ import annotations

import pytest

from cachefleet_bench import hit_micro


@pytest.mark.bench
def test_bench_hit_answers_every_request_from_l1_and_rows_compare_to_the_floor(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # the benchmark raises when a request goes unanswered or an answer is not an L1 hit
    rows = hit_micro.run(n=64, repeats=1, per_turn=4, redis=False)
    assert [(r["series"], r["per_turn"]) for r in rows] == [
        (series, width) for width in (1, 4) for series in ("floor", "l1", "l1-nocurves")
    ]
    assert all(r["us_per_request"] > 0 for r in rows)
    assert all(r["vs_floor"] == 1.0 for r in rows if r["series"] == "floor")
    assert (
        hit_micro.main(["--requests", "32", "--repeats", "1", "--per-turn", "2", "--no-redis"]) == 0
    )
    assert "vs floor" in capsys.readouterr().out


@pytest.mark.bench
@pytest.mark.redis
def test_bench_hit_answers_every_redis_row_request_from_redis() -> None:
    # raises when an l2 answer is not an L2 hit (--l1-bytes 0: never promoted to L1)
    # or when a floor-l2 request goes unanswered
    rows = hit_micro.run(n=64, repeats=1, per_turn=4)
    assert [(r["series"], r["per_turn"]) for r in rows] == [
        (series, width)
        for width in (1, 4)
        for series in ("floor", "l1", "l1-nocurves", "floor-l2", "l2")
    ]
    assert all(r["us_per_request"] > 0 for r in rows)
