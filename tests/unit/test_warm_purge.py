"""The pure parts of warm-ups and key purges: judging a stored value, the purge index."""

from __future__ import annotations

from cachefleet_common.contract.versioned import entry_head, judge_versioned_read, l1_id_line
from cachefleet_common.epochs import EpochTracker
from cachefleet_sidecar.cache.entry import Entry
from cachefleet_sidecar.cache.l2_warm import plan_reads
from cachefleet_sidecar.cache.purge import PurgeIndex
from cachefleet_sidecar.control.warm import judge

ENTRY = Entry(
    200, b"content-type: application/json\r\n", b'{"ok": 1}', stream=False, tenant="acme"
).dumps()


def stored(tracker: EpochTracker, model: str = "m1", namespace: str = "", l1: int = 0xABC) -> bytes:
    head = entry_head(tracker.vector("acme", model, namespace))
    return head + l1_id_line(l1) + ENTRY


def test_a_current_entry_is_warmed_with_its_writer_l1_key() -> None:
    tracker = EpochTracker()
    tracker.merge({"tenant:acme": 2, "namespace:acme/kb": 1})
    assert judge(stored(tracker), {}, tracker, "acme") == (0xABC, ENTRY)
    assert judge(stored(tracker, namespace="kb"), {}, tracker, "acme") == (0xABC, ENTRY)
    # what a read returns: the entry, the L1-key line stripped
    vector = tracker.vector("acme", "m1")
    head = entry_head(vector)
    assert judge_versioned_read(stored(tracker), (), (), head) == ENTRY


def test_stale_behind_corrupt_and_old_format_values_are_skipped_with_a_reason() -> None:
    tracker = EpochTracker()
    old = stored(tracker)
    tracker.merge({"tenant:acme": 1})
    assert judge(old, {}, tracker, "acme") == "stale"
    now = stored(tracker)
    assert judge(now, {"purge": 1}, tracker, "acme") == "behind"  # a purge not applied yet
    assert judge(now, {"tenant:acme": 2}, tracker, "acme") == "behind"
    assert judge(b"garbage", {}, tracker, "acme") == "corrupt"
    assert judge(None, {}, tracker, "acme") == "gone"
    no_key = entry_head(tracker.vector("acme", "m1")) + ENTRY
    assert judge(no_key, {}, tracker, "acme") == "no_l1_key"


def test_the_purge_index_takes_what_it_names_and_sweeps_to_what_l1_holds() -> None:
    resident = {("a", 1), ("a", 2)}
    index = PurgeIndex(limit=2)
    index.add("d1", "a", 1, lambda t, k: (t, k) in resident)
    index.add("d2", "a", 2, lambda t, k: (t, k) in resident)
    index.add("d3", "a", 3, lambda t, k: (t, k) in resident)  # over the limit: swept
    assert index.sweeps == 1
    assert len(index) == 2  # d3 is not resident
    assert index.take(["d2", "nope"]) == [("a", 2)]
    assert index.take(["d2"]) == []


def test_warm_up_reads_are_planned_within_the_budget_in_bounded_batches() -> None:
    """Issue 34 (6): what a warm-up reads is chosen by length before anything is read."""
    mib = 1024 * 1024
    # most recent first: what fits in what is left is read; a smaller one after a skipped
    # one may still fit; a gone value (0) is not read nor counted
    batches, unread = plan_reads([3 * mib, 2 * mib, 0, mib // 2], 4 * mib)
    assert (batches, unread) == ([[0], [3]], 1)
    # batches of at most batch_entries values and batch_bytes bytes (a larger one alone)
    lengths = [100] * 10 + [5000] + [100] * 3
    batches, unread = plan_reads(lengths, 10**6, batch_bytes=1000, batch_entries=4)
    assert unread == 0
    assert [i for b in batches for i in b] == list(range(14))
    assert all(len(b) <= 4 for b in batches)
    assert all(sum(lengths[i] for i in b) <= 1000 or len(b) == 1 for b in batches)
    assert [10] in batches
    assert plan_reads([], 10) == ([], 0)
    assert plan_reads([5, 5], 0) == ([], 2)
