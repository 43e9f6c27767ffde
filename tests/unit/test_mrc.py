"""Online miss-ratio curves: SHARDS against exact LRU, fixed size, the cost budget, mini-sims."""

from __future__ import annotations

import math
import random

import pytest
import xxhash

from cachefleet_common.sampling import BUCKETS, ShardsSampler, hit_ratio_at
from cachefleet_sidecar.adapt.mrc import MissRatioCurves
from cachefleet_sidecar.observe.metrics import reuse_families
from cachefleet_sidecar.policies import make_policy

SIZES = (256 * 1024, 1024 * 1024, 4 * 1024 * 1024)


def zipf_trace(n_keys: int, alpha: float, length: int, seed: int) -> list[tuple[int, int]]:
    """(digest, bytes) accesses with Zipf popularity and sizes from 1 to 3 KB."""
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) ** alpha for i in range(n_keys)]
    keys = rng.choices(range(n_keys), weights, k=length)
    return [(xxhash.xxh3_128_intdigest(b"k%d" % k), 1000 + (k % 5) * 500) for k in keys]


def exact_hit_ratio(policy: str, trace: list[tuple[int, int]], capacity: int) -> float:
    cache = make_policy(policy, capacity)
    hits = 0
    for digest, size in trace:
        if cache.get(digest) is not None:
            hits += 1
        else:
            cache.put(digest, True, size)
    return hits / len(trace)


def test_at_full_rate_the_curve_is_exact_lru() -> None:
    trace = zipf_trace(3000, 0.9, 40_000, seed=1)
    sampler = ShardsSampler(max_samples=10_000)
    for digest, size in trace:
        sampler.access(digest, size)
    assert sampler.rate == 1.0
    for capacity in SIZES:
        predicted = hit_ratio_at(sampler.snapshot(), capacity)
        # exact up to interpolation inside a bucket (half-powers of two)
        assert predicted == pytest.approx(exact_hit_ratio("lru", trace, capacity), abs=0.03)


def test_first_accesses_are_only_in_the_inf_bucket() -> None:
    sampler = ShardsSampler()
    for n in range(500):
        sampler.access(xxhash.xxh3_128_intdigest(b"%d" % n), 1000)
    snap = sampler.snapshot()
    assert sum(snap.counts[:-1]) == 0.0
    assert snap.counts[-1] == 500.0
    assert hit_ratio_at(snap, 10**12) == 0.0


def test_fixed_size_bounds_the_keys_and_the_estimate_stays_close() -> None:
    trace = zipf_trace(20_000, 0.9, 150_000, seed=2)
    sampler = ShardsSampler(max_samples=1024)
    for digest, size in trace:
        sampler.access(digest, size)
    snap = sampler.snapshot()
    assert snap.tracked <= 1024
    assert snap.rate < 0.2
    # the +Inf bucket estimates the number of requests (roughly: hot keys weigh a lot)
    assert sum(snap.counts) == pytest.approx(len(trace), rel=0.3)
    # corrected with the true total as the operator does (SHARDS-adj)
    counts = list(snap.counts)
    counts[0] += len(trace) - sum(counts)
    cumulative, acc = [], 0.0
    for bound, count in zip((*BUCKETS, float("inf")), counts, strict=True):
        acc += count
        cumulative.append((bound, acc))
    for capacity in SIZES:
        exact = exact_hit_ratio("lru", trace, capacity)
        assert hit_ratio_at(cumulative, capacity) == pytest.approx(exact, abs=0.08)


def sampling_rates(curves: MissRatioCurves) -> dict[str, float]:
    return {tenant: snap.rate for tenant, snap in curves.snapshots()}


