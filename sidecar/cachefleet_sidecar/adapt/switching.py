"""The policy switching engine: per-tenant P99 watch, LIRS -> SITS hot switch, rollback.

Pure: no I/O, no wall time (every call takes ``now``, seconds on any
monotonic clock), so tests drive it with synthetic latency streams. The
sidecar feeds it one observation per cached-endpoint request and applies the
:class:`Decision` objects that :meth:`SwitchingEngine.tick` returns (a switch
is :meth:`TenantL1.set_policy`: O(1), the entries move over in bounded batches).

Per tenant and window (default 10 s) the engine computes the P99 of request
latency and the Shannon entropy of the key stream. Windows with fewer than
``min_samples`` requests carry no signal: they are skipped and break a streak.

* **Baseline and drift.** The baseline is the mean of the window P99s of the
  last ``baseline_s`` (15 min); ``drift = max(min_drift, drift_sigmas x
  std / baseline)`` from their standard deviation. Windows above the
  threshold are kept out of the baseline while they form a streak (a spike
  must not raise its own bar); a streak that ends without a switch is
  folded in, so a slow drift becomes the new baseline and never triggers.
* **Latency sensitivity.** GPU saturation ``pressure`` (0..1, from NVML: the
  busier of SM and memory bandwidth) lowers the bar: threshold =
  ``baseline x (1 + drift x (1 - pressure / 2))``. A miss costs more on a
  saturated GPU, so the engine reacts to half the excursion.
* **Switch.** When a tenant's P99 is above the threshold for ``consecutive``
  (3) windows in a row, with at least ``min_history`` windows of baseline
  and a key stream of at least ``min_entropy_bits`` (below that a handful of
  keys dominate, every policy keeps them, and the latency is not the
  policy's doing), the tenant switches to ``target`` (SITS), unless it
  already runs it, is cooling down after a rollback, or the pod itself is
  starving for CPU (host pressure at or above ``max_host_pressure``, from
  :mod:`cachefleet_sidecar.adapt.host`: a policy cannot fix that latency).
* **Rollback.** If none of the ``rollback_windows`` data windows after the
  switch brings P99 back under the threshold of the switch, the tenant goes
  back to the policy it had, and does not switch again for
  ``cooldown_windows`` windows. A window under it settles the switch.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

DEFAULT_WINDOW_S = 10.0
DEFAULT_BASELINE_S = 900.0
DEFAULT_CONSECUTIVE = 3
DEFAULT_ROLLBACK_WINDOWS = 6
DEFAULT_COOLDOWN_WINDOWS = 30
DEFAULT_MIN_HISTORY = 6
DEFAULT_MIN_SAMPLES = 20
DEFAULT_MIN_ENTROPY_BITS = 2.5
DEFAULT_DRIFT_SIGMAS = 3.0
DEFAULT_MIN_DRIFT = 0.1
#: Host CPU pressure (PSI / throttling, 0..1) at or above which switches are held.
DEFAULT_MAX_HOST_PRESSURE = 0.5
#: Latency samples kept per tenant and window (a uniform reservoir beyond).
MAX_SAMPLES = 4096
#: The key stream's entropy is measured over this many hash buckets (<= 12 bits).
ENTROPY_BUCKETS = 4096
#: Decisions kept for /status.
DECISION_LOG = 32
#: Tenants the engine follows; later ones are ignored (the L1 bounds tenants too).
MAX_TENANTS = 1024

Action = Literal["switch", "rollback"]


@dataclass(frozen=True, slots=True)
class SwitchingConfig:
    window_s: float = DEFAULT_WINDOW_S
    baseline_s: float = DEFAULT_BASELINE_S
    consecutive: int = DEFAULT_CONSECUTIVE
    rollback_windows: int = DEFAULT_ROLLBACK_WINDOWS
    cooldown_windows: int = DEFAULT_COOLDOWN_WINDOWS
    min_history: int = DEFAULT_MIN_HISTORY
    min_samples: int = DEFAULT_MIN_SAMPLES
    min_entropy_bits: float = DEFAULT_MIN_ENTROPY_BITS
    drift_sigmas: float = DEFAULT_DRIFT_SIGMAS
    min_drift: float = DEFAULT_MIN_DRIFT
    max_host_pressure: float = DEFAULT_MAX_HOST_PRESSURE
    target: str = "sits"

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")
        if self.baseline_s < self.window_s:
            raise ValueError("baseline_s must be at least one window")
        for name in ("consecutive", "rollback_windows", "min_history", "min_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cooldown_windows < 0 or self.min_drift < 0 or self.drift_sigmas < 0:
            raise ValueError("cooldown_windows, min_drift and drift_sigmas must be >= 0")

    @property
    def history_windows(self) -> int:
        return max(1, int(self.baseline_s // self.window_s))


@dataclass(frozen=True, slots=True)
class Decision:
    """A switch or rollback the caller must apply to ``tenant``'s L1."""

    tenant: str
    action: Action
    from_policy: str
    to_policy: str
    at: float
    p99_s: float
    baseline_s: float
    threshold_s: float
    entropy_bits: float
    pressure: float
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "action": self.action,
            "from_policy": self.from_policy,
            "to_policy": self.to_policy,
            "at": round(self.at, 3),
            "p99_s": round(self.p99_s, 6),
            "baseline_s": round(self.baseline_s, 6),
            "threshold_s": round(self.threshold_s, 6),
            "entropy_bits": round(self.entropy_bits, 3),
            "pressure": round(self.pressure, 3),
            "reason": self.reason,
        }


