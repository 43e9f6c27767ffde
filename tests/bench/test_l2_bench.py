"""Smoke test of ``cachefleet bench l2``: it measures real reads and says how they compare."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachefleet_bench import l2_micro


@pytest.mark.bench
@pytest.mark.redis
def test_bench_l2_reads_the_entry_both_ways_and_writes_its_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "l2.json"
    # every versioned read must be a hit of the whole entry, or the benchmark exits
    assert l2_micro.main(["--reads", "256", "--repeats", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["read"], r["concurrency"]) for r in rows] == [
        ("plain GET", 1),
        ("versioned get", 1),
        ("plain GET", 64),
        ("versioned get", 64),
    ]
    assert all(r["wall_us"] > 0 and r["client_cpu_us"] > 0 for r in rows)
    table = capsys.readouterr().out
    assert "vs GET" in table
    assert "versioned get" in table


def test_bench_l2_refuses_a_meaningless_run() -> None:
    with pytest.raises(SystemExit):
        l2_micro.main(["--reads", "10"])
