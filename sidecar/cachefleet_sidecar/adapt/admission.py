"""Class-aware admission: which request may still go to a saturated model server.

Pure: readings of the model server's own metrics (:class:`modelserver.ModelServerMetrics`)
and clock values come in, decisions come out; no I/O, no event loop. The
sidecar's adapter (:mod:`cachefleet_sidecar.http.gate`) polls ``/metrics`` and parks
waiting requests; the admission replay of ``cachefleet bench routing`` drives the
same object with simulated time.

The rules (docs/admission.md):

* the server is *saturated* while its prefill queue holds at least
  ``max_waiting`` requests, its KV cache is at least ``max_kv_usage`` full, or
  (when ``max_running`` is set) at least that many requests run;
  a reading that failed counts as not saturated (and is counted); the numbers of
  one that did not are taken within bounds (NaN and negatives as 0, no count
  above 2**53, no mean prefill above an hour), so no answer can break the arithmetic;
* between two readings, every request this sidecar sent upstream counts as
  one more waiting (and running) request: the reading cannot show it yet, and
  without it every request until the next reading would see the old room;
* a cache hit costs the GPU nothing and is always admitted; only a request
  that would go upstream is asked about;
* ``Guaranteed`` always passes;
* ``BestEffort`` is refused while saturated: 429 with ``Retry-After`` (the
  estimated seconds until the queue drains below the threshold, at least 1);
* ``Standard`` (and a tenant without a class) passes when the server is not
  saturated and nobody is waiting before it; otherwise it waits in a bounded
  queue until readings say the server has room, or until
  ``standard_max_wait_s`` (then 503 with ``Retry-After``). The queue is
  weighted fair between tenants and fair between a tenant's fairness ids
  (:class:`flows.FairQueue`); when it is full, the newcomer takes the newest
  place of the tenant holding the most places for its weight, if that tenant
  holds more than the newcomer's would (the evicted request gets the 429), else
  the newcomer gets the 429;
* a request's class is its tenant's, lowered (never raised) by the class of the
  GIE objective it names (:func:`capped_class`).

Waiting requests are opaque tickets (the adapter's futures): :meth:`Admission.release`
hands back the ones that may go now, :meth:`Admission.expire` the ones whose
wait ran out, :meth:`Admission.abandon` forgets one whose client left,
:meth:`Admission.take_evicted` the ones that gave their place up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from cachefleet_common.classes import (
    BEST_EFFORT,
    DEFAULT_MAX_KV_USAGE,
    DEFAULT_MAX_WAITING,
    DEFAULT_STANDARD_MAX_WAIT_S,
    DEFAULT_STANDARD_QUEUE,
    GUARANTEED,
    normal_class,
)
from cachefleet_common.modelserver import ModelServerMetrics
from cachefleet_sidecar.adapt.flows import FairQueue, Flow

#: Bounds of ``Retry-After``, seconds.
MIN_RETRY_AFTER_S = 1
MAX_RETRY_AFTER_S = 60
#: Largest count a reading's field is taken as (requests waiting or running).
MAX_READ_COUNT = 2.0**53
#: Largest mean prefill time per request believed, seconds (the estimate only feeds
#: ``Retry-After``, which stops at :data:`MAX_RETRY_AFTER_S` anyway).
MAX_PREFILL_S = 3600.0

#: Refusal reasons (the ``reason`` label of the refusal counter and the error body).
REASON_SATURATED_QUEUE = "saturated_queue"
REASON_SATURATED_KV = "saturated_kv"
REASON_SATURATED_RUNNING = "saturated_running"
REASON_QUEUE_FULL = "queue_full"
REASON_QUEUE_TIMEOUT = "queue_timeout"
REASONS = (
    REASON_SATURATED_QUEUE,
    REASON_SATURATED_KV,
    REASON_SATURATED_RUNNING,
    REASON_QUEUE_FULL,
    REASON_QUEUE_TIMEOUT,
)
_CAUSE_REASON = {
    "queue": REASON_SATURATED_QUEUE,
    "kv": REASON_SATURATED_KV,
    "running": REASON_SATURATED_RUNNING,
}


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Thresholds; :class:`ValueError` names the field that is out of range."""

    max_waiting: float = DEFAULT_MAX_WAITING
    max_kv_usage: float = DEFAULT_MAX_KV_USAGE
    standard_queue: int = DEFAULT_STANDARD_QUEUE
    standard_max_wait_s: float = DEFAULT_STANDARD_MAX_WAIT_S
    #: Running requests at which the server counts as saturated (None: not a signal;
    #: vLLM's batch is full at its ``--max-num-seqs``).
    max_running: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_waiting) and self.max_waiting >= 1):
            raise ValueError(f"max_waiting: must be a number >= 1, got {self.max_waiting!r}")
        if not 0.0 < self.max_kv_usage <= 1.0:
            raise ValueError(f"max_kv_usage: must be in (0, 1], got {self.max_kv_usage!r}")
        if self.standard_queue < 0:
            raise ValueError(f"standard_queue: must be >= 0, got {self.standard_queue!r}")
        if self.max_running is not None and not (
            math.isfinite(self.max_running) and self.max_running >= 1
        ):
            raise ValueError(f"max_running: must be a number >= 1, got {self.max_running!r}")
        if not (math.isfinite(self.standard_max_wait_s) and self.standard_max_wait_s > 0):
            raise ValueError(
                f"standard_max_wait_s: must be > 0 seconds, got {self.standard_max_wait_s!r}"
            )


