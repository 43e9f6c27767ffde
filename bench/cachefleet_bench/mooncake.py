"""Mooncake-format traces: where they live, and one reader for the benchmarks.

One request a line: ``timestamp`` (ms), ``input_length`` (tokens),
``output_length``, ``hash_ids`` (the prompt as 512-token KV-block hashes;
equal prefixes share leading ids); plain or gzip-compressed (``.gz``).
:func:`read_records` opens and parses every trace; ``cachefleet bench
routing`` and the admission replay take whole requests through
:func:`load_trace`, ``cachefleet bench policies`` only the ``hash_ids``.

Conversations: the traces carry no conversation or session id. A request's
conversation is named by :func:`conversation_ids`: its first block that is
not part of a *shared prefix*, a chain of blocks that forks, in the trace,
into at least :data:`SHARED_FANOUT` distinct next blocks (a system prompt
that many conversations start with). In the conversation trace every request
starts with block 0, followed by 7,373 distinct blocks (one per
conversation); no other block of it is followed by more than 11, and none of
the synthetic trace by more than 13, so there a conversation is its first
block, as before.
"""

from __future__ import annotations

import gzip
import itertools
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The shared Mooncake synthetic trace: ``../shared/data/`` next to the checkout.
DEFAULT_TRACE = (
    Path(__file__).resolve().parents[3] / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
)
#: Mooncake's real conversation trace, shipped with the bench (data/README.md).
CONVERSATION_TRACE = Path(__file__).parent / "data" / "mooncake_conversation_trace.jsonl.gz"
#: Traces ``--trace`` also takes by name.
NAMED_TRACES = {"synthetic": DEFAULT_TRACE, "conversation": CONVERSATION_TRACE}
#: Tokens per block of the Mooncake traces' ``hash_ids``.
BLOCK_TOKENS = 512
#: A block followed by at least this many distinct blocks is a prefix shared by
#: conversations, not one conversation's (:func:`conversation_ids`).
SHARED_FANOUT = 32


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the line and the field."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of the trace, its arrival already in seconds."""

    arrival: float
    input_length: int
    blocks: tuple[int, ...]


def conversation_ids(prompts: Sequence[Sequence[int]]) -> list[int | None]:
    """Each prompt's conversation: its first block that is not part of a prefix many share.

    Over all ``prompts``, the blocks that follow each block are counted; a block
    is *shared* when the first block at or after it (following blocks that only
    one block ever follows) is followed by at least :data:`SHARED_FANOUT`
    distinct blocks: a system prompt of several blocks that many conversations
    start with. A prompt made only of shared blocks is named by its last one; an
    empty prompt by None. Mooncake's block ids stand for the whole prefix up to
    them, so a block id names one prefix.
    """
    following: dict[int, set[int]] = {}
    for blocks in prompts:
        for here, after in itertools.pairwise(blocks):
            nexts = following.setdefault(here, set())
            if len(nexts) < SHARED_FANOUT:
                nexts.add(after)
    branching: dict[int, int] = {}  # block -> distinct blocks following where its chain forks

    def fanout(block: int) -> int:
        chain: list[int] = []
        at = block
        while at not in branching:
            nexts = following.get(at, set())
            if len(nexts) != 1 or at in chain:  # a fork, an end, or a loop (not Mooncake's)
                branching[at] = len(nexts)
                break
            chain.append(at)
            at = next(iter(nexts))
        for passed in chain:
            branching[passed] = branching[at]
        return branching[block]

    out: list[int | None] = []
    for blocks in prompts:
        named = blocks[-1] if blocks else None
        for block in blocks:
            if fanout(block) < SHARED_FANOUT:
                named = block
                break
        out.append(named)
    return out


def trace_path(text: str) -> Path:
    """A trace named in :data:`NAMED_TRACES`, else the path ``text``."""
    return NAMED_TRACES.get(text) or Path(text)


def read_records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for each non-blank line, plain or ``.gz``.

    Raises :class:`TraceError` naming the file (and the line): a file that
    cannot be opened or decompressed, a line that is not a JSON object.
    """
    try:
        # Opened apart from the `with` below so that a failure names the flag.
        f = gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")  # noqa: SIM115
    except OSError as exc:
        raise TraceError(f"--trace {path}: {exc.strerror}") from None
    with f:
        try:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    raise TraceError(f"{path}:{number}: not JSON ({exc})") from None
                if not isinstance(record, dict):
                    raise TraceError(f"{path}:{number}: not a JSON object")
                yield number, record
        except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError
            raise TraceError(f"{path}: cannot be read ({exc})") from None


def load_trace(path: Path, *, speed: float = 1.0, limit: int | None = None) -> list[TraceRequest]:
    """The trace's requests in arrival order (``limit``: the file's first ones).

    Arrival times are the timestamps in seconds divided by ``speed``; equal
    timestamps keep the file's order. Raises :class:`TraceError` naming the
    line and the field.
    """
    if speed <= 0:
        raise TraceError(f"--speed must be positive, not {speed}")
    out: list[TraceRequest] = []
    records = read_records(path)
    for number, record in records:
        if limit is not None and len(out) >= limit:
            records.close()
            break
        ts, length = record.get("timestamp"), record.get("input_length")
        if not isinstance(ts, int | float) or isinstance(ts, bool) or not 0 <= ts < float("inf"):
            raise TraceError(f"{path}:{number}: 'timestamp' must be a number of ms >= 0")
        if not isinstance(length, int) or isinstance(length, bool) or length < 0:
            raise TraceError(f"{path}:{number}: 'input_length' must be an integer >= 0")
        ids = hash_ids(path, number, record)
        out.append(TraceRequest(ts / 1000.0 / speed, length, tuple(ids)))
    if not out:
        raise TraceError(f"{path}: no requests")
    out.sort(key=lambda r: r.arrival)
    return out


def hash_ids(path: Path, number: int, record: dict[str, Any]) -> list[int]:
    """The record's ``hash_ids``; raises :class:`TraceError` naming the line."""
    ids = record.get("hash_ids")
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
        raise TraceError(f"{path}:{number}: 'hash_ids' must be a list of integers")
    return ids
