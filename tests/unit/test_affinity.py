"""Affinity parts of the scheduling seam: LoRA adapters (vLLM's lora_requests_info), sessions."""

from __future__ import annotations

import random

import pytest

from cachefleet_common.modelserver import MetricsParseError, parse_metrics
from cachefleet_router.affinity import (
    REASON_SESSION,
    LoraAffinity,
    SessionAffinity,
    adapter_loads,
)
from cachefleet_router.endpoints import Endpoint, EndpointMetrics, RouteRequest
from cachefleet_router.profiles import build
from cachefleet_router.schedule import Candidate, Cycle, Profile, ProfilePicker
from cachefleet_router.scoring import ScoringConfig, TtftModel, ttft_parts


def lora_series(value: str, running: str, waiting: str) -> str:
    """One vllm:lora_requests_info line, as vLLM writes it (labels in its order)."""
    labels = f'max_lora="2",running_lora_adapters="{running}",waiting_lora_adapters="{waiting}"'
    return f"vllm:lora_requests_info{{{labels}}} {value}\n"


LORA_METRICS = (
    "# HELP vllm:lora_requests_info Running stats on lora requests.\n"
    "# TYPE vllm:lora_requests_info gauge\n"
    + lora_series("1.7e9", "", "")
    + lora_series("1.7000001e9", "sql", "")
    + lora_series("1.7000002e9", "sql,chat", "math")
    + lora_series("1.7000003e9", "", "")
    + 'vllm:num_requests_waiting{engine="0",model_name="base-8b"} 1\n'
    + 'vllm:num_requests_running{engine="0",model_name="base-8b"} 2\n'
)


class Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def lora(adapters: str = "", queued: str = "", max_lora: int = 2, **kw: float) -> EndpointMetrics:
    """Metrics of a vLLM server running ``adapters`` with ``queued`` waiting (comma-separated)."""
    return EndpointMetrics(
        lora_running=frozenset(adapters.split(",")) - {""},
        lora_waiting=frozenset(queued.split(",")) - {""},
        lora_max=max_lora,
        model_name="base-8b",
        server="vllm",
        **kw,  # type: ignore[arg-type]
    )


# -- parsing vllm:lora_requests_info -------------------------------------------------------


def test_the_newest_series_naming_an_adapter_is_the_current_one() -> None:
    """vLLM keeps every label set it ever set; the greatest value naming an adapter wins
    (a later empty one is an idle server, which still holds what it last ran)."""
    m = parse_metrics(LORA_METRICS)
    assert m.lora_running == {"sql", "chat"}
    assert m.lora_waiting == {"math"}
    assert m.lora_max == 2
    assert m.model_name == "base-8b"
    assert (m.waiting, m.running) == (1.0, 2.0)  # the rest as before


def test_only_empty_series_mean_no_adapter_running() -> None:
    text = (
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="",'
        'waiting_lora_adapters=""} 5\nvllm:num_requests_waiting 0\n'
    )
    m = parse_metrics(text)
    assert (m.lora_running, m.lora_waiting, m.lora_max) == (frozenset(), frozenset(), 4)


def test_without_lora_series_the_fields_stay_unset_and_the_rest_is_unchanged() -> None:
    text = "vllm:num_requests_waiting 3\nvllm:num_requests_running 1\n"
    m = parse_metrics(text)
    assert (m.lora_running, m.lora_waiting, m.lora_max, m.model_name) == (None,) * 4
    assert (m.waiting, m.running, m.server) == (3.0, 1.0, "vllm")
    # a LoRA series alone does not make an answer a model server's
    with pytest.raises(MetricsParseError):
        parse_metrics('vllm:lora_requests_info{running_lora_adapters="a"} 1\n')


def test_an_adapter_list_is_bounded() -> None:
    names = ",".join(f"a{i}" for i in range(5000))
    text = lora_series("1", names, "") + "vllm:num_requests_waiting 0\n"
    m = parse_metrics(text)
    assert m.lora_running is not None
    assert len(m.lora_running) <= 1024


# -- the lora-affinity scorer ----------------------------------------------------------------


def test_adapter_loads_follow_gies_order() -> None:
    """Running 0 < a free slot 1 < waiting for a slot 2 < every slot taken 5 (GIE: 1, .8, .6, 0)."""
    assert adapter_loads("sql", lora(adapters="sql,chat")) == 0
    assert adapter_loads("sql", lora(adapters="chat")) == 1  # a free slot
    assert adapter_loads("sql", lora(adapters="chat", queued="sql")) == 2  # no free slot
    assert adapter_loads("sql", lora(adapters="chat,math")) == 5
    assert adapter_loads("base-8b", lora(adapters="chat,math")) == 0  # the base model
    assert adapter_loads(None, lora(adapters="chat,math")) == 0
    assert adapter_loads("sql", EndpointMetrics()) == 0  # LoRA off / not vLLM: nothing known
    assert adapter_loads("sql", None) == 0


