"""vLLM's KV-cache events, decoded from their ZMQ frames (pure: bytes in, records out).

A vLLM server started with ``--kv-events-config`` publishes, per engine step
that changed its prefix cache, one ZMQ multipart message (vLLM's
``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``):

1. the topic (bytes; ``kv-events`` by default, llm-d deploys ``kv@<pod address>@<model>``);
2. a sequence number, 8 bytes big-endian, +1 per message of the publisher;
3. a msgpack ``EventBatch``, an array ``[ts, events, data_parallel_rank]``
   (the rank omitted when None).

Each event is ``BlockStored``, ``BlockRemoved`` or ``AllBlocksCleared``, in one of
two encodings: a map with a ``"type"`` key (vLLM today: tagged msgspec structs),
or a positional array whose first element is the type (older vLLM, which
declared the events ``array_like``). Positional field order, from vLLM's
structs:

* ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name, extra_keys, group_idx, ...]``
* ``["BlockRemoved", block_hashes, medium, group_idx, ...]``
* ``["AllBlocksCleared"]``

Later fields may be missing (older servers); unknown event types are skipped;
anything else malformed raises :class:`KvEventError`. Block hashes are ints
or bytes (sha256 digests in newer vLLM); both are folded to a 64-bit int key
(:func:`hash_key`), so the index never needs vLLM's hash function.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

#: the medium of blocks in GPU memory (None from servers that do not say)
MEDIUM_GPU = "GPU"


class KvEventError(ValueError):
    """A frame or event that is not what vLLM publishes."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[KvEvent, ...]
    dp_rank: int | None = None


@dataclass(frozen=True, slots=True)
class Frame:
    """One ZMQ message of a publisher."""

    topic: str
    seq: int
    batch: EventBatch


def hash_key(value: Any) -> int:
    """A block hash as a 64-bit int: ints as they are (masked), bytes by their first 8."""
    if isinstance(value, bool):
        raise KvEventError(f"not a block hash: {value!r}")
    if isinstance(value, int):
        return value & 0xFFFFFFFFFFFFFFFF
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(bytes(value[:8]).ljust(8, b"\0"), "big")
    raise KvEventError(f"not a block hash: {value!r}")


def _hashes(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list | tuple):
        raise KvEventError(f"block_hashes must be a list, not {type(value).__name__}")
    return tuple(hash_key(v) for v in value)


def _opt_int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise KvEventError(f"{name} must be an int or nil, not {value!r}")


def _opt_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _stored(fields: dict[str, Any]) -> BlockStored:
    tokens = fields.get("token_ids")
    if not isinstance(tokens, list | tuple) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise KvEventError("BlockStored.token_ids must be a list of ints")
    size = fields.get("block_size")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise KvEventError(f"BlockStored.block_size must be a positive int, not {size!r}")
    parent = fields.get("parent_block_hash")
    return BlockStored(
        block_hashes=_hashes(fields.get("block_hashes")),
        parent_block_hash=None if parent is None else hash_key(parent),
        token_ids=tuple(tokens),
        block_size=size,
        medium=_opt_str(fields.get("medium")),
        group_idx=_opt_int(fields.get("group_idx"), "group_idx"),
    )


def _removed(fields: dict[str, Any]) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=_hashes(fields.get("block_hashes")),
        medium=_opt_str(fields.get("medium")),
        group_idx=_opt_int(fields.get("group_idx"), "group_idx"),
    )


#: positional field names after the type, per event (vLLM's struct field order)
_POSITIONAL = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


