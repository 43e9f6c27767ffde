"""L2 bytes by gain on the fleet-wide curves, not by the L1 shares.

Two tenants alike per pod (same L1 curve, traffic and miss cost: equal L1
shares) differ fleet-wide: one's keys come back on other pods (its fleet
curve gains with L2 bytes), the other's never do. L2 goes where it gains.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachefleet_bench.allocation import workload as bench_workload
from cachefleet_common.sampling import BUCKETS
from cachefleet_operator.allocation import (
    PriorityClass,
    TenantDemand,
    TenantMetrics,
    allocate,
    hold,
)
from cachefleet_operator.allocation import greedy as greedy_grant
from cachefleet_operator.allocation import l2 as l2_split
from cachefleet_operator.allocation import level as level_search
from cachefleet_operator.curves import CurveTable, FloatArray, HitCurve, LatencyDist, LatencyTable

L1 = 8 * 2**30
L2 = 64 * 2**30


def curve(points: list[tuple[float, float]], rate: float = 50.0) -> HitCurve:
    """A curve from (bytes, hit ratio) points, ``rate`` requests per second behind it."""
    made = HitCurve.from_histogram([(b, h * rate) for b, h in points] + [(math.inf, rate)])
    assert made is not None
    return made


def misses() -> LatencyDist:
    made = LatencyDist.from_buckets([(0.999, 0.0), (1.0, 100.0), (math.inf, 100.0)])
    assert made is not None
    return made


PER_POD = curve([(0.25 * L1, 0.2), (0.5 * L1, 0.3)])
#: Fleet-wide reuse that pays off up to 3/4 of L2.
GAINS = curve([(0.25 * L2, 0.4), (0.75 * L2, 0.8)])
#: No key ever comes back anywhere in the fleet.
SCAN = curve([(0.25 * L2, 0.0), (0.75 * L2, 0.0)])


def demands(min_share: float = 0.1) -> list[TenantDemand]:
    return [
        TenantDemand("reuser", PriorityClass.STANDARD, min_share, 1.0),
        TenantDemand("scanner", PriorityClass.STANDARD, min_share, 1.0),
    ]


def metrics(reuser: HitCurve | None, scanner: HitCurve | None) -> dict[str, TenantMetrics]:
    def one(fleet: HitCurve | None) -> TenantMetrics:
        return TenantMetrics(
            hit_ratio=0.3, rps=50.0, curve=PER_POD, miss_latency=misses(), fleet_curve=fleet
        )

    return {"reuser": one(reuser), "scanner": one(scanner)}


def test_l2_goes_to_the_tenant_whose_fleet_curve_gains() -> None:
    allocation = allocate(demands(), metrics(GAINS, SCAN), None, L1, L2)
    reuser, scanner = allocation.tenants
    assert reuser.share == pytest.approx(scanner.share)  # alike per pod: equal L1
    assert reuser.l1_bytes == pytest.approx(scanner.l1_bytes, abs=1)
    # the scanner keeps its floor (minShare holds in L2 too); the rest goes to the gain
    assert scanner.l2_bytes == pytest.approx(0.1 * L2, abs=1)
    assert reuser.l2_bytes == pytest.approx(0.9 * L2, abs=1)
    assert reuser.l2_bytes + scanner.l2_bytes <= L2


def test_l2_follows_the_l1_shares_without_fleet_curves() -> None:
    allocation = allocate(demands(), metrics(None, None), None, L1, L2)
    for t in allocation.tenants:
        assert t.l2_bytes == math.floor(t.share * L2)


def test_a_tenant_without_a_fleet_curve_yet_keeps_its_l1_share_of_l2() -> None:
    allocation = allocate(demands(), metrics(GAINS, None), None, L1, L2)
    reuser, scanner = allocation.tenants
    assert scanner.l2_bytes == math.floor(scanner.share * L2)
    assert reuser.l2_bytes == pytest.approx((1.0 - scanner.share) * L2, abs=2)


def test_the_gain_is_weighed_like_l1_by_a_tenants_value() -> None:
    """Both gain alike fleet-wide until 1/2 of L2, but one of them is worth twice as much."""
    half = curve([(0.5 * L2, 0.6)])
    ms = metrics(half, half)
    ms["scanner"] = TenantMetrics(
        hit_ratio=0.3, rps=100.0, curve=PER_POD, miss_latency=misses(), fleet_curve=half
    )
    allocation = allocate(demands(min_share=0.0), ms, None, L1, L2)
    by = allocation.by_name()
    assert by["scanner"].l2_bytes == pytest.approx(0.5 * L2, abs=1)
    assert by["reuser"].l2_bytes == pytest.approx(0.5 * L2, abs=1)
    # with L2 too small for both, the more valuable one is served first
    small = allocate(demands(min_share=0.0), ms, None, L1, L2 // 4)
    assert small.by_name()["scanner"].l2_bytes == pytest.approx(L2 // 4, abs=1)
    assert small.by_name()["reuser"].l2_bytes == 0


def test_holding_the_shares_keeps_l2_with_them() -> None:
    held = hold(demands(), {"reuser": 0.5, "scanner": 0.5}, L1, L2)
    assert [t.l2_bytes for t in held.tenants] == [L2 // 2, L2 // 2]


def test_holding_keeps_the_l2_bytes_in_force_that_went_by_the_fleet_curves() -> None:
    """Metrics unavailable: L2 bytes that the fleet curves placed stay where they are
    (within bounds), not back to the L1 shares; a tenant without any gets its share."""
    in_force = {"reuser": int(0.9 * L2), "scanner": int(0.1 * L2)}
    held = hold(demands(), {"reuser": 0.5, "scanner": 0.5}, L1, L2, in_force)
    assert [t.l2_bytes for t in held.tenants] == [in_force["reuser"], in_force["scanner"]]
    assert [t.l1_bytes for t in held.tenants] == [L1 // 2, L1 // 2]
    partly = hold(demands(), {"reuser": 0.5, "scanner": 0.5}, L1, L2, {"reuser": L2 // 4})
    assert [t.l2_bytes for t in partly.tenants] == [L2 // 4, L2 // 2]
    # a floor raised above the bytes kept: brought up to it
    raised = hold(demands(min_share=0.2), {"reuser": 0.5, "scanner": 0.5}, L1, L2, in_force)
    assert raised.by_name()["scanner"].l2_bytes == pytest.approx(0.2 * L2, abs=1)


def knee_of(made: HitCurve | None) -> float:
    """Where the curve stops rising: the first point at its best."""
    assert made is not None
    return made.xs[made.ys.index(made.max_hit_ratio)]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_an_l2_that_holds_every_curve_gives_what_the_greedy_would(seed: int) -> None:
    """Ample L2 takes a shortcut (each curve up to where it stops rising); just short of
    that, the greedy runs: the two must meet at the boundary."""
    rng = random.Random(seed)
    tenants, ms = [], {}
    for i in range(20):
        name = f"t{i}"
        tenants.append(TenantDemand(name, rng.choice(list(PriorityClass)), 0.0, 1.0))
        knee = rng.uniform(0.5, 4.0) * 2**20
        points = [(knee * f, rng.uniform(0.2, 0.9) * f) for f in (0.25, 0.5, 1.0)]
        ms[name] = TenantMetrics(
            hit_ratio=0.3,
            rps=rng.uniform(1.0, 100.0),
            curve=PER_POD,
            miss_latency=misses(),
            fleet_curve=curve(points),
        )
    knees = {name: knee_of(m.fleet_curve) for name, m in ms.items()}
    total = sum(knees.values())
    fits = allocate(tenants, ms, None, L1, int(total * 1.0001))  # the shortcut
    for t in fits.tenants:
        assert t.l2_bytes == pytest.approx(knees[t.name], rel=0.001)
    short = allocate(tenants, ms, None, L1, int(total * 0.995))  # the greedy
    assert sum(t.l2_bytes for t in short.tenants) == pytest.approx(total * 0.995, rel=1e-6)
    for a, b in zip(fits.tenants, short.tenants, strict=True):
        assert b.l2_bytes <= a.l2_bytes
        assert b.l2_bytes == pytest.approx(a.l2_bytes, abs=0.01 * total)


@pytest.mark.parametrize("seed", [4, 5])
def test_the_level_step_changes_nothing_the_greedy_decides(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With L2 too small for every curve, a bisection over the utility level does what the
    greedy's first steps would, in one pass: the same L2 bytes as the greedy alone."""
    rng = random.Random(seed)
    tenants, ms = [], {}
    for i in range(200):
        name = f"t{i}"
        cls = rng.choice(list(PriorityClass))
        floor = 0.0 if cls is PriorityClass.BEST_EFFORT else 0.001
        tenants.append(TenantDemand(name, cls, floor, rng.choice((0.05, 1.0))))
        scale = rng.uniform(0.1, 3.0) * L2 / 200
        skew, reach = rng.uniform(0.3, 1.5), rng.uniform(0.2, 0.95)
        points = [(b, reach * (1.0 - math.exp(-((b / scale) ** skew)))) for b in BUCKETS]
        ms[name] = TenantMetrics(
            hit_ratio=0.3,
            rps=rng.uniform(0.1, 500.0),
            curve=PER_POD,
            miss_latency=misses(),
            fleet_curve=curve(points),
        )
    leveled = allocate(tenants, ms, None, L1, L2)
    monkeypatch.setattr(l2_split, "_fill", lambda table, values, lo, hi, cap: (lo, None))
    greedy = allocate(tenants, ms, None, L1, L2)
    assert sum(t.l2_bytes for t in greedy.tenants) >= 0.999 * L2  # L2 ran out: no shortcut
    for a, b in zip(leveled.tenants, greedy.tenants, strict=True):
        assert a.l2_bytes == pytest.approx(b.l2_bytes, abs=1e-4 * L2)


