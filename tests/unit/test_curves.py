"""Curves the allocator reads: hit ratio by size, latency quantiles, the p95 of a mix."""

from __future__ import annotations

import math
from bisect import bisect_left

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachefleet_operator.allocation import MetricsTable, TenantDemand, TenantMetrics, allocate
from cachefleet_operator.curves import (
    CurveTable,
    HitCurve,
    LatencyDist,
    LatencyTable,
    _bisect,
    needed_hit_ratio_for,
    predicted_p95,
)
from cachefleet_operator.metrics_source import tenant_metrics

INF = math.inf


def test_a_hit_curve_interpolates_and_saturates() -> None:
    curve = HitCurve.from_histogram([(1000.0, 10.0), (2000.0, 30.0), (INF, 100.0)])
    assert curve is not None
    assert curve.at(0) == 0.0
    assert curve.at(500) == pytest.approx(0.05)
    assert curve.at(1500) == pytest.approx(0.2)
    assert curve.at(10**9) == pytest.approx(0.3)
    assert curve.cold_ratio == pytest.approx(0.7)


def test_the_true_total_corrects_sampling_like_shards_adj() -> None:
    # the sample saw 100 requests; 120 really happened: 20 more hits at the smallest size
    curve = HitCurve.from_histogram([(1000.0, 10.0), (INF, 100.0)], total_requests=120.0)
    assert curve is not None
    assert curve.at(1000) == pytest.approx(30 / 120)
    assert curve.requests == 120.0


def test_dented_buckets_are_made_monotone_and_empty_ones_give_no_curve() -> None:
    curve = HitCurve.from_histogram([(1000.0, 10.0), (2000.0, 9.0), (INF, 20.0)])
    assert curve is not None
    assert curve.at(2000) == pytest.approx(0.5)
    assert HitCurve.from_histogram([(1000.0, 0.0), (INF, 0.0)]) is None
    assert HitCurve.from_histogram([(1000.0, 5.0)]) is None  # no +Inf


def test_the_hull_bridges_a_cliff() -> None:
    curve = HitCurve.from_histogram([(900.0, 0.0), (1000.0, 80.0), (INF, 100.0)])
    assert curve is not None
    hull = curve.hull([0.0, 500.0, 900.0, 1000.0, 2000.0])
    assert [x for x, _ in hull] == [0.0, 1000.0, 2000.0]


def test_latency_quantiles_match_histogram_quantile() -> None:
    dist = LatencyDist.from_buckets([(0.1, 50.0), (0.5, 90.0), (1.0, 100.0), (INF, 100.0)])
    assert dist is not None
    assert dist.quantile(0.5) == pytest.approx(0.1)
    assert dist.quantile(0.7) == pytest.approx(0.3)
    assert dist.quantile(0.95) == pytest.approx(0.75)
    assert dist.mean() == pytest.approx((50 * 0.05 + 40 * 0.3 + 10 * 0.75) / 100)


def test_predicted_p95_falls_as_the_hit_ratio_rises() -> None:
    hits = LatencyDist.from_buckets([(0.001, 100.0), (INF, 100.0)])
    misses = LatencyDist.from_buckets([(0.5, 0.0), (1.0, 100.0), (INF, 100.0)])
    p95s = [predicted_p95(h, hits, misses) for h in (0.0, 0.5, 0.9, 0.96)]
    assert p95s[0] == pytest.approx(0.975)
    assert p95s[0] > p95s[1] > p95s[2] >= 0.5
    assert p95s[3] is not None
    assert p95s[3] <= 0.001
    assert predicted_p95(0.5, hits, None) is None


def test_tenant_metrics_are_assembled_from_query_results() -> None:
    out = tenant_metrics(
        p95={"a": 0.2},
        hit={"a": 0.5},
        rps={"a": 10.0, "b": 1.0},
        reuse={"a": [(1000.0, 5.0), (INF, 10.0)]},
        upstream={"a": [(0.5, 1.0), (INF, 1.0)]},
        hits={},
        lookups={"a": 10.0},
    )
    assert set(out) == {"a", "b"}
    assert out["a"].curve is not None
    assert out["a"].curve.at(1000) == pytest.approx(0.5)
    assert out["a"].miss_latency is not None
    assert out["a"].hit_latency is None
    assert out["b"].curve is None


