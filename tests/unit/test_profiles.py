"""The scheduling seam: the router's named profiles, built from registered parts."""

from __future__ import annotations

import random

import pytest

from cachefleet_router.endpoints import Endpoint, EndpointMetrics, RouteRequest
from cachefleet_router.profiles import PROFILES, build
from cachefleet_router.schedule import Profile, ProfilePicker
from cachefleet_router.scoring import ScoringConfig, ScoringPicker


class Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def fleet(n: int, **metrics: float) -> list[Endpoint]:
    return [
        Endpoint(f"10.0.0.{i}:8000", metrics=EndpointMetrics(**metrics), scraped_at=9.9)  # type: ignore[arg-type]
        for i in range(n)
    ]


def test_the_profiles_the_router_offers() -> None:
    assert set(PROFILES) == {"default", "least-loaded", "round-robin", "gie-like"}
    with pytest.raises(ValueError, match=r"unknown profile 'nope'.*gie-like"):
        build("nope")


def test_a_profile_naming_a_missing_part_is_refused() -> None:
    bad = Profile("bad", scorers=(("no-such-scorer", 1.0),))
    with pytest.raises(ValueError, match="no scorer named 'no-such-scorer'"):
        ProfilePicker(bad, {}, clock=Clock())


def test_default_profile_decides_exactly_as_the_scoring_picker() -> None:
    """Same requests, same clock, same metrics: the same decisions, float for float."""
    rng = random.Random(3)
    clock_a, clock_b = Clock(), Clock()
    a = build("default", ScoringConfig(default_rate=2000.0), clock=clock_a)
    b = ScoringPicker(ScoringConfig(default_rate=2000.0), clock=clock_b)
    endpoints = fleet(4, waiting=1.0, running=1.0)
    pending = []
    for i in range(300):
        conv = rng.randrange(12)
        blocks = tuple(range(conv * 100, conv * 100 + rng.randint(1, 8)))
        request = RouteRequest(blocks=blocks, tokens=512 * len(blocks), answer_key=f"k{i % 7}")
        clock_a.now = clock_b.now = 10.0 + i * 0.05
        da, db = a.pick(request, endpoints), b.pick(request, endpoints)
        assert da is not None
        assert db is not None
        assert (da.address, da.expected_ttft_s, da.matched_blocks, da.reason) == (
            db.address,
            db.expected_ttft_s,
            db.matched_blocks,
            db.reason,
        )
        pending.append((da, db, request))
        if len(pending) > 5:
            pa, pb, pr = pending.pop(0)
            a.done(pa, pr, ok=True)
            b.done(pb, pr, ok=True)


def test_round_robin_takes_each_endpoint_in_turn() -> None:
    picker = build("round-robin")
    endpoints = fleet(3)
    picks = [picker.pick(RouteRequest(), endpoints) for _ in range(6)]
    assert [d.address for d in picks if d] == [e.address for e in endpoints] * 2
    assert all(d is not None and d.reason == "round-robin" for d in picks)


def test_least_loaded_counts_requests_in_flight_until_done() -> None:
    """Envoy's two choices: the in-flight counts stay within a few of each other, and an
    endpoint whose requests are done is drawn back in."""
    picker = build("least-loaded")
    endpoints = fleet(4)
    counts = dict.fromkeys((e.address for e in endpoints), 0)
    flying = []
    for _ in range(400):
        d = picker.pick(RouteRequest(), endpoints)
        assert d is not None
        assert d.reason == "least-loaded"
        counts[d.address] += 1
        flying.append(d)
    assert max(counts.values()) - min(counts.values()) <= 3
    first = endpoints[0].address
    for d in flying:  # everything on the first endpoint is done: it is the least loaded
        if d.address == first:
            picker.done(d, RouteRequest(), ok=True)
    after = [picker.pick(RouteRequest(), endpoints) for _ in range(40)]
    # drawn 7 times in 16 (and then always the least loaded), against 1 in 4 without the done
    assert sum(1 for d in after if d is not None and d.address == first) >= 13


def test_two_choices_draws_two_at_random_and_keeps_the_first_on_a_tie() -> None:
    """Envoy's N_CHOICES with choice_count 2: P(the cheapest of 4) = 1 - (3/4)^2 = 7/16,
    P(the dearest) = 1/16; all equal: uniform."""
    from cachefleet_router.profiles import TwoChoices
    from cachefleet_router.schedule import Candidate, Cycle

    chooser = TwoChoices(seed=1)
    cycle = Cycle(RouteRequest(), now=0.0)
    ranked = [Candidate(e, cost=float(i)) for i, e in enumerate(fleet(4))]
    picks = [chooser.choose(cycle, ranked).cost for _ in range(8000)]
    assert picks.count(0.0) / len(picks) == pytest.approx(7 / 16, abs=0.02)
    assert picks.count(3.0) / len(picks) == pytest.approx(1 / 16, abs=0.01)
    equal = [Candidate(e) for e in fleet(4)]
    chosen = [chooser.choose(cycle, equal).endpoint.address for _ in range(8000)]
    for e in fleet(4):
        assert chosen.count(e.address) / len(chosen) == pytest.approx(0.25, abs=0.02)


