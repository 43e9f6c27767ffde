"""Which answers may be stored, and which stored entries may be served (pure)."""

from __future__ import annotations

import pytest

from cachefleet_sidecar.cache.entry import (
    V_CHECK_AT,
    V_COMPLETION,
    V_EXPIRES_AT,
    V_FILLED_AT,
    V_PROMPT,
    V_RESPONSE,
    V_UPSTREAM_S,
    CorruptEntry,
    Entry,
    answer_problem,
    check_header_block,
    reaged,
    usage_of,
)

JSON = [(b"content-type", b"application/json")]
SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]
EVENT = b'data: {"choices": [{"delta": {"content": "error"}}]}\n\n'
DONE = b"data: [DONE]\n\n"


@pytest.mark.parametrize(
    "body",
    [
        b'{"id": "x", "choices": []}',
        b'{"object": "list", "data": [{"embedding": [0.1]}]}',
    ],
)
def test_correct_json_answers_are_storable(body: bytes) -> None:
    assert answer_problem(200, JSON, body, stream=False) is None


@pytest.mark.parametrize(
    ("status", "headers", "body", "why"),
    [
        (201, JSON, b"{}", "status"),
        (500, JSON, b"{}", "status"),
        (200, JSON, b'{"error": {"message": "overloaded"}}', "error object"),
        (200, JSON, b'{"object": "error", "message": "bad"}', "error object"),
        (200, JSON, b'{"id": "x", "choices": [', "complete JSON"),
        (200, JSON, b"[1, 2]", "JSON object"),
        (200, [(b"content-type", b"text/plain")], b"{}", "application/json"),
        (200, [*JSON, (b"set-cookie", b"a=b")], b"{}", "cookie"),
        (200, [*JSON, (b"cache-control", b"private, no-store")], b"{}", "no-store"),
        (200, [*JSON, (b"content-encoding", b"gzip")], b"{}", "encoded"),
        (200, SSE, EVENT + DONE, "application/json"),  # a stream for a plain request
    ],
)
def test_wrong_json_answers_are_not(
    status: int, headers: list[tuple[bytes, bytes]], body: bytes, why: str
) -> None:
    problem = answer_problem(status, headers, body, stream=False)
    assert problem is not None
    assert why in problem


@pytest.mark.parametrize(
    "body",
    [
        EVENT + DONE,
        DONE,
        (EVENT + DONE).replace(b"\n", b"\r\n"),
        EVENT + b"data:[DONE]\n\n",
        b'data: {"choices": [{"delta": {"content": "data: [DONE]"}}]}\n\n' + DONE,
    ],
)
def test_complete_streams_are_storable(body: bytes) -> None:
    assert answer_problem(200, SSE, body, stream=True) is None


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (EVENT, "[DONE]"),
        (EVENT + DONE[:-1], "[DONE]"),
        (EVENT + b'data: {"error": {"message": "x"}}\n\n' + DONE, "error object"),
        (EVENT + b'data: {"object": "error", "message": "x"}\n\n' + DONE, "error object"),
        (EVENT + b"event: error\ndata: {}\n\n" + DONE, "error event"),
        (EVENT + b"data: internal error\n\n" + DONE, "not JSON"),
        (b'data: {"content": "x"}\n\ndata: [DONE]\n\nextra', "[DONE]"),
    ],
)
def test_broken_or_failed_streams_are_not(body: bytes, why: str) -> None:
    problem = answer_problem(200, SSE, body, stream=True)
    assert problem is not None
    assert why in problem


def test_a_streamed_request_needs_a_stream() -> None:
    assert answer_problem(200, JSON, b"{}", stream=True) is not None


@pytest.mark.parametrize(
    "block",
    [
        b"content-type: application/json",  # unterminated
        b"content-type: a\r\n\r\nHTTP/1.1 200 OK\r\n",
        b"Content-Type: a\r\n",  # stored names are lower case
        b"x-a: b\nc\r\n",
        b"x-a: b\x00\r\n",
        b"x a: b\r\n",
        b"content-length: 5\r\n",
        b"transfer-encoding: chunked\r\n",
        b"connection: close\r\n",
        b"x-cache: HIT-L1\r\n",
    ],
)
def test_header_blocks_that_could_change_framing_are_refused(block: bytes) -> None:
    with pytest.raises(CorruptEntry):
        check_header_block(block)


def test_a_plain_header_block_parses() -> None:
    block = b"content-type: application/json\r\nx-request-id: 7\r\n"
    assert check_header_block(block) == [
        (b"content-type", b"application/json"),
        (b"x-request-id", b"7"),
    ]


