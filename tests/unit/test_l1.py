"""Unit tests of the tenant-partitioned L1 (shares, quotas, isolation, migration)."""

from __future__ import annotations

import pytest

from cachefleet_sidecar.cache.l1 import TenantL1, TenantLimitError, TenantStats


def capacities(l1: TenantL1[int, str]) -> dict[str, int]:
    return {tenant: s.capacity_bytes for tenant, s in l1.stats().items()}


def fill(l1: TenantL1[int, str], tenant: str, keys: range, size: int = 10) -> int:
    return sum(l1.put(tenant, key, f"{tenant}-{key}", size) for key in keys)


def test_active_tenants_share_total_bytes_equally() -> None:
    l1: TenantL1[int, str] = TenantL1(1000)
    assert l1.stats() == {}
    l1.put("a", 1, "x", 10)
    assert capacities(l1) == {"a": 1000}
    assert l1.get("b", 1) is None  # a get activates a tenant too
    assert capacities(l1) == {"a": 500, "b": 500}
    l1.put("c", 1, "x", 10)
    assert capacities(l1) == {"a": 333, "b": 333, "c": 333}
    assert l1.tenants == ("a", "b", "c")


def test_a_tenant_filling_its_share_never_evicts_another_tenant() -> None:
    l1: TenantL1[int, str] = TenantL1(1000)
    l1.get("a", 0)
    l1.get("b", 0)
    assert fill(l1, "b", range(40)) == 0  # 400 bytes, within b's 500
    evicted = fill(l1, "a", range(1000, 3000))
    assert evicted == 2000 - 50
    for key in range(40):
        assert l1.get("b", key) == f"b-{key}"
    stats = l1.stats()
    assert stats["b"].evictions == 0
    assert stats["b"].entries == 40
    assert stats["a"].used_bytes <= 500
    assert stats["a"].evictions == 1950


def test_tenants_never_see_each_others_entries() -> None:
    l1: TenantL1[int, str] = TenantL1(1000)
    l1.put("a", 7, "secret of a", 10)
    assert l1.get("b", 7) is None
    assert l1.remove("b", 7) is False
    assert l1.get("a", 7) == "secret of a"


def test_a_new_tenant_shrinks_the_others_evicting_their_coldest() -> None:
    l1: TenantL1[int, str] = TenantL1(1000)
    fill(l1, "a", range(100))  # 1000 bytes: all of it
    for key in range(90, 100):
        l1.get("a", key)  # the hottest
    l1.put("b", 1, "x", 10)
    stats = l1.stats()
    assert stats["a"].capacity_bytes == 500
    assert stats["a"].entries == 50
    assert stats["a"].evictions == 50
    for key in range(90, 100):
        assert l1.get("a", key) == f"a-{key}"


def test_entries_bigger_than_the_partition_are_not_cached() -> None:
    l1: TenantL1[int, str] = TenantL1(100)
    l1.get("a", 0)
    l1.get("b", 0)
    assert l1.put("a", 1, "big", 60) == 0
    assert l1.get("a", 1) is None
    assert l1.put("a", 2, "fits", 50) == 0
    assert l1.get("a", 2) == "fits"


def test_quotas_assign_bytes_and_the_rest_is_shared() -> None:
    l1: TenantL1[int, str] = TenantL1(1000)
    for tenant in ("a", "b", "c"):
        l1.get(tenant, 0)
    l1.set_quotas({"a": (600, None), "z": (100, None)})  # z: reserved, not active
    assert capacities(l1) == {"a": 600, "b": 150, "c": 150}
    l1.set_quotas(None)
    assert capacities(l1) == {"a": 333, "b": 333, "c": 333}


def test_tenants_outside_the_quota_map_may_get_nothing() -> None:
    l1: TenantL1[int, str] = TenantL1(1000)
    l1.set_quotas({"a": (1000, None)})
    l1.put("a", 1, "kept", 10)
    assert l1.put("other", 1, "x", 1) == 0
    assert l1.get("other", 1) is None
    assert l1.stats()["other"].capacity_bytes == 0
    assert l1.get("a", 1) == "kept"


