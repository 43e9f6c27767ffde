"""Unit tests of the L1 replacement policies (LRU, LIRS, SITS) and their factory."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachefleet_common.contract.names import Policy
from cachefleet_sidecar.policies import (
    LIRSPolicy,
    LirsSnapshot,
    LRUPolicy,
    ReplacementPolicy,
    SITSPolicy,
    available_policies,
    make_policy,
)

POLICY_NAMES = ["lru", "lirs", "sits"]


def access(policy: ReplacementPolicy[Any, Any], key: Any, size: int = 1) -> bool:
    """What the sidecar does per request: get, and put on a miss. True on a hit."""
    if policy.get(key) is not None:
        return True
    policy.put(key, f"value-{key}", size)
    return False


def hit_ratio(policy: ReplacementPolicy[Any, Any], keys: Iterable[Any], size: int = 1) -> float:
    keys = list(keys)
    return sum(access(policy, key, size) for key in keys) / len(keys)


# ----------------------------------------------------------------------- factory


def test_factory_builds_each_named_policy() -> None:
    for name in POLICY_NAMES:
        policy: ReplacementPolicy[str, str] = make_policy(name, 100)
        assert policy.name == name
        assert policy.capacity_bytes == 100
        assert len(policy) == 0
        assert policy.used_bytes == 0


def test_factory_accepts_the_protocol_enum() -> None:
    assert isinstance(make_policy(Policy.LIRS, 10), LIRSPolicy)
    assert isinstance(make_policy(Policy.LRU, 10), LRUPolicy)


def test_policy_names_match_the_protocol() -> None:
    assert set(available_policies()) <= {p.value for p in Policy}


@pytest.mark.parametrize("name", ["arc", "lfu", ""])
def test_factory_rejects_unknown_names_naming_them(name: str) -> None:
    with pytest.raises(ValueError, match=repr(name)):
        make_policy(name, 100)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_negative_capacity_and_size_are_rejected(name: str) -> None:
    with pytest.raises(ValueError, match="capacity"):
        make_policy(name, -1)
    policy: ReplacementPolicy[str, str] = make_policy(name, 10)
    with pytest.raises(ValueError, match="size"):
        policy.put("a", "x", -1)


# -------------------------------------------------------------- common contract


@pytest.fixture(params=POLICY_NAMES)
def new_policy(request: pytest.FixtureRequest) -> Callable[[int], ReplacementPolicy[Any, Any]]:
    return lambda capacity: make_policy(request.param, capacity)


def test_put_then_get_returns_the_value_and_counts_bytes(new_policy: Any) -> None:
    policy = new_policy(100)
    assert policy.put("a", "A", 30) == []
    assert policy.put("b", "B", 20) == []
    assert policy.get("a") == "A"
    assert policy.get("b") == "B"
    assert policy.get("zzz") is None
    assert "a" in policy
    assert "zzz" not in policy
    assert len(policy) == 2
    assert policy.used_bytes == 50


def test_put_replaces_value_and_size(new_policy: Any) -> None:
    policy = new_policy(100)
    policy.put("a", "old", 30)
    assert policy.put("a", "new", 50) == []
    assert policy.get("a") == "new"
    assert policy.used_bytes == 50
    assert len(policy) == 1
    assert policy.evictions == 0


def test_bytes_stay_within_capacity_and_evictions_are_reported(new_policy: Any) -> None:
    policy = new_policy(100)
    evicted: list[tuple[Any, Any]] = []
    for i in range(30):
        evicted += policy.put(i, f"v{i}", 10)
        assert policy.used_bytes <= 100
    assert len(policy) == 10
    assert len(evicted) == 20
    assert policy.evictions == 20
    for key, value in evicted:
        assert value == f"v{key}"
        assert key not in policy
    # The entry just stored is never its own victim.
    assert 29 in policy


def test_oversize_item_is_not_stored_and_cache_is_unchanged(new_policy: Any) -> None:
    policy = new_policy(100)
    policy.put("a", "A", 60)
    policy.put("b", "B", 40)
    assert policy.put("huge", "H", 101) == []
    assert "huge" not in policy
    assert policy.put("a", "bigger A", 101) == []
    assert policy.get("a") == "A"
    assert policy.get("b") == "B"
    assert policy.used_bytes == 100
    assert policy.evictions == 0


def test_an_item_of_exactly_capacity_displaces_everything_else(new_policy: Any) -> None:
    policy = new_policy(100)
    for i in range(4):
        policy.put(i, i, 25)
    evicted = policy.put("all", "ALL", 100)
    assert sorted(key for key, _ in evicted) == [0, 1, 2, 3]
    assert policy.get("all") == "ALL"
    assert len(policy) == 1


def test_remove_frees_bytes(new_policy: Any) -> None:
    policy = new_policy(100)
    policy.put("a", "A", 30)
    policy.put("b", "B", 30)
    assert policy.remove("a") is True
    assert policy.remove("a") is False
    assert policy.remove("never") is False
    assert policy.get("a") is None
    assert policy.used_bytes == 30
    assert len(policy) == 1
    assert policy.evictions == 0


def test_clear_empties_the_cache(new_policy: Any) -> None:
    policy = new_policy(100)
    for i in range(5):
        policy.put(i, i, 10)
    policy.clear()
    assert len(policy) == 0
    assert policy.used_bytes == 0
    assert policy.get(1) is None
    assert list(policy.items()) == []
    policy.put("x", "X", 100)
    assert policy.get("x") == "X"


def test_resize_shrinking_evicts_to_fit_and_growing_keeps(new_policy: Any) -> None:
    policy = new_policy(100)
    for i in range(10):
        policy.put(i, i, 10)
    assert policy.resize(200) == []
    assert len(policy) == 10
    evicted = policy.resize(45)
    assert len(evicted) == 6
    assert policy.used_bytes <= 45
    assert len(policy) == 4
    assert policy.capacity_bytes == 45
    assert policy.evictions == 6
    assert policy.resize(0) != []
    assert len(policy) == 0
    assert policy.put("z", "Z", 1) == []
    assert "z" not in policy


def test_resize_shrinking_evicts_cold_before_hot(new_policy: Any) -> None:
    policy = new_policy(100)
    for i in range(10):
        policy.put(i, i, 10)
    for _ in range(3):
        for hot in (7, 8, 9):
            assert policy.get(hot) == hot
    policy.resize(30)
    assert {7, 8, 9} <= {key for key, _, _ in policy.items()}


@pytest.mark.parametrize("target", POLICY_NAMES)
def test_items_coldest_first_migrate_without_loss(new_policy: Any, target: str) -> None:
    source = new_policy(100)
    for i in range(10):
        source.put(i, f"v{i}", 10)
    for _ in range(2):
        for hot in (3, 5):
            source.get(hot)
    entries = list(source.items())
    assert sorted(key for key, _, _ in entries) == list(range(10))
    # The hottest come last.
    assert {key for key, _, _ in entries[-2:]} == {3, 5}
    dest: ReplacementPolicy[Any, Any] = make_policy(target, 100)
    for key, value, size in entries:
        assert dest.put(key, value, size) == []
    assert dest.used_bytes == source.used_bytes
    for i in range(10):
        assert dest.get(i) == f"v{i}"


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 24), st.integers(0, 40)),
        st.tuples(st.just("get"), st.integers(0, 24), st.just(0)),
        st.tuples(st.just("remove"), st.integers(0, 24), st.just(0)),
        st.tuples(st.just("resize"), st.integers(0, 150), st.just(0)),
    ),
    max_size=150,
)


@pytest.mark.parametrize("name", POLICY_NAMES)
@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_random_operations_keep_byte_accounting(name: str, ops: list[tuple[str, int, int]]) -> None:
    policy: ReplacementPolicy[int, tuple[int, int]] = make_policy(name, 100)
    latest: dict[int, tuple[int, int]] = {}  # what a resident key must return
    for step, (op, arg, size) in enumerate(ops):
        if op == "put":
            value = (arg, step)
            fits = size <= policy.capacity_bytes
            evicted = policy.put(arg, value, size)
            for key, old in evicted:
                assert key != arg
                assert latest[key] == old
                assert key not in policy
            if fits:
                latest[arg] = value
                assert arg in policy
        elif op == "get":
            got = policy.get(arg)
            if arg in policy:
                assert got == latest[arg]
            else:
                assert got is None
        elif op == "remove":
            was_resident = arg in policy
            assert policy.remove(arg) is was_resident
            assert arg not in policy
        else:
            evicted = policy.resize(arg)
            assert all(key not in policy for key, _ in evicted)
        resident = list(policy.items())
        assert policy.used_bytes == sum(size for _, _, size in resident)
        assert policy.used_bytes <= policy.capacity_bytes
        assert len(policy) == len(resident) == len({key for key, _, _ in resident})
        for key, value, _ in resident:
            assert key in policy
            assert value == latest[key]
        if isinstance(policy, LIRSPolicy | SITSPolicy):
            policy.check_invariants()
        if isinstance(policy, LIRSPolicy):
            assert policy.ghost_count <= 2 * len(policy)


# ---------------------------------------------------------------------------- LRU


def test_lru_evicts_the_least_recently_used() -> None:
    policy: LRUPolicy[str, str] = LRUPolicy(30)
    for key in "abc":
        policy.put(key, key, 10)
    policy.get("a")
    assert policy.put("d", "d", 10) == [("b", "b")]
    assert policy.put("e", "e", 20) == [("c", "c"), ("a", "a")]
    assert [key for key, _, _ in policy.items()] == ["d", "e"]


# --------------------------------------------------------------------------- LIRS


def test_lirs_hand_checked_status_switch_and_pruning() -> None:
    """Three 1-byte slots: two LIR, one HIR (the paper's mechanics, step by step)."""
    p: LIRSPolicy[str, str] = LIRSPolicy(3)
    assert p.lir_capacity_bytes == 3  # empty: HIR share is 1 % of 3 bytes -> 0
    p.put("A", "a", 1)
    p.put("B", "b", 1)
    assert p.lir_capacity_bytes == 2  # one mean entry's worth of HIR space
    p.put("C", "c", 1)
    snap = p.snapshot()
    assert snap.stack == (("A", "LIR"), ("B", "LIR"), ("C", "HIR"))
    assert snap.queue == ("C",)

    # A miss evicts the front of Q; C stays in S as a ghost.
    assert p.put("D", "d", 1) == [("C", "c")]
    snap = p.snapshot()
    assert snap.stack == (("A", "LIR"), ("B", "LIR"), ("C", "ghost"), ("D", "HIR"))
    assert snap.queue == ("D",)
    assert "C" not in p

    # get on the ghost misses but records the reference.
    assert p.get("C") is None
    assert p.snapshot().stack[-1] == ("C", "ghost")

    # The status switch: C comes back as LIR; the bottom LIR (A) is demoted to
    # the end of Q, and the front of Q (D) is evicted, staying a ghost in S.
    assert p.put("C", "c", 1) == [("D", "d")]
    snap = p.snapshot()
    assert snap.stack == (("B", "LIR"), ("D", "ghost"), ("C", "LIR"))
    assert snap.queue == ("A",)
    assert p.get("A") == "a"  # demoted, still resident

    # Stack pruning: B is the bottom LIR; referencing it moves it up and the
    # ghost D, now at the bottom, is pruned (forgotten).
    snap = p.snapshot()
    assert snap.stack == (("B", "LIR"), ("D", "ghost"), ("C", "LIR"), ("A", "HIR"))
    assert p.get("B") == "b"
    snap = p.snapshot()
    assert snap.stack == (("C", "LIR"), ("A", "HIR"), ("B", "LIR"))
    assert p.ghost_count == 0

    # A resident HIR block that is in S (A) switches to LIR on a hit; the
    # bottom LIR (C) is demoted, and pruning leaves B at the bottom.
    assert p.get("A") == "a"
    snap = p.snapshot()
    assert snap.stack == (("B", "LIR"), ("A", "LIR"))
    assert snap.queue == ("C",)
    p.check_invariants()


def test_lirs_hir_hit_outside_s_stays_hir() -> None:
    p: LIRSPolicy[str, str] = LIRSPolicy(3)
    for key in "ABC":
        p.put(key, key, 1)
    p.get("A")  # A to the top; B becomes the bottom
    p.get("B")  # B to the top: C (HIR) is pruned from S
    assert p.snapshot().stack == (("A", "LIR"), ("B", "LIR"))
    assert p.get("C") == "C"  # resident HIR, not in S: stays HIR
    snap = p.snapshot()
    assert snap.stack == (("A", "LIR"), ("B", "LIR"), ("C", "HIR"))
    assert snap.queue == ("C",)


def test_lirs_resists_a_scan_that_flushes_lru() -> None:
    capacity = 1000  # 100 entries of 10 bytes
    hot = list(range(60))
    sweep = list(range(1000, 3000))
    results = {}
    for name in POLICY_NAMES:
        policy: ReplacementPolicy[int, str] = make_policy(name, capacity)
        for _ in range(5):
            hit_ratio(policy, hot, 10)
        assert hit_ratio(policy, hot, 10) == 1.0
        hit_ratio(policy, sweep, 10)
        results[name] = hit_ratio(policy, hot, 10)
    assert results["lru"] == 0.0
    assert results["lirs"] >= 0.95


def test_lirs_resists_a_scan_interleaved_with_hot_traffic() -> None:
    capacity = 100
    hot = list(range(80))
    results = {}
    for name in POLICY_NAMES:
        policy: ReplacementPolicy[int, str] = make_policy(name, capacity)
        for _ in range(5):
            hit_ratio(policy, hot)
        for start in range(1000, 2000, 50):
            hit_ratio(policy, range(start, start + 50))  # 50 new keys
            hit_ratio(policy, hot[start % 80 : start % 80 + 5])  # a few hot ones
        results[name] = hit_ratio(policy, hot)
    assert results["lru"] <= 0.1
    assert results["lirs"] >= 0.9


def test_lirs_keeps_most_of_a_loop_larger_than_the_cache() -> None:
    loop = list(range(120))
    lru: LRUPolicy[int, str] = LRUPolicy(100)
    lirs: LIRSPolicy[int, str] = LIRSPolicy(100)
    for policy in (lru, lirs):
        hit_ratio(policy, loop)
    assert hit_ratio(lru, loop * 5) == 0.0
    assert hit_ratio(lirs, loop * 5) >= 0.75


def test_lirs_ghosts_are_bounded_by_twice_the_resident_entries() -> None:
    p: LIRSPolicy[int, str] = LIRSPolicy(100)
    for i in range(50):
        access(p, i)
        access(p, i)
    for i in range(1000, 11000):
        access(p, i)
        assert p.ghost_count <= 2 * len(p)
    assert p.ghost_count > 0
    p.check_invariants()


def test_lirs_ghost_factor_zero_keeps_no_ghosts() -> None:
    p: LIRSPolicy[int, str] = LIRSPolicy(10, ghost_factor=0)
    for i in range(100):
        access(p, i)
    assert p.ghost_count == 0
    p.check_invariants()


def test_lirs_parameters_are_validated() -> None:
    with pytest.raises(ValueError, match="hir_ratio"):
        LIRSPolicy(10, hir_ratio=0)
    with pytest.raises(ValueError, match="ghost_factor"):
        LIRSPolicy(10, ghost_factor=-1)


def test_lirs_hir_share_follows_the_ratio_for_big_caches() -> None:
    p: LIRSPolicy[int, str] = LIRSPolicy(1_000_000, hir_ratio=0.05)
    p.put(1, "x", 100)
    assert p.lir_capacity_bytes == 950_000
    assert p.resize(2_000_000) == []
    assert p.lir_capacity_bytes == 1_900_000


def test_lirs_variable_sizes_demote_lir_bytes_over_the_share() -> None:
    p: LIRSPolicy[str, str] = LIRSPolicy(1000)
    p.put("small", "s", 100)
    p.put("mid", "m", 300)
    assert p.snapshot().stack == (("small", "LIR"), ("mid", "LIR"))
    # Growing a LIR entry past the LIR share (~888 bytes here) demotes the
    # bottom LIR block to Q; nothing is evicted while the bytes fit.
    assert p.put("mid", "M", 850) == []
    p.check_invariants()
    assert p.lir_bytes == 850
    assert p.snapshot() == LirsSnapshot(stack=(("mid", "LIR"),), queue=("small",))
    assert p.get("small") == "s"
    assert p.get("mid") == "M"
    # An entry bigger than the LIR share but within capacity is kept as HIR.
    evicted = p.put("big", "B", 995)
    assert p.get("big") == "B"
    assert {key for key, _ in evicted} == {"small", "mid"}
    p.check_invariants()


def test_lirs_replacing_a_resident_hir_counts_as_a_reference() -> None:
    p: LIRSPolicy[str, str] = LIRSPolicy(3)
    for key in "ABC":
        p.put(key, key, 1)
    assert p.put("C", "c2", 1) == []  # C is HIR in S: replacing promotes it
    snap = p.snapshot()
    assert ("C", "LIR") in snap.stack
    assert snap.queue == ("A",)
    assert p.get("C") == "c2"


# -------------------------------------------------------------------------- bench


@pytest.mark.bench
def test_l1_micro_benchmark_reports_each_cache() -> None:
    pytest.importorskip("cachetools")
    from cachefleet_bench import l1_micro

    rows = l1_micro.run(n_ops=2000, repeats=1)
    names = {row["cache"] for row in rows}
    assert names == {"lru", "lirs", "sits", "cachetools.LRUCache"}
    for row in rows:
        assert row["get_hit_ns"] > 0
        assert row["get_hits_per_s"] == pytest.approx(1e9 / row["get_hit_ns"])
        assert row["put_ns"] > 0
    assert l1_micro.main(["--ops", "1000", "--repeats", "1"]) == 0