def test_the_scorer_speaks_seconds_of_adapter_load() -> None:
    scorer = LoraAffinity(load_s=0.3)
    cycle = Cycle(RouteRequest(model="sql"), now=0.0)
    candidates = [
        Candidate(Endpoint("a:1", metrics=lora(adapters="sql"))),
        Candidate(Endpoint("b:1", metrics=lora(adapters="chat"))),
        Candidate(Endpoint("c:1", metrics=lora(adapters="chat,math"))),
    ]
    assert scorer.score(cycle, candidates) == pytest.approx([0.0, 0.3, 1.5])
    with pytest.raises(ValueError):
        LoraAffinity(-1.0)


def fleet(*metrics: EndpointMetrics) -> list[Endpoint]:
    return [Endpoint(f"10.0.0.{i}:8000", metrics=m, scraped_at=9.9) for i, m in enumerate(metrics)]


def test_default_profile_sends_an_adapter_where_it_is_loaded() -> None:
    picker = build("default", ScoringConfig(default_rate=2000.0), clock=Clock())
    endpoints = fleet(lora(adapters="chat,math"), lora(adapters="chat"), lora(adapters="sql"))
    adapter = picker.pick(RouteRequest(blocks=(1,), tokens=512, model="sql"), endpoints)
    assert adapter is not None
    assert adapter.address == "10.0.0.2:8000"
    # the base model needs no adapter: the lowest address, as without LoRA
    base = build("default", ScoringConfig(default_rate=2000.0), clock=Clock())
    decision = base.pick(RouteRequest(blocks=(1,), tokens=512, model="base-8b"), endpoints)
    assert decision is not None
    assert decision.address == "10.0.0.0:8000"


def test_an_overloaded_endpoint_holding_the_adapter_is_not_used() -> None:
    picker = build("default", ScoringConfig(default_rate=2000.0), clock=Clock())
    endpoints = fleet(
        lora(adapters="chat,math"), lora(adapters="chat"), lora(adapters="sql", waiting=50.0)
    )
    decision = picker.pick(RouteRequest(blocks=(1,), tokens=512, model="sql"), endpoints)
    assert decision is not None
    assert decision.address == "10.0.0.1:8000"  # a free slot beats every slot taken


def old_default(config: ScoringConfig, clock: Clock) -> ProfilePicker:
    """The default profile as it was before the affinity parts."""
    model = TtftModel(config, clock=clock)
    profile = Profile(
        "old",
        scorers=(("queue-wait", 1.0), ("prefix-prefill", 1.0)),
        filters=("bounded-load",),
        picker="least-ttft",
        seconds=True,
        reason="ttft",
    )
    return ProfilePicker(profile, ttft_parts(model), clock=clock, hooks=[model])


def test_without_adapter_or_session_the_default_profile_decides_as_before() -> None:
    """Endpoints exporting LoRA series, requests naming the base model or none: float for float."""
    rng = random.Random(5)
    config = ScoringConfig(default_rate=2000.0)
    clock_a, clock_b = Clock(), Clock()
    new, old = build("default", config, clock=clock_a), old_default(config, clock_b)
    endpoints = fleet(
        lora(adapters="chat,math", waiting=1.0),
        lora(adapters="chat"),
        lora(adapters="sql", waiting=2.0, running=1.0),
        lora(),
    )
    flying = []
    for i in range(300):
        conv = rng.randrange(10)
        blocks = tuple(range(conv * 100, conv * 100 + rng.randint(1, 9)))
        model = rng.choice([None, "base-8b"])
        request = RouteRequest(blocks=blocks, tokens=512 * len(blocks), model=model)
        clock_a.now = clock_b.now = 10.0 + i * 0.05
        da, db = new.pick(request, endpoints), old.pick(request, endpoints)
        assert da is not None
        assert db is not None
        assert (da.address, da.expected_ttft_s, da.matched_blocks, da.reason) == (
            db.address,
            db.expected_ttft_s,
            db.matched_blocks,
            db.reason,
        )
        flying.append((da, db, request))
        if rng.random() < 0.6:
            a, b, r = flying.pop(0)
            new.done(a, r, ok=True)
            old.done(b, r, ok=True)


# -- the session-affinity filter -------------------------------------------------------------


