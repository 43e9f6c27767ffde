"""Class-aware admission, the pure core: each class, thresholds, the queue, Retry-After."""

from __future__ import annotations

import json
import math

import pytest

from cachefleet_common.classes import BEST_EFFORT, GUARANTEED, STANDARD
from cachefleet_common.modelserver import ModelServerMetrics
from cachefleet_sidecar.adapt.admission import (
    MAX_RETRY_AFTER_S,
    MIN_RETRY_AFTER_S,
    Admission,
    AdmissionConfig,
)


def reading(
    waiting: float = 0, kv: float = 0.1, prefill_s: float = 0.0, n: float = 0
) -> ModelServerMetrics:
    return ModelServerMetrics(
        waiting=waiting,
        running=1,
        kv_usage=kv,
        prefill_seconds_total=prefill_s * n if n else None,
        prefill_requests_total=n or None,
        server="vllm",
    )


def saturated(config: AdmissionConfig | None = None, **kw: float) -> Admission:
    a = Admission(config or AdmissionConfig(max_waiting=4, standard_queue=2))
    a.observe(reading(waiting=kw.get("waiting", 10), prefill_s=kw.get("prefill_s", 0.0), n=10), 0)
    assert a.saturated
    return a


def test_nothing_is_refused_while_the_server_has_room() -> None:
    a = Admission(AdmissionConfig(max_waiting=8))
    a.observe(reading(waiting=3, kv=0.5), 0.0)
    assert not a.saturated
    for cls in (GUARANTEED, STANDARD, BEST_EFFORT, None):
        assert a.decide(cls, 0.0, object()).action == "admit"
    assert a.queued == 0


def test_requests_sent_since_the_last_reading_count_as_waiting() -> None:
    # The reading says 2 waiting (threshold 4); it cannot show what the sidecar sends next.
    a = Admission(AdmissionConfig(max_waiting=4, standard_queue=4))
    a.observe(reading(waiting=2, prefill_s=0.5, n=10), 0.0)
    assert a.decide(GUARANTEED, 0.1, object()).action == "admit"
    assert a.decide(BEST_EFFORT, 0.2, object()).action == "admit"
    assert (a.saturated, a.cause, a.sent) == (True, "queue", 2)  # 2 read + 2 sent
    shed = a.decide(BEST_EFFORT, 0.3)
    assert (shed.status, shed.reason) == (429, "saturated_queue")
    assert "4 requests waiting" in shed.message
    assert a.decide(STANDARD, 0.3, "parked").action == "wait"
    assert a.decide(GUARANTEED, 0.4, object()).action == "admit"  # still always passes
    # a shedding episode (log, Event) starts and stops on readings only
    assert a.shedding_since is None
    assert a.describe()["sent_since_reading"] == 3
    assert a.release() == []
    # the next reading shows the server's own count again: room for one
    a.observe(reading(waiting=3), 0.5)
    assert a.sent == 0
    assert a.release() == ["parked"]
    assert a.saturated  # 3 read + the one just let go
    assert a.decide(BEST_EFFORT, 0.6).action == "refuse"


def test_queue_threshold_and_kv_threshold_each_saturate() -> None:
    a = Admission(AdmissionConfig(max_waiting=4, max_kv_usage=0.9))
    a.observe(reading(waiting=4), 0.0)
    assert (a.saturated, a.cause) == (True, "queue")
    a.observe(reading(waiting=0, kv=0.9), 1.0)
    assert (a.saturated, a.cause) == (True, "kv")
    d = a.decide(BEST_EFFORT, 1.0)
    assert (d.status, d.reason) == (429, "saturated_kv")
    a.observe(reading(waiting=3, kv=0.89), 2.0)
    assert not a.saturated


def test_guaranteed_always_passes() -> None:
    a = saturated()
    assert a.decide(GUARANTEED, 0.0, object()).action == "admit"
    assert a.queued == 0


def test_besteffort_gets_429_with_retry_after_from_the_drain_estimate() -> None:
    # 10 waiting, threshold 4: 7 must finish before there is room; 0.5 s of prefill each.
    a = saturated(waiting=10, prefill_s=0.5)
    d = a.decide(BEST_EFFORT, 0.0)
    assert (d.action, d.status, d.reason) == ("refuse", 429, "saturated_queue")
    assert d.retry_after_s == 4  # ceil(7 * 0.5)
    assert "10 requests waiting" in d.message


def test_retry_after_is_at_least_one_and_bounded() -> None:
    unknown = saturated(waiting=10)  # the server never said how long a prefill takes
    assert unknown.decide(BEST_EFFORT, 0.0).retry_after_s == 1
    huge = saturated(waiting=10_000, prefill_s=5.0)
    assert huge.decide(BEST_EFFORT, 0.0).retry_after_s == MAX_RETRY_AFTER_S


def test_standard_and_classless_wait_in_a_bounded_fifo_then_go_in_order() -> None:
    a = saturated()  # queue bound 2
    first, second, third = object(), object(), object()
    assert a.decide(STANDARD, 0.0, first).action == "wait"
    assert a.decide(None, 0.0, second).action == "wait"  # no class: Standard
    full = a.decide(STANDARD, 0.0, third)
    assert (full.status, full.reason) == (429, "queue_full")
    assert a.release() == []  # still saturated
    a.observe(reading(waiting=3), 1.0)  # threshold 4: room for one
    assert a.release() == [first]
    assert a.release() == []  # the reading's headroom is spent
    a.observe(reading(waiting=0), 1.5)
    assert a.release() == [second]


