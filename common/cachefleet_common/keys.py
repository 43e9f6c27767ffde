"""Canonical cache keys for OpenAI-style requests (pure).

Rule: two requests share a key only when every model server would read them
as the same request. ``docs/cache-key.md`` states each normalisation and why
it preserves meaning; in short:

* the body is parsed strictly (:func:`parse_body`): UTF-8, no duplicate
  member names, no ``NaN``/``Infinity``, no number that overflows a double;
  anything else is not cached (servers' parsers disagree on such input);
* JSON formatting, escapes and the order of the *top-level* fields and of the
  fields of each chat message do not matter (servers read them by name);
  everything nested deeper (tool and JSON schemas, content parts) keeps its
  order, because chat templates and guided decoding follow it;
* numeric sampling parameters (:data:`SAMPLING_FIELDS`) that are JSON
  numbers are keyed by their exact double value, so ``0`` and ``0.0`` are one
  key and ``0.0004`` is never ``0``; no rounding anywhere;
* ``"stream"`` absent means ``false`` on the completion endpoints; a
  non-boolean ``stream`` makes the request uncacheable (servers coerce or
  reject it differently); no other type is ever coerced;
* text is keyed byte for byte. The per-tenant ``collapse_whitespace`` option
  (a tenant's declaration that its chat template ignores whitespace) strips
  and collapses whitespace in chat message text only, never in a
  ``/v1/completions`` prompt or a ``/v1/embeddings`` input;
* fields that never change the answer (:data:`NON_SEMANTIC_FIELDS`) are
  dropped.

The key is scoped by tenant, model version, invalidation epochs, endpoint
and the exact query string, each length-prefixed so no two scopes can run
into each other. Two digests come out of one canonical form: a 128-bit xxh3
integer for the in-process index and, lazily, SHA-256 hex for keys that
leave the process (Redis).

Only deterministic requests are cacheable by default: ``temperature``
exactly 0, or an explicit integer ``seed``. Embeddings are deterministic by
nature.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import orjson
import xxhash

#: Request fields that never change the answer.
NON_SEMANTIC_FIELDS = frozenset({"user", "metadata", "store"})
#: Float-typed sampling parameters: a JSON integer and the equal float are one value.
SAMPLING_FIELDS = frozenset(
    {
        "temperature",
        "top_p",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
    }
)
#: Largest body that is parsed to be keyed; larger ones are forwarded uncached
#: (parsing runs on the event loop, and a large token-id array stalls it for long).
MAX_KEYED_BODY_BYTES = 4 * 1024 * 1024
#: Version of the canonical form (part of every key: a change never reuses old entries).
KEY_FORMAT = b"cf2"

#: The endpoints whose responses are cached, with their kind.
CACHEABLE_PATHS: dict[bytes, str] = {
    b"/v1/chat/completions": "chat",
    b"/v1/completions": "completions",
    b"/v1/embeddings": "embeddings",
}

_WS = re.compile(r"\s+")
#: Largest integer every double represents exactly (2**53).
_EXACT_INT = 1 << 53


class Uncacheable(Exception):
    """The request is valid JSON but must not be cached; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class KeyOptions:
    """Per-tenant keying policy."""

    #: Strip and collapse whitespace in chat message text (never prompts/inputs).
    collapse_whitespace: bool = False
    #: Cache non-deterministic requests too (a tenant policy can widen it).
    cache_nondeterministic: bool = False


def _lp(data: bytes) -> bytes:
    """Length-prefixed bytes: ``<len>:<data>`` (no separator can be forged)."""
    return b"%d:%s" % (len(data), data)


@dataclass(frozen=True, slots=True)
class Scope:
    """What a key is scoped by, besides the request itself."""

    tenant: str
    model_version: str = ""
    epochs: tuple[int, ...] = ()
    #: The request's cache namespace (``X-Cache-Namespace``); "" when it names none.
    namespace: str = ""

    def prefix(self) -> bytes:
        epochs = ",".join(str(e) for e in self.epochs).encode()
        # A namespace partitions its tenant: ``<tenant>/<namespace>`` in the tenant's
        # place (tenant names hold no "/", so it is no other tenant's name either).
        who = f"{self.tenant}/{self.namespace}" if self.namespace else self.tenant
        return (
            KEY_FORMAT
            + _lp(who.encode())
            + _lp(self.model_version.encode("utf-8", "surrogateescape"))
            + _lp(epochs)
        )


@dataclass(slots=True)
class CacheKey:
    """A request's canonical identity within its scope."""

    kind: str
    model: str
    stream: bool
    canonical: bytes
    digest: int
    _sha256: str | None = field(default=None, repr=False)

    @property
    def sha256_hex(self) -> str:
        """SHA-256 of scope + canonical form, for keys that leave the process."""
        if self._sha256 is None:
            self._sha256 = hashlib.sha256(self.canonical).hexdigest()
        return self._sha256


# ------------------------------------------------------------------ parsing
class _Rejected(ValueError):
    pass


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _Rejected("duplicate member name")
    return obj


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Rejected("number out of range")
    return value


def _no_constant(name: str) -> Any:
    raise _Rejected(f"{name} is not JSON")