def p99(samples: list[float]) -> float:
    """Nearest-rank 99th percentile of a non-empty list."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def entropy_bits(counts: Mapping[int, int]) -> float:
    """Shannon entropy (bits) of a distribution given by counts."""
    total = sum(counts.values())
    if total == 0:
        return 0.0
    h = 0.0
    for c in counts.values():
        if c:
            p = c / total
            h -= p * math.log2(p)
    return h


class _Window:
    __slots__ = ("buckets", "count", "replace_at", "samples", "weight")

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.buckets: dict[int, int] = {}
        self.count = 0
        #: The reservoir's next replacement: the request count that takes a slot
        #: (Li's algorithm L: the requests skipped in between cost no random draw).
        self.replace_at = 0
        #: Algorithm L's running weight (the largest of the reservoir's random keys).
        self.weight = 1.0

    def skip(self, rng: random.Random) -> None:
        """Draw the count of the next request that replaces a sample (after this one)."""
        self.weight *= math.exp(math.log(_unit(rng)) / MAX_SAMPLES)
        self.replace_at = self.count + 1 + int(math.log(_unit(rng)) / math.log1p(-self.weight))


def _unit(rng: random.Random) -> float:
    """A uniform draw in (0, 1) (never 0: its log is taken)."""
    return rng.random() or 0.5


@dataclass(slots=True)
class _Tenant:
    window: _Window = field(default_factory=_Window)
    history: deque[float] = field(default_factory=deque)
    pending: list[float] = field(default_factory=list)
    state: Literal["watching", "trial", "settled", "cooldown"] = "watching"
    previous_policy: str | None = None
    trial_windows: int = 0
    trial_threshold: float = 0.0
    cooldown_left: int = 0
    last_p99: float | None = None
    last_entropy: float | None = None
    last_threshold: float | None = None
    switches: int = 0
    rollbacks: int = 0


class SwitchingEngine:
    """Per-tenant P99 windows, baseline, and the switch / rollback decisions."""

    def __init__(self, config: SwitchingConfig | None = None, *, now: float = 0.0) -> None:
        self.config = config or SwitchingConfig()
        self._tenants: dict[str, _Tenant] = {}
        self._window_end = now + self.config.window_s
        self._pressure = 0.0
        self._host_pressure = 0.0
        self._rng = random.Random(0)
        self.decisions: deque[Decision] = deque(maxlen=DECISION_LOG)

    @property
    def next_window_at(self) -> float:
        """When :meth:`tick` next has a window to close."""
        return self._window_end

    @property
    def pressure(self) -> float:
        return self._pressure

    def set_pressure(self, pressure: float) -> None:
        """GPU saturation in [0, 1] (clamped): the latency-sensitivity factor."""
        self._pressure = min(1.0, max(0.0, float(pressure)))

    @property
    def host_pressure(self) -> float:
        return self._host_pressure

    def set_host_pressure(self, pressure: float) -> None:
        """The pod's CPU pressure in [0, 1] (clamped): at ``max_host_pressure`` switches wait."""
        self._host_pressure = min(1.0, max(0.0, float(pressure)))

    def observe(self, tenant: str, latency_s: float, key_hash: int) -> None:
        """One request of ``tenant``: its latency and its cache key's hash."""
        self.observe_many(tenant, ((latency_s, key_hash),))

    def observe_many(self, tenant: str, requests: Iterable[tuple[float, int]]) -> None:
        """Requests of ``tenant``, in order: (latency, cache key hash) of each."""
        state = self._tenants.get(tenant)
        if state is None:
            if len(self._tenants) >= MAX_TENANTS:
                return
            state = self._tenants[tenant] = _Tenant(
                history=deque(maxlen=self.config.history_windows)
            )
        w = state.window
        samples, buckets, rng = w.samples, w.buckets, self._rng
        count = w.count
        for latency_s, key_hash in requests:
            count += 1
            if count <= MAX_SAMPLES:
                samples.append(latency_s)
                if count == MAX_SAMPLES:
                    w.count = count
                    w.skip(rng)
            elif count == w.replace_at:  # a uniform reservoir: most requests skip past
                samples[rng.randrange(MAX_SAMPLES)] = latency_s
                w.count = count
                w.skip(rng)
            bucket = key_hash % ENTROPY_BUCKETS
            buckets[bucket] = buckets.get(bucket, 0) + 1
        w.count = count

    def tick(self, now: float, policies: Mapping[str, str]) -> list[Decision]:
        """Close every window that ended by ``now``; the decisions to apply.

        ``policies`` is each tenant's policy in force. The engine assumes the
        caller applies every decision it returns.
        """
        out: list[Decision] = []
        while now >= self._window_end:
            end = self._window_end
            self._window_end += self.config.window_s
            for tenant, state in self._tenants.items():
                window, state.window = state.window, _Window()
                decision = self._close(tenant, state, window, end, policies.get(tenant))
                if decision is not None:
                    out.append(decision)
                    self.decisions.append(decision)
        return out

    def forget(self, tenant: str) -> None:
        self._tenants.pop(tenant, None)

    def baseline(self, tenant: str) -> tuple[float, float] | None:
        """(baseline P99, drift) of ``tenant``, or None without enough history."""
        state = self._tenants.get(tenant)
        if state is None or len(state.history) < self.config.min_history:
            return None
        return self._baseline(state)

    def status(self) -> dict[str, Any]:
        """What ``/status`` shows: per-tenant state and the recent decisions."""
        tenants = {}
        for tenant, s in self._tenants.items():
            base = self.baseline(tenant)
            tenants[tenant] = {
                "state": s.state,
                "p99_s": _round(s.last_p99),
                "entropy_bits": _round(s.last_entropy),
                "baseline_p99_s": _round(base[0]) if base else None,
                "drift": _round(base[1]) if base else None,
                "threshold_s": _round(s.last_threshold),
                "windows_over": len(s.pending),
                "switches": s.switches,
                "rollbacks": s.rollbacks,
            }
        return {
            "window_s": self.config.window_s,
            "target_policy": self.config.target,
            "pressure": round(self._pressure, 3),
            "host_pressure": round(self._host_pressure, 3),
            "tenants": tenants,
            "decisions": [d.as_dict() for d in self.decisions],
        }

    # ------------------------------------------------------------ internals

    def _baseline(self, state: _Tenant) -> tuple[float, float]:
        values = state.history
        mean = sum(values) / len(values)
        var = sum((v - mean) ** 2 for v in values) / len(values)
        cfg = self.config
        drift = max(cfg.min_drift, cfg.drift_sigmas * math.sqrt(var) / mean) if mean > 0 else 0.0
        return mean, drift

    def _threshold(self, state: _Tenant) -> tuple[float, float] | None:
        if len(state.history) < self.config.min_history:
            return None
        base, drift = self._baseline(state)
        return base, base * (1.0 + drift * (1.0 - self._pressure / 2.0))

    def _close(
        self, tenant: str, state: _Tenant, window: _Window, end: float, policy: str | None
    ) -> Decision | None:
        cfg = self.config
        if window.count < cfg.min_samples:
            self._fold_pending(state)  # an idle window breaks a streak
            return None
        value = p99(window.samples)
        entropy = entropy_bits(window.buckets)
        state.last_p99 = value
        state.last_entropy = entropy
        bar = self._threshold(state)
        state.last_threshold = None if bar is None else bar[1]

        if state.state == "trial":
            state.history.append(value)
            state.trial_windows += 1
            if value <= state.trial_threshold:
                state.state = "settled"
                return None
            if state.trial_windows >= cfg.rollback_windows:
                previous = state.previous_policy or policy or cfg.target
                state.state = "cooldown"
                state.cooldown_left = cfg.cooldown_windows
                state.rollbacks += 1
                return Decision(
                    tenant,
                    "rollback",
                    cfg.target,
                    previous,
                    end,
                    value,
                    bar[0] if bar else value,
                    state.trial_threshold,
                    entropy,
                    self._pressure,
                    f"P99 not back under {state.trial_threshold * 1e3:.1f} ms within "
                    f"{cfg.rollback_windows} windows of the switch",
                )
            return None
        if state.state == "cooldown":
            state.history.append(value)
            state.cooldown_left -= 1
            if state.cooldown_left <= 0:
                state.state = "watching"
            return None
        if bar is None:
            state.history.append(value)
            return None
        base, threshold = bar
        if value <= threshold:
            self._fold_pending(state)
            state.history.append(value)
            if state.state == "settled" and policy != cfg.target:
                state.state = "watching"  # someone else changed the policy since
            return None
        state.pending.append(value)
        if len(state.pending) < cfg.consecutive:
            return None
        if (
            policy is None
            or policy == cfg.target
            or state.state != "watching"
            or entropy < cfg.min_entropy_bits
            or self._host_pressure >= cfg.max_host_pressure
        ):
            # Nothing to switch to, or not the policy's doing: the new level
            # joins the baseline.
            self._fold_pending(state)
            return None
        self._fold_pending(state)
        state.state = "trial"
        state.previous_policy = policy
        state.trial_windows = 0
        state.trial_threshold = threshold
        state.switches += 1
        return Decision(
            tenant,
            "switch",
            policy,
            cfg.target,
            end,
            value,
            base,
            threshold,
            entropy,
            self._pressure,
            f"P99 over baseline x (1 + drift) for {cfg.consecutive} windows",
        )

    @staticmethod
    def _fold_pending(state: _Tenant) -> None:
        state.history.extend(state.pending)
        state.pending.clear()


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def gpu_pressure(samples: list[Any]) -> float:
    """Saturation of the busiest GPU: the larger of SM and memory-bandwidth busy.

    From NVML GPM's SM occupancy and DRAM bandwidth where the GPU offers them,
    else from NVML's utilisation gauges.

    Memory *used* is left out on purpose: model servers preallocate most of
    the GPU's memory for their KV cache (vLLM: 90 % by default), so it says
    nothing about load.
    """
    busiest = 0.0
    for s in samples:
        occupancy = getattr(s, "sm_occupancy_ratio", None)
        dram = getattr(s, "dram_bandwidth_ratio", None)
        if occupancy is not None and dram is not None:
            # GPM (Hopper+): how full the SMs and the DRAM bus were, not just
            # whether any kernel ran (utilization.gpu is 1.0 under one busy kernel).
            busiest = max(busiest, occupancy, dram)
        else:
            busiest = max(busiest, s.sm_utilization_ratio, s.memory_bandwidth_utilization_ratio)
    return min(1.0, busiest)
