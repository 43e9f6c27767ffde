"""The router's decoders against what a real vLLM 0.32 server sent (tests/data/vllm)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from cachefleet_common.modelserver import vllm_cache_config
from cachefleet_router.kvevents import BlockRemoved, BlockStored, decode_frame, event_sources
from cachefleet_router.kvindex import KvIndex
from cachefleet_router.tokens import tokens_from_answer

DATA = Path(__file__).parents[1] / "data" / "vllm"


def load(name: str) -> Any:
    return json.loads((DATA / name).read_text())


def frames() -> list[Any]:
    out = []
    for frame in load("kv_events_sequence.json")["frames"]:
        parts = [base64.b64decode(p) for p in frame["frames_b64"]]
        out.append(decode_frame(parts))
    return out


def test_every_captured_frame_decodes_in_sequence() -> None:
    decoded = frames()
    assert [f.seq for f in decoded] == list(range(10))
    assert {f.topic for f in decoded} == {"kv-events"}
    assert all(f.batch.dp_rank == 0 for f in decoded)
    first = decoded[0].batch.events[0]
    assert isinstance(first, BlockStored)
    assert (len(first.block_hashes), len(first.token_ids), first.block_size) == (3, 96, 32)
    assert first.parent_block_hash is None
    assert first.medium == "GPU"


def test_the_captured_run_replayed_into_the_index() -> None:
    decoded = frames()
    index = KvIndex(resync_blocks=10_000)
    index.set_capacity("vllm", 40)
    chat = decoded[0].batch.events[0]
    first_long = decoded[1].batch.events[0]
    decode_block = decoded[2].batch.events[0]
    assert isinstance(chat, BlockStored)
    assert isinstance(first_long, BlockStored)
    assert isinstance(decode_block, BlockStored)

    index.apply("vllm", 0, decoded[0].batch)
    assert index.known("vllm")  # a fresh server: sequence 0
    assert index.matched("vllm", [*list(chat.token_ids), 9, 9]) == (3, 96)
    index.apply("vllm", 1, decoded[1].batch)
    index.apply("vllm", 2, decoded[2].batch)
    # the decode block chains onto the prompt's last block through its parent hash
    assert decode_block.parent_block_hash == first_long.block_hashes[-1]
    long_tokens = list(first_long.token_ids) + list(decode_block.token_ids)
    assert index.matched("vllm", long_tokens) == (22, 22 * 32)

    removed: set[int] = set()
    for frame in decoded[3:9]:
        index.apply("vllm", frame.seq, frame.batch)
        removed.update(
            h for e in frame.batch.events if isinstance(e, BlockRemoved) for h in e.block_hashes
        )
        assert index.blocks("vllm") <= 40  # never more than the server's 40 blocks
    assert set(chat.block_hashes) <= removed  # evicted by the long prompts...
    assert index.matched("vllm", chat.token_ids) == (0, 0)  # ... and the index knows it
    assert index.gaps("vllm") == 0

    index.apply("vllm", 9, decoded[9].batch)  # POST /reset_prefix_cache
    assert index.known("vllm")
    assert index.blocks("vllm") == 0


def test_the_captured_kv_event_sources_name_a_bound_publisher() -> None:
    sources = event_sources(load("kv_event_sources.json"), "127.0.0.1")
    assert len(sources) == 1
    assert sources[0].address.startswith("tcp://127.0.0.1:")  # "*" -> the endpoint's host
    assert sources[0].address.endswith(":48541")
    assert sources[0].topic == "kv-events"


def test_the_captured_tokenize_answers_and_block_size() -> None:
    chat = load("tokenize_messages.json")["response"]
    assert tokens_from_answer(chat) == tuple(chat["tokens"])
    assert len(tokens_from_answer(chat) or ()) == chat["count"]
    assert tokens_from_answer({"error": "no"}) is None
    assert vllm_cache_config((DATA / "metrics.txt").read_text()) == (32, 40)
    assert vllm_cache_config("vllm:num_requests_waiting 0\n") is None