def test_quotas_asking_for_more_than_total_are_scaled_down() -> None:
    l1: TenantL1[int, str] = TenantL1(1000)
    l1.get("a", 0)
    l1.get("b", 0)
    l1.set_quotas({"a": (1500, None), "b": (500, None)})
    assert capacities(l1) == {"a": 750, "b": 250}


def test_shrinking_a_quota_evicts_only_that_tenant() -> None:
    l1: TenantL1[int, str] = TenantL1(1000)
    l1.set_quotas({"a": (500, None), "b": (500, None)})
    fill(l1, "a", range(50))
    fill(l1, "b", range(50))
    l1.set_quotas({"a": (200, None), "b": (500, None)})
    stats = l1.stats()
    assert stats["a"].entries == 20
    assert stats["a"].evictions == 30
    assert stats["b"].entries == 50
    assert stats["b"].evictions == 0


def test_invalid_quotas_and_policies_are_rejected() -> None:
    with pytest.raises(ValueError, match="'fifo'"):
        TenantL1(1000, default_policy="fifo")
    l1: TenantL1[int, str] = TenantL1(1000)
    with pytest.raises(ValueError, match="l1_bytes"):
        l1.set_quotas({"a": (-1, None)})
    with pytest.raises(ValueError, match="'arc'"):
        l1.set_quotas({"a": (10, "arc")})
    with pytest.raises(ValueError, match="'nope'"):
        l1.set_policy("a", "nope")
    with pytest.raises(ValueError, match="total_bytes"):
        TenantL1(-1)
    with pytest.raises(ValueError, match="max_tenants"):
        TenantL1(10, max_tenants=0)


def test_a_quota_policy_change_migrates_every_entry() -> None:
    l1: TenantL1[int, str] = TenantL1(1000)
    fill(l1, "a", range(100))
    assert l1.stats()["a"].policy == "lru"
    l1.set_quotas({"a": (1000, "lirs")})
    stats = l1.stats()["a"]
    assert stats.policy == "lirs"
    assert stats.entries == 100
    assert stats.used_bytes == 1000
    assert stats.evictions == 0
    for key in range(100):
        assert l1.get("a", key) == f"a-{key}"
    l1.set_quotas({"a": (1000, None)})  # back to the default policy
    assert l1.stats()["a"].policy == "lru"
    assert l1.stats()["a"].entries == 100


def test_migrating_into_less_room_keeps_the_hottest() -> None:
    l1: TenantL1[int, str] = TenantL1(1000, default_policy="lirs")
    fill(l1, "a", range(100))
    for key in range(80, 100):
        l1.get("a", key)
    l1.set_quotas({"a": (300, "lru")})
    stats = l1.stats()["a"]
    assert stats.policy == "lru"
    assert stats.entries == 30
    assert stats.evictions == 70
    for key in range(80, 100):
        assert l1.get("a", key) == f"a-{key}"


def test_set_policy_overrides_quotas_until_cleared() -> None:
    l1: TenantL1[int, str] = TenantL1(1000)
    fill(l1, "a", range(20))
    l1.set_policy("a", "lirs")
    assert l1.stats()["a"].policy == "lirs"
    assert l1.stats()["a"].entries == 20
    l1.set_quotas({"a": (800, "lru")})
    assert l1.stats()["a"].policy == "lirs"
    assert l1.stats()["a"].capacity_bytes == 800
    l1.set_policy("a", None)
    assert l1.stats()["a"].policy == "lru"
    assert l1.stats()["a"].entries == 20
    # An inactive tenant starts with its override.
    l1.set_policy("b", "lirs")
    assert "b" not in l1.stats()
    l1.get("b", 0)
    assert l1.stats()["b"].policy == "lirs"


def test_default_policy_applies_to_tenants_without_one() -> None:
    l1: TenantL1[int, str] = TenantL1(1000, default_policy="lirs")
    l1.set_quotas({"q": (100, "lru")})
    l1.get("a", 0)
    l1.get("q", 0)
    assert {t: s.policy for t, s in l1.stats().items()} == {"a": "lirs", "q": "lru"}
    l1.set_default_policy("lru")
    assert l1.stats()["a"].policy == "lru"


