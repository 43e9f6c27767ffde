"""Canonical keys and stored entries (pure)."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachefleet_common.keys import KeyOptions, Scope, Uncacheable, make_key, parse_body
from cachefleet_sidecar.cache.entry import CorruptEntry, Entry, OldEntry

ACME = Scope("acme", "v1", (0,))


def chat(content: object = "hello", **extra: object) -> dict[str, object]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        **extra,
    }


def key(body: dict[str, object], scope: Scope = ACME, **opts: bool) -> int:
    return make_key(body, "chat", scope, KeyOptions(**opts)).digest


#: The exact canonical bytes of format cf2. Keys outlive a sidecar (L2 entries
#: of a fleet mid-upgrade): changing the canonical form must change KEY_FORMAT.
CF2_GOLDEN: list[tuple[str, dict[str, object], KeyOptions, bytes, bytes]] = [
    (
        "chat",
        {
            "model": "m",
            "messages": [{"role": "user", "content": "  hi\n there ", "name": "x"}],
            "temperature": 0,
            "max_tokens": 8,
            "user": "u1",
        },
        KeyOptions(),
        b"",
        b'cf24:acme2:v13:3,74:chat0:{"max_tokens":8,"messages":[{"content":"  hi\\n there ",'
        b'"name":"x","role":"user"}],"model":"m","stream":false,"temperature":0.0}',
    ),
    (
        "chat",
        {
            "stream": True,
            "model": "m",
            "messages": [{"content": [{"type": "text", "text": " a  b "}], "role": "user"}],
            "seed": 3,
            "top_p": 1,
            "response_format": {"type": "json_schema", "json_schema": {"b": 1, "a": 2}},
        },
        KeyOptions(collapse_whitespace=True),
        b"x=1",
        b'cf24:acme2:v13:3,74:chat3:x=1{"messages":[{"content":[{"type":"text","text":"a b"}],'
        b'"role":"user"}],"model":"m","response_format":{"type":"json_schema","json_schema":'
        b'{"b":1,"a":2}},"seed":3,"stream":true,"top_p":1.0}',
    ),
    (
        "completions",
        {
            "prompt": [1, 2, 3],
            "model": "m",
            "temperature": 0.0,
            "metadata": {"k": "v"},
            "stream": False,
        },
        KeyOptions(),
        b"",
        b'cf24:acme2:v13:3,711:completions0:{"model":"m","prompt":[1,2,3],"stream":false,'
        b'"temperature":0.0}',
    ),
    (
        "embeddings",
        {"input": ["a", "b"], "model": "e", "encoding_format": "float"},
        KeyOptions(),
        b"",
        b'cf24:acme2:v13:3,710:embeddings0:{"encoding_format":"float","input":["a","b"],"model":"e"}',
    ),
    (
        "chat",
        {
            "model": "m",
            "messages": ["not a dict", {"role": "user", "content": None}],
            "temperature": 0.7,
            "presence_penalty": -1,
        },
        KeyOptions(cache_nondeterministic=True),
        b"",
        b'cf24:acme2:v13:3,74:chat0:{"messages":["not a dict",{"content":null,"role":"user"}],'
        b'"model":"m","presence_penalty":-1.0,"stream":false,"temperature":0.7}',
    ),
]


@pytest.mark.parametrize(("kind", "body", "options", "query", "canonical"), CF2_GOLDEN)
def test_the_canonical_form_is_byte_for_byte_format_cf2(
    kind: str, body: dict[str, object], options: KeyOptions, query: bytes, canonical: bytes
) -> None:
    scope = Scope("acme", "v1", (3, 7))
    assert make_key(body, kind, scope, options, query=query).canonical == canonical


def test_key_order_and_formatting_do_not_matter() -> None:
    a = parse_body(b'{"model":"m","temperature":0,"messages":[{"role":"user","content":"x"}]}')
    b = parse_body(
        b'{ "messages" : [ {"content":"x", "role":"user"} ],\n "model":"m", "temperature":0.0}'
    )
    assert a is not None
    assert b is not None
    assert key(a) == key(b)


def test_text_is_keyed_byte_for_byte_unless_the_tenant_collapses_whitespace() -> None:
    assert key(chat("  hi there\n")) != key(chat("hi there"))
    assert key(chat("hi  there")) != key(chat("hi there"))
    assert key(chat(" hi  \n there "), collapse_whitespace=True) == key(
        chat("hi there"), collapse_whitespace=True
    )


def test_content_parts_are_normalised_only_when_collapsing() -> None:
    parts = [{"type": "text", "text": " hi "}]
    plain = [{"type": "text", "text": "hi"}]
    assert key(chat(parts)) != key(chat(plain))
    assert key(chat(parts), collapse_whitespace=True) == key(chat(plain), collapse_whitespace=True)


def test_prompts_and_inputs_are_never_whitespace_normalised() -> None:
    opts = KeyOptions(collapse_whitespace=True)
    for kind, name in (("completions", "prompt"), ("embeddings", "input")):
        a = {"model": "m", "temperature": 0, name: "def f():\n    return 1"}
        b = {"model": "m", "temperature": 0, name: "def f(): return 1"}
        assert make_key(a, kind, ACME, opts).digest != make_key(b, kind, ACME, opts).digest
        c = {**a, name: [" x ", "y"]}
        d = {**a, name: ["x", "y"]}
        assert make_key(c, kind, ACME, opts).digest != make_key(d, kind, ACME, opts).digest


def test_non_semantic_fields_are_dropped_semantic_ones_kept() -> None:
    assert key(chat(user="u1", metadata={"a": 1})) == key(chat())
    assert key(chat(max_tokens=10)) != key(chat(max_tokens=20))
    assert key(chat(top_p=0.9)) != key(chat(top_p=0.95))
    assert key(chat(top_p=0.9000000001)) != key(chat(top_p=0.9))  # no rounding
    assert key(chat(top_p=1)) == key(chat(top_p=1.0))  # the same JSON number


def test_scope_separates_tenants_model_versions_and_epochs() -> None:
    body = chat()
    digests = {
        key(body, Scope("acme", "v1", (0,))),
        key(body, Scope("other", "v1", (0,))),
        key(body, Scope("acme", "v2", (0,))),
        key(body, Scope("acme", "v1", (1,))),
    }
    assert len(digests) == 4


def test_stream_and_endpoint_are_part_of_the_key() -> None:
    assert key(chat(stream=True)) != key(chat())
    assert key(chat(stream=False)) == key(chat())
    body = {"model": "m", "prompt": "hi", "temperature": 0}
    assert make_key(body, "completions", ACME).digest != make_key(body, "chat", ACME).digest


def test_determinism_rules() -> None:
    with pytest.raises(Uncacheable, match="deterministic"):
        make_key(chat(temperature=0.7), "chat", ACME)
    with pytest.raises(Uncacheable, match="deterministic"):
        make_key({"model": "m", "messages": []}, "chat", ACME)  # default temperature is 1
    with pytest.raises(Uncacheable, match="deterministic"):
        make_key(chat(temperature=True), "chat", ACME)
    assert make_key(chat(temperature=0.7, seed=3), "chat", ACME).digest
    assert make_key(chat(temperature=0.7), "chat", ACME, KeyOptions(cache_nondeterministic=True))
    assert make_key({"model": "e", "input": "x"}, "embeddings", ACME)
    with pytest.raises(Uncacheable, match="model"):
        make_key({"messages": [], "temperature": 0}, "chat", ACME)


def test_sha256_is_stable_hex() -> None:
    k = make_key(chat(), "chat", ACME)
    assert len(k.sha256_hex) == 64
    assert k.sha256_hex == make_key(chat(), "chat", ACME).sha256_hex


def test_parse_body_rejects_non_objects() -> None:
    assert parse_body(b"[1, 2]") is None
    assert parse_body(b"{oops") is None
    assert parse_body(b'{"a": 1}') == {"a": 1}


@given(st.text(max_size=40), st.text(max_size=40))
def test_distinct_contents_never_share_a_key(a: str, b: str) -> None:
    if a != b:
        assert key(chat(a)) != key(chat(b))


def test_entry_round_trip_and_hit_bytes() -> None:
    e = Entry(
        200,
        b"content-type: application/json\r\n",
        b'{"x":1}',
        stream=False,
        tenant="t",
        filled_at=1_700_000_000.25,
        upstream_s=1.5,
        prompt_tokens=12,
        completion_tokens=34,
    )
    back = Entry.loads(e.dumps())
    assert (back.status, back.headers, back.body, back.stream, back.tenant) == (
        200,
        e.headers,
        e.body,
        False,
        "t",
    )
    assert (back.filled_at, back.upstream_s, back.prompt_tokens, back.completion_tokens) == (
        1_700_000_000.25,
        1.5,
        12,
        34,
    )
    hit = e.hit_l1(7, "ab" * 32)
    assert hit.startswith(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
    assert b"content-length: 7\r\nx-cache-key: " + b"ab" * 32 + b"\r\nage: 7\r\n" in hit
    assert b"x-cache: HIT-L1\r\n\r\n" in hit
    assert orjson.loads(hit.split(b"\r\n\r\n", 1)[1]) == {"x": 1}


#: A CF2 envelope, byte for byte: what every sidecar of this version writes to L2
#: (magic, flags, status 200, tenant/headers/body lengths, fill time and upstream
#: seconds as big-endian doubles, prompt and completion tokens, then the bytes).
CF2_ENTRY = (
    b"CF2\x00\x00\xc8\x01\x00\x00\x00\x20\x00\x00\x00\x07"
    b"A\xd9T\xfc@@\x00\x00?\xf8\x00\x00\x00\x00\x00\x00\x00\x00\x00\x0c\x00\x00\x00\x22"
    b'tcontent-type: application/json\r\n{"x":1}'
)


def test_entry_envelope_golden_bytes() -> None:
    e = Entry(
        200,
        b"content-type: application/json\r\n",
        b'{"x":1}',
        stream=False,
        tenant="t",
        filled_at=1_700_000_001.0,
        upstream_s=1.5,
        prompt_tokens=12,
        completion_tokens=34,
    )
    assert e.dumps() == CF2_ENTRY
    assert Entry.loads(CF2_ENTRY).filled_at == 1_700_000_001.0


def test_an_entry_of_the_previous_format_is_an_old_entry() -> None:
    # the CF1 envelope had no fill time: it cannot be aged, so it is a miss (and replaced)
    old = b"CF1\x00\x00\xc8\x01\x00\x00\x00\x00\x00\x00\x00\x02t{}"
    with pytest.raises(OldEntry):
        Entry.loads(old)


@pytest.mark.parametrize("data", [b"", b"garbage", b"CF2" + b"\x00" * 20])
def test_corrupt_entries_are_refused(data: bytes) -> None:
    with pytest.raises(CorruptEntry):
        Entry.loads(data)


def test_non_2xx_is_never_loaded() -> None:
    bad = Entry(500, b"", b"{}", stream=False, tenant="t").dumps()
    with pytest.raises(CorruptEntry, match="status"):
        Entry.loads(bad)