def full_scan_fill_level(
    table: CurveTable, values: FloatArray, lo: FloatArray, hi: FloatArray, capacity: int
) -> FloatArray:
    """:func:`level_search._fill_level` as first written: every tenant, every column, at
    every level of the bisection (the windowed one must answer the same, bit for bit)."""
    cap = float(capacity)
    xs = table.xs / cap
    cand = (xs > lo[:, None]) & (xs < hi[:, None])
    xs = np.where(cand, xs, 0.0)
    ys = np.where(cand, table.ys, -np.inf)
    at_lo, at_hi = table.at(lo * cap), table.at(hi * cap)
    rows = table.rows

    def take(level: float) -> FloatArray:
        with np.errstate(invalid="ignore"):
            score = values[:, None] * ys - level * xs
        k = np.argmax(score, axis=1)
        inner = score[rows, k]
        best_lo = values * at_lo - level * lo
        best_hi = values * at_hi - level * hi
        out = np.where(inner > best_lo, xs[rows, k], lo)
        return np.where(best_hi > np.maximum(best_lo, inner), hi, out)

    with np.errstate(invalid="ignore", divide="ignore"):
        slopes = values * (np.maximum(at_hi, table.max_hit) - at_lo) / np.maximum(hi - lo, 1e-12)
    top = float(np.max(slopes, initial=0.0))
    if top <= 0.0 or not math.isfinite(top):
        return lo
    bottom = math.log(top * 1e-12) if top * 1e-12 > 0.0 else math.log(top) + math.log(1e-12)
    high, low = math.log(top * 2.0), bottom
    if float(take(math.exp(low)).sum()) <= 1.0:
        return take(math.exp(low))
    if float(take(math.exp(high)).sum()) > 1.0:  # where every tenant keeps lo
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            gains = values[:, None] * ys
            steps = (gains - (values * at_lo)[:, None]) / np.where(xs > 0, xs - lo[:, None], np.nan)
            steepest = np.fmax(np.nanmax(steps, axis=1, initial=0.0), slopes)
        high = math.log(2.0 * float(np.nanmax(steepest, initial=top)))
    for _ in range(level_search.FILL_LEVEL_STEPS):
        mid = (high + low) / 2.0
        if float(take(math.exp(mid)).sum()) <= 1.0:
            high = mid
        else:
            low = mid
    return take(math.exp(high))


