"""The L1 hits' book (:class:`HitBook`): what a batch of hits counts is what the
hits counted one by one, a scrape sees every hit answered, and the curves are
asked only about sampled keys. No sockets, no loop: ``later`` is a list."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import generate_latest

from cachefleet_common.keys import CacheKey
from cachefleet_common.sampling import HASH_SHIFT
from cachefleet_sidecar.adapt.mrc import MissRatioCurves
from cachefleet_sidecar.adapt.switching import SwitchingEngine
from cachefleet_sidecar.cache.entry import L1Value
from cachefleet_sidecar.cache.hits import HitBook
from cachefleet_sidecar.observe.metrics import BUCKETS, SidecarMetrics


def key(digest: int, model: str = "m") -> CacheKey:
    return CacheKey("chat", model, False, b"{}", digest)


def value(tenant: str, prompt: int = 10, completion: int = 5, upstream_s: float = 0.5) -> L1Value:
    return (tenant, b"HTTP/1.1 200 OK\r\n\r\n", 0.0, 0.0, 0.0, 0, 0, prompt, completion, upstream_s)


class Later:
    """The loop turns (:class:`Turns`): counts the turns the book opens; :meth:`run` ends one."""

    def __init__(self) -> None:
        self.every: list[Callable[[], None]] = []
        self.opened = 0
        self.open = False

    def turn(self) -> bool:
        if not self.open:
            self.open = True
            self.opened += 1
        return True

    def every_turn(self, fn: Callable[[], None]) -> None:
        self.every.append(fn)

    def run(self) -> None:
        self.open = False
        for fn in self.every:
            fn()


class CountingCurves(MissRatioCurves):
    def __init__(self) -> None:
        super().__init__(max_samples=16)
        self.accesses = 0

    def access(self, tenant: str, digest: int, size: int) -> None:
        self.accesses += 1
        super().access(tenant, digest, size)


def test_a_turn_of_hits_counts_what_each_hit_would() -> None:
    metrics = SidecarMetrics("ns/c")
    later = Later()
    engine = SwitchingEngine()
    book = HitBook(
        metrics, later, switching=engine, prices={"m": (1.0, 2.0)}, on_observed=lambda: None
    )
    a, b = key(1), key(2, model="other")
    book.add("t1", a, value("t1"), 0.001)
    book.add("t1", a, value("t1"), 0.002)
    book.add("t2", b, value("t2", prompt=100), 0.5)
    book.add("t1", b, value("t1"), 0.003, observe=False)
    assert later.opened == 1  # the turn opened once, flushed once at its end
    assert metrics.tenants == {}  # nothing counted before the turn ends
    later.run()

    t1, t2 = metrics.tenants["t1"], metrics.tenants["t2"]
    assert t1.requests[("l1", "hit")] == 3
    assert t2.requests[("l1", "hit")] == 1
    assert sum(t1.latency["l1"].counts) == 3
    assert abs(t1.latency["l1"].sum - 0.006) < 1e-12
    assert t2.latency["l1"].counts[BUCKETS.index(0.5)] == 1
    saved = t1.saved["m"]
    assert (saved.hits, saved.prompt_tokens, saved.completion_tokens) == (2, 20, 10)
    assert abs(saved.model_seconds - 1.0) < 1e-12
    assert abs(saved.cost - 2 * (10 * 1.0 + 5 * 2.0) / 1000) < 1e-12
    assert t1.saved["other"].hits == 1
    assert t1.saved["other"].cost == 0.0  # "other" has no price
    assert t2.saved["other"].prompt_tokens == 100
    # switching saw the observed hits only, each with its latency
    status = {t: s.window for t, s in engine._tenants.items()}
    assert status["t1"].count == 2
    assert sorted(status["t1"].samples) == [0.001, 0.002]
    assert status["t2"].count == 1


def test_a_scrape_sees_the_hits_of_a_turn_not_ended() -> None:
    metrics = SidecarMetrics("ns/c")
    later = Later()
    book = HitBook(metrics, later)
    book.add("t", key(1), value("t"), 0.001)
    text = metrics.render().decode()
    assert 'tenant="t",tier="l1",result="hit"} 1' in text, text
    book.add("t", key(1), value("t"), 0.001)
    assert generate_latest(metrics.registry).count(b'result="hit"') >= 1  # the collector too
    assert metrics.tenants["t"].requests[("l1", "hit")] == 2
    later.run()  # the turn's flush finds nothing left: counted once
    assert metrics.tenants["t"].requests[("l1", "hit")] == 2


def test_the_curves_are_asked_only_about_sampled_keys() -> None:
    metrics = SidecarMetrics("ns/c")
    curves = CountingCurves()
    later = Later()
    book = HitBook(metrics, later, mrc=curves)
    # 64 distinct keys: the sampler tracks at most 16, so its threshold falls.
    for i in range(64):
        book.add("t", key(i << HASH_SHIFT), value("t"), 0.001)
    later.run()
    asked = curves.accesses
    threshold = curves.threshold("t")
    assert threshold < 64
    for i in range(64):
        book.add("t", key(i << HASH_SHIFT), value("t"), 0.001)
    later.run()
    # The second pass asked only about the keys under the threshold (the sampled ones).
    assert curves.accesses - asked == sum(1 for i in range(64) if i < threshold)


def test_keys_under_the_fleet_threshold_reach_the_fleet_samples_by_the_book() -> None:
    """A tenant whose own sampler rate fell below the fleet rate still forwards every key
    under the fleet threshold: the book asks the curves about those too."""
    metrics = SidecarMetrics("ns/c")
    curves = CountingCurves()
    curves.forward_fleet(1 / 2, 10_000)
    later = Later()
    book = HitBook(metrics, later, mrc=curves)
    spread = (1 << 24) // 64  # 64 keys spread over the whole sampling hash space
    for i in range(64):
        book.add("t", key((i * spread) << HASH_SHIFT), value("t"), 0.001)
    later.run()
    assert curves.threshold("t") == curves.fleet_threshold  # its own fell below 1/2
    curves.take_fleet_samples()
    for i in range(64):
        book.add("t", key((i * spread) << HASH_SHIFT), value("t"), 0.001)
    later.run()
    assert len(curves.take_fleet_samples()) == 32  # the keys under 1/2 of the hash space


def test_one_hit_per_turn_counts_what_a_turn_of_the_same_hits_counts() -> None:
    """A lone hit in its turn is counted by a shorter path (:meth:`HitBook._one`):
    the counters, savings, curves and switching observations match a whole turn's."""
    hits = [
        ("t1", key(1 << HASH_SHIFT), value("t1"), 0.001, True),
        ("t1", key(1 << HASH_SHIFT), value("t1", prompt=7), 0.02, True),
        ("t2", key(2 << HASH_SHIFT, model="other"), value("t2", prompt=100), 0.5, True),
        ("t1", key(3 << HASH_SHIFT, model="m"), value("t1", completion=9), 0.003, False),
    ]

    def counted(per_turn: bool) -> tuple[object, ...]:
        metrics, later, curves, engine = (
            SidecarMetrics("ns/c"),
            Later(),
            CountingCurves(),
            SwitchingEngine(),
        )
        observed = []
        book = HitBook(
            metrics,
            later,
            mrc=curves,
            switching=engine,
            prices={"m": (1.0, 2.0)},
            on_observed=lambda: observed.append(1),
        )
        for hit in hits:
            book.add(*hit)
            if per_turn:
                later.run()
        later.run()
        tenants = {
            name: (
                tm.requests,
                tm.latency["l1"].counts,
                round(tm.latency["l1"].sum, 12),
                {
                    m: (s.hits, s.prompt_tokens, s.completion_tokens, s.model_seconds, s.cost)
                    for m, s in tm.saved.items()
                },
            )
            for name, tm in metrics.tenants.items()
        }
        windows = {
            t: (s.window.count, sorted(s.window.samples), s.window.buckets)
            for t, s in engine._tenants.items()
        }
        return tenants, windows, curves.accesses, bool(observed)

    one_by_one = counted(per_turn=True)
    assert one_by_one == counted(per_turn=False)
    assert one_by_one[2] == len(hits)  # every key sampled (a fresh sampler's whole hash space)
    assert one_by_one[1]["t1"][0] == 2  # the unobserved hit is not observed