def decode_event(raw: Any) -> KvEvent | None:
    """One event in either encoding; None for a type this router does not know."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        fields = raw
    elif isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _POSITIONAL.get(kind, ())
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise KvEventError(f"not an event: {raw!r:.80}")
    if kind == "BlockStored":
        return _stored(fields)
    if kind == "BlockRemoved":
        return _removed(fields)
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    if not isinstance(kind, str):
        raise KvEventError(f"an event without a type: {raw!r:.80}")
    return None


def decode_batch(payload: bytes) -> EventBatch:
    """The msgpack ``[ts, events, dp_rank]`` of one message."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise KvEventError(f"not msgpack: {exc}") from exc
    if isinstance(raw, dict):  # a map-encoded batch (not vLLM's, but cheap to accept)
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")]
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise KvEventError("an event batch is [ts, events, dp_rank]")
    ts = raw[0]
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise KvEventError(f"batch ts must be a number, not {ts!r}")
    events = tuple(e for e in (decode_event(x) for x in raw[1]) if e is not None)
    rank = _opt_int(raw[2], "data_parallel_rank") if len(raw) > 2 else None
    return EventBatch(float(ts), events, rank)


def decode_frame(parts: Sequence[bytes]) -> Frame:
    """A ZMQ multipart message: (topic, 8-byte big-endian sequence, payload)."""
    if len(parts) != 3:
        raise KvEventError(f"a KV event message has 3 parts, not {len(parts)}")
    topic, seq, payload = parts
    if len(seq) != 8:
        raise KvEventError(f"the sequence part has 8 bytes, not {len(seq)}")
    return Frame(
        topic=bytes(topic).decode("utf-8", "replace"),
        seq=int.from_bytes(seq, "big", signed=True),
        batch=decode_batch(bytes(payload)),
    )


def encode_frame(topic: str, seq: int, events: Sequence[Any], ts: float = 0.0) -> list[bytes]:
    """A frame as vLLM sends it (``events`` already in either encoding): for tests and tools."""
    return [
        topic.encode(),
        seq.to_bytes(8, "big", signed=True),
        msgpack.packb([ts, list(events)], use_bin_type=True),
    ]


@dataclass(frozen=True, slots=True)
class Source:
    """A publisher a subscriber connects to."""

    #: ``tcp://host:port``
    address: str
    #: the topic prefix to subscribe to ("" = all)
    topic: str = ""
    rank: int | None = None


_WILDCARDS = {"*", "0.0.0.0", "::", "[::]", ""}


def event_sources(doc: Any, host: str) -> list[Source]:
    """The ZMQ publishers a ``GET /kv_event_sources`` answer names, as ``host`` reaches them.

    vLLM 0.32 answers ``{"<rank>": <its KV events config>}``; other versions a list of
    ``{"endpoint", "topic", "data_parallel_rank", ...}`` (bare or under ``"sources"``).
    An endpoint bound on a wildcard (``tcp://*:5557``) is reached at ``host`` on that
    port; one naming a host is taken as given. Only data-parallel rank 0 (or unsaid) is
    kept: each rank publishes its own sequence. Non-ZMQ publishers are skipped.
    """
    entries: list[tuple[Any, Any]] = []
    if isinstance(doc, dict) and isinstance(doc.get("sources"), list):
        doc = doc["sources"]
    if isinstance(doc, list):
        entries = [(None, e) for e in doc]
    elif isinstance(doc, dict):
        entries = list(doc.items())
    out: list[Source] = []
    for key, entry in entries:
        if not isinstance(entry, dict):
            continue
        if entry.get("enable_kv_cache_events") is False:
            continue
        publisher = entry.get("publisher", entry.get("transport", "zmq"))
        if publisher not in ("zmq", None):
            continue
        rank = entry.get("data_parallel_rank")
        if rank is None and isinstance(key, str) and key.isdigit():
            rank = int(key)
        if isinstance(rank, int) and rank != 0:
            continue
        endpoint = entry.get("endpoint")
        if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
            continue
        where, sep, port = endpoint[len("tcp://") :].rpartition(":")
        if not sep or not port.isdigit():
            continue
        if where in _WILDCARDS:
            where = f"[{host}]" if ":" in host and not host.startswith("[") else host
        topic = entry.get("topic")
        out.append(
            Source(
                f"tcp://{where}:{port}",
                topic if isinstance(topic, str) else "",
                rank if isinstance(rank, int) else None,
            )
        )
    return out
