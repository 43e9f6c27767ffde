"""A short fuzz run (hypothesis) of the request parser and the key builder.

Bounded (a few hundred examples each) so it runs in CI on every ``make test``.
Properties: no input makes either raise anything but its documented
answer; every byte the connection writes is a well-formed HTTP response; a
connection never answers more requests than it was sent; a refused
connection stops taking requests.
"""

from __future__ import annotations

import re
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachefleet_common.keys import KeyOptions, Scope, Uncacheable, make_key, parse_body
from cachefleet_sidecar.http.server import Connection, Limiter, Limits, Request

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LIMITS = Limits(max_url_bytes=64, max_header_bytes=256, max_body_bytes=128, max_pipelined=4)
STATUS_LINE = re.compile(rb"HTTP/1\.1 (\d{3}) [^\r\n]*\r\n")


class FakeTransport:
    def __init__(self) -> None:
        self.out = bytearray()
        self.closed = False
        self.eof = False
        self.paused = False

    def get_extra_info(self, name: str) -> object:
        return ("127.0.0.1", 40000) if name == "peername" else None

    def write(self, data: bytes) -> None:
        assert not self.closed
        assert not self.eof
        self.out += data

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False


class Answering:
    """A handler that answers every request on the fast path, counting them."""

    def __init__(self) -> None:
        self.seen: list[Request] = []

    def fast(self, request: Request) -> bytes:
        self.seen.append(request)
        return b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"

    def resume(self, request: Request) -> bytes | None:  # pragma: no cover
        raise AssertionError("fast path answers everything at once")

    async def handle(self, request: Request, conn: Any) -> None:  # pragma: no cover
        raise AssertionError("fast path answers everything")


def responses(out: bytes) -> list[int]:
    """Statuses of the complete responses in ``out`` (asserts it is nothing else)."""
    statuses = []
    pos = 0
    while pos < len(out):
        if out.startswith(b"HTTP/1.1 100 Continue\r\n\r\n", pos):
            pos += 25
            continue
        match = STATUS_LINE.match(out, pos)
        assert match is not None, out[pos : pos + 80]
        end = out.index(b"\r\n\r\n", pos) + 4
        length = re.search(rb"content-length: (\d+)\r\n", out[pos:end], re.I)
        assert length is not None
        pos = end + int(length.group(1))
        assert pos <= len(out)
        statuses.append(int(match.group(1)))
    return statuses


request_lines = st.sampled_from(
    [
        b"GET / HTTP/1.1\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\n",
        b"GET /" + b"a" * 80 + b" HTTP/1.1\r\n",
        b"GET / HTTP/1.0\r\n",
        b"BREW / HTCPCP/1.0\r\n",
    ]
)
header_lines = st.sampled_from(
    [
        b"Host: x\r\n",
        b"Content-Length: 5\r\n",
        b"Content-Length: 500\r\n",
        b"Content-Length: -1\r\n",
        b"Transfer-Encoding: chunked\r\n",
        b"Connection: close\r\n",
        b"Expect: 100-continue\r\n",
        b"X-Big: " + b"b" * 300 + b"\r\n",
        b"Upgrade: websocket\r\nConnection: upgrade\r\n",
        b"Bad Header\r\n",
    ]
)
bodies = st.sampled_from([b"", b"hello", b"5\r\nhello\r\n0\r\n\r\n", b"x" * 200])


@st.composite
def streams(draw: st.DrawFn) -> list[bytes]:
    data = b""
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.integers(0, 9)) == 0:
            data += draw(st.binary(max_size=40))
            continue
        data += draw(request_lines)
        data += b"".join(draw(st.lists(header_lines, max_size=4)))
        data += b"\r\n" + draw(bodies)
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=6)))
    pieces, last = [], 0
    for cut in [*cuts, len(data)]:
        pieces.append(data[last:cut])
        last = cut
    return pieces


@FUZZ
@given(streams())
def test_the_request_parser_survives_any_input(pieces: list[bytes]) -> None:
    handler = Answering()
    conn = Connection(handler, Limiter(LIMITS))
    transport = FakeTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    for piece in pieces:
        if transport.closed:
            break
        conn.data_received(piece)
    statuses = responses(bytes(transport.out))
    assert statuses.count(200) == len(handler.seen)
    refusals = [s for s in statuses if s != 200]
    assert len(refusals) <= 1
    if refusals:
        assert statuses[-1] == refusals[0]  # nothing is answered after a refusal
        assert refusals[0] in {400, 413, 414, 431, 501, 503}
        assert transport.eof or transport.closed
    for request in handler.seen:
        assert len(request.url) <= LIMITS.max_url_bytes
        assert len(request.body) <= LIMITS.max_body_bytes
    conn.connection_lost(None)
    assert conn.limiter.body_bytes == 0  # every charged body byte was given back


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)


@FUZZ
@given(
    st.sampled_from(["chat", "completions", "embeddings"]),
    st.one_of(
        st.binary(max_size=200),
        st.dictionaries(
            st.sampled_from(
                ["model", "messages", "prompt", "input", "temperature", "seed", "stream", "top_p"]
            )
            | st.text(max_size=6),
            json_values,
            max_size=6,
        ).map(lambda d: __import__("json").dumps(d).encode()),
    ),
    st.binary(max_size=12),
    st.booleans(),
)
def test_the_key_builder_survives_any_body(
    kind: str, raw: bytes, query: bytes, collapse: bool
) -> None:
    body = parse_body(raw)
    if body is None:
        return
    try:
        key = make_key(
            body, kind, Scope("t"), KeyOptions(collapse_whitespace=collapse), query=query
        )
    except Uncacheable as exc:
        reason = exc.reason
        assert reason  # every refusal says why
        return
    assert key.model == body["model"]
    assert key.stream is (body.get("stream") is True)
    again = make_key(
        parse_body(raw) or {},
        kind,
        Scope("t"),
        KeyOptions(collapse_whitespace=collapse),
        query=query,
    )
    assert again.digest == key.digest


def test_a_pipelined_oversized_head_in_the_same_read_is_refused() -> None:
    handler = Answering()
    conn = Connection(handler, Limiter(LIMITS))
    transport = FakeTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    small = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    big = b"GET / HTTP/1.1\r\nX-Big: " + b"b" * 300 + b"\r\n\r\n"
    conn.data_received(small + big + small)
    assert responses(bytes(transport.out)) == [200, 431]
    assert transport.eof


def test_trailer_fields_are_bounded_and_never_become_headers() -> None:
    handler = Answering()
    conn = Connection(handler, Limiter(LIMITS))
    transport = FakeTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    head = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    conn.data_received(head + b"1\r\na\r\n0\r\nX-Tenant-ID: victim\r\n\r\n")
    (request,) = handler.seen
    assert request.body == b"a"
    assert request.header(b"x-tenant-id") is None
    # A trailer section past the bound is refused, complete or not.
    conn.data_received(head + b"1\r\na\r\n0\r\nX-T: " + b"t" * 300 + b"\r\n\r\n")
    assert responses(bytes(transport.out)) == [200, 431]
    endless = Connection(Answering(), Limiter(LIMITS))
    transport = FakeTransport()
    endless.connection_made(transport)  # type: ignore[arg-type]
    endless.data_received(head + b"1\r\na\r\n0\r\nX-T: ")
    for _ in range(200):
        if transport.eof:
            break
        endless.data_received(b"t" * 100)
    assert responses(bytes(transport.out)) == [413]
