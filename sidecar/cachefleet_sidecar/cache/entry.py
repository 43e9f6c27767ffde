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

An entry also records what it saved and when it was filled: the answer's
token ``usage`` (:func:`usage_of`: the JSON answer's, or a stream's last
event that carries one), the upstream seconds the fill took, and the fill
time (Unix seconds). A hit reports them as savings, serves ``Age`` from the
fill time, and the tenant's TTL and a request's ``max-age`` are judged by it.

The L2 wire form is a small versioned binary envelope (:meth:`Entry.dumps`).
An envelope of the previous format (``CF1``: no fill time, so no age) is an
:class:`OldEntry`: the caller treats it as a miss, and the fill replaces it.
:meth:`Entry.loads` checks the envelope, the header block (well-formed
``name: value`` lines, no framing or hop-by-hop header, so a stored entry
can never change the framing of the response it is served in) and the answer
itself; anything else is a :class:`CorruptEntry`, which the caller counts and
treats as a miss. What it found correct is remembered (a header block by its
bytes, a body by its xxh3-128), so a hot entry is checked once, not at every
L2 hit.
"""

from __future__ import annotations

import math
import re
import struct
from typing import Final

import orjson
import xxhash

from cachefleet_sidecar.http.wire import FORWARD_DROP, reason_phrase

#: Upstream response headers not stored in an entry: a hit is framed, marked and
#: dated (``Age``) when served, so the upstream's ``Date`` is not kept either.
STORE_DROP = FORWARD_DROP | {b"date"}
#: An L1 value: a tuple of atomic values (untracked by the cyclic GC), read by index:
#: ``(tenant, HIT-L1 response, check_at, expires_at, filled_at, age_start, age_end,
#: prompt_tokens, completion_tokens, upstream_s)``. Times are ``time.monotonic()``
#: seconds: ``check_at`` is the earlier of ``expires_at`` (fill time + the tenant's TTL)
#: and the moment the rendered ``Age`` goes out of date, so a hit makes one comparison;
#: ``response[age_start:age_end]`` is the ``Age`` value (see :func:`l1_value`).
L1Value = tuple[str, bytes, float, float, float, int, int, int, int, float]
#: Indexes into an :data:`L1Value`.
V_TENANT: Final = 0
V_RESPONSE: Final = 1
V_CHECK_AT: Final = 2
V_EXPIRES_AT: Final = 3
V_FILLED_AT: Final = 4
V_AGE_START: Final = 5
V_AGE_END: Final = 6
V_PROMPT: Final = 7
V_COMPLETION: Final = 8
V_UPSTREAM_S: Final = 9
#: Bytes an L1 value costs beyond its response bytes: the bytes object's header, the
#: value tuple and its floats and ints, the key (a 64-bit int), the policy's record (size,
#: cost, tuple) and its share of the policy's dict(s). Measured with tracemalloc; one
#: figure keeps every policy within 20 % of the truth
#: (tests/unit/test_l1.py::test_counted_bytes_are_what_an_entry_really_holds).
L1_OVERHEAD_BYTES = 470

_MAGIC = b"CF2"
_OLD_MAGIC = b"CF1"
#: magic, flags, status, tenant len, headers len, body len, filled at (Unix s),
#: upstream seconds, prompt tokens, completion tokens.
_HEAD = struct.Struct("!3sBHBIIddII")
_FLAG_STREAM = 1
#: What follows the Age value in an L1 hit's head.
_HIT_L1_TAIL = b"\r\nx-cache: HIT-L1\r\n\r\n"
_MAX_TOKENS = 2**32 - 1


class CorruptEntry(ValueError):
    """Stored bytes that are not an entry this version understands."""


class OldEntry(CorruptEntry):
    """An entry of the previous envelope (no fill time): a miss, replaced by the next fill."""


#: One header line: a lower-case token name, ": ", a value without control characters.
_LINE = rb"([!#$%&'*+\-.^_`|~0-9a-z]+): ([\t\x20-\x7e\x80-\xff]*)\r\n"
_LINES = re.compile(_LINE)
_BLOCK = re.compile(rb"(?:" + _LINE + rb")*")


def check_header_block(block: bytes) -> list[tuple[bytes, bytes]]:
    """The ``(name, value)`` pairs of a stored header block; raise :class:`CorruptEntry`.

    A block is ``name: value\r\n`` lines: lower-case token names, values
    without control characters, and no header that frames or routes the
    response (:data:`STORE_DROP`): the sidecar frames every response itself.
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
        if name in STORE_DROP:
            raise CorruptEntry(f"framing header {name.decode()!r} in a stored entry")
    return pairs


