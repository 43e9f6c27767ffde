"""Mooncake-format traces: where the shared one lives, and one reader for the benchmarks.

One request a line: ``timestamp`` (ms), ``input_length`` (tokens),
``output_length``, ``hash_ids`` (the prompt as 512-token KV-block hashes;
equal prefixes share leading ids). ``cachefleet bench routing`` and the
admission replay read it through :func:`load_trace`; ``cachefleet bench
policies`` needs only the ``hash_ids`` and reads them itself, with the same
:class:`TraceError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

#: The shared Mooncake synthetic trace: ``../shared/data/`` next to the checkout.
DEFAULT_TRACE = (
    Path(__file__).resolve().parents[3] / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
)
#: Tokens per block of the Mooncake traces' ``hash_ids``.
BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the line and the field."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of the trace, its arrival already in seconds."""

    arrival: float
    input_length: int
    blocks: tuple[int, ...]


def load_trace(path: Path, *, speed: float = 1.0, limit: int | None = None) -> list[TraceRequest]:
    """The trace's requests in arrival order (``limit``: the file's first ones).

    Arrival times are the timestamps in seconds divided by ``speed``; equal
    timestamps keep the file's order. Raises :class:`TraceError` naming the
    line and the field.
    """
    if speed <= 0:
        raise TraceError(f"--speed must be positive, not {speed}")
    out: list[TraceRequest] = []
    try:
        f = path.open("rb")
    except OSError as exc:
        raise TraceError(f"--trace {path}: {exc.strerror}") from None
    with f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise TraceError(f"{path}:{number}: not JSON ({exc})") from None
            if not isinstance(record, dict):
                raise TraceError(f"{path}:{number}: not a JSON object")
            ts, length, ids = (record.get(k) for k in ("timestamp", "input_length", "hash_ids"))
            if (
                not isinstance(ts, int | float)
                or isinstance(ts, bool)
                or not 0 <= ts < float("inf")
            ):
                raise TraceError(f"{path}:{number}: 'timestamp' must be a number of ms >= 0")
            if not isinstance(length, int) or isinstance(length, bool) or length < 0:
                raise TraceError(f"{path}:{number}: 'input_length' must be an integer >= 0")
            if not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in ids
            ):
                raise TraceError(f"{path}:{number}: 'hash_ids' must be a list of integers")
            out.append(TraceRequest(ts / 1000.0 / speed, length, tuple(ids)))
    if not out:
        raise TraceError(f"{path}: no requests")
    out.sort(key=lambda r: r.arrival)
    return out
