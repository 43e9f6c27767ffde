"""SLO pressure: the worst tenant's weighted p95 / target, damped where cache can still help."""

from __future__ import annotations

import pytest

from cachefleet_operator.allocation import PriorityClass
from cachefleet_operator.pressure import (
    CACHE_HELP_DAMPING,
    CLASS_WEIGHT,
    TenantPressure,
    slo_pressure,
    tenant_pressure,
)

G, S, B = PriorityClass.GUARANTEED, PriorityClass.STANDARD, PriorityClass.BEST_EFFORT


def test_guaranteed_at_target_is_one_and_classes_weigh_less() -> None:
    assert tenant_pressure(TenantPressure(0.2, 0.2, G)) == pytest.approx(1.0)
    assert tenant_pressure(TenantPressure(0.2, 0.2, S)) == pytest.approx(CLASS_WEIGHT[S])
    assert tenant_pressure(TenantPressure(2.0, 1.0, B)) == pytest.approx(1.0)


def test_the_worst_tenant_sets_the_pressure() -> None:
    tenants = [TenantPressure(0.1, 0.2, G), TenantPressure(0.9, 0.5, S), TenantPressure(1.0, 2.0)]
    assert slo_pressure(tenants) == pytest.approx(0.8 * 0.9 / 0.5)


@pytest.mark.parametrize(
    ("t", "reason"),
    [
        (TenantPressure(None, 0.2, G), "no observation"),
        (TenantPressure(0.3, None, G), "no target"),
        (TenantPressure(0.3, 0.0, G), "zero target"),
    ],
)
def test_unknown_tenants_do_not_count(t: TenantPressure, reason: str) -> None:
    assert tenant_pressure(t) is None, reason
    assert slo_pressure([t]) is None
    assert slo_pressure([t, TenantPressure(0.1, 0.2, G)]) == pytest.approx(0.5)


def test_a_miss_cache_can_still_fix_is_damped_and_only_a_miss() -> None:
    over = TenantPressure(0.4, 0.2, G, cache_can_help=True)
    assert tenant_pressure(over) == pytest.approx(1.0 + 1.0 * CACHE_HELP_DAMPING)
    for helps in (False, None):
        assert tenant_pressure(TenantPressure(0.4, 0.2, G, cache_can_help=helps)) == 2.0
    under = TenantPressure(0.1, 0.2, G, cache_can_help=True)
    assert tenant_pressure(under) == pytest.approx(0.5)


def test_no_tenants_no_pressure() -> None:
    assert slo_pressure([]) is None