def test_standard_queues_behind_earlier_waiters_even_when_room_came_back() -> None:
    a = saturated()
    a.decide(STANDARD, 0.0, "early")
    a.observe(reading(waiting=0), 1.0)
    # Room, but "early" has not been released yet: a newcomer must not overtake it.
    assert a.decide(STANDARD, 1.0, "late").action == "wait"
    assert a.release() == ["early", "late"]


def test_standard_wait_times_out_with_503() -> None:
    a = saturated(AdmissionConfig(max_waiting=4, standard_max_wait_s=10.0))
    a.decide(STANDARD, 0.0, "a")
    a.decide(STANDARD, 5.0, "b")
    assert a.expire(9.9) == []
    assert a.expire(10.0) == ["a"]
    d = a.timeout_decision()
    assert (d.status, d.reason) == (503, "queue_timeout")
    assert d.retry_after_s >= 1
    assert a.queued == 1


def test_abandoned_waiter_leaves_the_queue() -> None:
    a = saturated()
    a.decide(STANDARD, 0.0, "gone")
    assert a.abandon("gone")
    assert not a.abandon("gone")
    assert a.queued == 0


def test_a_cache_hit_is_never_refused() -> None:
    a = saturated()
    for _ in range(3):
        a.decide(STANDARD, 0.0, object())  # queue full
    for cls in (BEST_EFFORT, STANDARD, None, GUARANTEED):
        assert a.decide(cls, 0.0, hit=True).action == "admit"


def test_a_failed_reading_is_not_saturated_and_is_counted() -> None:
    a = saturated()
    assert a.observe(None, 1.0) is True  # shedding stopped
    assert (a.saturated, a.faults) == (False, 1)
    # no reading to add the sent requests to: nothing is refused, however many go
    for _ in range(10):
        assert a.decide(BEST_EFFORT, 1.0).action == "admit"
    assert not a.saturated


def test_shedding_start_and_stop_are_reported_once() -> None:
    a = Admission(AdmissionConfig(max_waiting=4))
    assert a.observe(reading(waiting=5), 0.0) is True
    assert a.observe(reading(waiting=6), 0.5) is False
    assert a.shedding_since == 0.0
    assert a.shedding_starts == 1
    assert a.observe(reading(waiting=1), 1.0) is True
    assert a.shedding_since is None
    assert a.describe()["shedding"] is False


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_waiting", 0),
        ("max_kv_usage", 1.5),
        ("max_kv_usage", 0),
        ("standard_queue", -1),
        ("standard_max_wait_s", 0),
    ],
)
def test_bad_thresholds_name_their_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        AdmissionConfig(**{field: value})  # type: ignore[arg-type]


def test_running_threshold_saturates_only_when_set() -> None:
    busy = ModelServerMetrics(waiting=0, running=4, kv_usage=0.1, server="vllm")
    off = Admission(AdmissionConfig(max_waiting=4))
    off.observe(busy, 0.0)
    assert not off.saturated
    on = Admission(AdmissionConfig(max_waiting=4, max_running=4))
    on.observe(busy, 0.0)
    assert (on.saturated, on.cause) == (True, "running")
    d = on.decide(BEST_EFFORT, 0.0)
    assert (d.status, d.reason) == (429, "saturated_running")
    for ticket in "abc":
        on.decide(STANDARD, 0.0, ticket)
    # room for two more running requests: two parked requests go, oldest first
    on.observe(ModelServerMetrics(waiting=0, running=2, kv_usage=0.1, server="vllm"), 1.0)
    assert on.release() == ["a", "b"]


@pytest.mark.parametrize(
    "hostile",
    [
        ModelServerMetrics(waiting=math.inf, server="vllm"),
        ModelServerMetrics(waiting=math.nan, running=math.nan, kv_usage=math.nan, server="vllm"),
        ModelServerMetrics(waiting=-1e308, running=-5, kv_usage=-1, server="vllm"),
        ModelServerMetrics(
            waiting=1e308,
            running=1e308,
            kv_usage=1e308,
            prefill_seconds_total=1e308,
            prefill_requests_total=1e-300,
            server="vllm",
        ),
        ModelServerMetrics(
            waiting=50, prefill_seconds_total=math.inf, prefill_requests_total=1, server="vllm"
        ),
    ],
)
def test_any_reading_leaves_decisions_and_status_working(hostile: ModelServerMetrics) -> None:
    """Issue 34 (2): no number a model server sends breaks a refusal, a timeout or /status
    (the OverflowError of ``ceil(inf)`` dropped BestEffort connections and killed the poller)."""
    a = Admission(AdmissionConfig(max_waiting=4, standard_queue=2))
    a.observe(hostile, 0.0)
    for value in (a.waiting, a.running, a.kv_usage, a.prefill_s or 0.0, a.drain_s()):
        assert math.isfinite(value)
        assert value >= 0
    assert 0 <= a.kv_usage <= 1
    shed = a.decide(BEST_EFFORT, 0.0)
    if a.saturated:
        assert shed.action == "refuse"
        assert MIN_RETRY_AFTER_S <= shed.retry_after_s <= MAX_RETRY_AFTER_S
    assert a.decide(STANDARD, 0.0, ticket="t").action in ("admit", "wait")
    timeout = a.timeout_decision()
    assert (timeout.status, timeout.reason) == (503, "queue_timeout")
    assert MIN_RETRY_AFTER_S <= timeout.retry_after_s <= MAX_RETRY_AFTER_S
    json.dumps(a.describe(), allow_nan=False)  # /status is JSON