def test_a_session_stays_on_its_endpoint() -> None:
    clock = Clock()
    picker = build("default", ScoringConfig(default_rate=2000.0), clock=clock)
    twin = build("default", ScoringConfig(default_rate=2000.0), clock=clock)
    endpoints = fleet(lora(), lora(), lora(adapters="sql"))
    # the session's first request goes where its adapter is
    first = RouteRequest(blocks=(1,), tokens=512, model="sql", session="alice")
    d = picker.pick(first, endpoints)
    twin.pick(RouteRequest(blocks=(1,), tokens=512, model="sql"), endpoints)
    assert d is not None
    assert d.address == "10.0.0.2:8000"
    picker.done(d, first, ok=True)
    # later turns name the base model: without the session they spread (a new prompt
    # family goes where this router placed the fewest recently), with it they stay
    free_picks = []
    for turn in range(5):
        clock.now += 1.0
        request = RouteRequest(blocks=(50 + turn,), tokens=512, model="base-8b")
        sticky = picker.pick(RouteRequest(**{**_fields(request), "session": "alice"}), endpoints)
        free = twin.pick(request, endpoints)
        assert sticky is not None
        assert free is not None
        assert sticky.address == "10.0.0.2:8000"
        assert sticky.reason == REASON_SESSION
        free_picks.append(free.address)
        picker.done(sticky, request, ok=True)
        twin.done(free, request, ok=True)
    assert set(free_picks) - {"10.0.0.2:8000"}, "without the session some turn leaves"


def _fields(request: RouteRequest) -> dict[str, object]:
    return {f: getattr(request, f) for f in RouteRequest.__dataclass_fields__}


def test_a_session_leaves_an_endpoint_over_the_cap_and_sticks_where_it_went() -> None:
    clock = Clock()
    picker = build("default", ScoringConfig(default_rate=2000.0), clock=clock)
    endpoints = fleet(lora(), lora(), lora(adapters="sql"))
    d = picker.pick(RouteRequest(blocks=(1,), tokens=512, model="sql", session="s"), endpoints)
    assert d is not None
    assert d.address == "10.0.0.2:8000"
    endpoints[2].metrics = lora(adapters="sql", waiting=50.0)  # its queue: far over the cap
    moved = picker.pick(RouteRequest(blocks=(2,), tokens=512, session="s"), endpoints)
    assert moved is not None
    assert moved.address != "10.0.0.2:8000"
    assert moved.reason != REASON_SESSION
    endpoints[2].metrics = lora(adapters="sql")  # idle again: the session stays where it went
    clock.now += 1.0
    again = picker.pick(RouteRequest(blocks=(3,), tokens=512, session="s"), endpoints)
    assert again is not None
    assert again.address == moved.address
    assert again.reason == REASON_SESSION


def test_a_session_expires_after_its_ttl() -> None:
    sessions = SessionAffinity(ttl_s=5.0)
    cands = [Candidate(Endpoint("a:1")), Candidate(Endpoint("b:1"))]
    cycle = Cycle(RouteRequest(session="s"), now=100.0)
    from cachefleet_router.endpoints import Decision

    sessions.picked(cycle, cands[1], Decision("b:1"))
    assert sessions.filter(Cycle(RouteRequest(session="s"), now=104.0), cands) == [cands[1]]
    assert sessions.filter(Cycle(RouteRequest(session="s"), now=105.5), cands) == cands
    assert sessions.filter(Cycle(RouteRequest(session="t"), now=101.0), cands) == cands
    assert sessions.filter(Cycle(RouteRequest(), now=101.0), cands) == cands


def test_sessions_are_bounded_least_recently_seen_first() -> None:
    from cachefleet_router.endpoints import Decision

    sessions = SessionAffinity(ttl_s=60.0, max_sessions=2)
    cand = Candidate(Endpoint("a:1"))
    for i, name in enumerate(["s1", "s2", "s1", "s3"]):
        sessions.picked(Cycle(RouteRequest(session=name), now=float(i)), cand, Decision("a:1"))
    assert len(sessions) == 2
    assert sessions.endpoint("s1", 4.0) == "a:1"  # seen again before s3 came
    assert sessions.endpoint("s2", 4.0) is None  # the least recently seen went
    assert sessions.endpoint("s3", 4.0) == "a:1"
    with pytest.raises(ValueError):
        SessionAffinity(ttl_s=0.0)


def test_session_memory_is_bounded() -> None:
    """The cap bounds the count; each session is a 64-bit key and an address (about 220 B)."""
    import tracemalloc

    from cachefleet_router.endpoints import Decision

    sessions = SessionAffinity(max_sessions=20_000)
    decisions = [Decision(f"10.0.0.{i}:8000") for i in range(16)]
    cand = Candidate(Endpoint("a:1"))
    requests = [RouteRequest(session=f"session-{i:08d}" * 8) for i in range(30_000)]
    tracemalloc.start()
    try:
        for i, request in enumerate(requests):
            sessions.picked(Cycle(request, float(i)), cand, decisions[i % 16])
        used, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(sessions) == 20_000
    assert used / len(sessions) < 400