def test_the_hit_ratio_that_meets_a_p95_target_is_the_one_the_mix_predicts() -> None:
    hits = LatencyDist.from_buckets([(0.001, 100.0), (INF, 100.0)])
    misses = LatencyDist.from_buckets([(0.5, 0.0), (1.0, 100.0), (INF, 100.0)])
    assert hits is not None
    assert misses is not None
    need = needed_hit_ratio_for(0.75, hits, misses)  # half the misses are within 0.75 s
    assert need == pytest.approx(0.9)
    assert predicted_p95(need, hits, misses) == pytest.approx(0.75)
    assert needed_hit_ratio_for(2.0, hits, misses) == 0.0  # every miss is in time
    assert needed_hit_ratio_for(0.0005, hits, misses) is None  # even hits are too slow


def test_query_results_are_grouped_and_malformed_samples_skipped() -> None:
    from cachefleet_operator.metrics_source import _buckets_by_tenant, _by_tenant_policy

    result = [
        {"metric": {"tenant": "a", "le": "1000.0"}, "value": [0, "5"]},
        {"metric": {"tenant": "a", "le": "+Inf"}, "value": [0, "10"]},
        {"metric": {"tenant": "a", "le": "bogus"}, "value": [0, "3"]},
        {"metric": {"le": "1.0"}, "value": [0, "3"]},  # no tenant
        {"metric": {"tenant": "b", "le": "1.0"}, "value": [0, "NaN"]},
    ]
    assert _buckets_by_tenant(result) == {"a": [(1000.0, 5.0), (INF, 10.0)]}
    sims = [
        {"metric": {"tenant": "a", "policy": "lirs", "size_bytes": "100"}, "value": [0, "2"]},
        {"metric": {"tenant": "a", "policy": "sits", "size_bytes": "100"}, "value": [0, "1"]},
    ]
    assert _by_tenant_policy(sims, "size_bytes") == {
        "a": {"lirs": [(100.0, 2.0)], "sits": [(100.0, 1.0)]}
    }


@st.composite
def ragged_curves(draw: st.DrawFn) -> list[HitCurve | None]:
    """Curves of different lengths (some with the same points), and no curve at all."""
    out: list[HitCurve | None] = []
    for _ in range(draw(st.integers(1, 8))):
        if draw(st.booleans()) and out:
            out.append(draw(st.sampled_from(out)))
            continue
        xs = sorted(draw(st.lists(st.floats(1.0, 1e9), min_size=1, max_size=7, unique=True)))
        ys = sorted(draw(st.lists(st.floats(0.0, 1.0), min_size=len(xs), max_size=len(xs))))
        buckets = [(x, y * 1e3) for x, y in zip(xs, ys, strict=True)] + [(math.inf, 1e3)]
        out.append(None if draw(st.booleans()) else HitCurve.from_histogram(buckets))
    return out


sizes = st.one_of(st.floats(-1.0, 2e9), st.sampled_from([0.0, math.inf]))


@settings(max_examples=200, deadline=None)
@given(ragged_curves(), st.data())
def test_a_curve_table_answers_what_each_curve_answers(
    curves: list[HitCurve | None], data: st.DataObject
) -> None:
    """``at`` and ``size_for`` of the table, row by row, bit for bit, against the scalar code."""
    table = CurveTable(curves)
    n = len(curves)
    at = np.array(data.draw(st.lists(sizes, min_size=n, max_size=n)))
    got = table.at(at)
    for i, c in enumerate(curves):
        want = 0.0 if c is None else c.at(float(at[i]))
        assert got[i] == want, i
    # the size that reaches a hit ratio is where the curve reaches it, and nowhere earlier
    hit = np.array(data.draw(st.lists(st.floats(-0.1, 1.1), min_size=n, max_size=n)))
    size = table.size_for(hit)
    for i, c in enumerate(curves):
        if c is None or hit[i] <= 0.0:
            continue
        if math.isnan(size[i]):
            assert c.max_hit_ratio < hit[i] - 1e-12
        else:
            # reached within the size's own rounding (a 1-byte bucket at 1e9 bytes is 1e-9 wide)
            assert c.at(float(size[i]) * (1 + 1e-12)) >= hit[i] - 1e-9
            k = bisect_left(c.ys, float(hit[i]) - 1e-12)  # the first point reaching it
            assert size[i] <= c.xs[k] * (1 + 1e-12)  # interpolation may round up


