"""Host CPU pressure: parsing, a fake cgroup tree, and the real files of this machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachefleet_sidecar.adapt.host import HostPressure, parse_cpu_stat, parse_psi_some_avg10

PSI = "some avg10=29.55 avg60=22.86 avg300=20.75 total=214143323\nfull avg10=0.00 avg60=0.00\n"


def tree(
    tmp_path: Path, *, psi: str | None = PSI, stat: str | None = None, v1: bool = False
) -> Path:
    cg = tmp_path / "sys" / "fs" / "cgroup"
    (cg / "cpu").mkdir(parents=True)
    if psi is not None:
        (cg / "cpu.pressure").write_text(psi)
    if stat is not None:
        (cg / "cpu" / "cpu.stat" if v1 else cg / "cpu.stat").write_text(stat)
    return tmp_path


def test_parsers() -> None:
    assert parse_psi_some_avg10(PSI) == pytest.approx(0.2955)
    with pytest.raises(ValueError, match="avg10"):
        parse_psi_some_avg10("full avg10=1.0\n")
    assert parse_cpu_stat("nr_periods 10\nnr_throttled 3\nthrottled_time 5\n") == (10, 3)
    with pytest.raises(ValueError, match="nr_periods"):
        parse_cpu_stat("usage_usec 5\n")


def test_pod_psi_and_throttling_between_samples(tmp_path: Path) -> None:
    root = tree(tmp_path, stat="nr_periods 100\nnr_throttled 10\n")
    host = HostPressure(root)
    assert host.describe()["psi"]["scope"] == "pod"
    first = host.sample()
    assert first.cpu_pressure_ratio == pytest.approx(0.2955)
    assert first.throttled_ratio is None  # needs two samples
    (root / "sys/fs/cgroup/cpu.stat").write_text("nr_periods 200\nnr_throttled 70\n")
    second = host.sample()
    assert second.throttled_ratio == pytest.approx(0.6)
    assert second.pressure == pytest.approx(0.6)


def test_cgroup_v1_cpu_stat_without_psi(tmp_path: Path) -> None:
    host = HostPressure(tree(tmp_path, psi=None, stat="nr_periods 5\nnr_throttled 0\n", v1=True))
    assert host.available
    assert host.describe()["psi"] is None
    host.sample()
    assert host.sample().pressure == 0.0


def test_nothing_readable_is_said_once_and_reports_no_pressure(tmp_path: Path) -> None:
    host = HostPressure(tmp_path)
    assert not host.available
    assert host.sample().pressure == 0.0
    described = host.describe()
    assert described["available"] is False
    # No paranoid file under this root: no perf events either, said with the reason.
    assert described["perf_events"]["available"] is False
    assert "perf_event_paranoid" in described["perf_events"]["access"]


def test_a_file_that_vanishes_counts_an_error(tmp_path: Path) -> None:
    root = tree(tmp_path)
    host = HostPressure(root)
    (root / "sys/fs/cgroup/cpu.pressure").unlink()
    assert host.sample().pressure == 0.0
    assert host.errors == 1


def test_the_real_files_of_this_machine() -> None:
    host = HostPressure()
    sample = host.sample()  # whatever is there, it must not raise
    assert 0.0 <= sample.pressure <= 1.0
    if Path("/proc/pressure/cpu").exists():
        assert host.available
