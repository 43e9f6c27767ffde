"""L1 known tenants and guests: guest share and pool, slot replacement, idle expiry (pure)."""

from __future__ import annotations

import pytest

from cachefleet_sidecar.cache.l1 import TenantL1, TenantLimitError


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
    l1.put("g2", 1, "x", 1)
    l1.get("g1", 1)  # g2 is now the guest seen least recently
    l1.put("k", 1, "x", 1)
    assert set(l1.tenants) == {"g1", "k"}


def test_a_new_guest_replaces_the_least_recently_seen_guest() -> None:
    gone: list[str] = []
    l1: TenantL1[int, str] = TenantL1(300, max_tenants=3)
    l1.on_replaced = gone.append
    for name in ("g1", "g2", "g3"):
        l1.put(name, 1, name, 10)
    l1.get("g1", 1)  # order of last use: g2, g3, g1
    assert l1.get("g4", 1) is None  # a partition at once, not a TenantLimitError
    assert gone == ["g2"]
    assert set(l1.tenants) == {"g1", "g3", "g4"}
    assert l1.get("g2", 1) is None  # g2's entries went with its partition...
    assert gone == ["g2", "g3"]  # ...and coming back it replaced the next least recent
    assert l1.get("g1", 1) == "g1"
    assert l1.replaced == 2
    assert l1.used_bytes == 10  # only g1's entry is left: the others' bytes came back
    assert {s.capacity_bytes for s in l1.stats().values()} == {100}


def test_known_tenants_are_never_replaced() -> None:
    l1: TenantL1[int, str] = TenantL1(1000, guest_share=0.5, max_tenants=4)
    l1.set_reserved({"k1", "k2", "k3", "k4"})
    l1.put("k1", 1, "kept", 1)
    l1.put("k2", 1, "kept", 1)
    for i in range(500):  # 500 guest names through the two slots left
        assert l1.get(f"g{i}", 1) is None
        l1.put(f"g{i}", 1, "x", 1)
        assert l1.get(f"g{i}", 1) == "x"  # cached at once
        assert len(l1.tenants) <= 4
    assert l1.get("k1", 1) == "kept"
    assert l1.get("k2", 1) == "kept"
    assert l1.stats()["k1"].capacity_bytes == 250
    assert l1.replaced == 498
    l1.put("k3", 1, "x", 1)  # a known newcomer takes a guest's slot, too
    l1.put("k4", 1, "x", 1)
    assert set(l1.tenants) == {"k1", "k2", "k3", "k4"}
    with pytest.raises(TenantLimitError, match="'g-late'"):
        l1.get("g-late", 1)  # every slot is a known tenant's: served uncached
    assert l1.get("k1", 1) == "kept"


def test_the_replacement_order_holds_guests_only() -> None:
    # O(1) replacement: the order the victim is taken from never holds a known tenant,
    # however many of them were used less recently than every guest.
    l1: TenantL1[int, str] = TenantL1(1000, max_tenants=40)
    l1.set_reserved({f"k{i}" for i in range(30)})
    for i in range(30):
        l1.put(f"k{i}", 1, "x", 1)
    for i in range(10):
        l1.put(f"g{i}", 1, "x", 1)
    assert list(l1._recent) == [f"g{i}" for i in range(10)]
    for i in range(20):
        l1.get(f"new{i}", 1)
    assert all(f"k{i}" in l1.tenants for i in range(30))
    assert list(l1._recent) == [f"new{i}" for i in range(10, 20)]
    l1.set_reserved({"new15"})  # who is known changed: the orders are sorted again
    assert "new15" not in l1._recent
    assert list(l1._recent)[:2] == ["k0", "k1"]  # former known tenants: least recent first
    l1.get("late", 1)
    assert "k0" not in l1.tenants
    assert "new15" in l1.tenants


def test_a_guest_pool_in_bytes_with_its_own_policy() -> None:
    l1: TenantL1[int, str] = TenantL1(1000, guest_share=0.5, max_tenants=8)
    l1.set_quotas({"q": (900, None)})
    l1.set_guest_pool(200, "lirs")  # replaces the guest share; quotas are scaled into the rest
    l1.put("q", 1, "x", 1)
    l1.put("g1", 1, "x", 1)
    l1.put("g2", 1, "x", 1)
    stats = l1.stats()
    assert stats["q"].capacity_bytes == 800
    assert (stats["g1"].capacity_bytes, stats["g1"].policy) == (100, "lirs")
    assert stats["q"].policy == "lru"
    l1.set_guest_pool(None)  # back to the guest share and the default policy
    stats = l1.stats()
    assert stats["g1"].capacity_bytes == 250
    assert stats["g1"].policy == "lru"
    with pytest.raises(ValueError, match="guest pool"):
        l1.set_guest_pool(-1)


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


def test_a_guest_pool_holds_with_no_tenant_known() -> None:
    # The operator's defaults with no tenant listed: every tenant is a guest of the pool.
    l1: TenantL1[int, str] = TenantL1(1000, max_tenants=8)
    l1.set_guest_pool(1000, "sits")
    for name in ("a", "b", "c", "d"):
        l1.put(name, 1, "x", 1)
    assert {(s.capacity_bytes, s.policy) for s in l1.stats().values()} == {(250, "sits")}
