"""Performance counters of the sidecar process through ``perf_event_open``, behind an adapter.

The card's "PMU counters": hardware events (cycles, instructions, cache
references and misses) and two software events (task clock, context
switches) of this process, counted on every CPU it runs on, read as deltas
between two samples (one per switching window). They are reported in
``/status`` (``policy_switching.host.perf_events``) with the derived IPC and
cache-miss ratio; they do not move a decision (PSI and CFS throttling in
:mod:`cachefleet_sidecar.adapt.host` answer "is the pod starving for CPU"; no
threshold on IPC is calibrated yet, docs/sits.md).

Only where the kernel allows it. ``/proc/sys/kernel/perf_event_paranoid``
and this process's capabilities decide first (:func:`access_plan`): with
``CAP_PERFMON`` or ``CAP_SYS_ADMIN`` everything may be counted; otherwise
level 3 or more (Debian's "no unprivileged use") means nothing is opened,
level 2 counts user space only, 1 or less user and kernel space. Then each
event is opened on its own: a virtual machine without a virtual PMU refuses
the hardware events (``ENOENT``) and still counts the software ones; a
container's seccomp profile may refuse all (``EPERM``). What could not be
opened is said once (log) and shown with its reason; the sidecar carries on.

The syscall, the files read and the architecture's syscall number are
parameters, so tests inject a paranoid level (a file under a fake root)
while the syscall stays real.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import platform
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("cachefleet.perf")

PERF_TYPE_HARDWARE = 0
PERF_TYPE_SOFTWARE = 1
#: (name, type, config) of every event opened, hardware first.
EVENTS: tuple[tuple[str, int, int], ...] = (
    ("cycles", PERF_TYPE_HARDWARE, 0),
    ("instructions", PERF_TYPE_HARDWARE, 1),
    ("cache_references", PERF_TYPE_HARDWARE, 2),
    ("cache_misses", PERF_TYPE_HARDWARE, 3),
    ("task_clock_ns", PERF_TYPE_SOFTWARE, 1),
    ("context_switches", PERF_TYPE_SOFTWARE, 3),
)
#: ``perf_event_open`` by machine (``platform.machine()``).
SYSCALL_NUMBERS = {"x86_64": 298, "aarch64": 241, "arm64": 241}
#: ``PERF_ATTR_SIZE_VER0``: the fields used here all sit in the first 64 bytes,
#: and every kernel with perf events accepts this size.
ATTR_SIZE = 64
#: read_format: TOTAL_TIME_ENABLED | TOTAL_TIME_RUNNING (scales multiplexed counts).
READ_FORMAT = 1 | 2
_INHERIT = 1 << 1
_EXCLUDE_KERNEL = 1 << 5
_EXCLUDE_HV = 1 << 6
PERF_FLAG_FD_CLOEXEC = 8
#: Capability bits that lift the paranoid level: CAP_SYS_ADMIN, CAP_PERFMON.
_CAPS = (21, 38)

#: ``syscall(attr, pid, cpu, group_fd, flags)`` -> fd, or -errno.
Syscall = Callable[[bytes, int, int, int, int], int]


def event_attr(type_: int, config: int, exclude_kernel: bool) -> bytes:
    """A ``struct perf_event_attr`` counting one event, enabled at once, never the hypervisor.

    ``inherit``: threads the process starts later are counted too.
    """
    flags = _INHERIT | _EXCLUDE_HV | (_EXCLUDE_KERNEL if exclude_kernel else 0)
    head = struct.pack("=IIQQQQQ", type_, ATTR_SIZE, config, 0, 0, READ_FORMAT, flags)
    return head.ljust(ATTR_SIZE, b"\0")


def access_plan(paranoid: int | None, privileged: bool) -> tuple[bool, bool, str]:
    """(may open, exclude kernel space, why) for this paranoid level and privilege."""
    if paranoid is None:
        return False, False, "no /proc/sys/kernel/perf_event_paranoid: no perf events here"
    if privileged:
        return True, False, "privileged (CAP_PERFMON or CAP_SYS_ADMIN): user and kernel space"
    if paranoid >= 3:
        return False, False, f"perf_event_paranoid={paranoid}: not allowed without CAP_PERFMON"
    if paranoid == 2:
        return True, True, "perf_event_paranoid=2: user space only"
    return True, False, f"perf_event_paranoid={paranoid}: user and kernel space"


def privileged_from_status(text: str) -> bool:
    """True if ``/proc/self/status``'s ``CapEff`` holds CAP_PERFMON or CAP_SYS_ADMIN."""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == "CapEff":
            try:
                caps = int(value.strip(), 16)
            except ValueError:
                return False
            return any(caps >> bit & 1 for bit in _CAPS)
    return False


def parse_read(data: bytes) -> float | None:
    """A counter's value from its 24-byte read, scaled for multiplexing; None if never ran."""
    value, enabled, running = struct.unpack("=QQQ", data[:24])
    if running == 0:
        return None
    return value * (enabled / running) if running < enabled else float(value)


