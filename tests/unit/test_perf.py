"""perf_event_open counters: the pure parts, the real syscall on this machine, refusals.

The kernel decides what may be counted; these tests inject the paranoid
level and capabilities through a fake root (the adapter's file boundary)
while the syscall stays the real one, so "not allowed" is tested for real:
the adapter must not even try.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from cachefleet_sidecar.adapt.host import HostPressure
from cachefleet_sidecar.adapt.perf import (
    ATTR_SIZE,
    EVENTS,
    SYSCALL_NUMBERS,
    PerfCounters,
    PerfSample,
    Syscall,
    access_plan,
    event_attr,
    libc_syscall,
    parse_read,
    privileged_from_status,
)

REAL_PARANOID = Path("/proc/sys/kernel/perf_event_paranoid")
MACHINE_HAS_PERF = REAL_PARANOID.exists() and os.uname().machine in SYSCALL_NUMBERS


def fake_root(tmp_path: Path, paranoid: str | None, cap_eff: str = "0000000000000000") -> Path:
    if paranoid is not None:
        (tmp_path / "proc/sys/kernel").mkdir(parents=True)
        (tmp_path / "proc/sys/kernel/perf_event_paranoid").write_text(paranoid + "\n")
    (tmp_path / "proc/self").mkdir(parents=True, exist_ok=True)
    (tmp_path / "proc/self/status").write_text(f"Name:\tpython\nCapEff:\t{cap_eff}\n")
    return tmp_path


class Spy:
    """Counts the calls and the attrs handed to the real syscall."""

    def __init__(self, inner: Syscall | None) -> None:
        self.inner = inner
        self.attrs: list[bytes] = []

    def __call__(self, attr: bytes, pid: int, cpu: int, group: int, flags: int) -> int:
        self.attrs.append(attr)
        assert self.inner is not None
        return self.inner(attr, pid, cpu, group, flags)


def burn() -> int:
    return sum(i * i for i in range(300_000))


def test_the_attr_is_the_kernels_layout() -> None:
    attr = event_attr(0, 1, exclude_kernel=True)
    assert len(attr) == ATTR_SIZE
    type_, size, config, period, sample_type, read_format, flags = struct.unpack(
        "=IIQQQQQ", attr[:48]
    )
    assert (type_, size, config, period, sample_type, read_format) == (0, 64, 1, 0, 0, 3)
    assert flags & 1 == 0  # enabled at once
    assert (flags >> 1 & 1, flags >> 5 & 1, flags >> 6 & 1) == (1, 1, 1)  # inherit, no kernel, hv
    assert not event_attr(1, 1, exclude_kernel=False)[40] >> 5 & 1


def test_access_follows_paranoid_level_and_capabilities() -> None:
    assert access_plan(None, True)[0] is False
    assert access_plan(3, False)[:2] == (False, False)
    assert access_plan(4, True)[:2] == (True, False)
    assert access_plan(2, False)[:2] == (True, True)
    assert access_plan(1, False)[:2] == (True, False)
    assert access_plan(-1, False)[:2] == (True, False)
    assert privileged_from_status("CapEff:\t000001ffffffffff\n")  # root
    assert privileged_from_status(f"CapEff:\t{1 << 38:016x}\n")  # CAP_PERFMON alone
    assert not privileged_from_status("CapEff:\t0000000000000000\n")
    assert not privileged_from_status("no caps here")


def test_multiplexed_counts_are_scaled_and_idle_ones_are_unknown() -> None:
    assert parse_read(struct.pack("=QQQ", 100, 10, 10)) == 100.0
    assert parse_read(struct.pack("=QQQ", 100, 20, 10)) == 200.0
    assert parse_read(struct.pack("=QQQ", 0, 5, 0)) is None
    sample = PerfSample({"instructions": 300.0, "cycles": 100.0, "cache_misses": None})
    assert (sample.ipc, sample.cache_miss_ratio) == (3.0, None)


def test_a_paranoid_level_that_forbids_it_opens_nothing_for_real(tmp_path: Path) -> None:
    spy = Spy(libc_syscall(SYSCALL_NUMBERS["x86_64"]) if MACHINE_HAS_PERF else None)
    perf = PerfCounters(fake_root(tmp_path, "3"), syscall=spy)
    assert perf.sample().deltas == {}
    assert spy.attrs == []  # not even tried
    described = perf.describe()
    assert described["available"] is False
    assert "perf_event_paranoid=3" in described["access"]
    assert set(described["not_counted"]) == {name for name, _, _ in EVENTS}
    assert HostPressure(tmp_path).describe()["perf_events"]["available"] is False


@pytest.mark.skipif(not MACHINE_HAS_PERF, reason="this kernel or machine has no perf_event_open")
def test_the_real_syscall_counts_this_process_where_the_kernel_lets_it(tmp_path: Path) -> None:
    # Paranoid 2 and no capability, injected: the adapter asks for user space
    # only, and the real kernel answers for each event.
    spy = Spy(libc_syscall(SYSCALL_NUMBERS[os.uname().machine]))
    perf = PerfCounters(fake_root(tmp_path, "2"), syscall=spy)
    perf.sample()
    burn()
    second = perf.sample()
    assert len(spy.attrs) == len(EVENTS)
    assert all(attr[40] >> 5 & 1 for attr in spy.attrs)  # exclude_kernel on every event
    assert set(perf.fds) | set(perf.missing) == {name for name, _, _ in EVENTS}
    for name, reason in perf.missing.items():
        assert reason.split(":")[0].startswith("E"), (name, reason)  # an errno, said
    if "task_clock_ns" in perf.fds:
        assert (second.deltas["task_clock_ns"] or 0) > 0  # it did run
    assert perf.available == bool(perf.fds)
    fds = list(perf.fds.values())
    perf.close()
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


@pytest.mark.skipif(not MACHINE_HAS_PERF, reason="this kernel or machine has no perf_event_open")
def test_the_default_adapter_reads_this_machines_real_settings() -> None:
    level = int(REAL_PARANOID.read_text())
    perf = PerfCounters()
    try:
        perf.sample()
        described = perf.describe()
        privileged = privileged_from_status(Path("/proc/self/status").read_text())
        assert described["access"] == access_plan(level, privileged)[2]
        if level >= 3 and not privileged:
            assert not perf.available
    finally:
        perf.close()
