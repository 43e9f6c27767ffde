"""``cachefleet simulate``: deterministic replay, the allocators compared, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachefleet_bench import simulate, workloads
from cachefleet_bench.simulate import WorkloadError, load_workload
from cachefleet_operator.cli import main as cli

MIB = 1024 * 1024


@pytest.fixture(scope="module")
def cliff(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The cliff workload, shortened to 300 s to keep the test quick."""
    out = tmp_path_factory.mktemp("wl")
    trace, cache = workloads.write("cliff", out)
    lines = [line for line in trace.read_text().splitlines() if json.loads(line)["ts"] < 300]
    trace.write_text("\n".join(lines) + "\n")
    return trace, cache


def run(cliff: tuple[Path, Path], tmp_path: Path, *extra: str) -> dict[str, object]:
    trace, cache = cliff
    out = tmp_path / "out.json"
    argv = ["simulate", "--workload", str(trace), "--cache", str(cache)]
    argv += ["--capacity-bytes", str(16 * MIB), "--json", str(out), *extra]
    assert cli(argv) == 0
    result: dict[str, object] = json.loads(out.read_text())
    return result


def test_gain_based_allocation_beats_class_only_and_equal_on_a_cliff(
    cliff: tuple[Path, Path], tmp_path: Path
) -> None:
    result = run(cliff, tmp_path, "--policy", "lru", "--plot", str(tmp_path / "p.png"))
    by = {r["allocator"]: r for r in result["results"]}  # type: ignore[attr-defined]
    assert set(by) == {"cachefleet", "class-only", "equal", "oracle"}
    ours = by["cachefleet"]["upstream_seconds"]
    assert ours < by["class-only"]["upstream_seconds"]
    assert ours < by["equal"]["upstream_seconds"]
    tenants = {t["name"]: t for t in by["cachefleet"]["tenants"]}
    # the working set that needs more than its class share got it, and hits
    assert tenants["reports"]["hit_ratio"] > 0.5
    assert tenants["reports"]["mean_share"] > 0.3
    # the scan gives its class share back: only the first interval at class-only
    assert tenants["scan"]["mean_share"] < 0.05
    assert (tmp_path / "p.png").stat().st_size > 0


def test_the_replay_is_deterministic(cliff: tuple[Path, Path], tmp_path: Path) -> None:
    first = run(cliff, tmp_path, "--allocators", "cachefleet")
    second = run(cliff, tmp_path, "--allocators", "cachefleet")
    assert first == second


def test_a_bad_workload_line_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "w.jsonl"
    bad.write_text(
        '{"ts": 0, "tenant": "a", "key": "k", "bytes": 10, "upstream_s": 0.1}\n{"ts": 1}\n'
    )
    with pytest.raises(WorkloadError, match=r"w.jsonl:2: KeyError"):
        load_workload(bad)
    back = tmp_path / "b.jsonl"
    back.write_text(
        '{"ts": 5, "tenant": "a", "key": "k", "bytes": 10, "upstream_s": 0.1}\n'
        '{"ts": 1, "tenant": "a", "key": "k", "bytes": 10, "upstream_s": 0.1}\n'
    )
    with pytest.raises(WorkloadError, match="goes back in time"):
        load_workload(back)


def test_errors_exit_2_with_a_message(
    cliff: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace, _ = cliff
    cache = tmp_path / "ic.yaml"
    cache.write_text("spec:\n  tenants: []\n")
    argv = ["--workload", str(trace), "--cache", str(cache), "--capacity-bytes", "1000"]
    assert simulate.main(argv) == 2
    assert "spec" in capsys.readouterr().err
