"""The epoch tracker and the acknowledgement arithmetic, without I/O."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachefleet_common.contract.messages import EpochAck, ack_epochs
from cachefleet_common.epochs import (
    CACHE_SCOPE,
    EpochTracker,
    covers,
    encode_vector,
    model_scope,
    parse_epochs,
    tenant_scope,
    valid_scope,
)
from cachefleet_operator.api import InvalidationScope, ScopeType
from cachefleet_operator.invalidation import ack_progress, scope_name


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_scope_names_and_validation() -> None:
    assert tenant_scope("acme") == "tenant:acme"
    assert model_scope("llama") == "model:llama"
    assert valid_scope(CACHE_SCOPE)
    assert valid_scope("tenant:a")
    assert valid_scope("model:m")
    assert not valid_scope("tenant:")
    assert not valid_scope("nonsense")
    assert not valid_scope("")


def test_parse_epochs_drops_junk() -> None:
    raw = {b"cache": b"3", b"tenant:a": b"1", b"bogus": b"7", b"model:m": b"x", "model:n": 2}
    assert parse_epochs(raw) == {"cache": 3, "tenant:a": 1, "model:n": 2}


def test_vector_order_and_encoding() -> None:
    tracker = EpochTracker()
    tracker.merge({"cache": 2, "tenant:a": 5, "model:m": 1, "tenant:b": 9})
    assert tracker.values_for("a", "m") == (2, 5, 1)
    assert tracker.values_for("c", "other") == (2, 0, 0)
    vector = tracker.vector("a", "m")
    # the key-purge sequence is checked against the fence but is no part of the head
    assert vector == (("cache", 2), ("tenant:a", 5), ("model:m", 1), ("purge", 0))
    assert encode_vector(vector) == "cache=2;tenant:a=5;model:m=1"


def test_a_namespace_has_its_own_epoch_and_a_purge_moves_no_head() -> None:
    tracker = EpochTracker()
    tracker.merge({"tenant:a": 5, "namespace:a/kb1": 3, "purge": 7})
    assert tracker.values_for("a", "m", "kb1") == (0, 5, 0, 3)
    assert tracker.values_for("a", "m", "kb2") == (0, 5, 0, 0)
    assert tracker.values_for("a", "m") == (0, 5, 0)
    vector = tracker.vector("a", "m", "kb1")
    assert vector[-2:] == (("namespace:a/kb1", 3), ("purge", 7))
    assert encode_vector(vector) == "cache=0;tenant:a=5;model:m=0;namespace:a/kb1=3"
    before = encode_vector(tracker.vector("a", "m"))
    tracker.merge({"purge": 8})
    assert encode_vector(tracker.vector("a", "m")) == before  # entries stay readable
    assert valid_scope("namespace:a/kb1")
    assert valid_scope("purge")
    assert not valid_scope("namespace:a")
    assert not valid_scope("namespace:/kb1")
    assert not valid_scope("namespace:a/")


def test_merge_is_monotone_duplicates_and_reordering_change_nothing() -> None:
    tracker = EpochTracker()
    assert tracker.merge({"cache": 3})
    version = tracker.version
    assert not tracker.merge({"cache": 3})  # duplicate
    assert not tracker.merge({"cache": 2})  # late, older notice
    assert tracker.known == {"cache": 3}
    assert tracker.version == version
    assert not tracker.merge({"junk": 99})
    assert tracker.known == {"cache": 3}


@given(st.lists(st.tuples(st.sampled_from(["cache", "tenant:a", "model:m"]), st.integers(0, 50))))
def test_any_message_order_ends_at_the_max(messages: list[tuple[str, int]]) -> None:
    forward, backward = EpochTracker(), EpochTracker()
    for scope, epoch in messages:
        forward.merge({scope: epoch})
    for scope, epoch in reversed(messages):
        backward.merge({scope: epoch})
    expected: dict[str, int] = {}
    for scope, epoch in messages:
        if epoch > 0:
            expected[scope] = max(epoch, expected.get(scope, 0))
    assert forward.known == backward.known == expected


def test_staleness_bound_gates_l1() -> None:
    clock = Clock()
    tracker = EpochTracker(bound_s=2.0, clock=clock)
    assert not tracker.fresh()  # never confirmed
    assert tracker.valid_until == -math.inf
    tracker.confirm({"cache": 1}, sent_at=clock.now)
    assert tracker.fresh()
    clock.now += 1.9
    assert tracker.fresh()
    clock.now += 0.2
    assert not tracker.fresh()  # 2.1 s without confirmation: no L1 hits
    tracker.confirm({"cache": 1}, sent_at=clock.now)
    assert tracker.fresh()


def test_a_notice_does_not_confirm_and_a_late_read_does_not_extend() -> None:
    clock = Clock()
    tracker = EpochTracker(bound_s=2.0, clock=clock)
    tracker.merge({"cache": 4})
    assert not tracker.fresh()
    tracker.confirm({"cache": 4}, sent_at=clock.now)
    until = tracker.valid_until
    tracker.confirm({"cache": 4}, sent_at=clock.now - 1.0)  # a slow, older read
    assert tracker.valid_until == until


def test_confirm_reports_redis_behind_and_never_goes_back() -> None:
    tracker = EpochTracker()
    tracker.merge({"cache": 5, "tenant:a": 2})
    confirmation = tracker.confirm({"cache": 1}, sent_at=0.0)  # Redis restarted
    assert not confirmation.changed
    assert confirmation.redis_behind == {"cache": 5, "tenant:a": 2}
    assert tracker.known == {"cache": 5, "tenant:a": 2}
    assert tracker.confirm({"cache": 6, "tenant:a": 2}, sent_at=1.0).changed


def test_invalid_bound() -> None:
    with pytest.raises(ValueError):
        EpochTracker(bound_s=0)


def test_covers() -> None:
    assert covers({"cache": 3}, {"cache": 3})
    assert not covers({"cache": 2}, {"cache": 3})
    assert covers({"cache": 2}, {})
    assert not covers({}, {"tenant:a": 1})


def test_ack_progress_names_lagging_pods() -> None:
    acks = {
        "a": EpochAck(pod="a", epochs={"cache": 3}),
        "b": EpochAck(pod="b", epochs={"cache": 2}),
        "gone": EpochAck(pod="gone", epochs={"cache": 9}),
    }
    acked, lagging = ack_progress(["c", "b", "a"], acks, {"cache": 3})
    assert acked == ["a"]
    assert lagging == ["b", "c"]  # b is behind, c never acknowledged; "gone" is no member
    assert ack_progress([], acks, {"cache": 3}) == ([], [])


def test_scope_name_of_a_spec() -> None:
    assert scope_name(InvalidationScope(type=ScopeType.CACHE)) == "cache"
    assert scope_name(InvalidationScope(type=ScopeType.TENANT, tenant="t1")) == "tenant:t1"
    assert scope_name(InvalidationScope(type=ScopeType.MODEL, model="llama")) == "model:llama"
    kb = InvalidationScope(type=ScopeType.NAMESPACE, tenant="t1", namespace="kb-7")
    assert scope_name(kb) == "namespace:t1/kb-7"
    assert scope_name(InvalidationScope(type=ScopeType.KEY, key="a" * 64)) == "purge"


def test_ack_epochs_reads_what_the_sidecar_writes_and_skips_junk() -> None:
    ack = EpochAck(pod="p-1", epochs={"cache": 3, "tenant:a": 7})
    assert ack_epochs(ack.model_dump_json()) == ("p-1", {"cache": 3, "tenant:a": 7})
    assert ack_epochs(ack.model_dump_json().encode()) == ("p-1", {"cache": 3, "tenant:a": 7})
    for junk in (
        b"",
        b"not json",
        b"[]",
        b'{"pod": "p"}',
        b'{"pod": 1, "epochs": {}}',
        b'{"pod": "p", "epochs": []}',
        b'{"pod": "p", "epochs": {"cache": "x"}}',
    ):
        assert ack_epochs(junk) is None, junk


def test_vector_is_built_once_and_follows_every_epoch_move() -> None:
    tracker = EpochTracker()
    first = tracker.vector("t", "m")
    assert tracker.vector("t", "m") is first
    assert tracker.vector("u", "m") != first
    tracker.merge({"tenant:t": 3})
    moved = tracker.vector("t", "m")
    assert moved == (("cache", 0), ("tenant:t", 3), ("model:m", 0), ("purge", 0))
    tracker.merge({"tenant:t": 2})  # behind: nothing moves
    assert tracker.vector("t", "m") is moved
    tracker.merge({"model:m": 1})
    assert tracker.vector("t", "m")[2] == ("model:m", 1)


# ------------------------------------------------------- the versioned read's verdict

VECTOR = (("cache", 2), ("tenant:acme", 1), ("model:m1", 0))


def test_a_versioned_read_serves_only_its_own_epochs_under_a_fence_not_ahead() -> None:
    from cachefleet_common.contract.versioned import (
        READ_BEHIND,
        READ_MISS,
        READ_STALE_ENTRY,
        entry_head,
        judge_versioned_read,
    )

    head = entry_head(VECTOR)
    assert head == b"cache=2;tenant:acme=1;model:m1=0\n"
    fence_equal = [b"2", b"1", None]  # a scope never advanced has no field
    assert judge_versioned_read(head + b"answer", fence_equal, VECTOR, head) == b"answer"
    assert judge_versioned_read(None, fence_equal, VECTOR, head) == READ_MISS
    # a fence behind the reader (its Redis lost state) does not refuse it
    assert judge_versioned_read(head + b"a", [None, None, None], VECTOR, head) == b"a"
    # any one scope ahead refuses the read, whatever is stored
    for i in range(3):
        ahead: list[bytes | None] = [b"2", b"1", b"0"]
        ahead[i] = b"%d" % (VECTOR[i][1] + 1)
        assert judge_versioned_read(head + b"a", ahead, VECTOR, head) == READ_BEHIND
        assert judge_versioned_read(None, ahead, VECTOR, head) == READ_BEHIND
    # an entry of other epochs (older or newer) or a planted value is not served
    older = entry_head((("cache", 1), ("tenant:acme", 1), ("model:m1", 0)))
    for stored in (older + b"answer", b"garbage", head[:-1] + b"answer"):
        assert judge_versioned_read(stored, fence_equal, VECTOR, head) == READ_STALE_ENTRY


def test_the_fence_command_asks_for_the_vectors_scopes_in_order() -> None:
    from cachefleet_common import resp
    from cachefleet_common.contract.names import tenant_epochs_key
    from cachefleet_common.contract.versioned import fence_command

    packed = fence_command("team-a/chat", "acme", VECTOR)
    key = tenant_epochs_key("team-a/chat", "acme")
    assert packed == resp.pack_command(("HMGET", key, "cache", "tenant:acme", "model:m1"))
    assert fence_command("team-a/chat", "acme", ()) == b""
