"""Host CPU pressure of this pod, from the cgroup and PSI files, behind a small adapter.

What the switching engine asks: is the latency we see caused by the pod
starving for CPU? If so a policy switch cannot help, and the engine holds
its switches (see :mod:`cachefleet_sidecar.adapt.switching`).

Sources, the first readable of each kind:

* PSI ``some avg10`` of CPU (the share of the last 10 s in which some task
  waited for a CPU): the cgroup v2 ``cpu.pressure`` of this pod, else the
  whole host's ``/proc/pressure/cpu``.
* CFS throttling (``nr_periods`` / ``nr_throttled`` of ``cpu.stat``, cgroup
  v2 or v1): the share of scheduling periods throttled since the previous
  sample.

Performance counters (``perf_event_open``, :mod:`cachefleet_sidecar.adapt.perf`)
are sampled with the rest, where the kernel allows them, and reported in
``describe()``; they do not change the pressure. Where no source is readable
the adapter says so once (logged, and in ``describe()`` for ``/status``) and
reports no pressure.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachefleet_sidecar.adapt.perf import PerfCounters

log = logging.getLogger("cachefleet.host")

#: Candidate files, most specific first: (path under the root, scope).
PSI_FILES = (("sys/fs/cgroup/cpu.pressure", "pod"), ("proc/pressure/cpu", "host"))
CPU_STAT_FILES = (
    ("sys/fs/cgroup/cpu.stat", "pod"),
    ("sys/fs/cgroup/cpu/cpu.stat", "pod"),
    ("sys/fs/cgroup/cpu,cpuacct/cpu.stat", "pod"),
)


@dataclass(frozen=True, slots=True)
class HostSample:
    #: PSI "some avg10" as a ratio (0..1), or None without PSI.
    cpu_pressure_ratio: float | None
    #: Share of CFS periods throttled since the previous sample, or None.
    throttled_ratio: float | None

    @property
    def pressure(self) -> float:
        """The larger of the two, 0 when neither is known."""
        return max(self.cpu_pressure_ratio or 0.0, self.throttled_ratio or 0.0)


def parse_psi_some_avg10(text: str) -> float:
    """``some avg10=29.55 ...`` -> 0.2955; raises ValueError if absent."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "some":
            for field in fields[1:]:
                name, _, value = field.partition("=")
                if name == "avg10":
                    return min(1.0, max(0.0, float(value) / 100.0))
    raise ValueError("no 'some avg10' in PSI text")


def parse_cpu_stat(text: str) -> tuple[int, int]:
    """(nr_periods, nr_throttled) of a ``cpu.stat``; raises ValueError if absent."""
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        values[name] = value
    try:
        return int(values["nr_periods"]), int(values["nr_throttled"])
    except KeyError:
        raise ValueError("no nr_periods / nr_throttled in cpu.stat") from None


class HostPressure:
    """Reads this pod's CPU pressure; never raises on the caller's path."""

    def __init__(self, root: Path = Path("/"), perf: PerfCounters | None = None) -> None:
        self.root = root
        #: This process's performance counters (same root: a fake root fakes them too).
        self.perf = perf if perf is not None else PerfCounters(root)
        self.psi: tuple[Path, str] | None = self._first(PSI_FILES, parse_psi_some_avg10)
        self.cpu_stat: tuple[Path, str] | None = self._first(CPU_STAT_FILES, parse_cpu_stat)
        self._last_periods: tuple[int, int] | None = None
        self.errors = 0
        if self.psi is None and self.cpu_stat is None:
            log.info("host CPU pressure unavailable (no PSI, no cgroup cpu.stat); carrying on")

    @property
    def available(self) -> bool:
        return self.psi is not None or self.cpu_stat is not None

    def _first(
        self, candidates: tuple[tuple[str, str], ...], parse: Any
    ) -> tuple[Path, str] | None:
        for relative, scope in candidates:
            path = self.root / relative
            try:
                parse(path.read_text())
            except (OSError, ValueError):
                continue
            return path, scope
        return None

    def sample(self) -> HostSample:
        psi = throttled = None
        try:
            if self.psi is not None:
                psi = parse_psi_some_avg10(self.psi[0].read_text())
            if self.cpu_stat is not None:
                periods = parse_cpu_stat(self.cpu_stat[0].read_text())
                last, self._last_periods = self._last_periods, periods
                if last is not None and periods[0] > last[0]:
                    throttled = (periods[1] - last[1]) / (periods[0] - last[0])
                elif last is not None:
                    throttled = 0.0
        except (OSError, ValueError) as exc:
            self.errors += 1
            log.debug("host pressure sample failed: %s", exc)
        self.perf.sample()
        return HostSample(psi, throttled)

    def describe(self) -> dict[str, Any]:
        return {
            "available": self.available,
            "psi": None if self.psi is None else {"file": str(self.psi[0]), "scope": self.psi[1]},
            "cpu_stat": None
            if self.cpu_stat is None
            else {"file": str(self.cpu_stat[0]), "scope": self.cpu_stat[1]},
            "perf_events": self.perf.describe(),
            "errors": self.errors,
        }