def test_max_tenants_bounds_the_partitions() -> None:
    l1: TenantL1[int, str] = TenantL1(1000, max_tenants=2)
    l1.set_reserved({"a", "b"})  # every slot held by a known tenant: nobody to replace
    l1.put("a", 1, "x", 1)
    l1.put("b", 1, "x", 1)
    with pytest.raises(TenantLimitError, match="'c'"):
        l1.put("c", 1, "x", 1)
    with pytest.raises(TenantLimitError):
        l1.get("c", 1)
    assert l1.tenants == ("a", "b")
    assert l1.get("a", 1) == "x"  # known tenants are unaffected
    assert l1.remove_tenant("a") is True
    assert l1.remove_tenant("a") is False
    assert capacities(l1) == {"b": 1000}
    l1.set_reserved(())
    l1.put("c", 1, "y", 1)
    assert capacities(l1) == {"b": 500, "c": 500}


def test_remove_and_clear() -> None:
    l1: TenantL1[int, str] = TenantL1(1000)
    fill(l1, "a", range(10))
    fill(l1, "b", range(10))
    assert l1.remove("a", 3) is True
    assert l1.remove("a", 3) is False
    assert l1.remove("nobody", 3) is False
    assert "nobody" not in l1.stats()
    l1.clear("a")
    assert l1.stats()["a"].entries == 0
    assert l1.stats()["b"].entries == 10
    l1.clear()
    assert l1.used_bytes == 0
    assert l1.tenants == ("a", "b")  # shares stay


def test_resizing_the_whole_l1_resizes_every_share() -> None:
    l1: TenantL1[int, str] = TenantL1(1000)
    fill(l1, "a", range(50))
    fill(l1, "b", range(50))
    l1.resize(400)
    assert capacities(l1) == {"a": 200, "b": 200}
    assert l1.used_bytes <= 400
    assert l1.total_bytes == 400


def test_stats_are_frozen_snapshots() -> None:
    l1: TenantL1[int, str] = TenantL1(100)
    l1.put("a", 1, "x", 10)
    stats = l1.stats()["a"]
    assert stats == TenantStats(
        policy="lru", capacity_bytes=100, used_bytes=10, entries=1, evictions=0
    )
    with pytest.raises(AttributeError):
        stats.entries = 5  # type: ignore[misc]
    l1.put("a", 2, "y", 10)
    assert stats.entries == 1


KEY_HEX = "ab" * 32  # an X-Cache-Key digest, as every L1 value carries one


@pytest.mark.parametrize("policy", ["lru", "lirs", "sits"])
@pytest.mark.parametrize("body_bytes", [0, 600, 4000])
def test_counted_bytes_are_what_an_entry_really_holds(policy: str, body_bytes: int) -> None:
    """What L1 counts for an entry is, within 20 %, what holding it costs the process
    (its response bytes, the value, the key and the policy's records, as tracemalloc sees
    them): a 64 MiB L1 holds about 64 MiB, whatever the answers' sizes (issue 23, item 6)."""
    import gc
    import time
    import tracemalloc

    import xxhash

    from cachefleet_sidecar.cache.entry import Entry, L1Value

    n = 12000
    l1: TenantL1[int, L1Value] = TenantL1(1 << 40, default_policy=policy)
    entries = [
        Entry(
            200,
            b"content-type: application/json\r\n",
            b"%07d" % i * (body_bytes // 7),
            stream=False,
            tenant="a",
        )
        for i in range(n)
    ]
    raw_keys = [b"%d" % i for i in range(n)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        counted = 0
        for entry, raw in zip(entries, raw_keys, strict=True):
            value, size = entry.l1_value(KEY_HEX, time.time(), time.monotonic(), 3600.0)
            l1.put("a", xxhash.xxh3_64_intdigest(raw), value, size, 0.01)
            counted += size
        gc.collect()
        real = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert l1.stats()["a"].entries == n
    assert 1 / 1.2 <= counted / real <= 1.2, (counted / n, real / n)