def libc_syscall(number: int) -> Syscall:
    """The real ``perf_event_open`` through libc's ``syscall(2)``."""
    libc = ctypes.CDLL(None, use_errno=True)
    call = libc.syscall
    call.restype = ctypes.c_long

    def perf_event_open(attr: bytes, pid: int, cpu: int, group: int, flags: int) -> int:
        buf = ctypes.create_string_buffer(attr, len(attr))
        fd = int(
            call(
                ctypes.c_long(number),
                buf,
                ctypes.c_int(pid),
                ctypes.c_int(cpu),
                ctypes.c_int(group),
                ctypes.c_ulong(flags),
            )
        )
        return fd if fd >= 0 else -ctypes.get_errno()

    return perf_event_open


@dataclass(frozen=True, slots=True)
class PerfSample:
    """Counts since the previous sample (None: event not open or not run)."""

    deltas: dict[str, float | None]

    @property
    def ipc(self) -> float | None:
        """Instructions per cycle."""
        ins, cyc = self.deltas.get("instructions"), self.deltas.get("cycles")
        return ins / cyc if ins is not None and cyc else None

    @property
    def cache_miss_ratio(self) -> float | None:
        miss, refs = self.deltas.get("cache_misses"), self.deltas.get("cache_references")
        return miss / refs if miss is not None and refs else None


class PerfCounters:
    """This process's counters; never raises on the caller's path.

    Nothing is opened until the first :meth:`sample` (a sidecar that never
    runs its switching engine holds no perf descriptors); :meth:`close` (or
    garbage collection) releases them.
    """

    def __init__(
        self,
        root: Path = Path("/"),
        *,
        syscall: Syscall | None = None,
        machine: str | None = None,
        read: Callable[[int, int], bytes] = os.read,
        close: Callable[[int], None] = os.close,
    ) -> None:
        self._read = read
        self._close = close
        self._syscall = syscall
        self.fds: dict[str, int] = {}
        #: event -> why it is not counted.
        self.missing: dict[str, str] = {}
        self._last: dict[str, float | None] = {}
        self._opened = False
        self.last: PerfSample | None = None
        paranoid = _read_int(root / "proc/sys/kernel/perf_event_paranoid")
        privileged = privileged_from_status(_read_text(root / "proc/self/status"))
        self._allowed, self._exclude_kernel, self.access = access_plan(paranoid, privileged)
        self.machine = machine or platform.machine()
        self._number = SYSCALL_NUMBERS.get(self.machine)
        if self._allowed and self._number is None:
            self._allowed = False
            self.access = f"no perf_event_open number known for {self.machine}"

    def open(self) -> None:
        """Open every event the kernel allows (once; :meth:`sample` calls it)."""
        if self._opened:
            return
        self._opened = True
        if not self._allowed or self._number is None:
            self.missing = dict.fromkeys((name for name, _, _ in EVENTS), self.access)
        else:
            call = self._syscall or libc_syscall(self._number)
            for name, type_, config in EVENTS:
                attr = event_attr(type_, config, self._exclude_kernel)
                try:
                    fd = call(attr, 0, -1, -1, PERF_FLAG_FD_CLOEXEC)
                except OSError as exc:  # libc without syscall(2), ...
                    fd = -(exc.errno or errno.ENOSYS)
                if fd >= 0:
                    self.fds[name] = fd
                else:
                    code = errno.errorcode.get(-fd, str(-fd))
                    self.missing[name] = f"{code}: {os.strerror(-fd)}"
        if self.missing:
            log.info(
                "perf events not counted: %s (%s); carrying on",
                ", ".join(sorted(self.missing)),
                self.access,
            )

    @property
    def available(self) -> bool:
        """Whether some event is counted (before the first sample: whether one may be)."""
        return bool(self.fds) if self._opened else self._allowed

    def sample(self) -> PerfSample:
        """Deltas since the previous call (the first call: since the counters opened)."""
        self.open()
        now: dict[str, float | None] = {}
        for name, fd in self.fds.items():
            try:
                now[name] = parse_read(self._read(fd, 24))
            except (OSError, struct.error):
                now[name] = None
        deltas: dict[str, float | None] = {}
        for name, value in now.items():
            before = self._last.get(name, 0.0)
            deltas[name] = None if value is None or before is None else value - before
        self._last = now
        self.last = PerfSample(deltas)
        return self.last

    def describe(self) -> dict[str, Any]:
        last = self.last
        return {
            "available": self.available,
            "access": self.access,
            "counting": sorted(self.fds),
            "not_counted": dict(sorted(self.missing.items())),
            "last": None
            if last is None
            else {
                **{k: v for k, v in last.deltas.items() if v is not None},
                "ipc": last.ipc,
                "cache_miss_ratio": last.cache_miss_ratio,
            },
        }

    def close(self) -> None:
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                self._close(fd)
        self.fds.clear()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None
