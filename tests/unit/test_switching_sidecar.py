"""The switching engine inside the sidecar: GPU pressure in, switches applied out.

A fake NVML backend stands in for the GPU; windows are closed with a
synthetic clock (``switch_tick(now)``), so no test waits for wall time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cachefleet_common.contract.names import Policy
from cachefleet_sidecar.adapt.host import HostPressure
from cachefleet_sidecar.adapt.telemetry import GpuSample, GpuTelemetry
from cachefleet_sidecar.compose import Sidecar, build
from cachefleet_sidecar.config import SidecarConfig, parse_args
from cachefleet_sidecar.policies import SITSPolicy

W = 10.0


class FakeNvml:
    def __init__(self, sm: float, bandwidth: float) -> None:
        self.sm = sm
        self.bandwidth = bandwidth

    def init(self) -> None:
        pass

    def sample(self) -> list[GpuSample]:
        return [GpuSample(0, "NVIDIA H200", 120 << 30, 141 << 30, self.sm, self.bandwidth)]


def make(
    sm: float = 0.0, bandwidth: float = 0.0, host_root: Path = Path("/nonexistent"), **kw: object
) -> Sidecar:
    """A sidecar with a fake GPU and (by default) no readable host pressure files.

    The real host's PSI moves with the machine's load: tests must not read it.
    """
    config = SidecarConfig.from_flat(cache="ns/c", admin_listen=None, policy=Policy.LIRS, **kw)
    return build(
        config, telemetry=GpuTelemetry(FakeNvml(sm, bandwidth)), host=HostPressure(host_root)
    )


def switches(app: Sidecar) -> dict[tuple[str, str], float]:
    out = {}
    for family in text_string_to_metric_families(app.metrics.render().decode()):
        for s in family.samples:
            if s.name == "cachefleet_policy_switches_total":
                out[(s.labels["from_policy"], s.labels["to_policy"])] = s.value
    return out


def drive(app: Sidecar, now: float, windows: int, level: float) -> float:
    """``windows`` windows of tenant t's traffic at ``level`` seconds; the new clock."""
    engine = app.switching
    assert engine is not None
    rng = random.Random(int(now))
    for _ in range(windows):
        for _ in range(100):
            engine.observe("t", level + rng.random() * 0.005, rng.randrange(10_000))
        now += W
        app.switcher.switch_tick(now)
    return now


def test_switch_and_rollback_migrate_every_entry_and_are_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = make()
    assert app.switching is not None
    for key in range(200):
        app.l1.put("t", key, ("t", b"x"), 100)
    entries = app.l1.stats()["t"].entries
    start = app.switching.next_window_at
    now = drive(app, start, 90, 0.020)
    assert app.l1.stats()["t"].policy == "lirs"
    # Exported at 0 before the first switch, so that Prometheus sees it change.
    assert switches(app) == {("lirs", "sits"): 0.0, ("sits", "lirs"): 0.0}
    with caplog.at_level(logging.INFO, logger="cachefleet"):
        now = drive(app, now, 3, 0.060)
    stats = app.l1.stats()["t"]
    assert stats.policy == "sits"
    assert stats.entries == entries  # nothing lost in the switch
    assert switches(app) == {("lirs", "sits"): 1.0, ("sits", "lirs"): 0.0}
    line = next(r.getMessage() for r in caplog.records if "policy switch" in r.getMessage())
    logged = json.loads(line.split(" ", 2)[2])
    assert logged["tenant"] == "t"
    assert logged["to_policy"] == "sits"
    status = app.admin.status()["policy_switching"]
    assert status["enabled"] is True
    assert status["tenants"]["t"]["state"] == "trial"
    assert status["decisions"][-1]["action"] == "switch"
    # No better after the switch: rolled back, entries kept again.
    now = drive(app, now, 6, 0.060)
    stats = app.l1.stats()["t"]
    assert stats.policy == "lirs"
    assert stats.entries == entries
    assert switches(app) == {("lirs", "sits"): 1.0, ("sits", "lirs"): 1.0}
    assert app.admin.status()["tenants"]["t"]["policy"] == "lirs"


def test_gpu_saturation_reaches_the_engine_and_sits_partitions() -> None:
    app = make(sm=0.3, bandwidth=0.9)
    assert app.switching is not None
    app.l1.set_policy("t", "sits")
    app.l1.put("t", 1, ("t", b"x"), 10)
    app.switcher.switch_tick(app.switching.next_window_at)
    assert app.switching.pressure == pytest.approx(0.9)
    part = app.l1._parts["t"]
    assert isinstance(part, SITSPolicy)
    assert part.pressure == pytest.approx(0.9)
    assert app.admin.status()["policy_switching"]["pressure"] == pytest.approx(0.9)


