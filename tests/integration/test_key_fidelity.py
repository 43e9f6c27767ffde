"""Spec: only correct answers are stored, under a key that means exactly the request.

Black-box through real sockets against the stand-in model server
(``docs/cache-key.md`` states the rules these tests read as).
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import httpx
import pytest

from cachefleet_common.contract.clients import redis_from_url
from cachefleet_common.contract.versioned import l1_id_line, split_l1_id
from cachefleet_e2e.fake_upstream import FakeUpstream
from cachefleet_sidecar.cache.entry import Entry

from .conftest import RunningSidecar, SidecarFactory
from .test_sidecar import CHAT, answer, metric

COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"


async def post(sc: RunningSidecar, path: str, body: dict[str, Any] | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return await sc.client.post(
        path, content=content, headers={"X-Tenant-ID": "acme", "content-type": "application/json"}
    )


async def faults(sc: RunningSidecar, kind: str) -> float:
    text = (await sc.admin.get("/metrics")).text
    return metric(text, "cachefleet_cache_faults_total", kind=kind) or 0.0


# ----------------------------------------------------------------- the key
async def test_the_query_string_is_part_of_the_key(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    body = {"model": "m1", "messages": [{"role": "user", "content": "q"}], "temperature": 0}
    plain = await post(sidecar, CHAT, body)
    versioned = await post(sidecar, CHAT + "?api-version=2", body)
    assert plain.headers["x-cache"] == versioned.headers["x-cache"] == "MISS"
    assert answer(plain) != answer(versioned)
    again = await post(sidecar, CHAT + "?api-version=2", body)
    assert again.headers["x-cache"] == "HIT-L1"
    assert answer(again) == answer(versioned)
    other = await post(sidecar, CHAT + "?api-version=3", body)
    assert other.headers["x-cache"] == "MISS"
    assert upstream.calls[CHAT] == 3


async def test_sampling_parameters_are_never_rounded(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    await sidecar.chat("p", body={"seed": 1, "top_p": 0.5})
    near = await sidecar.chat("p", body={"seed": 1, "top_p": 0.5004})
    assert near.headers["x-cache"] == "MISS"
    # 0.0004 is not 0: not deterministic, so never cached and never served 0's answer.
    greedy = await sidecar.chat("t")
    warm = await sidecar.chat("t", body={"temperature": 0.0004})
    assert warm.headers["x-cache"] == "BYPASS"
    assert answer(warm) != answer(greedy)
    # The same JSON number written differently is the same request.
    assert (await sidecar.chat("t", body={"temperature": 0.0})).headers["x-cache"] == "HIT-L1"


async def test_a_stream_flag_that_is_not_a_boolean_is_never_cached(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    odd = {"stream": "false"}
    first = await sidecar.chat("s", body=odd)
    second = await sidecar.chat("s", body=odd)
    assert first.headers["x-cache"] == second.headers["x-cache"] == "BYPASS"
    assert upstream.calls[CHAT] == 2
    # Neither took the place of the real non-streamed or streamed request.
    assert (await sidecar.chat("s", body={"stream": False})).headers["x-cache"] == "MISS"
    streamed = await sidecar.chat("s", body={"stream": True})
    assert streamed.headers["x-cache"] == "MISS"
    assert streamed.headers["content-type"] == "text/event-stream"


@pytest.mark.parametrize("collapse", [False, True])
async def test_prompts_and_embedding_inputs_keep_their_whitespace(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream, collapse: bool
) -> None:
    sc = await sidecar_factory(collapse_whitespace=collapse)
    code = "def f():\n    return 1\n"
    for path, field in ((COMPLETIONS, "prompt"), (EMBEDDINGS, "input")):
        base: dict[str, Any] = {"model": "m1"} | ({"temperature": 0} if path == COMPLETIONS else {})
        variants = [code, code.strip(), "def f():\n  return 1\n", " " + code]
        seen = [await post(sc, path, {**base, field: text}) for text in variants]
        assert [r.headers["x-cache"] for r in seen] == ["MISS"] * 4, path
        assert (await post(sc, path, {**base, field: code})).headers["x-cache"] == "HIT-L1"
    assert upstream.calls[COMPLETIONS] == upstream.calls[EMBEDDINGS] == 4


async def test_duplicate_member_names_are_not_cached(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    # Parsers disagree on which of two "temperature"s wins: never key such a body.
    raw = (
        b'{"model":"m1","temperature":1,"temperature":0,"messages":[{"role":"user","content":"d"}]}'
    )
    assert (await post(sidecar, CHAT, raw)).headers["x-cache"] == "BYPASS"
    assert (await post(sidecar, CHAT, raw)).headers["x-cache"] == "BYPASS"
    assert upstream.calls[CHAT] == 2


# ------------------------------------------------- only correct answers
@pytest.mark.parametrize(
    ("fault", "streamed"),
    [("error_object_next", False), ("sse_error_next", True), ("sse_no_done_next", True)],
)
async def test_a_wrong_answer_is_forwarded_but_never_stored(
    sidecar: RunningSidecar, upstream: FakeUpstream, fault: str, streamed: bool
) -> None:
    setattr(upstream, fault, 1)
    body = {"stream": True} if streamed else {}
    bad = await sidecar.chat("wrong", body=body)
    assert bad.status_code == 200  # the upstream's own answer, unchanged
    assert bad.headers["x-cache"] == "MISS"
    assert ("[DONE]" not in bad.text) if fault == "sse_no_done_next" else ("error" in bad.text)
    good = await sidecar.chat("wrong", body=body)
    assert good.headers["x-cache"] == "MISS"
    assert "error" not in good.text
    assert (await sidecar.chat("wrong", body=body)).headers["x-cache"] == "HIT-L1"
    assert upstream.calls[CHAT] == 2
    assert await faults(sidecar, "answer_not_stored") == 1


# -------------------------------------------------------------- HTTP/1.0
def http10(port: int, body: dict[str, Any], *, keep_alive: bool = False) -> bytes:
    """One HTTP/1.0 exchange on a raw socket; everything read until the server closes."""
    raw = json.dumps(body).encode()
    head = (
        b"POST /v1/chat/completions HTTP/1.0\r\nHost: x\r\nX-Tenant-ID: acme\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(raw)
    )
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + raw)
        chunks = []
        while True:
            data = sock.recv(65536)
            if not data:
                return b"".join(chunks)
            chunks.append(data)


async def test_http10_clients_get_bodies_they_can_read(
    sidecar: RunningSidecar, upstream: FakeUpstream
) -> None:
    port = int(sidecar.url.rsplit(":", 1)[1])
    body = {
        "model": "m1",
        "messages": [{"role": "user", "content": "old client"}],
        "temperature": 0,
        "stream": True,
    }
    for expected in ("MISS", "HIT-L1"):
        # The stand-in streams with chunked framing; an HTTP/1.0 client must not see it.
        raw = await asyncio.to_thread(http10, port, body)
        head, _, payload = raw.partition(b"\r\n\r\n")
        lines = head.lower().split(b"\r\n")
        assert lines[0].startswith(b"http/1.1 200")
        assert b"transfer-encoding: chunked" not in lines
        assert f"x-cache: {expected}".lower().encode() in lines
        assert payload.startswith(b"data: {")
        assert payload.endswith(b"data: [DONE]\n\n")
        assert b"\r\n0\r\n" not in payload
    assert upstream.calls[CHAT] == 1


# ------------------------------------------------------ L2 entries are checked
def _planted(original: Entry, variant: str) -> bytes:
    ok_headers = b"content-type: application/json\r\n"
    body = original.body
    if variant == "response splitting":
        return Entry(
            200,
            ok_headers + b"x-a: 1\r\n\r\nHTTP/1.1 200 OK\r\n",
            body,
            stream=False,
            tenant="acme",
        ).dumps()
    if variant == "framing header":
        return Entry(
            200, ok_headers + b"content-length: 2\r\n", body, stream=False, tenant="acme"
        ).dumps()
    if variant == "error object":
        return Entry(
            200, ok_headers, b'{"error": {"message": "planted"}}', stream=False, tenant="acme"
        ).dumps()
    if variant == "stream flag":
        return Entry(200, ok_headers, body, stream=True, tenant="acme").dumps()
    if variant == "cut envelope":
        return original.dumps()[:-3]
    raise AssertionError(variant)


VARIANTS = ["response splitting", "framing header", "error object", "stream flag", "cut envelope"]


@pytest.mark.redis
async def test_a_planted_or_corrupt_l2_entry_is_a_counted_miss(
    sidecar_factory: SidecarFactory, upstream: FakeUpstream, redis_url: str
) -> None:
    # patient: a loaded machine must not drop a write (or time out a read) under 50 ms
    writer = await sidecar_factory(redis_url=redis_url, pod="pod-a", patient=True)
    client = redis_from_url(redis_url)
    try:
        for n, variant in enumerate(VARIANTS, 1):
            before = {k async for k in client.scan_iter(match="cf:*:e:*")}
            await writer.chat(f"planted {variant}")
            await writer.stored(n)  # the L2 write is asynchronous
            added = {k async for k in client.scan_iter(match="cf:*:e:*")} - before
            (name,) = added
            stored = bytes(await client.get(name))
            epochs, _, rest = stored.partition(b"\n")
            l1_id, envelope = split_l1_id(rest)  # the writer's L1 key, then the entry
            assert l1_id is not None
            line = l1_id_line(l1_id)
            planted = _planted(Entry.loads(envelope), variant)
            await client.set(name, epochs + b"\n" + line + planted, keepttl=True)
    finally:
        await client.aclose()
    reader = await sidecar_factory(redis_url=redis_url, pod="pod-b", patient=True)
    for variant in VARIANTS:
        resp = await reader.chat(f"planted {variant}")
        assert resp.status_code == 200, variant
        assert resp.headers["x-cache"] == "MISS", variant
        assert "planted" not in resp.text
        assert json.loads(resp.text)["choices"], variant
    assert await faults(reader, "corrupt_entry") == len(VARIANTS)
    assert upstream.calls[CHAT] == 2 * len(VARIANTS)
