"""The pause-free policy switch: a Migration, and TenantL1 driving it.

What a user would notice if it broke: an entry lost or served stale across a
switch, byte totals that drift from the entries held (quotas then lie), a
switch that stalls the event loop (work per step not bounded), a rollback
mid-way that drops what moved, or costs forgotten so that SITS stops sparing
expensive entries after a switch.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cachefleet_sidecar.cache.l1 import TenantL1
from cachefleet_sidecar.policies import LIRSPolicy, LRUPolicy, SITSPolicy, make_policy
from cachefleet_sidecar.policies.migrating import Migration

POLICIES = ("lru", "lirs", "sits")


def test_a_switch_moves_nothing_at_once_and_each_step_is_bounded() -> None:
    l1: TenantL1[int, str] = TenantL1(100_000, default_policy="lirs")
    for key in range(5_000):
        l1.put("a", key, f"v{key}", 10, cost=0.5)
    used = l1.stats()["a"].used_bytes
    l1.set_policy("a", "sits")
    stats = l1.stats()["a"]
    assert (stats.policy, stats.migrating, stats.entries, stats.used_bytes) == (
        "sits",
        5_000,  # the switch itself moved nothing: O(1)
        5_000,
        used,
    )
    assert l1.migrating
    assert l1.migrate_step(100) == 100
    assert l1.stats()["a"].migrating == 4_900
    # A touched entry moves on its own (one entry, no more).
    assert l1.get("a", 4_999) == "v4999"
    assert l1.stats()["a"].migrating == 4_899
    steps = 0
    while l1.migrating:
        assert l1.migrate_step(256) <= 256
        steps += 1
    assert steps == 20  # ceil(4899 / 256): the batches did all the work
    stats = l1.stats()["a"]
    assert (stats.entries, stats.used_bytes, stats.evictions, stats.migrating) == (
        5_000,
        used,
        0,
        0,
    )
    assert all(l1.get("a", key) == f"v{key}" for key in range(5_000))


def test_the_new_policy_serves_admissions_at_once_and_the_old_entries_give_way_first() -> None:
    l1: TenantL1[int, str] = TenantL1(1_000, default_policy="lru")
    for key in range(100):
        l1.put("a", key, f"old{key}", 10)
    l1.set_policy("a", "sits")
    assert l1.put("a", 1_000, "new", 50) == 5  # room made from the old structure
    stats = l1.stats()["a"]
    assert (stats.used_bytes, stats.entries, stats.evictions) == (1_000, 96, 5)
    assert all(l1.get("a", key) is None for key in range(5))  # the coldest gave way
    assert l1.get("a", 1_000) == "new"
    assert l1.get("a", 99) == "old99"


def test_rollback_mid_migration_keeps_every_entry_and_drains_back() -> None:
    l1: TenantL1[int, str] = TenantL1(10_000, default_policy="lru")
    for key in range(500):
        l1.put("a", key, f"v{key}", 10)
    l1.set_policy("a", "sits")
    l1.migrate_step(200)
    for key in range(450, 500):
        assert l1.get("a", key) == f"v{key}"
    l1.put("a", 999, "new", 10)
    l1.set_policy("a", None)  # rollback to the default (LRU) while 250 are still in it
    stats = l1.stats()["a"]
    assert stats.policy == "lru"
    assert stats.entries == 501
    assert stats.migrating == 251  # what had moved to SITS now drains back
    while l1.migrating:
        l1.migrate_step(64)
    stats = l1.stats()["a"]
    assert (stats.entries, stats.used_bytes, stats.evictions) == (501, 5_010, 0)
    assert l1.get("a", 999) == "new"
    assert all(l1.get("a", key) == f"v{key}" for key in range(500))


def test_a_switch_to_a_third_policy_mid_migration_nests_and_loses_nothing() -> None:
    l1: TenantL1[int, str] = TenantL1(10_000, default_policy="lru")
    for key in range(300):
        l1.put("a", key, f"v{key}", 10)
    l1.set_policy("a", "sits")
    l1.migrate_step(100)
    l1.set_policy("a", "lirs")
    assert l1.stats()["a"].policy == "lirs"
    assert l1.stats()["a"].migrating == 300
    while l1.migrating:
        l1.migrate_step(50)
    assert l1.stats()["a"].entries == 300
    assert all(l1.get("a", key) == f"v{key}" for key in range(300))


def test_a_switch_keeps_each_entrys_cost() -> None:
    sits: SITSPolicy[int, str] = SITSPolicy(10_000)
    for key in range(50):
        sits.put(key, f"v{key}", 100, cost=key / 10)
    for front in (LIRSPolicy[int, str](10_000), LRUPolicy[int, str](10_000)):
        moving: Migration[int, str] = Migration(sits, front)
        moving.get(7)  # moved on touch
        moving.step(1_000)  # the rest in a batch
        assert moving.done
        back_again: Migration[int, str] = Migration(front, SITSPolicy(10_000))
        back_again.step(1_000)
        sits = back_again.front  # type: ignore[assignment]
    for key in range(50):
        assert sits.pop_entry(key) == (f"v{key}", 100, key / 10)


def test_a_pending_quota_shrink_trims_the_old_structure_first() -> None:
    l1: TenantL1[int, str] = TenantL1(1_000, default_policy="lirs")
    for key in range(100):
        l1.put("a", key, f"v{key}", 10)
    l1.set_policy("a", "lru")
    for key in range(90, 100):
        l1.get("a", key)  # these moved into the LRU
    l1.set_quotas({"a": (200, None)})
    stats = l1.stats()["a"]
    assert (stats.used_bytes, stats.entries, stats.evictions) == (200, 20, 80)
    assert all(l1.get("a", key) == f"v{key}" for key in range(90, 100))


# ------------------------------------------------------------------ property

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 40), st.integers(0, 60)),
        st.tuples(st.just("get"), st.integers(0, 40), st.just(0)),
        st.tuples(st.just("remove"), st.integers(0, 40), st.just(0)),
        st.tuples(st.just("step"), st.integers(0, 8), st.just(0)),
        st.tuples(st.just("switch"), st.integers(0, 3), st.just(0)),
        st.tuples(st.just("quota"), st.integers(50, 400), st.just(0)),
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, start=st.sampled_from(POLICIES))
def test_random_switches_lose_nothing_unreported_and_keep_bytes_exact(
    ops: list[tuple[str, int, int]], start: str
) -> None:
    l1: TenantL1[int, tuple[int, int]] = TenantL1(300, default_policy=start)
    latest: dict[int, tuple[tuple[int, int], int]] = {}  # key -> (value, size)
    evictions = 0
    l1.get("a", -1)  # the partition exists from here on
    for n, (op, arg, size) in enumerate(ops):
        before = {k: (v, s) for k, v, s in l1.entries("a")}
        pending = l1.stats()["a"].migrating
        if op == "put":
            dropped = l1.put("a", arg, (arg, n), size, cost=size / 7)
            evictions += dropped
            if size <= l1.stats()["a"].capacity_bytes:
                latest[arg] = ((arg, n), size)
        elif op == "get":
            got = l1.get("a", arg)
            assert got == (before[arg][0] if arg in before else None)
            assert l1.stats()["a"].migrating >= pending - 1  # at most one moved
        elif op == "remove":
            assert l1.remove("a", arg) is (arg in before)
            latest.pop(arg, None)
        elif op == "step":
            assert l1.migrate_step(arg) <= arg
        elif op == "switch":
            l1.set_policy("a", None if arg == 3 else POLICIES[arg])
        else:
            l1.set_quotas({"a": (arg, None)})
        after = {k: (v, s) for k, v, s in l1.entries("a")}
        stats = l1.stats()["a"]
        if op in ("get", "step", "switch"):
            assert after == before  # moving and switching lose nothing
        gone = set(before) - set(after) - ({arg} if op in ("put", "remove") else set())
        if op == "quota":
            evictions += len(gone)
        # Every entry held is the latest value stored under its key...
        assert all(latest[k] == vs for k, vs in after.items())
        # ...nothing disappears without being counted, and bytes stay exact.
        assert stats.evictions == evictions
        assert len(l1.entries("a")) == len(after) == stats.entries
        assert stats.used_bytes == sum(s for _, s in after.values())
        assert stats.used_bytes <= stats.capacity_bytes
        if op == "put":
            assert len(gone) == dropped
        for key in gone:
            latest.pop(key, None)


def test_every_policy_can_hand_its_entries_over_coldest_first() -> None:
    for name in POLICIES:
        policy = make_policy(name, 1_000)
        for key in range(20):
            policy.put(key, key, 10, cost=float(key))
        taken = []
        while (entry := policy.pop_coldest()) is not None:
            taken.append(entry)
        assert sorted(taken) == [(k, k, 10, float(k)) for k in range(20)], name
        assert (len(policy), policy.used_bytes, policy.evictions) == (0, 0, 0), name