@settings(max_examples=200, deadline=None)
@given(ragged_curves(), st.data())
def test_bisecting_table_rows_counts_what_comparing_every_cell_counts(
    curves: list[HitCurve | None], data: st.DataObject
) -> None:
    table = CurveTable(curves)
    n = len(curves)
    values = np.array(data.draw(st.lists(sizes | st.just(math.nan), min_size=n, max_size=n)))
    for right in (True, False):
        below = table.xs <= values[:, None] if right else table.xs < values[:, None]
        assert (_bisect(table.xs, values, right=right) == np.count_nonzero(below, axis=1)).all()
    ends = table.length
    hits = np.array(data.draw(st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n)))
    inside = np.arange(table.ys.shape[1])[None, :] < ends[:, None]
    counted = np.count_nonzero((table.ys < hits[:, None]) & inside, axis=1)
    assert (_bisect(table.ys, hits, right=False, ends=ends) == counted).all()


@settings(max_examples=200, deadline=None)
@given(ragged_curves(), st.data())
def test_rows_taken_from_a_curve_table_are_the_table_of_those_curves(
    curves: list[HitCurve | None], data: st.DataObject
) -> None:
    """``take`` (some rows, in any order, -1 for none) answers what a table of the taken
    curves answers, and each row read back as a curve is the curve it was made from."""
    table = CurveTable(curves)
    index = data.draw(st.lists(st.integers(-1, len(curves) - 1), min_size=1, max_size=10))
    chosen = [None if i < 0 else curves[i] for i in index]
    taken, fresh = table.take(np.array(index, dtype=np.int64)), CurveTable(chosen)
    at = np.array(data.draw(st.lists(sizes, min_size=len(index), max_size=len(index))))
    assert taken.at(at).tolist() == fresh.at(at).tolist()
    hit = np.array(
        data.draw(st.lists(st.floats(0.0, 1.0), min_size=len(index), max_size=len(index)))
    )
    np.testing.assert_array_equal(taken.size_for(hit), fresh.size_for(hit))
    for column in ("present", "length", "max_hit", "footprint", "cold", "requests"):
        np.testing.assert_array_equal(getattr(taken, column), getattr(fresh, column))
    assert [taken.curve(k) for k in range(len(index))] == chosen


def test_rows_taken_from_a_latency_table_answer_as_a_table_of_those_histograms() -> None:
    fast = LatencyDist.from_buckets([(0.1, 5.0), (0.2, 10.0), (INF, 10.0)])
    slow = LatencyDist.from_buckets([(1.0, 1.0), (2.0, 3.0), (4.0, 8.0), (INF, 9.0)])
    dists = [fast, None, slow]
    index = np.array([2, -1, 0, 1, 2])
    seconds = np.array([1.5, 0.1, 0.15, 3.0, 5.0])
    taken = LatencyTable(dists).take(index)
    fresh = LatencyTable([None if i < 0 else dists[i] for i in index])
    np.testing.assert_array_equal(taken.cdf(seconds), fresh.cdf(seconds))
    np.testing.assert_array_equal(taken.mean, fresh.mean)
    assert taken.present.tolist() == [True, False, True, False, True]


def tenant_metrics_one_by_one(
    p95: dict[str, float],
    hit: dict[str, float],
    rps: dict[str, float],
    reuse: dict[str, list[tuple[float, float]]],
    upstream: dict[str, list[tuple[float, float]]],
    hits: dict[str, list[tuple[float, float]]],
    lookups: dict[str, float],
    cold_bytes: dict[str, float],
    policy_hits: dict[str, dict[str, list[tuple[float, float]]]],
    policy_requests: dict[str, dict[str, float]],
) -> dict[str, TenantMetrics]:
    """What tenant_metrics made before its columns: each tenant's objects, one by one."""
    out = {}
    for t in dict.fromkeys([*p95, *hit, *rps]):
        footprint = cold_bytes.get(t)
        curve = HitCurve.from_histogram(reuse[t], lookups.get(t), footprint) if t in reuse else None
        by_policy = policy_requests.get(t) or {}
        if by_policy:
            policy = max(by_policy, key=lambda name: by_policy[name])
            simulated = HitCurve.from_hits(
                (policy_hits.get(t) or {}).get(policy, []),
                by_policy[policy],
                cold_ratio=None if curve is None else curve.cold_ratio,
                footprint_bytes=footprint,
            )
            curve = simulated or curve
        out[t] = TenantMetrics(
            p95_s=p95.get(t),
            hit_ratio=hit.get(t),
            rps=rps.get(t),
            curve=curve,
            miss_latency=LatencyDist.from_buckets(upstream[t]) if t in upstream else None,
            hit_latency=LatencyDist.from_buckets(hits[t]) if t in hits else None,
        )
    return out


