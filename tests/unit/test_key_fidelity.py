"""Key fidelity as a property: requests that differ in meaning never share a key.

A generator builds OpenAI requests (chat, completions, embeddings; text
with code-like whitespace, sampling numbers, nested JSON schemas, extra
fields), then changes one thing that a model server could answer
differently; the two keys must differ (or the changed request must be
uncacheable). The converse: rewriting a request in a way no server can see
(JSON formatting and escapes, field order, 0 for 0.0, non-semantic fields)
keeps its key. ``docs/cache-key.md`` is the rule book these follow.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachefleet_common.keys import KeyOptions, Scope, Uncacheable, make_key, parse_body

SCOPE = Scope("acme", "v1", (3,))
PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

texts = st.text(alphabet=st.sampled_from(list("ab \t\n{}:_")), min_size=0, max_size=12)
numbers = st.floats(min_value=0, max_value=2, allow_nan=False) | st.integers(0, 3)
scalars = st.none() | st.booleans() | st.integers(-5, 5) | texts


@st.composite
def schemas(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(
        st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=2, max_size=4, unique=True)
    )
    return {"type": "object", "properties": {n: {"type": "string"} for n in names}}


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    kind = draw(st.sampled_from(["chat", "completions", "embeddings"]))
    body: dict[str, Any] = {"model": draw(st.sampled_from(["m", "llama", "m2"]))}
    if kind == "chat":
        body["messages"] = [
            {"role": draw(st.sampled_from(["system", "user", "assistant"])), "content": draw(texts)}
            for _ in range(draw(st.integers(1, 3)))
        ]
    elif kind == "completions":
        body["prompt"] = draw(texts | st.lists(texts, min_size=1, max_size=3))
    else:
        body["input"] = draw(texts | st.lists(texts, min_size=1, max_size=3))
    if kind != "embeddings":
        if draw(st.booleans()):
            body["temperature"] = 0
        else:
            body["seed"] = draw(st.integers(0, 2**70))
            body["temperature"] = draw(numbers)
        for name in ("top_p", "presence_penalty"):
            if draw(st.booleans()):
                body[name] = draw(numbers)
        if draw(st.booleans()):
            body["stream"] = draw(st.booleans())
        if draw(st.booleans()):
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"schema": draw(schemas())},
            }
    for name in draw(
        st.lists(st.sampled_from(["max_tokens", "n", "stop", "x_extra"]), unique=True)
    ):
        body[name] = draw(scalars)
    return kind, body


def _texts(body: dict[str, Any]) -> list[tuple[Any, Any]]:
    """(container, index) of every text a server reads."""
    spots: list[tuple[Any, Any]] = []
    for name in ("prompt", "input"):
        if isinstance(body.get(name), str):
            spots.append((body, name))
        elif isinstance(body.get(name), list):
            spots += [(body[name], i) for i in range(len(body[name]))]
    for message in body.get("messages", []):
        spots.append((message, "content"))
    return spots


@st.composite
def changed(draw: st.DrawFn) -> tuple[str, dict[str, Any], str, dict[str, Any], bytes]:
    """A request and one that could get a different answer (kind, body, kind, body, query)."""
    kind, a = draw(requests())
    b = copy.deepcopy(a)
    kind_b, query = kind, b""
    how = draw(
        st.sampled_from(
            ["text", "number", "type", "add", "remove", "order", "query", "kind", "role"]
        )
    )
    spots = _texts(b)
    if how == "text" and spots:
        box, i = draw(st.sampled_from(spots))
        text = box[i]
        at = draw(st.integers(0, len(text)))
        box[i] = text[:at] + draw(st.sampled_from([" ", "\n", "\t", "x", "  "])) + text[at:]
    elif how == "number":
        name = draw(st.sampled_from(["temperature", "top_p", "presence_penalty"]))
        value = b.get(name, 0)
        value = 0 if not isinstance(value, int | float) or isinstance(value, bool) else value
        b[name] = math.nextafter(float(value), math.inf)
    elif how == "type":
        name = draw(st.sampled_from(sorted(b)))
        value = b[name]
        b[name] = draw(
            st.sampled_from([json.dumps(value), [value], {"v": value}]).filter(lambda v: v != value)
        )
    elif how == "add":
        b["logprobs" if "logprobs" not in b else "top_k"] = draw(scalars)
    elif how == "remove":
        removable = [n for n in b if n not in ("model", "user", "metadata", "store")]
        if not removable or (removable == ["stream"] and b["stream"] is False):
            b["echo"] = True
        else:
            victim = draw(st.sampled_from(removable))
            if victim == "stream" and b["stream"] is False:
                b["echo"] = True
            else:
                del b[victim]
    elif how == "order" and "response_format" in b:
        props = b["response_format"]["json_schema"]["schema"]["properties"]
        b["response_format"]["json_schema"]["schema"]["properties"] = dict(reversed(props.items()))
    elif how == "query":
        query = draw(st.sampled_from([b"api-version=1", b"a=1&b=2", b"x"]))
    elif how == "kind":
        kind_b = draw(
            st.sampled_from(["chat", "completions", "embeddings"]).filter(lambda k: k != kind)
        )
    elif how == "role" and "messages" in b:
        b["messages"][0]["role"] += "x"
    else:
        b["model"] += "-other"
    return kind, a, kind_b, b, query


def digest(kind: str, body: dict[str, Any], query: bytes = b"", **opts: bool) -> int | None:
    try:
        return make_key(body, kind, SCOPE, KeyOptions(**opts), query=query).digest
    except Uncacheable:
        return None


@PROPERTY
@given(changed(), st.booleans())
def test_requests_that_differ_in_meaning_never_collide(
    case: tuple[str, dict[str, Any], str, dict[str, Any], bytes], collapse: bool
) -> None:
    kind, a, kind_b, b, query = case
    if collapse and kind == kind_b == "chat" and a != b and "messages" in a:
        # Collapsing is the tenant's declaration that chat whitespace is noise.
        return
    key_a = digest(kind, a, collapse_whitespace=collapse)
    key_b = digest(kind_b, b, query, collapse_whitespace=collapse)
    if key_a is not None and key_b is not None:
        assert key_a != key_b, (a, b)


@st.composite
def rewritten(draw: st.DrawFn) -> tuple[str, bytes, bytes]:
    """A request, serialised twice in ways no server can tell apart."""
    kind, body = draw(requests())
    first = json.dumps(body).encode()
    other = copy.deepcopy(body)
    for name in ("temperature", "top_p", "presence_penalty"):
        value = other.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            other[name] = float(value)
        elif isinstance(value, float) and value.is_integer():
            other[name] = int(value)
    other["user"] = draw(texts)
    if kind != "embeddings" and "stream" not in other and draw(st.booleans()):
        other["stream"] = False
    for message in other.get("messages", []):
        items = list(message.items())
        message.clear()
        message.update(reversed(items))
    names = list(other)
    order = draw(st.permutations(names))
    other = {n: other[n] for n in order}
    second = json.dumps(
        other,
        ensure_ascii=draw(st.booleans()),
        indent=draw(st.sampled_from([None, 2])),
        separators=draw(st.sampled_from([(",", ":"), (", ", ": ")])),
    ).encode()
    return kind, first, second


@PROPERTY
@given(rewritten())
def test_rewriting_a_request_invisibly_keeps_its_key(case: tuple[str, bytes, bytes]) -> None:
    kind, first, second = case
    a, b = parse_body(first), parse_body(second)
    assert a is not None
    assert b is not None
    assert digest(kind, a) == digest(kind, b)


def test_ambiguous_bodies_are_not_parsed() -> None:
    for raw in (
        b'{"a": 1, "a": 2}',
        b'{"m": {"x": 1, "x": 1}}',
        b'{"t": NaN}',
        b'{"t": 1e400}',
        b"\xef\xbb\xbf{}",
        '{"t": "\u00e9"}'.encode("latin-1"),
        b"[]",
    ):
        assert parse_body(raw) is None, raw
    big = parse_body(b'{"seed": 123456789012345678901234567890}')
    assert big == {"seed": 123456789012345678901234567890}