#: Header blocks found well-formed, and what :func:`answer_problem` finds in them for a
#: JSON and for a streamed answer (None: nothing): both checks are pure functions of
#: the bytes, and the blocks of one upstream repeat (only a well-formed block is kept).
_checked_blocks: dict[bytes, tuple[str | None, str | None]] = {}
_CHECKED_BLOCKS_LIMIT = 1024
_CHECKED_BLOCK_MAX_BYTES = 1024
#: Bodies :meth:`Entry.loads` found correct, by the xxh3-128 of the body and the stream
#: flag: a hot entry's body is checked once, not at every L2 hit (as the request path's
#: key memo trusts the same hash of a raw body). Cleared when full.
_checked_bodies: set[int] = set()
_CHECKED_BODIES_LIMIT = 16384


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
    return _headers_problem(headers, stream=stream) or _body_problem(body, stream=stream)


def _headers_problem(headers: list[tuple[bytes, bytes]], *, stream: bool) -> str | None:
    """What :func:`answer_problem` finds wrong in a 200 answer's headers, or None."""
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
    elif not ctype.startswith(b"application/json"):
        return "answer is not application/json"
    return None


def _body_problem(body: bytes, *, stream: bool) -> str | None:
    """What :func:`answer_problem` finds wrong in the body of an answer whose headers pass."""
    if stream:
        return _sse_problem(body)
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return "answer is not complete JSON"
    if not isinstance(doc, dict):
        return "answer is not a JSON object"
    if _error_object(doc):
        return "answer is an error object"
    return None


def _tokens(usage: object) -> tuple[int, int]:
    if not isinstance(usage, dict):
        return 0, 0
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")

    def count(value: object) -> int:
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return min(value, _MAX_TOKENS)
        return 0

    return count(prompt), count(completion)


def usage_of(body: bytes, *, stream: bool) -> tuple[int, int]:
    """``(prompt_tokens, completion_tokens)`` of a correct answer's ``usage`` (0 when absent).

    A JSON answer's top-level ``usage``; a stream's last ``data:`` event that
    carries a ``usage`` object (OpenAI sends it in the last chunk when asked
    with ``stream_options.include_usage``). Anything unreadable counts 0.
    """
    if b'"usage"' not in body:
        return 0, 0
    if not stream:
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            return 0, 0
        return _tokens(doc.get("usage")) if isinstance(doc, dict) else (0, 0)
    text = body.replace(b"\r\n", b"\n")
    end = text.rfind(b'"usage"')
    start = text.rfind(b"\n\n", 0, end) + 2 if text.rfind(b"\n\n", 0, end) >= 0 else 0
    stop = text.find(b"\n\n", end)
    for line in text[start : stop if stop >= 0 else len(text)].split(b"\n"):
        name, _, value = line.partition(b":")
        if name == b"data":
            try:
                doc = orjson.loads(value)
            except orjson.JSONDecodeError:
                return 0, 0
            return _tokens(doc.get("usage")) if isinstance(doc, dict) else (0, 0)
    return 0, 0


