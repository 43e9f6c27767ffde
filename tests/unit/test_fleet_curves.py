"""Fleet-wide curves: the sidecars' fleet samples replayed into one SHARDS tracker per tenant.

A key stream round-robined over three pods shows each pod mostly first
accesses (every pod's curve tops out low), while the fleet, whose L2 answers
a key one pod has seen for the others, reuses most of it: the fleet curve
replayed from the forwarded samples must see that reuse.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachefleet_common.contract.fleet import (
    FLEET_SAMPLE_RATE,
    FleetSample,
    decode_fleet_batch,
    encode_fleet_batch,
)
from cachefleet_common.sampling import (
    BUCKETS,
    HASH_SHIFT,
    HASH_SPACE,
    ReuseHistogram,
    ShardsSampler,
)
from cachefleet_operator.curves import HitCurve
from cachefleet_operator.fleet import FleetCurves, _Cache, _Tenant
from cachefleet_operator.metrics_source import tenant_metrics
from cachefleet_sidecar.adapt.mrc import MissRatioCurves

CACHE = "ns/chat"
WINDOW_S = 3600.0
SIZE = 1000


class Clock:
    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def digests(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(128) for _ in range(n)]


def curve_of(histograms: list[ReuseHistogram]) -> HitCurve:
    """The curve Prometheus would give: the pods' histograms summed by bucket."""
    summed = [sum(counts) for counts in zip(*(h.counts for h in histograms), strict=True)]
    made = HitCurve.from_histogram(
        ReuseHistogram(tuple(summed), 0.0, 1.0, 0).cumulative(),
    )
    assert made is not None
    return made


def round_robin(
    keys: list[int], rounds: int, pods: int, rate: float, clock: Clock, step_s: float = 0.001
) -> list[MissRatioCurves]:
    """``rounds`` passes over ``keys``, access i on pod i % pods; every pod forwards at ``rate``."""
    fleet = []
    for _ in range(pods):
        curves = MissRatioCurves(budget_per_s=1e12, clock=clock)
        curves.forward_fleet(rate, 10**9, wall=clock)
        fleet.append(curves)
    i = 0
    for _ in range(rounds):
        for key in keys:
            fleet[i % pods].access("search", key, SIZE)
            clock.now += step_s
            i += 1
    return fleet


Batches = list[tuple[int, list[FleetSample]]]


def ship(pods: list[MissRatioCurves], flush_every: int = 500) -> Batches:
    """Each pod's samples as the stream carries them: batches, pod after pod (not in time order)."""
    batches = []
    for n, pod in enumerate(pods):
        taken = pod.take_fleet_samples()
        for start in range(0, len(taken), flush_every):
            chunk = taken[start : start + flush_every]
            payload = encode_fleet_batch(f"pod-{n}", pod.fleet_threshold, chunk)
            batches.append(decode_fleet_batch(payload))
    return batches


def test_the_fleet_curve_sees_the_reuse_that_round_robin_hides_from_each_pod() -> None:
    clock = Clock()
    keys = digests(3001)  # not a multiple of 3: a key comes back on another pod each round
    pods = round_robin(keys, rounds=4, pods=3, rate=FLEET_SAMPLE_RATE, clock=clock)
    per_pod = curve_of([p.snapshots().__next__()[1] for p in pods])
    # each pod sees each key first once (3 of the 4 accesses), at most 1 in 4 is a hit
    assert per_pod.max_hit_ratio == pytest.approx(0.25, abs=0.02)

    fleet = FleetCurves()
    used = fleet.ingest(CACHE, ship(pods), "1-0")
    assert 0.03 * 4 * len(keys) < used < 0.1 * 4 * len(keys)  # about 1/16 of the accesses
    curve = fleet.curves(CACHE, WINDOW_S)["search"]
    # one shared cache: only the first round is cold
    assert curve.max_hit_ratio == pytest.approx(0.75, abs=0.03)
    assert curve.max_hit_ratio > per_pod.max_hit_ratio + 0.4
    # the estimate of the requests behind it (each sample weighs 16), per second of window
    assert curve.requests * WINDOW_S == pytest.approx(4 * len(keys), rel=0.2)
    # the working set is 3,001 keys of 1 kB: a shared cache of ~3 MB holds it
    assert curve.at(1.5e6) < 0.6
    assert curve.at(4e6) == pytest.approx(0.75, abs=0.03)
    assert fleet.after(CACHE) == "1-0"


