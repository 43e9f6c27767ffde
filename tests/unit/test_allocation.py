"""Allocation: invariants under any input (hypothesis) and the intent on examples."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from cachefleet_operator.allocation import (
    AllocationParams,
    PriorityClass,
    TenantDemand,
    TenantMetrics,
    allocate,
    describe_moves,
    hold,
    quota_moves,
)

L1 = 10 * 2**30
L2 = 100 * 2**30
TOL = 1e-9

opt_pos = st.one_of(st.none(), st.floats(0.001, 50.0))


@st.composite
def tenants_and_metrics(draw: st.DrawFn) -> tuple[list[TenantDemand], dict[str, TenantMetrics]]:
    n = draw(st.integers(1, 12))
    floors_left = 1.0
    tenants = []
    metrics = {}
    for i in range(n):
        cls = draw(st.sampled_from(list(PriorityClass)))
        max_share = draw(st.floats(0.0, 1.0))
        if cls is PriorityClass.BEST_EFFORT:
            min_share = 0.0
        else:
            min_share = draw(st.floats(0.0, min(max_share, floors_left)))
            floors_left -= min_share
        tenants.append(
            TenantDemand(
                name=f"t{i}",
                priority_class=cls,
                min_share=min_share,
                max_share=max_share,
                p95_target_s=draw(opt_pos),
                min_hit_ratio=draw(st.one_of(st.none(), st.floats(0.0, 1.0))),
                min_rps=draw(opt_pos),
            )
        )
        if draw(st.booleans()):
            metrics[f"t{i}"] = TenantMetrics(
                p95_s=draw(st.one_of(opt_pos, st.just(math.nan), st.just(math.inf))),
                hit_ratio=draw(st.one_of(st.none(), st.floats(0.0, 1.0))),
                rps=draw(st.one_of(st.none(), st.floats(0.0, 1e5))),
            )
    return tenants, metrics


def check_invariants(
    tenants: list[TenantDemand], alloc_shares: dict[str, float], l1: list[int], l2: list[int]
) -> None:
    assert sum(alloc_shares.values()) <= 1.0 + TOL
    assert sum(l1) <= L1
    assert sum(l2) <= L2
    for d in tenants:
        share = alloc_shares[d.name]
        assert share >= -TOL
        floor = 0.0 if d.priority_class is PriorityClass.BEST_EFFORT else d.min_share
        assert share >= floor - 1e-6, f"{d.name} below its floor"
        assert share <= max(d.max_share, floor) + 1e-6, f"{d.name} above its cap"


@settings(max_examples=150, deadline=None)
@given(tenants_and_metrics(), st.data())
def test_capacity_floors_and_caps_hold_for_any_metrics_and_history(
    case: tuple[list[TenantDemand], dict[str, TenantMetrics]], data: st.DataObject
) -> None:
    tenants, metrics = case
    previous = data.draw(
        st.one_of(
            st.none(),
            st.dictionaries(st.sampled_from([d.name for d in tenants]), st.floats(0.0, 1.0)),
        )
    )
    params = AllocationParams(
        smoothing=data.draw(st.floats(0.05, 1.0)), hysteresis=data.draw(st.floats(0.0, 0.5))
    )
    result = allocate(tenants, metrics, previous, L1, L2, params)
    check_invariants(
        tenants,
        result.shares(),
        [t.l1_bytes for t in result.tenants],
        [t.l2_bytes for t in result.tenants],
    )
    kept = hold(tenants, result.shares(), L1, L2)
    check_invariants(
        tenants,
        kept.shares(),
        [t.l1_bytes for t in kept.tenants],
        [t.l2_bytes for t in kept.tenants],
    )


@settings(max_examples=100, deadline=None)
@given(tenants_and_metrics(), st.data())
def test_small_metric_noise_does_not_move_quotas(
    case: tuple[list[TenantDemand], dict[str, TenantMetrics]], data: st.DataObject
) -> None:
    tenants, metrics = case
    # converge first: repeated rebalances with the same metrics settle
    shares = None
    for _ in range(40):
        shares = allocate(tenants, metrics, shares, L1, L2).shares()
    settled = allocate(tenants, metrics, shares, L1, L2).shares()
    assert settled == shares

    def jitter(value: float | None) -> float | None:
        if value is None or not math.isfinite(value):
            return value
        return value * (1.0 + data.draw(st.floats(-0.01, 0.01)))

    noisy = {
        name: TenantMetrics(p95_s=jitter(m.p95_s), hit_ratio=m.hit_ratio, rps=jitter(m.rps))
        for name, m in metrics.items()
    }
    assert allocate(tenants, noisy, shares, L1, L2).shares() == shares


def three_tenants() -> list[TenantDemand]:
    return [
        TenantDemand("gold", PriorityClass.GUARANTEED, 0.2, 1.0, p95_target_s=0.2),
        TenantDemand("silver", PriorityClass.STANDARD, 0.0, 1.0, p95_target_s=0.5),
        TenantDemand("bronze", PriorityClass.BEST_EFFORT, 0.0, 1.0, p95_target_s=2.0),
    ]


def on_target() -> dict[str, TenantMetrics]:
    return {
        "gold": TenantMetrics(p95_s=0.18, hit_ratio=0.5, rps=100.0),
        "silver": TenantMetrics(p95_s=0.45, hit_ratio=0.5, rps=100.0),
        "bronze": TenantMetrics(p95_s=1.8, hit_ratio=0.5, rps=100.0),
    }


def settle(tenants: list[TenantDemand], metrics: dict[str, TenantMetrics]) -> dict[str, float]:
    shares = None
    for _ in range(30):
        shares = allocate(tenants, metrics, shares, L1, L2).shares()
    assert shares is not None
    return shares


def test_tenant_missing_its_p95_gains_share_within_one_rebalance() -> None:
    tenants = three_tenants()
    before = settle(tenants, on_target())
    metrics = on_target()
    metrics["silver"] = TenantMetrics(p95_s=1.0, hit_ratio=0.5, rps=100.0)  # 2x its target
    after = allocate(tenants, metrics, before, L1, L2)
    assert after.shares()["silver"] > before["silver"] + 0.05
    index = [t.name for t in after.tenants].index("silver")
    assert "p95 1s > target 0.5s" in after.reason(index)


def test_tenant_far_inside_its_targets_gives_share_back() -> None:
    tenants = three_tenants()
    before = settle(tenants, on_target())
    metrics = on_target()
    metrics["silver"] = TenantMetrics(p95_s=0.05, hit_ratio=0.5, rps=100.0)  # 10x better
    after = allocate(tenants, metrics, before, L1, L2).shares()
    assert after["silver"] < before["silver"] - 0.05
    assert after["gold"] > before["gold"]


def test_guaranteed_floor_holds_even_when_others_are_desperate() -> None:
    tenants = [
        TenantDemand("gold", PriorityClass.GUARANTEED, 0.4, 1.0, p95_target_s=1.0),
        TenantDemand("silver", PriorityClass.STANDARD, 0.0, 1.0, p95_target_s=0.1),
    ]
    metrics = {
        "gold": TenantMetrics(p95_s=0.01, hit_ratio=0.99, rps=1.0),
        "silver": TenantMetrics(p95_s=5.0, hit_ratio=0.0, rps=1e4),
    }
    result = allocate(tenants, metrics, None, L1, L2).by_name()
    assert result["gold"].share >= 0.4 - 1e-12
    assert result["gold"].l1_bytes >= int(0.4 * L1) - 1
    assert result["silver"].share > 0.5


def test_best_effort_gets_only_what_is_left() -> None:
    tenants = [
        TenantDemand("gold", PriorityClass.GUARANTEED, 0.5, 1.0, p95_target_s=0.1),
        TenantDemand("silver", PriorityClass.STANDARD, 0.3, 1.0, p95_target_s=0.1),
        TenantDemand("bronze", PriorityClass.BEST_EFFORT, 0.0, 1.0, p95_target_s=0.1),
    ]
    # everyone misses badly and bronze has by far the most traffic
    metrics = {
        "gold": TenantMetrics(p95_s=0.4, rps=1.0),
        "silver": TenantMetrics(p95_s=0.4, rps=1.0),
        "bronze": TenantMetrics(p95_s=0.4, rps=1e4),
    }
    result = allocate(tenants, metrics, None, L1, L2).shares()
    assert result["bronze"] <= 1.0 - result["gold"] - result["silver"] + 1e-9
    assert result["gold"] >= 0.5
    assert result["silver"] >= 0.3


def test_max_share_caps_and_leftover_goes_to_others() -> None:
    tenants = [
        TenantDemand("a", PriorityClass.STANDARD, 0.0, 0.1, p95_target_s=0.1),
        TenantDemand("b", PriorityClass.STANDARD, 0.0, 1.0, p95_target_s=0.1),
    ]
    metrics = {"a": TenantMetrics(p95_s=1.0, rps=1e4), "b": TenantMetrics(p95_s=0.1, rps=1.0)}
    result = allocate(tenants, metrics, None, L1, L2).shares()
    assert abs(result["a"] - 0.1) < 1e-9
    assert abs(result["b"] - 0.9) < 1e-9


def test_without_metrics_shares_follow_classes() -> None:
    result = allocate(three_tenants(), {}, None, L1, L2).shares()
    assert result["gold"] > result["silver"] > result["bronze"] > 0.0
    assert abs(sum(result.values()) - 1.0) < 1e-9


def test_a_tenant_without_series_is_taken_to_have_no_traffic() -> None:
    metrics = on_target()
    del metrics["silver"]
    result = allocate(three_tenants(), metrics, None, L1, L2).shares()
    assert result["silver"] < result["bronze"]


def test_hold_keeps_previous_shares_and_gives_new_tenants_their_floor() -> None:
    tenants = [*three_tenants(), TenantDemand("new", PriorityClass.STANDARD, 0.05, 1.0)]
    previous = {"gold": 0.5, "silver": 0.3, "bronze": 0.15}
    kept = hold(tenants, previous, L1, L2).shares()
    assert kept["gold"] == 0.5
    assert kept["silver"] == 0.3
    assert abs(kept["new"] - 0.05) < 1e-12
    assert sum(kept.values()) <= 1.0 + 1e-12  # bronze trimmed to make room


def test_moves_name_who_gained_and_lost_and_why() -> None:
    tenants = three_tenants()
    before = settle(tenants, on_target())
    metrics = on_target()
    metrics["silver"] = TenantMetrics(p95_s=1.0, hit_ratio=0.5, rps=100.0)
    after = allocate(tenants, metrics, before, L1, L2)
    text = describe_moves(quota_moves(before, after))
    gained, lost = text.split(" | ")
    assert gained.startswith("gained: silver")
    assert "SLA missed" in gained
    assert lost.startswith("lost: ")
    assert quota_moves(after.shares(), after) == []
