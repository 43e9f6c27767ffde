"""TTFT and ITL: the SSE event clock of a streamed answer, and the sidecar's histograms."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cachefleet_sidecar.observe.metrics import (
    ITL_BUCKETS,
    MAX_MODEL_SERIES,
    OTHER_TENANT,
    TTFT_BUCKETS,
    SidecarMetrics,
)
from cachefleet_sidecar.observe.tokentimes import EventTimes

EVENT = b'data: {"choices": [{"delta": {"content": "data: x"}}]}\n\n'
DONE = b"data: [DONE]\n\n"


def test_first_event_and_mean_gap_of_one_event_per_chunk() -> None:
    times = EventTimes()
    times.feed(b": a comment, not data\n\n", 0.1)
    assert times.first is None
    for i in range(5):
        times.feed(EVENT, 0.3 + 0.02 * i)
    times.feed(DONE, 0.5)  # the sentinel is no token: it neither counts nor moves the end
    assert times.first == 0.3
    assert times.events == 5
    gap = times.mean_gap()
    assert gap is not None
    assert abs(gap - 0.02) < 1e-12


def test_events_split_and_merged_across_chunks() -> None:
    times = EventTimes()
    stream = EVENT * 3 + DONE
    # cut inside every "data:" and inside "[DONE]": nothing lost, nothing counted twice
    cuts = [3, len(EVENT) + 2, 2 * len(EVENT) + 5, 3 * len(EVENT) + 9]
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    for n, piece in enumerate(pieces):
        times.feed(piece, float(n))
    assert times.events == 3
    merged = EventTimes()
    merged.feed(EVENT * 4 + DONE, 1.0)  # arrived together: one time, no gap
    assert (merged.events, merged.first, merged.mean_gap()) == (4, 1.0, 0.0)


def test_crlf_lines_and_a_done_split_after_its_data_field() -> None:
    times = EventTimes()
    times.feed(EVENT.replace(b"\n", b"\r\n"), 0.0)
    times.feed(EVENT.replace(b"\n", b"\r\n") + b"data:", 0.1)
    times.feed(b" [DONE]\r\n\r\n", 0.2)
    assert times.events == 2
    assert times.mean_gap() == 0.1


def test_one_event_has_no_gap() -> None:
    times = EventTimes()
    times.feed(EVENT + DONE, 0.4)
    assert (times.first, times.events, times.mean_gap()) == (0.4, 1, None)


def samples(text: str) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
    return sorted(
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    )


def test_histograms_have_the_slo_buckets_and_bounded_models() -> None:
    # 0.25-0.5 s and 10-50 ms are buckets of their own
    assert {0.25, 0.5} <= set(TTFT_BUCKETS)
    assert {0.01, 0.05} <= set(ITL_BUCKETS)
    m = SidecarMetrics("ns/chat")
    tm = m.tenant("acme")
    tm.answered("llama", 0.3, 0.02)
    tm.answered("llama", 0.31, None)  # a whole answer: TTFT only
    for i in range(MAX_MODEL_SERIES + 3):
        tm.answered(f"model-{i}", 1.0, None)
    assert len(tm.answers) == MAX_MODEL_SERIES + 1
    assert tm.answers[OTHER_TENANT].ttft.counts[-1] == 0
    assert sum(tm.answers[OTHER_TENANT].ttft.counts) == 4
    text = m.render().decode()
    assert samples(text) == samples(generate_latest(m.registry).decode())
    got = {
        (name, dict(labels).get("le")): v
        for name, labels, v in samples(text)
        if dict(labels).get("model") == "llama"
    }
    assert got[("cachefleet_ttft_seconds_bucket", "0.25")] == 0
    assert got[("cachefleet_ttft_seconds_bucket", "0.5")] == 2
    assert got[("cachefleet_ttft_seconds_count", None)] == 2
    assert got[("cachefleet_itl_seconds_bucket", "0.01")] == 0
    assert got[("cachefleet_itl_seconds_bucket", "0.025")] == 1
    assert got[("cachefleet_itl_seconds_count", None)] == 1
    # a model with whole answers only has no ITL series
    assert not [
        s
        for s in samples(text)
        if s[0].startswith("cachefleet_itl") and dict(s[1]).get("model") == "model-0"
    ]
