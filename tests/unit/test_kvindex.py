"""vLLM's KV events decoded (both encodings) and the precise prefix index they build."""

from __future__ import annotations

import tracemalloc
from typing import Any

import msgpack
import pytest

from cachefleet_router.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEventError,
    decode_batch,
    decode_frame,
    encode_frame,
    hash_key,
)
from cachefleet_router.kvindex import KvIndex, chain

BS = 4  # tokens per block in these tests


def stored_map(hashes: list[Any], parent: Any, tokens: list[int], **extra: Any) -> dict[str, Any]:
    """A BlockStored as vLLM encodes it today: a map with "type"."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        **extra,
    }


def stored_array(hashes: list[Any], parent: Any, tokens: list[int]) -> list[Any]:
    """The same as older vLLM encoded it: positional, the type first."""
    return ["BlockStored", hashes, parent, tokens, BS, None, "GPU"]


def apply(index: KvIndex, endpoint: str, seq: int, *events: Any) -> None:
    frame = decode_frame(encode_frame("kv-events", seq, list(events)))
    index.apply(endpoint, frame.seq, frame.batch)


PROMPT = list(range(100, 112))  # three blocks of 4 tokens


def test_a_frame_decodes_in_both_encodings_alike() -> None:
    as_map = decode_frame(
        encode_frame(
            "kv@10.0.0.1:8000@m",
            7,
            [
                stored_map([11, 12], None, PROMPT[:8]),
                {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"},
                {"type": "AllBlocksCleared"},
            ],
            ts=1.5,
        )
    )
    as_array = decode_frame(
        encode_frame(
            "kv@10.0.0.1:8000@m",
            7,
            [
                stored_array([11, 12], None, PROMPT[:8]),
                ["BlockRemoved", [11], "GPU"],
                ["AllBlocksCleared"],
            ],
            ts=1.5,
        )
    )
    assert as_map == as_array
    assert as_map.topic == "kv@10.0.0.1:8000@m"
    assert as_map.seq == 7
    assert as_map.batch.ts == 1.5
    assert as_map.batch.events == (
        BlockStored((11, 12), None, tuple(PROMPT[:8]), BS, "GPU", None),
        BlockRemoved((11,), "GPU", None),
        AllBlocksCleared(),
    )


def test_bytes_hashes_fold_to_64_bits_and_the_rank_is_read() -> None:
    digest = bytes(range(32))
    payload = msgpack.packb([2.0, [stored_map([digest], digest, PROMPT[:4])], 3], use_bin_type=True)
    batch = decode_batch(payload)
    assert batch.dp_rank == 3
    event = batch.events[0]
    assert isinstance(event, BlockStored)
    assert event.block_hashes == (hash_key(digest),) == (int.from_bytes(digest[:8], "big"),)


def test_unknown_event_types_are_skipped_and_garbage_refused() -> None:
    payload = msgpack.packb([0.0, [{"type": "SomethingNew", "x": 1}, ["AllBlocksCleared"]]])
    assert decode_batch(payload).events == (AllBlocksCleared(),)
    for bad in (b"\xc1", msgpack.packb({"no": "batch"}), msgpack.packb([0.0, [42]])):
        with pytest.raises(KvEventError):
            decode_batch(bad)
    with pytest.raises(KvEventError, match="3 parts"):
        decode_frame([b"topic", b"\0" * 8])
    with pytest.raises(KvEventError, match="8 bytes"):
        decode_frame([b"topic", b"\0", msgpack.packb([0.0, []])])
    with pytest.raises(KvEventError, match="block_size"):
        decode_batch(
            msgpack.packb([0.0, [{**stored_map([1], None, [1, 2, 3, 4]), "block_size": 0}]])
        )


@pytest.mark.parametrize("encode", [stored_map, stored_array])
def test_stored_blocks_match_a_request_by_its_token_ids(encode: Any) -> None:
    index = KvIndex()
    # the first message a fresh server publishes has sequence 0: its state is known
    apply(index, "a", 0, encode([11, 12], None, PROMPT[:8]))
    apply(index, "a", 1, encode([13], 12, PROMPT[8:12]))  # a child of block 12
    assert index.known("a")
    assert index.matched("a", [*PROMPT, 7, 7]) == (3, 12)
    assert index.matched("a", PROMPT[:6]) == (1, 4)  # one whole block
    assert index.matched("a", [*PROMPT[:4], 0, 0, 0, 0, *PROMPT[8:]]) == (1, 4)
    assert index.matched("a", [5, *PROMPT]) == (0, 0)
    assert index.matched("b", PROMPT) is None  # never heard of: not known


def test_removed_blocks_are_evicted_and_a_clear_empties() -> None:
    index = KvIndex()
    apply(index, "a", 0, stored_map([11, 12, 13], None, PROMPT))
    apply(index, "a", 1, {"type": "BlockRemoved", "block_hashes": [13], "medium": "GPU"})
    assert index.matched("a", PROMPT) == (2, 8)
    apply(index, "a", 2, ["BlockRemoved", [12], None])
    assert index.matched("a", PROMPT) == (1, 4)
    apply(index, "a", 3, {"type": "AllBlocksCleared"})
    assert index.matched("a", PROMPT) == (0, 0)
    assert index.known("a")
    assert index.blocks("a") == 0


def test_a_gap_makes_the_endpoint_unknown_until_a_clear() -> None:
    index = KvIndex(resync_blocks=100)
    apply(index, "a", 0, stored_map([11, 12, 13], None, PROMPT))
    apply(index, "a", 5, stored_map([21], None, [9, 9, 9, 9]))  # 1..4 lost
    assert not index.known("a")
    assert index.matched("a", PROMPT) is None  # the approximate index serves it now
    assert index.gaps("a") == 1
    apply(index, "a", 6, {"type": "AllBlocksCleared"})
    assert index.known("a")
    apply(index, "a", 7, stored_map([11, 12, 13], None, PROMPT))
    assert index.matched("a", PROMPT) == (3, 12)


def test_after_a_gap_enough_new_blocks_make_the_state_known_again() -> None:
    index = KvIndex(resync_blocks=3)
    apply(index, "a", 0, stored_map([11], None, PROMPT[:4]))
    apply(index, "a", 9, stored_map([31, 32], None, [1, 2, 3, 4, 5, 6, 7, 8]))
    assert not index.known("a")
    apply(index, "a", 10, stored_map([41], None, [7, 7, 7, 7]))
    assert index.known("a")  # 3 blocks stored since the gap
    # what was held before the gap was dropped: a subset of the truth, never a guess
    assert index.matched("a", PROMPT) == (0, 0)
    assert index.matched("a", [1, 2, 3, 4, 5, 6, 7, 8]) == (2, 8)


def test_a_router_that_starts_late_learns_from_its_first_message() -> None:
    """Servers publish long before a (re)started router subscribes: its first message has a
    later sequence. Waiting for ``resync_blocks`` new blocks left a router that joined a
    tiny real vLLM pool (1,024 blocks in all) on the estimate for its whole run, and a
    conversation's turns spread 5/5/2 over three servers (tests/vllm/test_router_vllm.py).
    What it missed counts as not held; what is stored from now on is seen."""
    index = KvIndex(resync_blocks=10)
    apply(index, "a", 412, stored_map([11], None, PROMPT[:4]))
    assert index.known("a")
    assert index.gaps("a") == 0
    assert index.matched("a", PROMPT) == (1, 4)
    apply(index, "a", 413, stored_map([12], 11, PROMPT[4:8]))
    assert index.matched("a", PROMPT) == (2, 8)
    # a child of a block stored before the router listened: no chain reaches it, not held
    apply(index, "a", 414, stored_map([99], 77, [5, 5, 5, 5]))
    assert index.matched("a", [1, 1, 1, 1, 5, 5, 5, 5]) == (0, 0)
    assert index.matched("b", PROMPT) is None  # never heard from: not known


def test_a_reconnect_with_a_later_sequence_is_a_gap() -> None:
    index = KvIndex(resync_blocks=10)
    apply(index, "a", 0, stored_map([11], None, PROMPT[:4]))
    index.lost("a")
    apply(index, "a", 9, stored_map([21], None, [9, 9, 9, 9]))  # 1..8 lost meanwhile
    assert not index.known("a")
    assert index.matched("a", PROMPT) is None


def test_a_restarted_server_starts_again_at_zero_empty() -> None:
    index = KvIndex()
    apply(index, "a", 0, stored_map([11, 12], None, PROMPT[:8]))
    apply(index, "a", 1, stored_map([13], 12, PROMPT[8:]))
    apply(index, "a", 0, stored_map([51], None, [5, 5, 5, 5]))  # a new process
    assert index.known("a")
    assert index.matched("a", PROMPT) == (0, 0)
    assert index.matched("a", [5, 5, 5, 5]) == (1, 4)


def test_a_replayed_message_is_applied_once() -> None:
    index = KvIndex()
    apply(index, "a", 0, stored_map([11, 12, 13], None, PROMPT))
    apply(index, "a", 1, ["BlockRemoved", [13], "GPU"])
    apply(index, "a", 1, stored_map([13], 12, PROMPT[8:]))  # seq 1 again: a repeat, ignored
    assert index.matched("a", PROMPT) == (2, 8)
    assert index.known("a")


def test_a_lost_subscription_makes_the_state_unknown() -> None:
    index = KvIndex(resync_blocks=5)
    apply(index, "a", 0, stored_map([11], None, PROMPT[:4]))
    index.lost("a")
    assert index.matched("a", PROMPT) is None
    apply(index, "a", 3, {"type": "AllBlocksCleared"})
    assert index.known("a")


def test_blocks_off_the_gpu_or_without_a_known_parent_do_not_count() -> None:
    index = KvIndex()
    apply(index, "a", 0, stored_map([11], None, PROMPT[:4], medium="CPU"))
    apply(index, "a", 1, stored_map([12], 999, PROMPT[4:8]))  # parent 999 never stored
    apply(index, "a", 2, stored_map([14], None, PROMPT[:4], group_idx=1))
    assert index.blocks("a") == 0
    assert index.matched("a", PROMPT) == (0, 0)


def test_the_same_prefix_under_two_hashes_is_counted() -> None:
    """Two vLLM hashes with the same tokens (a LoRA or a salt apart): one key, held twice."""
    index = KvIndex()
    apply(index, "a", 0, stored_map([11], None, PROMPT[:4]), stored_map([71], None, PROMPT[:4]))
    apply(index, "a", 1, ["BlockRemoved", [11], "GPU"])
    assert index.matched("a", PROMPT) == (1, 4)
    apply(index, "a", 2, ["BlockRemoved", [71], "GPU"])
    assert index.matched("a", PROMPT) == (0, 0)


def test_an_endpoint_holds_at_most_its_capacity_oldest_out() -> None:
    index = KvIndex(max_blocks=2)
    apply(index, "a", 0, stored_map([11, 12, 13], None, PROMPT))
    assert index.blocks("a") == 2
    assert index.matched("a", PROMPT) == (0, 0)  # the first block went first
    index.set_capacity("a", 10)  # num_gpu_blocks 10: 10 and 10 % held at most
    apply(index, "a", 1, stored_map([11], None, PROMPT[:4]))
    apply(index, "a", 2, stored_map([21 + i for i in range(12)], None, [5] * 48))
    assert index.blocks("a") == 11


def test_the_bound_holds_per_message_not_per_event() -> None:
    """A full server's step stores new blocks and evicts old ones in one message, in
    either order: the hot first block it keeps must not be dropped on the way."""
    index = KvIndex(max_blocks=3)
    apply(index, "a", 0, stored_map([11, 12, 13], None, PROMPT))
    apply(
        index,
        "a",
        1,
        stored_map([31, 32], 11, [7] * 8),  # a new branch after the shared first block
        ["BlockRemoved", [12, 13], "GPU"],  # ... and what made room for it
    )
    assert index.matched("a", PROMPT) == (1, 4)
    assert index.matched("a", PROMPT[:4] + [7] * 8) == (3, 12)


def test_endpoints_tracked_are_bounded() -> None:
    index = KvIndex(max_endpoints=2)
    for i, name in enumerate("abc"):
        apply(index, name, 0, stored_map([i], None, PROMPT[:4]))
    assert index.endpoints() == ["b", "c"]


def test_chain_keys_depend_on_every_token_before() -> None:
    a = chain(list(range(16)), 4)
    b = chain([99, *range(1, 16)], 4)
    assert len(a) == 4
    assert all(x != y for x, y in zip(a, b, strict=True))
    assert chain(list(range(16)), 4, limit=2) == a[:2]
    assert chain([1, 2, 3], 4) == []


def test_memory_per_block_is_bounded() -> None:
    """A full endpoint of 20,000 blocks: the index's own cost per block, measured."""
    blocks = 20_000
    tokens = list(range(blocks * BS))
    index = KvIndex(max_blocks=blocks)
    apply(index, "a", 0)  # known, empty
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        parent = None
        for seq, start in enumerate(range(0, blocks, 100), start=1):
            hashes = [(1 << 62) + start + i for i in range(100)]
            event = BlockStored(
                tuple(hashes), parent, tuple(tokens[start * BS : (start + 100) * BS]), BS
            )
            index.apply("a", seq, EventBatch(0.0, (event,)))
            parent = hashes[-1]
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert index.blocks("a") == blocks
    per_block = used / blocks
    assert per_block < 400, per_block  # two table entries and two 64-bit ints
    assert index.matched("a", tokens) == (blocks, blocks * BS)
