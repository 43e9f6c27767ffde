"""Cached responses: what is stored, and the ready-to-send bytes of a hit (pure).

An :class:`Entry` keeps the upstream's status, the end-to-end response
headers (hop-by-hop headers and framing removed) and the complete body. A
hit is answered with bytes built once per entry and tier, so the hit path
does no formatting. For an SSE response the body is the complete event
stream, replayed as ``text/event-stream``.

The L2 wire form is a small versioned binary envelope (:meth:`Entry.dumps`);
anything that does not parse is a :class:`CorruptEntry` and is treated as a
miss by the caller.
"""

from __future__ import annotations

import struct
from http import HTTPStatus

#: Response headers that describe the connection or the framing, never the
#: content: not stored, not forwarded as is.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
        b"content-length",
        b"x-cache",
        b"date",
    }
)

#: An L1 value: (tenant, the complete HIT-L1 response).
L1Value = tuple[str, bytes]
#: Bytes an L1 value costs beyond its response bytes (dict slot, tuple, key).
L1_OVERHEAD_BYTES = 160

_MAGIC = b"CF1"
_HEAD = struct.Struct("!3sBHBII")  # magic, flags, status, tenant len, headers len, body len
_FLAG_STREAM = 1


class CorruptEntry(ValueError):
    """Stored bytes that are not an entry this version understands."""


def reason_phrase(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b"Unknown"


def header_block(headers: list[tuple[bytes, bytes]]) -> bytes:
    """``name: value\\r\\n`` lines of the end-to-end headers, in order."""
    return b"".join(
        name + b": " + value + b"\r\n" for name, value in headers if name.lower() not in HOP_BY_HOP
    )


class Entry:
    """One cached response."""

    __slots__ = ("body", "headers", "status", "stream", "tenant")

    def __init__(
        self, status: int, headers: bytes, body: bytes, *, stream: bool, tenant: str
    ) -> None:
        self.tenant = tenant
        self.status = status
        self.headers = headers
        self.body = body
        self.stream = stream

    def response(self, x_cache: bytes) -> bytes:
        """The complete HTTP/1.1 response with ``X-Cache: <x_cache>``."""
        return (
            b"HTTP/1.1 %d %s\r\n%scontent-length: %d\r\nx-cache: %s\r\n\r\n"
            % (self.status, reason_phrase(self.status), self.headers, len(self.body), x_cache)
            + self.body
        )

    @property
    def hit_l1(self) -> bytes:
        """The ready-to-send bytes of an L1 hit."""
        return self.response(b"HIT-L1")

    def l1_value(self) -> tuple[L1Value, int]:
        """What L1 keeps of this entry, and what it costs there in bytes.

        L1 holds a plain ``(tenant, ready-to-send bytes)`` tuple, not the
        entry: a tuple of atomic values is untracked by Python's cyclic GC, so
        a large L1 adds nothing to collection pauses.
        """
        hit = self.hit_l1
        return (self.tenant, hit), len(hit) + L1_OVERHEAD_BYTES

    def dumps(self) -> bytes:
        flags = _FLAG_STREAM if self.stream else 0
        tenant = self.tenant.encode()
        head = _HEAD.pack(
            _MAGIC, flags, self.status, len(tenant), len(self.headers), len(self.body)
        )
        return head + tenant + self.headers + self.body

    @classmethod
    def loads(cls, data: bytes) -> Entry:
        if len(data) < _HEAD.size:
            raise CorruptEntry("short entry")
        magic, flags, status, tlen, hlen, blen = _HEAD.unpack_from(data)
        if magic != _MAGIC or _HEAD.size + tlen + hlen + blen != len(data):
            raise CorruptEntry("bad envelope")
        if not 200 <= status < 300:
            raise CorruptEntry(f"stored status {status}")
        start = _HEAD.size
        try:
            tenant = data[start : start + tlen].decode()
        except UnicodeDecodeError as exc:
            raise CorruptEntry("bad tenant") from exc
        start += tlen
        headers = data[start : start + hlen]
        body = data[start + hlen :]
        return cls(status, headers, body, stream=bool(flags & _FLAG_STREAM), tenant=tenant)
