"""Unit tests of the switching engine, driven by synthetic latency streams.

No wall time: every window is closed by ``tick(now)`` with a synthetic clock.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from cachefleet_sidecar.adapt.switching import (
    MAX_SAMPLES,
    Decision,
    SwitchingConfig,
    SwitchingEngine,
    entropy_bits,
    gpu_pressure,
    p99,
)
from cachefleet_sidecar.adapt.telemetry import GpuSample

W = 10.0  # window seconds
HISTORY = 90  # 15 minutes of windows


class Driver:
    """One tenant's traffic, window by window, against one engine."""

    def __init__(self, engine: SwitchingEngine | None = None, *, policy: str = "lirs") -> None:
        self.engine = engine or SwitchingEngine(SwitchingConfig(window_s=W))
        self.policy = policy
        self.now = 0.0
        self.window = 0
        self.rng = random.Random(1)
        self.decisions: list[Decision] = []

    def run(
        self,
        windows: int,
        latency: Callable[[int, random.Random], float],
        *,
        requests: int = 200,
        keys: int = 1000,
    ) -> list[Decision]:
        """``windows`` windows of ``requests`` each; applies and returns the decisions."""
        out = []
        for _ in range(windows):
            for _ in range(requests):
                self.engine.observe("t", latency(self.window, self.rng), self.rng.randrange(keys))
            self.now += W
            self.window += 1
            for d in self.engine.tick(self.now, {"t": self.policy}):
                assert d.from_policy == self.policy
                self.policy = d.to_policy
                out.append(d)
        self.decisions += out
        return out


def steady(_w: int, rng: random.Random) -> float:
    return 0.020 + rng.random() * 0.005  # 20-25 ms


def spike(level: float) -> Callable[[int, random.Random], float]:
    return lambda _w, rng: level + rng.random() * 0.005


def test_p99_and_entropy_helpers() -> None:
    assert p99([float(i) for i in range(1, 101)]) == 99.0
    assert p99([5.0]) == 5.0
    assert entropy_bits({}) == 0.0
    assert entropy_bits({1: 10}) == 0.0
    assert entropy_bits(dict.fromkeys(range(8), 3)) == pytest.approx(3.0)


def test_steady_traffic_never_switches() -> None:
    d = Driver()
    assert d.run(300, steady) == []
    base = d.engine.baseline("t")
    assert base is not None
    assert base[0] == pytest.approx(0.025, rel=0.02)


def test_a_sustained_spike_switches_after_three_windows() -> None:
    d = Driver()
    d.run(HISTORY, steady)
    assert d.run(2, spike(0.060)) == []  # two windows over: not yet
    decisions = d.run(1, spike(0.060))
    assert len(decisions) == 1
    switch = decisions[0]
    assert switch.action == "switch"
    assert (switch.from_policy, switch.to_policy) == ("lirs", "sits")
    assert switch.p99_s > switch.threshold_s > switch.baseline_s
    assert d.engine.status()["tenants"]["t"]["switches"] == 1


def test_a_short_spike_does_not_switch() -> None:
    d = Driver()
    d.run(HISTORY, steady)
    for _ in range(5):
        assert d.run(2, spike(0.080)) == []
        assert d.run(3, steady) == []
    assert d.policy == "lirs"


def test_slow_drift_is_absorbed_by_the_baseline() -> None:
    d = Driver()
    d.run(HISTORY, steady)
    # +0.15 % per window (~1 % a minute): +57 % over 300 windows, never a jump.
    # (The 15-minute mean lags a faster ramp by more than min_drift: docs/sits.md.)
    decisions = d.run(300, lambda w, rng: steady(w, rng) * (1.0015 ** (w - HISTORY)))
    assert decisions == []


def test_noise_does_not_switch() -> None:
    d = Driver()

    def noisy(_w: int, rng: random.Random) -> float:
        return max(0.001, rng.gauss(0.025, 0.006))

    assert d.run(400, noisy) == []


def test_no_switch_before_enough_baseline() -> None:
    d = Driver()
    d.run(3, steady)
    assert d.run(5, spike(0.100)) == []


def test_rollback_when_the_switch_does_not_help() -> None:
    d = Driver()
    d.run(HISTORY, steady)
    assert [x.action for x in d.run(3, spike(0.060))] == ["switch"]
    assert d.policy == "sits"
    # Still slow after the switch: back to LIRS after rollback_windows (6).
    assert d.run(5, spike(0.060)) == []
    rolled = d.run(1, spike(0.060))
    assert [(x.action, x.from_policy, x.to_policy) for x in rolled] == [
        ("rollback", "sits", "lirs")
    ]
    assert d.policy == "lirs"
    # Cooling down: the same excursion does not switch again at once.
    assert d.run(10, spike(0.060)) == []
    assert d.engine.status()["tenants"]["t"]["rollbacks"] == 1