def test_batches_read_later_extend_the_same_curve() -> None:
    clock = Clock()
    keys = digests(3001, seed=2)
    fleet = FleetCurves()
    pods = round_robin(keys, rounds=1, pods=3, rate=FLEET_SAMPLE_RATE, clock=clock)
    fleet.ingest(CACHE, ship(pods), "1-0")
    assert fleet.curves(CACHE, WINDOW_S)["search"].max_hit_ratio == 0.0  # all first accesses
    for _ in range(3):  # three more rounds, one rebalance each
        more = round_robin(keys, rounds=1, pods=3, rate=FLEET_SAMPLE_RATE, clock=clock)
        fleet.ingest(CACHE, ship(more), None)
    assert fleet.curves(CACHE, WINDOW_S)["search"].max_hit_ratio == pytest.approx(0.75, abs=0.03)
    assert fleet.after(CACHE) == "1-0"  # None: nothing new read, the place is kept


def test_the_curve_covers_the_window_only() -> None:
    clock = Clock()
    fleet = FleetCurves()
    reused = digests(2000, seed=3)
    fleet.ingest(CACHE, ship(round_robin(reused, 4, 3, FLEET_SAMPLE_RATE, clock)))
    assert fleet.curves(CACHE, 3 * 3600.0)["search"].max_hit_ratio > 0.6
    clock.now += 700.0  # ten minutes later, a scan: nothing comes back
    fleet.ingest(CACHE, ship(round_robin(digests(8000, seed=4), 1, 3, FLEET_SAMPLE_RATE, clock)))
    clock.now += 700.0
    fleet.ingest(CACHE, ship(round_robin(digests(8000, seed=5), 1, 3, FLEET_SAMPLE_RATE, clock)))
    # a window of hours still holds the reuse; one of ten minutes holds the scans only
    assert fleet.curves(CACHE, 3 * 3600.0)["search"].max_hit_ratio > 0.1
    assert fleet.curves(CACHE, 600.0)["search"].max_hit_ratio == 0.0


def test_a_pod_forwarding_fewer_keys_lowers_the_trackers_threshold() -> None:
    clock = Clock()
    keys = digests(4000, seed=6)
    low = round_robin(keys, 2, 1, FLEET_SAMPLE_RATE / 2, clock)
    fleet = FleetCurves()
    fleet.ingest(CACHE, ship(low))
    curve = fleet.curves(CACHE, WINDOW_S)["search"]
    # weighed at the rate that pod used (1/32), not the tracker's (1/16)
    assert curve.requests * WINDOW_S == pytest.approx(2 * len(keys), rel=0.25)
    assert curve.max_hit_ratio == pytest.approx(0.5, abs=0.05)


def test_only_the_named_tenants_are_tracked_and_the_rest_bounded() -> None:
    clock = Clock()
    fleet = FleetCurves(max_tenants=1)
    samples = [FleetSample(t, d >> 64, SIZE, clock.now) for t in ("a", "b") for d in digests(500)]
    fleet.ingest(CACHE, [(HASH_SPACE, samples)], tenants={"a", "b"})
    assert set(fleet.curves(CACHE, WINDOW_S)) == {"a"}
    assert fleet.ignored == 500
    fleet.ingest(CACHE, [(HASH_SPACE, samples)], tenants={"b"})  # "a" left the spec
    assert set(fleet.curves(CACHE, WINDOW_S)) == {"b"}
    fleet.forget(CACHE)
    assert fleet.curves(CACHE, WINDOW_S) == {}


def test_a_batch_round_trips_and_garbage_is_refused() -> None:
    digest = (123 << 64) | 5
    payload = encode_fleet_batch("pod-a", 4096, [("search", digest, 700, 1000.25)])
    threshold, samples = decode_fleet_batch(payload)
    assert threshold == 4096
    assert samples == [FleetSample("search", 123, 700, 1000.25)]
    for bad in (b"{", b"[]", b'{"thr": 1, "t0": 0, "s": {"a b": [1, 2, 3]}}', b'{"thr": 1}'):
        with pytest.raises(ValueError):
            decode_fleet_batch(bad)