@pytest.mark.parametrize("seed", range(6))
def test_the_level_bisection_rescoring_only_moving_tenants_answers_as_a_full_scan(
    seed: int,
) -> None:
    """Tenants whose choice is the same at both ends of the bracket are not scored again,
    the others only between their two ends' columns: the shares are the full scan's."""
    rng = random.Random(seed)
    n = rng.choice((1, 7, 300, 2_000))
    cap = rng.choice((L2 // 100, L2, 4 * L2))
    curves: list[HitCurve | None] = []
    for _ in range(n):
        if rng.random() < 0.1:
            curves.append(None)
            continue
        scale = rng.uniform(0.05, 5.0) * cap / n
        skew, reach = rng.uniform(0.3, 1.5), rng.uniform(0.0, 0.95)
        flat = rng.random() < 0.2  # plateaus: ties between columns
        points = [
            (b, reach * (1.0 if flat and b > scale else 1.0 - math.exp(-((b / scale) ** skew))))
            for b in BUCKETS
        ]
        curves.append(curve(points))
    table = CurveTable(curves)
    values = np.array([rng.choice((0.0, rng.uniform(0.01, 1e4))) for _ in range(n)])
    lo = np.array([rng.choice((0.0, 0.2 / n)) for _ in range(n)])
    hi = np.maximum(lo, np.array([rng.choice((0.01, 0.2, 1.0)) for _ in range(n)]))
    got = level_search._fill_level(table, values, lo, hi, cap)
    want = full_scan_fill_level(table, values, lo, hi, cap)
    assert got.tobytes() == want.tobytes()
    assert float(got.sum()) <= 1.0


@st.composite
def fill_level_cases(
    draw: st.DrawFn,
) -> tuple[CurveTable, FloatArray, FloatArray, FloatArray, int]:
    """Tables with shared sizes or not (curves of their own, rows without one), values
    from none to many orders of magnitude, floors, caps and capacities of every kind."""
    n = draw(st.integers(1, 120))
    cap = draw(st.sampled_from((L2 // 100, L2, 4 * L2)))
    shared = draw(st.booleans())
    curves: list[HitCurve | None] = []
    for _ in range(n):
        if not shared and draw(st.booleans()) and draw(st.booleans()):
            curves.append(None)
            continue
        scale = draw(st.floats(0.01, 10.0)) * cap / n
        skew, reach = draw(st.floats(0.3, 2.0)), draw(st.floats(0.0, 1.0))
        bounds = BUCKETS if shared else sorted(set(draw(st.lists(st.sampled_from(BUCKETS)))))
        flat = draw(st.booleans())  # plateaus: ties between columns
        points = [
            (b, reach * (1.0 if flat and b > scale else 1.0 - math.exp(-((b / scale) ** skew))))
            for b in bounds
        ]
        curves.append(curve(points) if points else None)
    table = CurveTable(curves)
    values = np.array(
        draw(st.lists(st.sampled_from((0.0, 1e-6, 0.3, 1.0, 7.0, 1e4)), min_size=n, max_size=n))
    )
    lo = np.array(draw(st.lists(st.sampled_from((0.0, 0.2 / n, 1e-9)), min_size=n, max_size=n)))
    hi = np.maximum(
        lo,
        np.array(draw(st.lists(st.sampled_from((0.0, 0.01, 0.2, 1.0)), min_size=n, max_size=n))),
    )
    return table, values, lo, hi, cap


@settings(max_examples=300, deadline=None)
@given(fill_level_cases(), st.sampled_from((None, -30.0, -1e-3, 0.0, 1e-6, 2.0)))
def test_the_level_bisection_from_an_estimate_answers_as_a_full_scan(
    case: tuple[CurveTable, FloatArray, FloatArray, FloatArray, int], miss: float | None
) -> None:
    """The bisection's path is predicted from an estimate of where the shares first fit and
    only its last bracket is computed: right or wrong (``miss``: the estimate moved by
    that much, in logs), the shares are the full scan's, bit for bit."""
    table, values, lo, hi, cap = case
    if miss is None:
        got = level_search._fill_level(table, values, lo, hi, cap)
    else:
        guess = level_search._Segments.guess
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(
                level_search._Segments, "guess", lambda self, need: guess(self, need) + miss
            )
            got = level_search._fill_level(table, values, lo, hi, cap)
    want = full_scan_fill_level(table, values, lo, hi, cap)
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("seed", [1, 2])
def test_the_estimate_of_the_level_predicts_the_bisections_last_bracket(seed: int) -> None:
    """On the bench's fleet workload the estimate lands in the bisection's last bracket:
    two levels are computed (its two ends), not one per step."""
    levels = []

    class Counted(level_search._Level):
        def __new__(cls, *fields: object) -> Counted:
            levels.append(fields[0])
            return super().__new__(cls, *fields)  # type: ignore[arg-type]

    tenants, ms = bench_workload(2_000, seed, fleet=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(level_search, "_Level", Counted)
        got = allocate(tenants, ms, None, L1, L2)
    assert len(levels) == 2
    assert sum(t.l2_bytes for t in got.tenants) >= 0.999 * L2  # the bisection ran


@pytest.mark.parametrize("n", [1_000, 3_000])
def test_l2_bytes_never_exceed_l2_when_curves_are_steepest_near_their_floor(n: int) -> None:
    """Curves that rise steeply just above a tenant's floor and keep rising past its cap
    (the bench's fleet workload): the level bisection's bracket starts where every tenant
    keeps its floor, so L2 is handed out in full and never more (it was 1.5-3x over)."""
    tenants, ms = bench_workload(n, fleet=True)
    for l2 in (L2, 4 * L2):
        got = allocate(tenants, ms, None, L1, l2)
        total = sum(t.l2_bytes for t in got.tenants)
        assert l2 * 0.999 <= total <= l2
        assert sum(t.l1_bytes for t in got.tenants) <= L1


def fleet_metrics(wobble: float = 0.0, reach: float = 0.9) -> dict[str, TenantMetrics]:
    """Four tenants alike whose fleet curves all want more L2 than there is (``wobble``:
    every hit ratio moved by up to that fraction, as noise would, which decides who gets
    the segments they tie for; ``reach``: the first one's best hit ratio fleet-wide, the
    others' 0.9)."""
    rng = random.Random(1)
    out = {}
    for i, scale in enumerate((0.15, 0.15, 0.15, 0.15)):
        best = reach if i == 0 else 0.9
        points = [
            (f * L2, best * (1.0 - math.exp(-f / scale)) * (1.0 + rng.uniform(-wobble, wobble)))
            for f in (0.02, 0.05, 0.1, 0.2, 0.3, 0.45, 0.7)
        ]
        out[f"t{i}"] = TenantMetrics(
            hit_ratio=0.3,
            rps=50.0,
            curve=PER_POD,
            miss_latency=misses(),
            fleet_curve=curve(sorted(points)),
        )
    return out


def test_a_wobble_of_the_fleet_curves_moves_no_l2_byte_a_real_change_does() -> None:
    """L2 bytes move by the rule the L1 shares follow: only for a gain above ``minGain``,
    then half-way. Noise on the fleet curves moves the targets a little and no byte; a
    tenant whose keys come back far less often fleet-wide gives half of what it loses up
    at once, and one whose keys stop coming back all of it."""
    tenants = [TenantDemand(f"t{i}", PriorityClass.STANDARD, 0.05, 1.0) for i in range(4)]
    first = allocate(tenants, fleet_metrics(), None, L1, L2)
    shares = first.shares()
    in_force = {t.name: t.l2_bytes for t in first.tenants}
    wobbled = fleet_metrics(wobble=0.01)
    # the targets move with the wobble: without the bytes in force, L2 would follow them
    fresh = allocate(tenants, wobbled, shares, L1, L2)
    assert max(abs(t.l2_bytes - in_force[t.name]) for t in fresh.tenants) > 0.001 * L2
    held = allocate(tenants, wobbled, shares, L1, L2, previous_l2=in_force)
    assert {t.name: t.l2_bytes for t in held.tenants} == in_force
    assert held.shares() == shares  # L1 moved no more than before
    # a real change: t0's keys come back a third as often
    changed = fleet_metrics(reach=0.3)
    target = allocate(tenants, changed, shares, L1, L2).by_name()
    moved = allocate(tenants, changed, shares, L1, L2, previous_l2=in_force).by_name()
    assert target["t0"].l2_bytes < in_force["t0"] - 0.05 * L2
    halfway = in_force["t0"] + 0.5 * (target["t0"].l2_bytes - in_force["t0"])
    assert moved["t0"].l2_bytes == pytest.approx(halfway, rel=1e-6)
    assert sum(t.l2_bytes for t in moved.values()) <= L2
    for name in ("t1", "t2", "t3"):  # what t0 gives up goes to the others
        assert moved[name].l2_bytes >= in_force[name]
    assert sum(moved[n].l2_bytes for n in ("t1", "t2", "t3")) > sum(
        in_force[n] for n in ("t1", "t2", "t3")
    )
    # t0's keys stop coming back: its floor at once (no reuse is never held)
    scan = allocate(tenants, fleet_metrics(reach=0.0), shares, L1, L2, previous_l2=in_force)
    assert scan.by_name()["t0"].l2_bytes == pytest.approx(0.05 * L2, abs=1)


def test_l2_bytes_in_force_at_a_floor_of_no_whole_byte_count_do_not_move_the_rest() -> None:
    """L2 bytes are whole: a tenant held at a floor of 3 % of L2 (2,061,584,302.08 bytes)
    has 2,061,584,302 in force, a fraction of a byte below it. That is rounding, not a
    bound that moved: a wobble of the fleet curves still moves no byte of anyone."""
    tenants = [TenantDemand(f"t{i}", PriorityClass.STANDARD, 0.05, 1.0) for i in range(4)]
    tenants.append(TenantDemand("floor", PriorityClass.STANDARD, 0.03, 1.0))

    def with_floor_tenant(metrics: dict[str, TenantMetrics]) -> dict[str, TenantMetrics]:
        slow = replace(metrics["t1"], rps=0.01)  # worth too little to get past its floor
        return {**metrics, "floor": slow}

    first = allocate(tenants, with_floor_tenant(fleet_metrics()), None, L1, L2)
    in_force = {t.name: t.l2_bytes for t in first.tenants}
    assert in_force["floor"] == math.floor(0.03 * L2) < 0.03 * L2
    wobbled = with_floor_tenant(fleet_metrics(wobble=0.01))
    held = allocate(tenants, wobbled, first.shares(), L1, L2, previous_l2=in_force)
    assert {t.name: t.l2_bytes for t in held.tenants} == in_force


def test_l2_bytes_in_force_outside_the_bounds_are_brought_in_at_once() -> None:
    """A share of L2 in force above a tenant's maxShare (the spec changed, or L2 shrank)
    is not held: the bytes move, within bounds, as the L1 shares do when bounds move."""
    tenants = [TenantDemand(f"t{i}", PriorityClass.STANDARD, 0.05, 1.0) for i in range(4)]
    first = allocate(tenants, fleet_metrics(), None, L1, L2)
    in_force = {t.name: t.l2_bytes for t in first.tenants}
    capped = [replace(t, max_share=0.1) if t.name == "t3" else t for t in tenants]
    again = allocate(capped, fleet_metrics(), first.shares(), L1, L2, previous_l2=in_force)
    assert in_force["t3"] > 0.1 * L2
    assert again.by_name()["t3"].l2_bytes <= 0.1 * L2
    assert sum(t.l2_bytes for t in again.tenants) <= L2


@settings(max_examples=60, deadline=None)
@given(
    st.integers(20, 600),
    st.integers(0, 10_000),
    st.sampled_from((L2 // 16, L2 // 2, L2, 4 * L2)),
    st.booleans(),
)
def test_the_greedy_told_who_the_last_bracket_moves_hands_out_l2_as_without(
    n: int, seed: int, l2: int, in_force: bool
) -> None:
    """After the level bisection the greedy first offers only the tenants whose choice its
    last bracket moves, and the others once the offers left are worth no more than that
    bracket's lower level: the L2 bytes are those of offering every tenant from the start,
    bit for bit."""
    tenants, ms = bench_workload(n, seed, fleet=True)
    first = allocate(tenants, ms, None, L1, l2)
    previous = first.shares() if in_force else None
    got = allocate(tenants, ms, previous, L1, l2)
    fill = level_search._fill
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(l2_split, "_fill", lambda *args: (fill(*args)[0], None))
        want = allocate(tenants, ms, previous, L1, l2)
    assert [t.l2_bytes for t in got.tenants] == [t.l2_bytes for t in want.tenants]
    assert got.tenants == want.tenants


@settings(max_examples=200, deadline=None)
@given(fill_level_cases(), st.data())
def test_the_greedy_offering_some_tenants_first_steps_as_offering_all(
    case: tuple[CurveTable, FloatArray, FloatArray, FloatArray, int], data: st.DataObject
) -> None:
    """Any tenants offered first, the others once no offer left is worth more than the best
    of theirs at the start: the same shares as offering every tenant from the start."""
    table, values, lo, hi, cap = case
    n = values.size
    shares = lo * min(1.0, 0.9 / max(float(lo.sum()), 1e-12))
    first = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    left = 1.0 - float(shares.sum())
    active = np.flatnonzero(table.present & (values > 0.0) & ~first)
    per, _ = table.best_extensions(values, shares, np.minimum(hi, shares + left), cap, active)
    bound = float(np.nanmax(per, initial=0.0))
    plans = greedy_grant._Plans(values, table, LatencyTable([None] * n), [""] * n)
    got, want = shares.copy(), shares.copy()
    greedy_grant._greedy(plans, got, hi, cap, (first, bound))
    greedy_grant._greedy(plans, want, hi, cap)
    assert got.tobytes() == want.tobytes()
