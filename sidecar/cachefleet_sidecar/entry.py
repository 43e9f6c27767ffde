"""Cached responses: what is stored, and the ready-to-send bytes of a hit (pure).

An :class:`Entry` keeps the upstream's status, the end-to-end response
headers (hop-by-hop headers and framing removed) and the complete body. A
hit is answered with bytes built once per entry and tier, so the hit path
does no formatting. For an SSE response the body is the complete event
stream, replayed as ``text/event-stream``.

Only correct answers become entries: :func:`answer_problem` is asked before
an answer is stored and again when an entry comes back from Redis. A correct
answer is a 200 whose body is a complete JSON object that is not an OpenAI
error object, or (streamed) a complete SSE stream that ends in its terminal
``data: [DONE]`` and carries no error event; an answer with ``Set-Cookie`` or
``Cache-Control: no-store`` is never stored.

The L2 wire form is a small versioned binary envelope (:meth:`Entry.dumps`).
:meth:`Entry.loads` checks the envelope, the header block (well-formed
``name: value`` lines, no framing or hop-by-hop header, so a stored entry
can never change the framing of the response it is served in) and the answer
itself; anything else is a :class:`CorruptEntry`, which the caller counts and
treats as a miss.
"""

from __future__ import annotations

import re
import struct
from http import HTTPStatus

import orjson

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
#: Bytes an L1 value costs beyond its response bytes: the bytes object's header, the
#: value tuple, the key (a 64-bit int), the policy's record (size, cost, tuple) and its
#: share of the policy's dict(s). Measured with tracemalloc at about 280 (LRU), 320
#: (LIRS) and 345 (SITS) bytes; one figure keeps every policy within 15 % of the truth
#: (tests/unit/test_l1.py::test_counted_bytes_are_what_an_entry_really_holds).
L1_OVERHEAD_BYTES = 320

_MAGIC = b"CF1"
_HEAD = struct.Struct("!3sBHBII")  # magic, flags, status, tenant len, headers len, body len
_FLAG_STREAM = 1


class CorruptEntry(ValueError):
    """Stored bytes that are not an entry this version understands."""


#: One header line: a lower-case token name, ": ", a value without control characters.
_LINE = rb"([!#$%&'*+\-.^_`|~0-9a-z]+): ([\t\x20-\x7e\x80-\xff]*)\r\n"
_LINES = re.compile(_LINE)
_BLOCK = re.compile(rb"(?:" + _LINE + rb")*")


def check_header_block(block: bytes) -> list[tuple[bytes, bytes]]:
    """The ``(name, value)`` pairs of a stored header block; raise :class:`CorruptEntry`.

    A block is ``name: value\r\n`` lines: lower-case token names, values
    without control characters, and no header that frames or routes the
    response (:data:`HOP_BY_HOP`): the sidecar frames every response itself.
    The block is checked by one regular expression, not line by line (this
    runs on every L2 hit).
    """
    if not block:
        return []
    if not block.endswith(b"\r\n"):
        raise CorruptEntry("header block not terminated")
    if _BLOCK.fullmatch(block) is None:
        raise CorruptEntry("malformed header line")
    pairs: list[tuple[bytes, bytes]] = _LINES.findall(block)
    for name, _ in pairs:
        if name in HOP_BY_HOP:
            raise CorruptEntry(f"framing header {name.decode()!r} in a stored entry")
    return pairs


#: Header blocks found well-formed, and their pairs: the check is a pure function of the
#: bytes, and the blocks of one upstream repeat (only a well-formed block is kept).
_checked_blocks: dict[bytes, list[tuple[bytes, bytes]]] = {}
_CHECKED_BLOCKS_LIMIT = 1024
_CHECKED_BLOCK_MAX_BYTES = 1024


def _error_object(doc: object) -> bool:
    return isinstance(doc, dict) and ("error" in doc or doc.get("object") == "error")