def test_the_budget_halves_the_rate_of_a_hot_tenant_and_spares_a_quiet_one() -> None:
    now = [0.0]
    curves = MissRatioCurves(max_samples=4096, budget_per_s=1000.0, clock=lambda: now[0])
    keys = [xxhash.xxh3_128_intdigest(b"%d" % n) for n in range(2000)]
    for i in range(20_000):  # the hot tenant: 20,000 accesses in one second, 20x the budget
        now[0] = i / 20_000
        curves.access("hot", keys[i % 2000], 100)
        if i % 100 == 0:  # the quiet one: 200 in the same second
            curves.access("quiet", keys[i % 1000], 100)
    rates = sampling_rates(curves)
    assert rates["hot"] <= 0.125
    assert rates["quiet"] == 1.0
    calm = MissRatioCurves(max_samples=4096, budget_per_s=1000.0, clock=lambda: now[0])
    for i in range(20_000):  # the same accesses over 100 seconds: under budget
        now[0] = i / 200
        calm.access("hot", keys[i % 2000], 100)
    assert sampling_rates(calm)["hot"] == 1.0


def test_curves_are_per_tenant_and_exported_as_a_histogram() -> None:
    curves = MissRatioCurves(max_samples=64)
    for n in range(100):
        curves.access("a", xxhash.xxh3_128_intdigest(b"%d" % (n % 10)), 1000)
    curves.access("b", 12345 << 64, 10)
    families = {f.name: f for f in reuse_families("ns/c", curves)}
    hist = families["cachefleet_reuse_distance_bytes"]
    by_tenant: dict[str, dict[str, float]] = {}
    for sample in hist.samples:
        if sample.name.endswith("_bucket"):
            by_tenant.setdefault(sample.labels["tenant"], {})[sample.labels["le"]] = sample.value
    assert by_tenant["a"]["+Inf"] == 100.0
    # ten keys of 1,000 bytes: every reuse needs 10,000 bytes at most
    assert by_tenant["a"]["11585.0"] == 90.0
    assert by_tenant["b"]["+Inf"] == 1.0
    curves.forget("b")
    assert curves.tenants() == ("a",)


def test_a_mini_simulation_estimates_the_tenants_own_policy() -> None:
    trace = zipf_trace(20_000, 0.9, 120_000, seed=3)
    curves = MissRatioCurves(
        max_samples=4096, budget_per_s=math.inf, policy_sizes=SIZES, default_policy="lru"
    )
    curves.set_policy("t", "lirs")
    for digest, size in trace:
        curves.access("t", digest, size)
        curves.access("plain", digest, size)
    sims = dict(curves.policy_curves())
    assert set(sims) == {"t"}  # an LRU tenant needs none: its histogram is exact for LRU
    sim = sims["t"]
    assert sim.policy == "lirs"
    for capacity, hits in zip(SIZES, sim.hits, strict=True):
        exact = exact_hit_ratio("lirs", trace, capacity)
        assert hits / sim.requests == pytest.approx(exact, abs=0.05)
    # a policy change restarts the simulation of the new policy
    curves.set_policy("t", None)
    assert dict(curves.policy_curves()) == {}


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="max_samples"):
        ShardsSampler(max_samples=0)
    with pytest.raises(ValueError, match="max_rate"):
        ShardsSampler(max_rate=0.0)
    with pytest.raises(ValueError, match="max_rate"):
        MissRatioCurves(max_rate=1.5)
    with pytest.raises(ValueError, match="budget"):
        MissRatioCurves(budget_per_s=0.0)


def test_only_known_tenants_are_measured_when_the_sidecar_knows_its_tenants() -> None:
    curves = MissRatioCurves()
    curves.access("junk", 1 << 64, 100)
    curves.limit_to(frozenset({"real"}))
    assert curves.tenants() == ()  # the made-up tenant's state went
    for n in range(50):
        curves.access(f"junk-{n}", (n + 1) << 64, 100)
    curves.access("real", 7 << 64, 100)
    assert curves.tenants() == ("real",)
    curves.limit_to(None)
    curves.access("open", 9 << 64, 100)
    assert set(curves.tenants()) == {"real", "open"}
