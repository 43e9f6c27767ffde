"""The router's per-endpoint prefix index: chained matching, LRU order, the bound."""

from __future__ import annotations

import pytest

from cachefleet_common.modelserver import ModelServerMetrics
from cachefleet_router.prefix import DEFAULT_INDEX_BLOCKS, PrefixIndex, capacity_blocks


def test_matched_counts_only_the_leading_run() -> None:
    index = PrefixIndex(100)
    index.insert([1, 2, 3, 4])
    assert index.matched([1, 2, 3, 4, 5, 6]) == 4
    assert index.matched([1, 2, 9, 4]) == 2  # a gap ends the prefix, block 4 does not count
    assert index.matched([9, 2, 3]) == 0  # another first block: nothing shared
    assert index.matched([]) == 0


def test_bound_is_never_exceeded_and_oldest_prompt_goes_first() -> None:
    index = PrefixIndex(6)
    index.insert([1, 2, 3])
    index.insert([10, 11, 12])
    index.insert([20, 21])  # two blocks over: the oldest prompt's tail is evicted
    assert len(index) == 6
    assert index.matched([1, 2, 3]) == 1  # its first block, the most recent of it, is left
    assert index.matched([10, 11, 12]) == 3
    assert index.matched([20, 21]) == 2


def test_insert_refreshes_recency() -> None:
    index = PrefixIndex(4)
    index.insert([1, 2])
    index.insert([3, 4])
    index.insert([1, 2])  # routed again: now the most recent
    index.insert([5, 6])
    assert index.matched([1, 2]) == 2
    assert index.matched([3, 4]) == 0


def test_lookup_does_not_refresh_recency() -> None:
    index = PrefixIndex(4)
    index.insert([1, 2])
    index.insert([3, 4])
    assert index.matched([1, 2]) == 2
    index.insert([5, 6])
    assert index.matched([1, 2]) == 0
    assert index.matched([3, 4]) == 2


def test_shared_prefix_is_held_once() -> None:
    index = PrefixIndex(100)
    for tail in range(10):
        index.insert([1, 2, 3, 100 + tail])
    assert len(index) == 13


def test_resize_shrinks_by_evicting_lru() -> None:
    index = PrefixIndex(10)
    index.insert([1, 2, 3])
    index.insert([4, 5, 6])
    index.resize(3)
    assert len(index) == 3
    assert index.matched([4, 5, 6]) == 3
    assert index.matched([1]) == 0


def test_discard_forgets_blocks() -> None:
    index = PrefixIndex(10)
    index.insert([1, 2, 3])
    index.discard([2])
    assert index.matched([1, 2, 3]) == 1


@pytest.mark.parametrize("capacity", [0, -1])
def test_capacity_must_be_positive(capacity: int) -> None:
    with pytest.raises(ValueError, match="capacity"):
        PrefixIndex(capacity)


def test_capacity_from_the_servers_kv_capacity_else_the_default() -> None:
    vllm = ModelServerMetrics(kv_capacity_tokens=4096 * 16, server="vllm")
    assert capacity_blocks(vllm, 512) == 128
    assert capacity_blocks(ModelServerMetrics(), 512) == DEFAULT_INDEX_BLOCKS
    assert capacity_blocks(None, 512, default=77) == 77
    assert capacity_blocks(ModelServerMetrics(kv_capacity_tokens=100), 512) == 1
    with pytest.raises(ValueError, match="block_tokens"):
        capacity_blocks(None, 0)