BOUNDS = [1e3, 1e4, 1e5, 1e6, INF]


@st.composite
def histograms(draw: st.DrawFn) -> list[tuple[float, float]]:
    """Cumulative buckets, mostly on the shared bounds (in any order), some not; counts
    with rate() dents, zeros, now and then a NaN."""
    kind = draw(st.sampled_from(["shared", "shared", "shared", "own", "no +Inf", "nan"]))
    own = sorted(set(draw(st.lists(st.floats(1.0, 1e7), max_size=4))))
    bounds = BOUNDS if kind != "own" else [*own, INF]
    if kind == "no +Inf":
        bounds = BOUNDS[:-1]
    counts = draw(
        st.lists(
            st.sampled_from([0.0, 1.0, 2.5, 7.0, 10.0, 40.0, 100.0]),
            min_size=len(bounds),
            max_size=len(bounds),
        )
    )
    counts = sorted(counts) if draw(st.booleans()) else counts
    if kind == "nan":
        counts[draw(st.integers(0, len(counts) - 1))] = math.nan
    pairs = list(zip(bounds, counts, strict=True))
    return draw(st.permutations(pairs)) if draw(st.booleans()) else pairs


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_tenant_metrics_as_columns_are_what_each_tenants_objects_were(data: st.DataObject) -> None:
    names = [f"t{i}" for i in range(data.draw(st.integers(0, 12)))]
    some = st.lists(st.sampled_from(names), unique=True) if names else st.just([])
    values = st.floats(0.0, 10.0)
    p95 = {t: data.draw(values) for t in data.draw(some)}
    hit = {t: data.draw(values) for t in data.draw(some)}
    rps = {t: data.draw(values) for t in names if t not in p95 and t not in hit}
    reuse = {t: data.draw(histograms()) for t in data.draw(some)}
    upstream = {t: data.draw(histograms()) for t in data.draw(some)}
    hits = {t: data.draw(histograms()) for t in data.draw(some)}
    lookups = {
        t: data.draw(st.sampled_from([0.0, 5.0, 50.0, 1e3, math.nan])) for t in data.draw(some)
    }
    cold = {t: data.draw(st.floats(0.0, 1e9)) for t in data.draw(some)}
    requests = {
        t: {"lirs": data.draw(st.sampled_from([0.0, 10.0, 100.0]))} for t in data.draw(some)
    }
    sims = {t: {"lirs": [(1e3, 3.0), (1e5, 8.0)]} for t in data.draw(some)}
    args = (p95, hit, rps, reuse, upstream, hits, lookups, cold, sims, requests)
    table = tenant_metrics(*args)
    expected = tenant_metrics_one_by_one(*args)
    assert list(table) == list(expected)
    assert dict(table) == expected
    # and the columns are the objects' (allocation reads the columns)
    tenants = [TenantDemand(t, p95_target_s=0.5, min_hit_ratio=0.3) for t in names]
    got = allocate(tenants, table, None, 10**6, 10**7)
    want = allocate(tenants, MetricsTable(expected), None, 10**6, 10**7)
    assert [(*t[:9], t.cannot_meet, t.predicted_hit_ratio) for t in got.tenants] == [
        (*t[:9], t.cannot_meet, t.predicted_hit_ratio) for t in want.tenants
    ]
    for column in ("footprint", "cold", "requests", "max_hit", "length"):
        np.testing.assert_array_equal(
            getattr(table.curves, column), getattr(MetricsTable(expected).curves, column)
        )
    np.testing.assert_array_equal(table.misses.mean, MetricsTable(expected).misses.mean)