@dataclass(frozen=True, slots=True)
class Decision:
    """``admit``: send it upstream; ``wait``: parked (its ticket comes back through
    :meth:`Admission.release` or :meth:`Admission.expire`); ``refuse``: answer
    ``status`` with ``Retry-After: retry_after_s``."""

    action: Literal["admit", "wait", "refuse"]
    status: int = 0
    reason: str = ""
    retry_after_s: int = 0
    message: str = ""


ADMIT = Decision("admit")
WAIT = Decision("wait")


def _bounded(value: float, top: float) -> float:
    """``value`` within [0, ``top``]: NaN, a negative number or no number is 0."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return 0.0
    return min(top, number) if number > 0 else 0.0  # NaN > 0 is False


class Admission:
    """The admission state of one model server, fed by :meth:`observe`."""

    def __init__(self, config: AdmissionConfig | None = None) -> None:
        self.config = config or AdmissionConfig()
        self.saturated = False
        #: What saturates the server now: ``queue``, ``kv`` or ``""``.
        self.cause = ""
        self.waiting = 0.0
        self.running = 0.0
        self.kv_usage = 0.0
        #: Mean seconds of prefill per request, from the server's histogram (None: unknown).
        self.prefill_s: float | None = None
        #: Readings that failed (each counted as "not saturated").
        self.faults = 0
        #: When the current shedding began (None: not shedding), and how often it began.
        self.shedding_since: float | None = None
        self.shedding_starts = 0
        self._queue: FairQueue[object] = FairQueue()
        #: Parked tickets that gave their place up to a newcomer (the adapter answers 429).
        self._evicted: list[object] = []
        #: Requests sent upstream since the last reading (it cannot show them yet).
        self.sent = 0
        #: The last reading failed: nothing is refused until one succeeds.
        self._blind = False

    # ------------------------------------------------------------------ state
    @property
    def queued(self) -> int:
        """Standard requests waiting now."""
        return len(self._queue)

    def observe(self, metrics: ModelServerMetrics | None, now: float) -> bool:
        """Take one reading (None: it failed); True when shedding started or stopped."""
        self.sent = 0
        self._blind = metrics is None
        if metrics is None:
            self.faults += 1
            self.waiting = self.running = self.kv_usage = 0.0
        else:
            # a reading is a model server's word: finite and within bounds, whatever it says
            self.waiting = _bounded(metrics.waiting, MAX_READ_COUNT)
            self.running = _bounded(metrics.running, MAX_READ_COUNT)
            self.kv_usage = _bounded(metrics.kv_usage, 1.0)
            seconds = _bounded(metrics.prefill_seconds_total or 0.0, MAX_READ_COUNT)
            count = _bounded(metrics.prefill_requests_total or 0.0, MAX_READ_COUNT)
            if seconds > 0 and count >= 1:
                self.prefill_s = min(MAX_PREFILL_S, seconds / count)
        self._assess()
        was = self.shedding_since is not None
        if self.saturated and not was:
            self.shedding_since = now
            self.shedding_starts += 1
        elif not self.saturated and was:
            self.shedding_since = None
        return self.saturated != was

    def _assess(self) -> None:
        """``saturated`` and ``cause`` from the last reading plus the requests sent since
        (after a failed reading: not saturated, whatever was sent)."""
        cfg = self.config
        if self._blind:
            self.saturated, self.cause = False, ""
        elif self.waiting + self.sent >= cfg.max_waiting:
            self.saturated, self.cause = True, "queue"
        elif self.kv_usage >= cfg.max_kv_usage:
            self.saturated, self.cause = True, "kv"
        elif cfg.max_running is not None and self.running + self.sent >= cfg.max_running:
            self.saturated, self.cause = True, "running"
        else:
            self.saturated, self.cause = False, ""

    def _send(self) -> None:
        """Count one request sent upstream; the estimate may now say "saturated"."""
        self.sent += 1
        if not self.saturated:
            self._assess()

    def drain_s(self) -> float:
        """Estimated seconds until the server has room again (0 when it has room now).

        The requests above the threshold, plus the Standard requests parked
        here (they go first), times the server's mean prefill time per
        request (0 while the server has not said: ``Retry-After`` then takes
        its floor).
        """
        if not self.saturated:
            return 0.0
        per = self.prefill_s or 0.0
        if self.cause == "queue":
            excess = self.waiting + self.sent - self.config.max_waiting + 1 + len(self._queue)
        else:
            excess = 1 + len(self._queue)
        return max(0.0, excess * per)

    def retry_after_s(self) -> int:
        """``Retry-After`` in whole seconds: the drain estimate, within its bounds."""
        drain = self.drain_s()
        if not drain < MAX_RETRY_AFTER_S:  # NaN and infinity included
            return MAX_RETRY_AFTER_S
        return max(MIN_RETRY_AFTER_S, math.ceil(drain))

    # -------------------------------------------------------------- decisions
    def decide(
        self,
        priority_class: str | None,
        now: float,
        ticket: object = None,
        *,
        hit: bool = False,
        flow: Flow | None = None,
    ) -> Decision:
        """What to do with one request of ``priority_class``.

        ``hit``: the answer comes from a cache, never refused. A Standard
        request that must wait is parked under ``ticket`` in ``flow`` (its
        tenant, fairness id and weight; None: one flow for all) with the deadline
        ``now + standard_max_wait_s``. A full queue may evict another ticket to
        make room (:meth:`take_evicted`).
        """
        if hit:
            return ADMIT
        cls = normal_class(priority_class)
        if cls == GUARANTEED:
            self._send()
            return ADMIT
        if cls == BEST_EFFORT:
            if not self.saturated:
                self._send()
                return ADMIT
            return self._refusal(429, _CAUSE_REASON[self.cause])
        if not self.saturated and not self._queue:
            self._send()
            return ADMIT
        flow = flow or Flow()
        if len(self._queue) >= self.config.standard_queue:
            evicted = self._queue.evict_for(flow)
            if evicted is None:
                return self._refusal(429, REASON_QUEUE_FULL)
            self._evicted.append(evicted)
        self._queue.push(ticket, flow, now + self.config.standard_max_wait_s)
        return WAIT

    def take_evicted(self) -> list[object]:
        """Parked tickets that gave their place up since the last call (each then gets
        :meth:`full_decision`)."""
        out, self._evicted = self._evicted, []
        return out

    def full_decision(self) -> Decision:
        """The answer of a Standard request that finds (or loses its place in) a full queue."""
        return self._refusal(429, REASON_QUEUE_FULL)

    def release(self) -> list[object]:
        """Parked tickets that may go now, in fair order: as many as leave the server
        unsaturated, each counted as sent, so the next one waits for the next reading."""
        out: list[object] = []
        while self._queue and not self.saturated:
            if self._blind and self.sent >= self.config.max_waiting:
                break  # no reading to go by: at most max_waiting per (failed) reading
            out.append(self._queue.pop())
            self._send()
        return out

    def release_all(self) -> list[object]:
        """Every parked ticket (the sidecar is stopping: they go upstream as they would)."""
        return self._queue.drain()

    def expire(self, now: float) -> list[object]:
        """Parked tickets whose wait ran out (each then gets :meth:`timeout_decision`)."""
        return self._queue.expire(now)

    def abandon(self, ticket: object) -> bool:
        """Forget a parked ticket (its client left); False when it was not parked."""
        return self._queue.remove(ticket)

    def timeout_decision(self) -> Decision:
        """The answer of a Standard request whose wait ran out: 503 with ``Retry-After``."""
        return self._refusal(503, REASON_QUEUE_TIMEOUT)

    def _refusal(self, status: int, reason: str) -> Decision:
        retry = self.retry_after_s()
        if reason == REASON_QUEUE_FULL:
            text = f"{self.config.standard_queue} requests already wait for the model server"
        elif reason == REASON_QUEUE_TIMEOUT:
            text = f"waited {self.config.standard_max_wait_s:g} s and the model server is saturated"
        elif reason == REASON_SATURATED_KV:
            text = f"model server saturated: KV cache {self.kv_usage:.0%} in use"
        elif reason == REASON_SATURATED_RUNNING:
            text = f"model server saturated: {self.running:g} requests running"
        else:
            waiting = self.waiting + self.sent  # what it holds now, as far as we know
            text = f"model server saturated: {waiting:g} requests waiting for prefill"
        return Decision("refuse", status, reason, retry, f"{text}; retry in {retry} s")

    def describe(self) -> dict[str, object]:
        """The state for /status."""
        return {
            "shedding": self.shedding_since is not None,
            "cause": self.cause or None,
            "waiting": self.waiting,
            "running": self.running,
            "kv_usage": round(self.kv_usage, 4),
            "sent_since_reading": self.sent,
            "queued": len(self._queue),
            "queued_tenants": self._queue.tenants,
            "retry_after_s": self.retry_after_s() if self.saturated else None,
            "metrics_faults": self.faults,
            "thresholds": {
                "max_waiting": self.config.max_waiting,
                "max_kv_usage": self.config.max_kv_usage,
                "max_running": self.config.max_running,
                "standard_queue": self.config.standard_queue,
                "standard_max_wait_s": self.config.standard_max_wait_s,
            },
        }
