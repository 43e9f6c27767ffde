"""The versioned L2 entry: its head, the optional L1-key line, and judging a read.

A versioned entry is stored as its head (the encoded epoch vector and a
newline), optionally a line ``#<L1 key hex>``, then the entry. A reader sends
``GET`` and the fence's ``HMGET`` (:func:`fence_command`) and judges the replies
(:func:`judge_versioned_read`). The rules are in docs/redis-protocol.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from cachefleet_common import resp
from cachefleet_common.contract.names import tenant_epochs_key
from cachefleet_common.epochs import EpochVector, encode_vector


def vector_args(vector: EpochVector) -> list[str]:
    """ARGV tail of the versioned L2 scripts: the encoded vector, then scope, epoch pairs."""
    args = [encode_vector(vector)]
    for scope, epoch in vector:
        args += [scope, str(epoch)]
    return args


def fence_command(cache: str, tenant: str, vector: EpochVector) -> bytes:
    """The packed ``HMGET`` of ``tenant``'s fence for the scopes of ``vector``, in its order."""
    if not vector:
        return b""
    return resp.pack_command(("HMGET", tenant_epochs_key(cache, tenant), *(s for s, _ in vector)))


def entry_head(vector: EpochVector) -> bytes:
    """What a versioned entry written under ``vector`` starts with."""
    return encode_vector(vector).encode() + b"\n"


#: :func:`judge_versioned_read`'s verdicts besides a hit (which returns the value).
READ_MISS: Final = 0
READ_STALE_ENTRY: Final = 2
READ_BEHIND: Final = -1


def judge_versioned_read(
    value: bytes | None, fence: Sequence[bytes | None], vector: EpochVector, head: bytes
) -> bytes | int:
    """The verdict on a versioned read's ``GET`` and fence ``HMGET`` replies.

    The value without its head (a hit), :data:`READ_BEHIND` (a fence field is
    ahead of ``vector``: the reader missed an invalidation and must not be
    served), :data:`READ_MISS`, or :data:`READ_STALE_ENTRY` (a value that is
    not an entry of ``vector``: written under other epochs, or corrupt).
    """
    if fence_ahead(fence, vector):
        return READ_BEHIND
    return judge_entry(value, head)


def fence_ahead(fence: Sequence[bytes | None], vector: EpochVector) -> bool:
    """Whether a field of the fence's ``HMGET`` reply is ahead of ``vector`` (same order)."""
    for seen, (_, epoch) in zip(fence, vector, strict=True):
        if seen is not None and int(seen) > epoch:
            return True
    return False


def judge_entry(value: bytes | None, head: bytes) -> bytes | int:
    """:func:`judge_versioned_read` of a read whose fence is not ahead of its vector."""
    if value is None:
        return READ_MISS
    if not value.startswith(head):
        return READ_STALE_ENTRY
    start = len(head)
    return value[_l1_id_at(value, start)[1] :]  # one copy of the entry


#: Starts the optional L1-key line between a versioned entry's head and the entry.
L1_ID_MARK: Final = b"#"


def l1_id_line(l1_id: int) -> bytes:
    """The line a writer puts before its entry: ``#<L1 key hex>\n``."""
    return b"#%x\n" % l1_id


def split_l1_id(body: bytes) -> tuple[int | None, bytes]:
    """(the writer's L1 key or None, the entry) of what follows a versioned entry's head."""
    l1_id, start = _l1_id_at(body, 0)
    return l1_id, body[start:] if start else body


def _l1_id_at(data: bytes, start: int) -> tuple[int | None, int]:
    """(the writer's L1 key or None, where the entry starts) of what follows a versioned
    entry's head at ``start`` in ``data``: no copy is made."""
    if data[start : start + 1] != L1_ID_MARK:
        return None, start
    end = data.find(b"\n", start + 1, start + 40)
    if end < 0:
        return None, start
    try:
        return int(data[start + 1 : end], 16), end + 1
    except ValueError:
        return None, start
