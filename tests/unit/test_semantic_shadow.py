"""L3 shadow mode in the tier: would-be hits not served, answers compared and counted."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cachefleet_common.keys import KeyOptions, Scope
from cachefleet_sidecar.cache import semantic
from cachefleet_sidecar.cache.embeddings import HashedEmbeddings
from cachefleet_sidecar.cache.l3 import Pending, Ref, SemanticTier, answer_text
from cachefleet_sidecar.observe.metrics import SidecarMetrics

Q = "How do I reset my password on the web portal?"
PARA = "how do I reset my password on the web portal"


def chat(text: str) -> dict[str, Any]:
    return {"model": "m1", "messages": [{"role": "user", "content": text}], "temperature": 0}


def chat_answer(text: str, number: int = 1) -> bytes:
    doc = {
        "id": f"cmpl-{number}",
        "created": 1700000000 + number,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
    }
    return json.dumps(doc).encode()


def response(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nx-cache: HIT-L3\r\n\r\n%s" % (len(body), body)


class _Draws:
    """A stand-in for ``random.Random`` that returns the given draws in turn."""

    def __init__(self, *draws: float) -> None:
        self.draws = list(draws)

    def random(self) -> float:
        return self.draws.pop(0)


async def shadow_tier(**kw: Any) -> tuple[SemanticTier, list[tuple[str, str]]]:
    options = semantic.SemanticOptions(enabled=True, shadow=True)
    tier = SemanticTier("ns/c", HashedEmbeddings(), options, **kw)
    seen: list[tuple[str, str]] = []
    tier.on_shadow = lambda tenant, outcome: seen.append((tenant, outcome))
    await tier.start()
    return tier, seen


async def candidate(tier: SemanticTier, cached_answer: bytes) -> Pending:
    """Index Q, look up PARA (a would-be hit), and take the shadow path with Q's answer."""
    scope, opts = Scope("acme"), KeyOptions()
    _, pending = await tier.lookup("acme", chat(Q), "chat", scope, opts, b"")
    assert pending is not None
    tier.add(pending, Ref(1, "ab", stream=False))
    match, pending = await tier.lookup("acme", chat(PARA), "chat", scope, opts, b"")
    assert match is not None
    assert match.result == "hit"
    assert pending is not None
    return tier.shadow(pending, response(cached_answer), stream=False)


def test_answer_text_reads_chat_completions_and_streams() -> None:
    assert answer_text(chat_answer("Paris."), stream=False) == "Paris."
    completion = b'{"choices": [{"index": 0, "text": "42"}]}'
    assert answer_text(completion, stream=False) == "42"
    sse = (
        b'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n'
        b'data: {"choices": [{"index": 0, "delta": {"content": "Par"}}]}\n\n'
        b'data: {"choices": [{"index": 0, "delta": {"content": "is."}}]}\n\n'
        b"data: [DONE]\n\n"
    )
    assert answer_text(sse, stream=True) == "Paris."
    assert answer_text(b"not json", stream=False) is None
    assert answer_text(b'{"error": {"message": "x"}}', stream=False) is None


async def test_a_would_be_hit_is_counted_as_shadow_and_carries_its_answer() -> None:
    tier, _ = await shadow_tier()
    pending = await candidate(tier, chat_answer("Open settings, then Reset."))
    assert pending.candidate == chat_answer("Open settings, then Reset.")
    assert tier._counts["acme"].lookups["shadow"] == 1
    assert tier._counts["acme"].lookups["hit"] == 0


async def test_the_same_answer_agrees_whatever_its_whitespace_and_ids() -> None:
    tier, seen = await shadow_tier()
    pending = await candidate(tier, chat_answer("Open settings,  then\nReset.", 1))
    outcome = await tier.compare("acme", pending, chat_answer("Open settings, then Reset.", 2))
    assert outcome == "agree"
    assert seen == [("acme", "agree")]


async def test_another_answer_disagrees_and_a_near_identical_one_agrees() -> None:
    tier, seen = await shadow_tier()
    pending = await candidate(tier, chat_answer("Open the portal settings and press Reset."))
    other = chat_answer("You cannot reset it yourself; call the help desk on weekdays.")
    assert await tier.compare("acme", pending, other) == "disagree"
    # One character apart: not equal, but the same embedder puts them above the bar.
    near = chat_answer("Open the portal settings and press Reset!")
    assert await tier.compare("acme", pending, near) == "agree"
    assert seen == [("acme", "disagree"), ("acme", "agree")]


async def test_an_answer_without_text_cannot_be_compared() -> None:
    tier, seen = await shadow_tier()
    pending = await candidate(tier, chat_answer("Open settings."))
    assert await tier.compare("acme", pending, b'{"object": "list"}') == "error"
    assert seen == [("acme", "error")]


async def test_only_the_sampled_share_is_compared() -> None:
    tier, _ = await shadow_tier(shadow_sample=0.5, rng=_Draws(0.2, 0.7))  # type: ignore[arg-type]
    sampled = await candidate(tier, chat_answer("a"))
    skipped = await candidate(tier, chat_answer("b"))
    assert sampled.candidate is not None
    assert skipped.candidate is None


def test_shadow_outcomes_are_per_tenant_metrics() -> None:
    metrics = SidecarMetrics("ns/c")
    metrics.tenant("acme").shadow_compared("agree")
    metrics.tenant("acme").shadow_compared("disagree")
    metrics.tenant("acme").shadow_compared("agree")
    text = metrics.render().decode()
    assert "# TYPE cachefleet_l3_shadow_comparisons_total counter" in text
    assert (
        'cachefleet_l3_shadow_comparisons_total{cache="ns/c",tenant="acme",outcome="agree"} 2'
        in text
    )
    assert 'tenant="acme",outcome="disagree"} 1' in text


@pytest.mark.parametrize("shadow", [True, False])
def test_the_options_say_whether_a_tenant_shadows(shadow: bool) -> None:
    tier = SemanticTier("ns/c", HashedEmbeddings(), semantic.SemanticOptions(enabled=True))
    tier.set_options({"acme": semantic.SemanticOptions(enabled=True, shadow=shadow)})
    assert tier.shadowing("acme") is shadow
    assert tier.shadowing("globex") is False  # the default
    assert tier.describe()["default"]["shadow"] is False


def test_the_sidecar_flags_set_the_default_and_refuse_a_bad_share(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from cachefleet_sidecar.config import parse_args

    base = ["--upstream", "http://127.0.0.1:9"]
    assert parse_args(base).semantic.shadow is False
    flags = [*base, "--semantic-shadow", "--semantic-shadow-sample", "0.25"]
    config = parse_args(flags)
    assert (config.semantic.shadow, config.semantic.shadow_sample) == (True, 0.25)
    monkeypatch.setenv("CACHEFLEET_SEMANTIC_SHADOW", "1")
    assert parse_args(base).semantic.shadow is True
    with pytest.raises(SystemExit):
        parse_args([*base, "--semantic-shadow-sample", "0"])
    assert "--semantic-shadow-sample" in capsys.readouterr().err
    tier = SemanticTier.from_settings(
        config.semantic,
        cache=config.cache,
        upstream=config.http.upstream,
        max_tenants=config.tenancy.max_tenants,
    )
    assert (tier.default.shadow, tier.shadow_sample) == (True, 0.25)
