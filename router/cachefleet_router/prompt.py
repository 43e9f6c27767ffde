"""A request body reduced to what routing needs (pure: bytes and headers in, RouteRequest out).

The gateway hands the picker the raw body of an OpenAI-style request. This
module reads its ``model`` and its prompt — chat ``messages`` (``role`` +
``content``, the content a string or a list of parts) or a completions
``prompt`` (a string or a list of them) — and writes the prompt as one
canonical text, so that two requests that would put the same tokens in front
of the model give the same text.

That text is cut into blocks of :data:`BLOCK_CHARS` characters, an
approximation of :data:`~cachefleet_router.endpoints.DEFAULT_BLOCK_TOKENS`
tokens at :data:`CHARS_PER_TOKEN` characters a token (no tokenizer is at hand
in the picker). Only whole blocks are hashed, as a model server only caches
whole KV blocks. The hashes are chained: each block's xxh64 is seeded by the
previous block's hash (the first by the model's name), so two prompts share
their first ``n`` hashes exactly when they share their first ``n`` blocks.

Bad input is never an error here: a body that is not JSON, not an object, or
has no prompt gives a :class:`RouteRequest` with no blocks, which the picker
places by load alone (``extra["body"]`` says why).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import orjson
import xxhash

from cachefleet_common.classes import OBJECTIVE_HEADER, capped_class

from .endpoints import DEFAULT_BLOCK_TOKENS, RouteRequest

#: Characters per token of the estimate (English text with BPE tokenizers: ~4).
CHARS_PER_TOKEN = 4
#: Characters of prompt text in one hashed block (~DEFAULT_BLOCK_TOKENS tokens).
BLOCK_CHARS = DEFAULT_BLOCK_TOKENS * CHARS_PER_TOKEN
#: Longest prompt text that is hashed; the rest only counts towards the token estimate.
MAX_HASHED_CHARS = 4 * 1024 * 1024

#: ``extra["body"]`` values: why a request has no blocks
BODY_EMPTY = "empty"
BODY_UNPARSEABLE = "unparseable"
BODY_NO_PROMPT = "no-prompt"
BODY_OVERSIZED = "oversized"

#: tenant -> priority class (None: Standard)
ClassOf = Callable[[str], str | None]


def _part_text(part: Any) -> str:
    """One content part as text: text parts as themselves, any other part as canonical JSON."""
    if isinstance(part, str):
        return part
    if isinstance(part, Mapping):
        if part.get("type") == "text" and isinstance(part.get("text"), str):
            return str(part["text"])
        return orjson.dumps(part, option=orjson.OPT_SORT_KEYS).decode()
    return orjson.dumps(part, option=orjson.OPT_SORT_KEYS).decode()


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_part_text(part) for part in content)
    return _part_text(content)


def chat_text(messages: Iterable[Any]) -> str:
    """Chat messages as one text: a role line, then the content, per message.

    Tool calls and a message's ``name`` are part of what the model reads, so
    they are part of the text; anything that is not a message object is skipped.
    """
    out: list[str] = []
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        role = message.get("role")
        head = f"<|{role if isinstance(role, str) else ''}|>"
        name = message.get("name")
        if isinstance(name, str) and name:
            head += f" {name}"
        out.append(head)
        out.append(_content_text(message.get("content")))
        calls = message.get("tool_calls")
        if calls:
            out.append(orjson.dumps(calls, option=orjson.OPT_SORT_KEYS).decode())
    return "\n".join(out)


def completion_text(prompt: Any) -> str | None:
    """A completions ``prompt`` as text (a string, or a list of strings joined); None otherwise."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return "\n".join(prompt)
    if isinstance(prompt, list) and all(isinstance(p, int) for p in prompt):
        return " ".join(str(p) for p in prompt)  # token ids: still a stable prefix
    return None


def block_hashes(text: str, model: str | None = None) -> tuple[int, ...]:
    """Chained xxh64 of each whole :data:`BLOCK_CHARS`-character block of ``text``."""
    seed = xxhash.xxh64_intdigest((model or "").encode())
    out: list[int] = []
    limit = min(len(text), MAX_HASHED_CHARS)
    for start in range(0, limit - BLOCK_CHARS + 1, BLOCK_CHARS):
        block = text[start : start + BLOCK_CHARS].encode("utf-8", "surrogatepass")
        seed = xxhash.xxh64_intdigest(block, seed=seed)
        out.append(seed)
    return tuple(out)


def estimate_tokens(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def header(headers: Mapping[str, str], name: str) -> str | None:
    """A header's value, names compared without case (Envoy lower-cases them; tests may not)."""
    wanted = name.lower()
    for key, value in headers.items():
        if key.lower() == wanted:
            return value
    return None


def reduce_request(
    body: bytes,
    headers: Mapping[str, str],
    *,
    tenant_header: str = "X-Tenant-ID",
    class_of: ClassOf | None = None,
    truncated: bool = False,
    objective_class: ClassOf | None = None,
) -> RouteRequest:
    """``body`` and ``headers`` of one request as a :class:`RouteRequest`; never raises.

    ``truncated``: the body was cut at the service's limit (its prompt is not
    hashed: a cut JSON document does not parse). ``objective_class``: the class of
    a GIE objective (``x-gateway-inference-objective``), which lowers the tenant's
    class and never raises it.
    """
    tenant = header(headers, tenant_header) or None
    priority = class_of(tenant) if (class_of is not None and tenant) else None
    objectives = header(headers, OBJECTIVE_HEADER)
    if objectives and objective_class is not None:
        for objective in objectives.split(","):  # repeated headers, joined: each may lower
            priority = capped_class(priority, objective_class(objective.strip()))

    def bare(reason: str, model: str | None = None) -> RouteRequest:
        return RouteRequest(
            model=model, tenant=tenant, priority_class=priority, extra={"body": reason}
        )

    if truncated:
        return bare(BODY_OVERSIZED)
    if not body.strip():
        return bare(BODY_EMPTY)
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return bare(BODY_UNPARSEABLE)
    if not isinstance(doc, dict):
        return bare(BODY_UNPARSEABLE)
    model = doc.get("model") if isinstance(doc.get("model"), str) else None
    text: str | None = None
    messages = doc.get("messages")
    if isinstance(messages, list):
        text = chat_text(messages)
    elif "prompt" in doc:
        text = completion_text(doc.get("prompt"))
    if text is None:
        return bare(BODY_NO_PROMPT, model)
    return RouteRequest(
        blocks=block_hashes(text, model),
        tokens=estimate_tokens(text),
        model=model,
        tenant=tenant,
        priority_class=priority,
    )