def test_the_sidecar_forwards_sampled_keys_only_within_its_bound() -> None:
    clock = Clock()
    curves = MissRatioCurves(clock=clock)
    assert curves.fleet_threshold == 0
    curves.access("search", 0, SIZE)
    assert curves.take_fleet_samples() == []  # not forwarding: nothing kept
    curves.forward_fleet(FLEET_SAMPLE_RATE, 3, wall=clock)
    threshold = curves.fleet_threshold
    below = [(h << HASH_SHIFT) for h in (0, 1, threshold - 1)]
    above = [(h << HASH_SHIFT) for h in (threshold, HASH_SPACE - 1)]
    for digest in above + below + below:
        curves.access("search", digest, SIZE)
    taken = curves.take_fleet_samples()
    assert [d for _, d, _, _ in taken] == below  # the next three found the buffer full
    assert curves.fleet_dropped == 3
    assert curves.take_fleet_samples() == []
    curves.limit_to(frozenset({"other"}))
    curves.access("search", 0, SIZE)  # a tenant the sidecar does not measure
    assert curves.take_fleet_samples() == []
    with pytest.raises(ValueError):
        curves.forward_fleet(1.5, 10)


def test_many_tenants_share_one_budget_of_keys() -> None:
    clock = Clock()
    fleet = FleetCurves(max_samples=512, rate=1.0, key_budget=1000)
    keys = digests(4000, seed=7)
    one = [FleetSample("a", d >> 64, SIZE, clock.now) for d in keys]
    fleet.ingest(CACHE, [(HASH_SPACE, one)], tenants={"a"})
    alone = fleet.curves(CACHE, WINDOW_S)["a"]
    assert alone.requests * WINDOW_S == pytest.approx(4000, rel=0.2)  # 512 keys: rate ~1/8
    # four tenants now: each may keep 250 keys, "a" gives the rest up at once
    others = [FleetSample(t, d >> 64, SIZE, clock.now) for t in "bcd" for d in keys[:300]]
    fleet.ingest(CACHE, [(HASH_SPACE, others)], tenants={"a", "b", "c", "d"})
    state = fleet._caches[CACHE]
    assert [len(state.tenants[t].sampler) for t in "abcd"] == [250] * 4
    assert state.tenants["a"].sampler.rate < 250 / 4000 * 1.3


def windowed_one_by_one(
    history: list[tuple[float, tuple[float, ...]]], window_s: float
) -> HitCurve | None:
    """What a tenant's fleet curve was before the table: its own loop and HitCurve."""
    if len(history) < 2:
        return None
    now, counts = history[-1]
    while len(history) > 2 and history[1][0] <= now - window_s:
        history.pop(0)
    base = history[0][1]
    delta = [max(0.0, c - b) for c, b in zip(counts, base, strict=True)]
    cumulative, acc = [], 0.0
    for bound, count in zip((*BUCKETS, math.inf), delta, strict=True):
        acc += count / window_s
        cumulative.append((bound, acc))
    return HitCurve.from_histogram(cumulative)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_the_fleet_table_is_each_tenants_curve_bit_for_bit(data: st.DataObject) -> None:
    fleet = FleetCurves()
    state = fleet._caches.setdefault(CACHE, _Cache())
    expected: dict[str, HitCurve] = {}
    count = st.sampled_from([0.0, 1.0, 3.0, 17.0, 250.0])
    window_s = data.draw(st.sampled_from([60.0, 600.0, 3600.0]))
    for i in range(data.draw(st.integers(0, 6))):
        snapshots = []
        for k in range(data.draw(st.integers(0, 4))):
            counts = data.draw(
                st.lists(count, min_size=len(BUCKETS) + 1, max_size=len(BUCKETS) + 1)
            )
            snapshots.append((1000.0 + 400.0 * k, tuple(counts)))
        tracked = state.tenants[f"t{i}"] = _Tenant(ShardsSampler(16, FLEET_SAMPLE_RATE))
        tracked.history.extend(snapshots)
        made = windowed_one_by_one(list(snapshots), window_s)
        if made is not None:
            expected[f"t{i}"] = made
    assert fleet.curves(CACHE, window_s) == expected
    # and as columns that metrics read from Prometheus take: the curves' table
    names, table = fleet.table(CACHE, window_s)
    read = tenant_metrics({"t0": 0.1, "t3": 0.2, "other": 0.3}, {}, {}, {}, {}, {}, {})
    with_rows = read.with_fleet_rows(names, table)
    assert dict(with_rows) == {
        name: dataclasses.replace(m, fleet_curve=expected.get(name)) for name, m in read.items()
    }
    assert (with_rows.fleet is None) == (not expected.keys() & {"t0", "t3"})