def test_loads_checks_the_answer_inside_the_envelope() -> None:
    headers = b"content-type: application/json\r\n"
    good = Entry(200, headers, b'{"choices": []}', stream=False, tenant="t")
    for _ in range(2):  # the second finds its headers and body checked already
        assert Entry.loads(good.dumps()).body == good.body
    for bad in (
        Entry(200, headers, b'{"error": {}}', stream=False, tenant="t"),
        Entry(200, headers + b"content-length: 1\r\n", good.body, stream=False, tenant="t"),
        Entry(200, headers, good.body, stream=True, tenant="t"),
    ):
        with pytest.raises(CorruptEntry):
            Entry.loads(bad.dumps())


def test_header_block_edge_lines() -> None:
    # a value may hold ": "; a blank line, a missing ": " or a bare CR may not
    assert check_header_block(b"x-a: b: c\r\n") == [(b"x-a", b"b: c")]
    for block in (b"\r\n", b"x-a: b\r\n\r\n", b"x-a:b\r\n", b"x-a: b\rc\r\n", b"X-A: b\r\n"):
        with pytest.raises(CorruptEntry):
            check_header_block(block)


def test_l2_hit_renders_the_response_and_the_promotion_once() -> None:
    e = Entry(
        200,
        b"content-type: application/json\r\n",
        b'{"x": 1}',
        stream=False,
        tenant="t",
        filled_at=1000.0,
        prompt_tokens=3,
        completion_tokens=4,
        upstream_s=0.5,
    )
    response, (value, size) = e.l2_hit("k" * 64, 1012.5, 50.0, 60.0)
    assert response == e.response(b"HIT-L2", 12, "k" * 64)
    assert (value, size) == e.l1_value("k" * 64, 1012.5, 50.0, 60.0)
    assert value[V_RESPONSE] == e.hit_l1(12, "k" * 64)
    assert value[V_FILLED_AT] == 50.0 - 12.5
    assert value[V_EXPIRES_AT] == 50.0 - 12.5 + 60.0
    assert value[V_CHECK_AT] == 50.0 - 12.5 + 13  # when "Age: 12" goes out of date
    assert (value[V_PROMPT], value[V_COMPLETION], value[V_UPSTREAM_S]) == (3, 4, 0.5)
    # no promotion is rendered for an L1 partition that could not store it
    assert e.l2_hit("k" * 64, 1012.5, 50.0, 60.0, size - 1) == (response, None)
    assert e.l2_hit("k" * 64, 1012.5, 50.0, 60.0, size) == (response, (value, size))


def test_reaged_value_says_the_new_age_and_keeps_the_rest() -> None:
    e = Entry(200, b"content-type: application/json\r\n", b"{}", stream=False, tenant="t")
    value, _ = e.l1_value("", 9.0, 100.0, 1000.0)  # filled 9 s ago: Age 9
    assert b"\r\nage: 9\r\n" in value[V_RESPONSE]
    later = reaged(value, 100.0 + 95.2)  # 104.2 s after the fill: three digits now
    assert later[V_RESPONSE] == e.hit_l1(104)
    assert later[V_CHECK_AT] == value[V_FILLED_AT] + 105
    assert reaged(later, 100.0 + 999.0)[V_RESPONSE] == e.hit_l1(1008)
    near_end = reaged(value, 100.0 + 990.5)
    assert near_end[V_CHECK_AT] == value[V_EXPIRES_AT]  # the TTL ends before Age moves


def test_usage_of_json_and_stream_answers() -> None:
    body = b'{"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 7}}'
    assert usage_of(body, stream=False) == (11, 7)
    assert usage_of(b'{"choices": []}', stream=False) == (0, 0)
    assert usage_of(
        b'{"usage": {"prompt_tokens": "x", "completion_tokens": -3}}', stream=False
    ) == (
        0,
        0,
    )
    stream = (
        b'data: {"choices": [{"delta": {"content": "hi"}}], "usage": null}\n\n'
        b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}\n\n'
        b"data: [DONE]\n\n"
    )
    assert usage_of(stream, stream=True) == (5, 2)
    assert usage_of(stream.replace(b"\n", b"\r\n"), stream=True) == (5, 2)
    no_usage = b'data: {"choices": []}\n\ndata: [DONE]\n\n'
    assert usage_of(no_usage, stream=True) == (0, 0)
    # embeddings report prompt tokens only
    assert usage_of(
        b'{"data": [], "usage": {"prompt_tokens": 9, "total_tokens": 9}}', stream=False
    ) == (
        9,
        0,
    )