class Entry:
    """One cached response, with what it saves and when it was filled."""

    __slots__ = (
        "body",
        "completion_tokens",
        "filled_at",
        "headers",
        "prompt_tokens",
        "status",
        "stream",
        "tenant",
        "upstream_s",
    )

    def __init__(
        self,
        status: int,
        headers: bytes,
        body: bytes,
        *,
        stream: bool,
        tenant: str,
        filled_at: float = 0.0,
        upstream_s: float = 0.0,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
    ) -> None:
        self.tenant = tenant
        self.status = status
        self.headers = headers
        self.body = body
        self.stream = stream
        #: When the answer came from upstream (Unix seconds).
        self.filled_at = filled_at
        #: Upstream seconds the fill took: what a hit saves the model.
        self.upstream_s = upstream_s
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens

    def age(self, now: float) -> int:
        """Whole seconds since the fill at Unix time ``now`` (0 for a clock behind it)."""
        return int(self.elapsed(now))

    def elapsed(self, now: float) -> float:
        """Seconds since the fill at Unix time ``now`` (0 for a clock behind it)."""
        return max(0.0, now - self.filled_at)

    def _prefix(self, key_hex: str = "", age: bool = True) -> bytes:
        """The response up to the Age value (``age``; else up to X-Cache): status line,
        headers, content-length, key."""
        key = b"x-cache-key: %s\r\n" % key_hex.encode() if key_hex else b""
        return b"HTTP/1.1 %d %s\r\n%scontent-length: %d\r\n%s%s" % (
            self.status,
            reason_phrase(self.status),
            self.headers,
            len(self.body),
            key,
            b"age: " if age else b"",
        )

    def response(self, x_cache: bytes, age: int | None = 0, key_hex: str = "") -> bytes:
        """The complete HTTP/1.1 response with ``Age`` (None: none, a shared miss),
        ``X-Cache-Key`` and ``X-Cache``."""
        if age is None:
            return b"".join(
                (self._prefix(key_hex, False), b"x-cache: ", x_cache, b"\r\n\r\n", self.body)
            )
        return b"".join(
            (self._prefix(key_hex), b"%d\r\nx-cache: " % age, x_cache, b"\r\n\r\n", self.body)
        )

    def hit_l1(self, age: int = 0, key_hex: str = "") -> bytes:
        """The ready-to-send bytes of an L1 hit."""
        return self.response(b"HIT-L1", age, key_hex)

    def l1_value(self, key_hex: str, now: float, mono: float, ttl_s: float) -> tuple[L1Value, int]:
        """What L1 keeps of this entry at Unix time ``now`` (``mono`` on the monotonic
        clock), under the tenant's TTL ``ttl_s``, and what it costs there in bytes.

        L1 holds a plain tuple of atomic values (:data:`L1Value`), not the
        entry: such a tuple is untracked by Python's cyclic GC, so a large L1
        adds nothing to collection pauses.
        """
        elapsed = self.elapsed(now)
        prefix = self._prefix(key_hex)
        hit = b"".join((prefix, b"%d" % int(elapsed), _HIT_L1_TAIL, self.body))
        return self._value(hit, len(prefix), elapsed, mono, ttl_s)

    def l1_bytes(self, key_hex: str) -> int:
        """What :meth:`l1_value` costs in L1, in bytes, at an age of under 10 s."""
        return (
            len(self._prefix(key_hex)) + len(self.body) + len(_HIT_L1_TAIL) + 1 + L1_OVERHEAD_BYTES
        )

    def _value(
        self, hit: bytes, age_start: int, elapsed: float, mono: float, ttl_s: float
    ) -> tuple[L1Value, int]:
        age = int(elapsed)
        filled = mono - elapsed
        expires = filled + ttl_s
        value: L1Value = (
            self.tenant,
            hit,
            min(expires, filled + age + 1),
            expires,
            filled,
            age_start,
            age_start + len(b"%d" % age),
            self.prompt_tokens,
            self.completion_tokens,
            self.upstream_s,
        )
        return value, len(hit) + L1_OVERHEAD_BYTES

    def l2_hit(
        self, key_hex: str, now: float, mono: float, ttl_s: float, room: float = math.inf
    ) -> tuple[bytes, tuple[L1Value, int] | None]:
        """An L2 hit's response and :meth:`l1_value` (its promotion), formatted once;
        no promotion (None) when it would cost L1 more than ``room`` bytes."""
        elapsed = self.elapsed(now)
        prefix = self._prefix(key_hex)
        tail = b"%d\r\nx-cache: " % int(elapsed)
        body = self.body
        hit_l2 = b"".join((prefix, tail, b"HIT-L2\r\n\r\n", body))
        if len(hit_l2) + L1_OVERHEAD_BYTES > room:  # HIT-L1 is as long as HIT-L2
            return hit_l2, None
        hit_l1 = b"".join((prefix, tail, b"HIT-L1\r\n\r\n", body))
        return hit_l2, self._value(hit_l1, len(prefix), elapsed, mono, ttl_s)

    def dumps(self) -> bytes:
        flags = _FLAG_STREAM if self.stream else 0
        tenant = self.tenant.encode()
        head = _HEAD.pack(
            _MAGIC,
            flags,
            self.status,
            len(tenant),
            len(self.headers),
            len(self.body),
            self.filled_at,
            self.upstream_s,
            min(max(self.prompt_tokens, 0), _MAX_TOKENS),
            min(max(self.completion_tokens, 0), _MAX_TOKENS),
        )
        return head + tenant + self.headers + self.body

    @classmethod
    def loads(cls, data: bytes) -> Entry:
        if data[:3] == _OLD_MAGIC:
            raise OldEntry("entry of the previous format (no fill time)")
        if len(data) < _HEAD.size:
            raise CorruptEntry("short entry")
        magic, flags, status, tlen, hlen, blen, filled_at, upstream_s, prompt, completion = (
            _HEAD.unpack_from(data)
        )
        if magic != _MAGIC or _HEAD.size + tlen + hlen + blen != len(data):
            raise CorruptEntry("bad envelope")
        if status != 200:
            raise CorruptEntry(f"stored status {status}")
        if flags & ~_FLAG_STREAM:
            raise CorruptEntry("unknown flags")
        if not (math.isfinite(filled_at) and math.isfinite(upstream_s) and upstream_s >= 0):
            raise CorruptEntry("bad fill time or upstream seconds")
        start = _HEAD.size
        try:
            tenant = data[start : start + tlen].decode()
        except UnicodeDecodeError as exc:
            raise CorruptEntry("bad tenant") from exc
        start += tlen
        headers = data[start : start + hlen]
        body = data[start + hlen :]
        stream = bool(flags & _FLAG_STREAM)
        # answer_problem(status, check_header_block(headers), body), the headers' part memoised
        checked = _checked_blocks.get(headers)
        if checked is None:
            pairs = check_header_block(headers)
            checked = (
                _headers_problem(pairs, stream=False),
                _headers_problem(pairs, stream=True),
            )
            if len(headers) <= _CHECKED_BLOCK_MAX_BYTES:
                if len(_checked_blocks) >= _CHECKED_BLOCKS_LIMIT:
                    _checked_blocks.clear()
                _checked_blocks[headers] = checked
        problem = checked[stream]
        if problem is None:
            mark = xxhash.xxh3_128_intdigest(body) << 1 | stream
            if mark not in _checked_bodies:
                problem = _body_problem(body, stream=stream)
                if problem is None:
                    if len(_checked_bodies) >= _CHECKED_BODIES_LIMIT:
                        _checked_bodies.clear()
                    _checked_bodies.add(mark)
        if problem is not None:
            raise CorruptEntry(f"stored answer refused: {problem}")
        return cls(
            status,
            headers,
            body,
            stream=stream,
            tenant=tenant,
            filled_at=filled_at,
            upstream_s=upstream_s,
            prompt_tokens=prompt,
            completion_tokens=completion,
        )


def reaged(value: L1Value, mono: float) -> L1Value:
    """``value`` with its ``Age`` brought up to the monotonic time ``mono`` (not expired).

    Called when a hit finds ``mono`` past the value's ``check_at`` and before
    its ``expires_at``: once a second at most for a hot entry.
    """
    filled = value[V_FILLED_AT]
    age = max(0, int(mono - filled))
    hit = value[V_RESPONSE]
    start, end = value[V_AGE_START], value[V_AGE_END]
    digits = b"%d" % age
    view = memoryview(hit)
    fresh = b"".join((view[:start], digits, view[end:]))
    expires = value[V_EXPIRES_AT]
    return (
        value[V_TENANT],
        fresh,
        min(expires, filled + age + 1),
        expires,
        filled,
        start,
        start + len(digits),
        value[V_PROMPT],
        value[V_COMPLETION],
        value[V_UPSTREAM_S],
    )