def test_without_a_gpu_pressure_stays_zero() -> None:
    class NoGpu:
        def init(self) -> None:
            raise RuntimeError("NVML Shared Library Not Found")

        def sample(self) -> list[GpuSample]:
            raise AssertionError("never sampled")

    app = build(
        SidecarConfig.from_flat(cache="ns/c", admin_listen=None), telemetry=GpuTelemetry(NoGpu())
    )
    assert app.switching is not None
    app.switcher.switch_tick(app.switching.next_window_at)
    assert app.switching.pressure == 0.0


def test_switching_can_be_turned_off() -> None:
    app = make(switch_window_s=0)
    assert app.switching is None
    assert app.admin.status()["policy_switching"] == {"enabled": False}
    app.switcher.switch_tick(1e9)  # a no-op


def test_switch_window_flag() -> None:
    assert parse_args(["--switch-window", "5"]).adapt.switch_window_s == 5.0
    assert parse_args(["--switch-window", "0"]).adapt.switch_window_s == 0.0
    assert parse_args(["--policy", "sits"]).caching.policy.value == "sits"
    with pytest.raises(SystemExit):
        parse_args(["--switch-window", "-1"])


def test_host_cpu_pressure_reaches_the_engine_and_status(tmp_path: Path) -> None:
    cgroup = tmp_path / "sys" / "fs" / "cgroup"
    cgroup.mkdir(parents=True)
    (cgroup / "cpu.pressure").write_text("some avg10=72.00 avg60=50.00 avg300=10.00 total=1\n")
    app = make(host_root=tmp_path)
    assert app.switching is not None
    app.switcher.switch_tick(app.switching.next_window_at)
    assert app.switching.host_pressure == pytest.approx(0.72)
    status = app.admin.status()["policy_switching"]
    assert status["host_pressure"] == pytest.approx(0.72)
    assert status["host"]["psi"]["scope"] == "pod"


def test_a_switching_fault_is_counted_never_raised(caplog: pytest.LogCaptureFixture) -> None:
    app = make()
    assert app.switching is not None

    def broken(now: float) -> None:
        raise RuntimeError("boom")

    app.switcher.switch_tick = broken  # type: ignore[method-assign]
    app.switching._window_end = 0.0  # a window is due on the next request
    with caplog.at_level(logging.ERROR, logger="cachefleet"):
        app.switcher.observe("t", 0.01, 1)
    assert app.metrics.cache_faults["policy_switching"] == 1
    assert "policy switching failed" in caplog.text


async def test_a_switch_drains_in_the_background_while_the_loop_keeps_serving() -> None:
    app = make()
    for key in range(3_000):
        app.l1.put("t", key, ("t", b"x"), 100)
    app.l1.set_policy("t", "sits")
    app.switcher.kick_migration()
    assert app.admin.status()["tenants"]["t"]["l1_migrating_entries"] == 3_000
    # The loop stays free: this coroutine runs between the batches, and the
    # partition answers (from either structure) throughout.
    seen_pending = []
    for _ in range(10_000):  # bounded; the drain needs ~12 batches
        pending = app.l1.stats()["t"].migrating
        seen_pending.append(pending)
        assert app.l1.get("t", 2_999 - len(seen_pending) % 3_000) == ("t", b"x")
        if not pending:
            break
        await asyncio.sleep(0.001)
    assert seen_pending[-1] == 0
    assert len(set(seen_pending)) > 3  # it moved in several batches, not one block
    assert not app.l1.migrating
    stats = app.l1.stats()["t"]
    assert (stats.policy, stats.entries, stats.evictions) == ("sits", 3_000, 0)
    await app.aclose()


def test_an_expired_tenants_switch_series_go_with_it() -> None:
    app = make()
    assert app.switching is not None
    app.l1.put("t", 1, ("t", b"x"), 100)
    drive(app, app.switching.next_window_at, 1, 0.020)
    assert switches(app) == {("lirs", "sits"): 0.0, ("sits", "lirs"): 0.0}
    assert app.tenants.expire_idle(1) == []  # used within the last tick: kept
    assert app.tenants.expire_idle(0) == ["t"]
    assert "t" not in app.l1.stats()
    assert switches(app) == {}