def _sse_problem(body: bytes) -> str | None:
    text = body.replace(b"\r\n", b"\n").replace(b"\r", b"\n") if b"\r" in body else body
    if not (
        text.endswith((b"\ndata: [DONE]\n\n", b"\ndata:[DONE]\n\n"))
        or text
        in (
            b"data: [DONE]\n\n",
            b"data:[DONE]\n\n",
        )
    ):
        return "stream does not end with its terminal data: [DONE]"
    if b"error" not in text:
        return None  # fast path: no event can name or carry an error
    for event in text.split(b"\n\n"):
        for line in event.split(b"\n"):
            name, _, value = line.partition(b":")
            value = value[1:] if value.startswith(b" ") else value
            if name == b"event" and b"error" in value:
                return "stream carries an error event"
            if name == b"data" and value != b"[DONE]":
                try:
                    doc = orjson.loads(value)
                except orjson.JSONDecodeError:
                    return "stream event data is not JSON"
                if _error_object(doc):
                    return "stream carries an error object"
    return None


def answer_problem(
    status: int, headers: list[tuple[bytes, bytes]], body: bytes, *, stream: bool
) -> str | None:
    """Why an upstream answer must not be stored, or None when it is a correct answer.

    ``headers`` are lower-case ``(name, value)`` pairs; ``stream`` says whether
    the request asked for SSE (the answer must be of that form).
    """
    if status != 200:
        return f"status {status}"
    ctype = b""
    for name, value in headers:
        if name == b"content-type":
            ctype = value.lower()
        elif name == b"set-cookie":
            return "answer sets a cookie"
        elif name == b"cache-control" and b"no-store" in value.lower():
            return "upstream said no-store"
        elif name == b"content-encoding" and value.strip().lower() != b"identity":
            return "encoded answer"
    if stream:
        if not ctype.startswith(b"text/event-stream"):
            return "streamed request answered without text/event-stream"
        return _sse_problem(body)
    if not ctype.startswith(b"application/json"):
        return "answer is not application/json"
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return "answer is not complete JSON"
    if not isinstance(doc, dict):
        return "answer is not a JSON object"
    if _error_object(doc):
        return "answer is an error object"
    return None


_PHRASES = {status.value: status.phrase.encode() for status in HTTPStatus}


def reason_phrase(status: int) -> bytes:
    """The reason phrase of ``status`` (``b"Unknown"`` for a code HTTP does not name)."""
    return _PHRASES.get(status, b"Unknown")


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

    def _prefix(self) -> bytes:
        """The response up to the X-Cache value: status line, headers, content-length."""
        return b"HTTP/1.1 %d %s\r\n%scontent-length: %d\r\nx-cache: " % (
            self.status,
            reason_phrase(self.status),
            self.headers,
            len(self.body),
        )

    def response(self, x_cache: bytes) -> bytes:
        """The complete HTTP/1.1 response with ``X-Cache: <x_cache>``."""
        return b"".join((self._prefix(), x_cache, b"\r\n\r\n", self.body))

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

    def l2_hit(self) -> tuple[bytes, tuple[L1Value, int]]:
        """An L2 hit's response and :meth:`l1_value` (its promotion), formatted once."""
        prefix = self._prefix()
        hit_l1 = b"".join((prefix, b"HIT-L1\r\n\r\n", self.body))
        hit_l2 = b"".join((prefix, b"HIT-L2\r\n\r\n", self.body))
        return hit_l2, ((self.tenant, hit_l1), len(hit_l1) + L1_OVERHEAD_BYTES)

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
        if status != 200:
            raise CorruptEntry(f"stored status {status}")
        if flags & ~_FLAG_STREAM:
            raise CorruptEntry("unknown flags")
        start = _HEAD.size
        try:
            tenant = data[start : start + tlen].decode()
        except UnicodeDecodeError as exc:
            raise CorruptEntry("bad tenant") from exc
        start += tlen
        headers = data[start : start + hlen]
        body = data[start + hlen :]
        stream = bool(flags & _FLAG_STREAM)
        pairs = _checked_blocks.get(headers)
        if pairs is None:
            pairs = check_header_block(headers)
            if len(headers) <= _CHECKED_BLOCK_MAX_BYTES:
                if len(_checked_blocks) >= _CHECKED_BLOCKS_LIMIT:
                    _checked_blocks.clear()
                _checked_blocks[headers] = pairs
        problem = answer_problem(status, pairs, body, stream=stream)
        if problem is not None:
            raise CorruptEntry(f"stored answer refused: {problem}")
        return cls(status, headers, body, stream=stream, tenant=tenant)
