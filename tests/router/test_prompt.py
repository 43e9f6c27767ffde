"""The prompt reduction: bodies -> chained block hashes, token estimate, tenant and class."""

from __future__ import annotations

import json

from cachefleet_router.endpoints import DEFAULT_BLOCK_TOKENS
from cachefleet_router.prompt import (
    BLOCK_CHARS,
    BODY_EMPTY,
    BODY_NO_PROMPT,
    BODY_UNPARSEABLE,
    CHARS_PER_TOKEN,
    reduce_request,
)

SYSTEM = "You are a careful assistant. " * 200  # ~5,800 chars: two whole blocks and a bit


def chat(*messages: tuple[str, object], model: str = "m1") -> bytes:
    return json.dumps(
        {"model": model, "messages": [{"role": r, "content": c} for r, c in messages]}
    ).encode()


def test_block_size_approximates_the_default_block_tokens() -> None:
    assert BLOCK_CHARS == DEFAULT_BLOCK_TOKENS * CHARS_PER_TOKEN


def test_same_prefix_gives_the_same_leading_hashes() -> None:
    a = reduce_request(chat(("system", SYSTEM), ("user", "first question " * 400)), {})
    b = reduce_request(chat(("system", SYSTEM), ("user", "another one " * 400)), {})
    assert len(a.blocks) >= 3
    assert len(b.blocks) >= 3
    assert a.blocks[:2] == b.blocks[:2]  # the system prompt's whole blocks
    assert a.blocks[2] != b.blocks[2]  # the block where they part


def test_a_different_system_prompt_changes_the_first_block() -> None:
    a = reduce_request(chat(("system", SYSTEM), ("user", "q")), {})
    b = reduce_request(chat(("system", "Be terse. " + SYSTEM), ("user", "q")), {})
    assert a.blocks
    assert b.blocks
    assert a.blocks[0] != b.blocks[0]
    assert not set(a.blocks) & set(b.blocks)  # chained: nothing after a change matches


def test_a_conversation_that_grows_keeps_its_earlier_blocks() -> None:
    turn1 = [("system", SYSTEM), ("user", "tell me about caches " * 100)]
    turn2 = [*turn1, ("assistant", "caches keep things " * 150), ("user", "and more " * 50)]
    a, b = reduce_request(chat(*turn1), {}), reduce_request(chat(*turn2), {})
    assert len(b.blocks) > len(a.blocks)
    assert b.blocks[: len(a.blocks)] == a.blocks


def test_the_model_seeds_the_chain() -> None:
    a = reduce_request(chat(("system", SYSTEM), model="llama"), {})
    b = reduce_request(chat(("system", SYSTEM), model="qwen"), {})
    assert a.model == "llama"
    assert b.model == "qwen"
    assert a.blocks[0] != b.blocks[0]  # two models never share KV blocks


def test_content_parts_read_like_the_same_text() -> None:
    text = SYSTEM
    as_string = reduce_request(chat(("user", text)), {})
    as_parts = reduce_request(chat(("user", [{"type": "text", "text": text}])), {})
    assert as_string.blocks == as_parts.blocks
    with_image = reduce_request(
        chat(("user", [{"type": "image_url", "image_url": {"url": "a.png"}}, text])), {}
    )
    assert with_image.blocks[0] != as_string.blocks[0]


def test_only_whole_blocks_are_hashed_and_tokens_are_estimated() -> None:
    short = reduce_request(chat(("user", "hello there")), {})
    assert short.blocks == ()
    assert 0 < short.tokens < 20
    body = json.dumps({"model": "m", "prompt": "x" * (BLOCK_CHARS * 3 + 10)}).encode()
    long = reduce_request(body, {})
    assert len(long.blocks) == 3
    assert long.tokens == (BLOCK_CHARS * 3 + 10 + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN


def test_completion_prompt_as_a_list() -> None:
    one = reduce_request(json.dumps({"prompt": "y" * BLOCK_CHARS * 2}).encode(), {})
    listed = reduce_request(json.dumps({"prompt": ["y" * BLOCK_CHARS * 2]}).encode(), {})
    assert one.blocks == listed.blocks
    assert len(one.blocks) == 2


def test_tenant_from_its_header_and_class_from_the_table() -> None:
    classes = {"gold": "Guaranteed", "bulk": "BestEffort"}
    req = reduce_request(chat(("user", "hi")), {"x-tenant-id": "gold"}, class_of=classes.get)
    assert req.tenant == "gold"
    assert req.priority_class == "Guaranteed"
    other = reduce_request(
        chat(("user", "hi")), {"X-Team": "bulk"}, tenant_header="x-team", class_of=classes.get
    )
    assert other.tenant == "bulk"
    assert other.priority_class == "BestEffort"
    unknown = reduce_request(chat(("user", "hi")), {"x-tenant-id": "new"}, class_of=classes.get)
    assert unknown.tenant == "new"
    assert unknown.priority_class is None
    nobody = reduce_request(chat(("user", "hi")), {}, class_of=classes.get)
    assert nobody.tenant is None
    assert nobody.priority_class is None


def test_bad_bodies_give_a_request_without_blocks_never_an_error() -> None:
    cases = {
        b"": BODY_EMPTY,
        b"   ": BODY_EMPTY,
        b"not json at all": BODY_UNPARSEABLE,
        b'{"model": "m", "messages": [': BODY_UNPARSEABLE,
        b"[1, 2, 3]": BODY_UNPARSEABLE,
        b"\xff\xfe\x00garbage": BODY_UNPARSEABLE,
        b'{"model": "m"}': BODY_NO_PROMPT,
        b'{"model": "m", "prompt": {"odd": true}}': BODY_NO_PROMPT,
    }
    for body, reason in cases.items():
        req = reduce_request(body, {"x-tenant-id": "t"})
        assert (req.blocks, req.extra) == ((), {"body": reason}), body
        assert req.tenant == "t"
    odd = reduce_request(b'{"messages": [1, null, {"role": 5, "content": {"a": 1}}]}', {})
    assert odd.blocks == ()
    assert odd.tokens > 0