_DECODER = json.JSONDecoder(
    object_pairs_hook=_unique_object, parse_float=_finite_float, parse_constant=_no_constant
)


def parse_body(raw: bytes) -> dict[str, Any] | None:
    """The request body as a JSON object, or None when it is not one or is ambiguous.

    Strict: UTF-8 only, no byte-order mark, no duplicate member names, no
    ``NaN``/``Infinity``, no float that overflows. Integers stay exact (a
    64-bit-overflowing ``seed`` is not silently turned into a float).
    """
    try:
        text = raw.decode("utf-8")
        body = _DECODER.decode(text)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return body if isinstance(body, dict) else None


#: Why a body is not keyed before its fields are read (the sidecar's ``X-Cache: BYPASS`` reasons).
BODY_TOO_LARGE = "body too large to key"
BODY_NOT_OBJECT = "body is not an unambiguous JSON object"
#: Why a request to any other path than :data:`CACHEABLE_PATHS` is not cached.
NOT_CACHED_ENDPOINT = "not a cached endpoint"


def keyable_body(raw: bytes) -> dict[str, Any] | str:
    """The parsed body of a request to key, or why it is not keyed.

    The sidecar's first step for every cacheable request (bodies over
    :data:`MAX_KEYED_BODY_BYTES` are not parsed at all); ``kubectl cachefleet
    explain-key`` runs the same one.
    """
    if len(raw) > MAX_KEYED_BODY_BYTES:
        return BODY_TOO_LARGE
    body = parse_body(raw)
    return BODY_NOT_OBJECT if body is None else body


# ------------------------------------------------------------ normalisation
def _norm_text(text: str, collapse: bool) -> str:
    return _WS.sub(" ", text.strip()) if collapse else text


def _norm_content(content: Any, collapse: bool) -> Any:
    if not collapse:
        return content
    if isinstance(content, str):
        return _norm_text(content, collapse)
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                part = {**part, "text": _norm_text(part["text"], collapse)}
            parts.append(part)
        return parts
    return content


def _sampling_value(value: Any) -> Any:
    """A JSON integer equal to a double is keyed as that double (``0`` == ``0.0``)."""
    if (
        isinstance(value, int)
        and not isinstance(value, bool)
        and -_EXACT_INT <= value <= _EXACT_INT
    ):
        return float(value)
    return value


def _message(message: Any, collapse: bool) -> Any:
    if not isinstance(message, dict):
        return message
    out = {name: message[name] for name in sorted(message)}
    if collapse and "content" in out:
        out["content"] = _norm_content(out["content"], collapse)
    return out


def is_deterministic(body: dict[str, Any], kind: str) -> bool:
    """True when the same request must produce the same answer.

    Embeddings always; completions when ``seed`` is an integer or
    ``temperature`` is a number exactly equal to 0 (absent means 1).
    """
    if kind == "embeddings":
        return True
    seed = body.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        return True
    temperature = body.get("temperature")
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        return False
    return bool(temperature == 0)


def canonical_body(body: dict[str, Any], kind: str, options: KeyOptions) -> dict[str, Any]:
    """The canonical form of a parsed request body (a new dict, top-level keys sorted).

    Raises :class:`Uncacheable` for a ``stream`` that is not a boolean.
    """
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise Uncacheable('"stream" is not a boolean')
    names = sorted(body)
    if kind == "embeddings":
        if "stream" in body:
            raise Uncacheable('"stream" is not an embeddings parameter')
    elif "stream" not in body:  # absent means false
        bisect.insort(names, "stream")
    collapse = options.collapse_whitespace
    out: dict[str, Any] = {}
    for name in names:  # one pass, in key order: the dict comes out sorted
        if name in NON_SEMANTIC_FIELDS:
            continue
        value = body.get(name, False)  # only "stream" can be absent
        if name in SAMPLING_FIELDS:
            out[name] = _sampling_value(value)
        elif name == "messages" and kind == "chat" and isinstance(value, list):
            out[name] = [_message(m, collapse) for m in value]
        else:
            out[name] = value
    return out


def make_key(
    body: dict[str, Any],
    kind: str,
    scope: Scope,
    options: KeyOptions = KeyOptions(),
    *,
    query: bytes = b"",
) -> CacheKey:
    """Key a parsed request body; raise :class:`Uncacheable` when it must not be cached.

    ``query`` is the request's raw query string (after ``?``), keyed byte for byte.
    """
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise Uncacheable("no model")
    canon = canonical_body(body, kind, options)
    if not options.cache_nondeterministic and not is_deterministic(body, kind):
        raise Uncacheable("not deterministic (temperature != 0 and no seed)")
    try:
        encoded = orjson.dumps(canon)
    except orjson.JSONEncodeError as exc:  # integers beyond 64 bits, lone surrogates
        raise Uncacheable(f"body cannot be keyed exactly: {exc}") from exc
    canonical = scope.prefix() + _lp(kind.encode()) + _lp(query) + encoded
    return CacheKey(
        kind=kind,
        model=model,
        stream=canon.get("stream") is True,
        canonical=canonical,
        digest=xxhash.xxh3_128_intdigest(canonical),
    )