def test_gie_like_weighs_prefix_3_against_queue_2_and_kv_cache_2() -> None:
    """GIE's default weights: a full prefix match (3) beats the shortest queue (2) alone,
    but not the shortest queue and the emptiest KV cache together (2 + 2)."""
    request = RouteRequest(blocks=(1, 2, 3, 4), tokens=2048)
    holder, other = (
        Endpoint("10.0.0.1:8000", metrics=EndpointMetrics(waiting=5.0, kv_usage=0.0)),
        Endpoint("10.0.0.2:8000", metrics=EndpointMetrics(waiting=0.0, kv_usage=0.0)),
    )
    picker = build("gie-like")
    warm = picker.pick(request, [holder])  # the holder's index now has the prompt
    assert warm is not None
    assert warm.address == holder.address
    chosen = picker.pick(request, [holder, other])
    assert chosen is not None
    assert chosen.address == holder.address
    holder.metrics = EndpointMetrics(waiting=5.0, kv_usage=1.0)
    chosen = picker.pick(request, [holder, other])
    assert chosen is not None
    assert chosen.address == other.address


def test_precise_prefix_wins_where_known_and_the_estimate_serves_elsewhere() -> None:
    """The approximate index believes a holds the prompt (it was routed there); the
    servers' own KV events say b does. Known: b. After a gap on b: a again."""
    from cachefleet_router.kvevents import BlockStored, EventBatch
    from cachefleet_router.kvindex import KvIndex

    tokens = tuple(range(64))
    index = KvIndex(resync_blocks=1000)
    clock = Clock()
    picker = ScoringPicker(
        ScoringConfig(block_tokens=16, default_rate=100.0, home_block=-1),
        clock=clock,
        precise=index,
    )
    a, b = Endpoint("a:8000"), Endpoint("b:8000")
    request = RouteRequest(blocks=(1, 2, 3, 4), tokens=64, token_ids=tokens)
    first = picker.pick(request, [a])  # only a was there: its approximate index has the prompt
    assert first is not None
    clock.now += 5.0
    picker.done(first, request, ok=True)
    index.apply("b:8000", 0, EventBatch(0.0, (BlockStored((11, 12, 13, 14), None, tokens, 16),)))
    index.apply("a:8000", 0, EventBatch(0.0, ()))  # a's server: known, holds nothing
    chosen = picker.pick(request, [a, b])
    assert chosen is not None
    assert (chosen.address, chosen.matched_blocks, chosen.expected_ttft_s) == ("b:8000", 4, 0.0)
    clock.now += 5.0
    picker.done(chosen, request, ok=True)
    # a alone: its server says it holds nothing, whatever the approximate index believes
    alone = picker.pick(request, [a])
    assert alone is not None
    assert alone.matched_blocks == 0
    clock.now += 5.0
    picker.done(alone, request, ok=True)
    index.lost("a:8000")  # a gap: a's state is not known, the approximate index serves it
    alone = picker.pick(request, [a])
    assert alone is not None
    assert alone.matched_blocks == 4


def test_a_prompt_in_flight_counts_until_the_servers_events_can_say_so() -> None:
    """Routed to a and queued there, a prompt is in no server's events yet: the next
    request of its family still goes to a; once done, only the events speak."""
    from cachefleet_router.kvevents import EventBatch
    from cachefleet_router.kvindex import KvIndex

    index = KvIndex()
    for name in ("a:8000", "b:8000"):
        index.apply(name, 0, EventBatch(0.0, ()))  # known, empty
    clock = Clock()
    picker = ScoringPicker(
        ScoringConfig(block_tokens=16, default_rate=100.0, home_block=-1, tie_abs_s=0.0),
        clock=clock,
        precise=index,
    )
    a, b = Endpoint("a:8000"), Endpoint("b:8000")
    first = RouteRequest(blocks=(1, 2, 3, 4), tokens=64, token_ids=tuple(range(64)))
    second = RouteRequest(blocks=(1, 2, 3, 9), tokens=64, token_ids=(*range(48), 7, *range(15)))
    sent = picker.pick(first, [b, a])
    assert sent is not None
    assert sent.address == "a:8000"  # a tie: the address
    clock.now += 0.5  # a is running it: 0.14 s of its 0.64 s left
    follow = picker.pick(second, [a, b])
    assert follow is not None
    assert (follow.address, follow.matched_blocks) == ("a:8000", 3)  # in flight on a
    picker.done(sent, first, ok=True)
    picker.done(follow, second, ok=True)
    clock.now += 10.0
    # done, and a's events never said it holds them (say it evicted them): nothing held
    again = picker.pick(second, [a, b])
    assert again is not None
    assert again.matched_blocks == 0
