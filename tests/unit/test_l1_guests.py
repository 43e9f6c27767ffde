"""L1 known tenants and guests: guest share, slots, idle expiry (pure, no I/O)."""

from __future__ import annotations

import pytest

from cachefleet_sidecar.l1 import TenantL1, TenantLimitError


def test_guests_share_only_the_guest_pool() -> None:
    l1: TenantL1[int, str] = TenantL1(1000, guest_share=0.2, max_tenants=50)
    l1.set_reserved({"a", "b"})
    l1.put("a", 1, "x", 10)
    assert l1.stats()["a"].capacity_bytes == 800
    for i in range(40):
        l1.put(f"g{i}", 1, "x", 1)
    stats = l1.stats()
    assert stats["a"].capacity_bytes == 800  # 40 guests later: unchanged
    assert sum(s.capacity_bytes for t, s in stats.items() if t != "a") <= 200
    l1.put("b", 1, "x", 10)  # another known tenant shares the known budget
    assert l1.stats()["a"].capacity_bytes == 400


def test_without_guest_share_everyone_shares_equally() -> None:
    l1: TenantL1[int, str] = TenantL1(1000)
    l1.set_reserved({"a"})
    l1.put("a", 1, "x", 10)
    l1.put("g", 1, "x", 10)
    assert {s.capacity_bytes for s in l1.stats().values()} == {500}


def test_guest_pool_comes_out_of_what_quotas_leave() -> None:
    l1: TenantL1[int, str] = TenantL1(1000, guest_share=0.1)
    l1.set_quotas({"q": (2000, None)})  # asks for more than there is: scaled to 900
    l1.put("q", 1, "x", 1)
    l1.put("g", 1, "x", 1)
    stats = l1.stats()
    assert stats["q"].capacity_bytes == 900
    assert stats["g"].capacity_bytes == 100


def test_a_known_tenant_takes_the_slot_of_the_least_recent_guest() -> None:
    l1: TenantL1[int, str] = TenantL1(1000, max_tenants=2)
    l1.set_reserved({"k"})
    l1.put("g1", 1, "x", 1)
    l1.advance()
    l1.put("g2", 1, "x", 1)
    with pytest.raises(TenantLimitError):
        l1.get("g3", 1)  # a guest never pushes out another tenant
    l1.put("k", 1, "x", 1)
    assert set(l1.tenants) == {"g2", "k"}


def test_idle_partitions_expire() -> None:
    l1: TenantL1[int, str] = TenantL1(1000)
    l1.put("busy", 1, "x", 1)
    l1.put("idle", 1, "x", 1)
    expired = []
    for _ in range(3):
        l1.advance()
        l1.get("busy", 1)
        expired.append(l1.expire_idle(2))
    assert expired == [[], [], ["idle"]]  # unused for more than two ticks
    assert set(l1.tenants) == {"busy"}
    assert l1.stats()["busy"].capacity_bytes == 1000  # the share came back