def test_a_switch_that_helps_settles() -> None:
    d = Driver()
    d.run(HISTORY, steady)
    d.run(3, spike(0.060))
    assert d.policy == "sits"
    assert d.run(20, steady) == []
    assert d.policy == "sits"
    assert d.engine.status()["tenants"]["t"]["state"] == "settled"


def test_a_tenant_already_on_the_target_is_left_alone() -> None:
    d = Driver(policy="sits")
    d.run(HISTORY, steady)
    assert d.run(10, spike(0.080)) == []


def test_a_concentrated_key_stream_does_not_switch() -> None:
    """Few hot keys: every policy keeps them; a slow upstream is not the policy's doing."""
    d = Driver()
    d.run(HISTORY, steady, keys=3)
    assert d.run(10, spike(0.080), keys=3) == []
    status = d.engine.status()["tenants"]["t"]
    assert status["entropy_bits"] < 2.5


def test_idle_windows_carry_no_signal_and_break_a_streak() -> None:
    d = Driver()
    d.run(HISTORY, steady)
    d.run(2, spike(0.060))
    d.run(1, spike(0.060), requests=5)  # under min_samples: skipped
    assert d.run(2, spike(0.060)) == []
    assert len(d.run(1, spike(0.060))) == 1


def test_gpu_pressure_lowers_the_bar() -> None:
    def excursion(pressure: float) -> list[Decision]:
        engine = SwitchingEngine(SwitchingConfig(window_s=W))
        engine.set_pressure(pressure)
        d = Driver(engine)
        d.run(HISTORY, steady)
        return d.run(4, spike(0.0218))  # modest: P99 ~7 % over the usual

    assert excursion(0.0) == []
    switched = excursion(1.0)
    assert [x.action for x in switched] == ["switch"]
    assert switched[0].pressure == 1.0


def test_gpu_pressure_from_samples() -> None:
    def sample(sm: float, bw: float, used: int) -> GpuSample:
        return GpuSample(0, "H200", used, 100, sm, bw)

    assert gpu_pressure([]) == 0.0
    assert gpu_pressure([sample(0.2, 0.7, 99)]) == 0.7  # memory used is not load
    assert gpu_pressure([sample(0.2, 0.1, 10), sample(1.0, 0.3, 10)]) == 1.0


def test_one_tenants_spike_does_not_switch_another() -> None:
    engine = SwitchingEngine(SwitchingConfig(window_s=W))
    rng = random.Random(3)
    now = 0.0
    policies = {"a": "lirs", "b": "lirs"}
    seen: list[Decision] = []
    for window in range(HISTORY + 3):
        for _ in range(100):
            a = 0.070 if window >= HISTORY else 0.020
            engine.observe("a", a + rng.random() * 0.005, rng.randrange(500))
            engine.observe("b", 0.020 + rng.random() * 0.005, rng.randrange(500))
        now += W
        seen += engine.tick(now, policies)
    assert [(d.tenant, d.action) for d in seen] == [("a", "switch")]


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="window_s"):
        SwitchingConfig(window_s=0)
    with pytest.raises(ValueError, match="consecutive"):
        SwitchingConfig(consecutive=0)
    with pytest.raises(ValueError, match="baseline_s"):
        SwitchingConfig(window_s=10, baseline_s=5)


def test_status_lists_recent_decisions() -> None:
    d = Driver()
    d.run(HISTORY, steady)
    d.run(3, spike(0.060))
    status = d.engine.status()
    assert status["window_s"] == W
    assert status["decisions"][-1]["action"] == "switch"
    assert status["decisions"][-1]["tenant"] == "t"


def test_a_pod_starving_for_cpu_holds_the_switch() -> None:
    """Latency from CPU starvation of the pod itself: no policy can fix it."""
    engine = SwitchingEngine(SwitchingConfig(window_s=W))
    d = Driver(engine)
    d.run(HISTORY, steady)
    engine.set_host_pressure(0.8)
    assert d.run(5, spike(0.060)) == []
    assert engine.status()["host_pressure"] == 0.8
    engine.set_host_pressure(0.1)
    assert [x.action for x in d.run(3, spike(0.060))] == ["switch"]


def test_the_latency_reservoir_is_a_uniform_sample_of_the_whole_window() -> None:
    engine = SwitchingEngine()
    requests = 20 * MAX_SAMPLES
    for i in range(requests):
        engine.observe("t", float(i), i)
    window = engine._tenants["t"].window
    assert window.count == requests
    assert len(window.samples) == MAX_SAMPLES
    assert len(set(window.samples)) == MAX_SAMPLES  # each request is kept at most once
    # Each quarter of the window holds about a quarter of the samples (a reservoir that
    # stopped replacing would hold only the first quarter's).
    quarters = [0, 0, 0, 0]
    for latency in window.samples:
        quarters[int(4 * latency / requests)] += 1
    assert all(abs(q - MAX_SAMPLES / 4) < MAX_SAMPLES / 16 for q in quarters), quarters
