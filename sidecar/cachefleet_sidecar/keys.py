"""Canonical cache keys for OpenAI-style requests (pure).

Two requests that mean the same thing get the same key:

* JSON key order and formatting do not matter (the body is parsed and
  re-serialised with sorted keys);
* leading and trailing whitespace of message text is dropped; collapsing
  runs of whitespace *inside* text is a per-tenant option (off by default,
  because it changes code and other whitespace-sensitive prompts);
* sampling parameters are rounded to :data:`SAMPLING_DECIMALS` decimals, so
  float noise (``0.7000000001``) does not split entries, while distinct
  settings stay distinct;
* fields that do not change the answer (:data:`NON_SEMANTIC_FIELDS`) are
  dropped.

The key is scoped by tenant, endpoint, model, model version and the
invalidation epochs, so one tenant's entry can never be found by another
tenant's lookup. Two digests come out of one canonical form: a 128-bit
xxh3 integer for the in-process index and, lazily, SHA-256 hex for keys that
leave the process (Redis).

Only deterministic requests are cacheable by default: ``temperature`` 0, or
an explicit integer ``seed``. Embeddings are deterministic by nature.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

import orjson
import xxhash

#: Request fields that never change the answer.
NON_SEMANTIC_FIELDS = frozenset({"user", "metadata", "store"})
#: Numeric sampling parameters rounded before keying.
SAMPLING_FIELDS = frozenset(
    {"temperature", "top_p", "frequency_penalty", "presence_penalty", "repetition_penalty"}
)
SAMPLING_DECIMALS = 3

#: The endpoints whose responses are cached, with their kind.
CACHEABLE_PATHS: dict[bytes, str] = {
    b"/v1/chat/completions": "chat",
    b"/v1/completions": "completions",
    b"/v1/embeddings": "embeddings",
}

_WS = re.compile(r"\s+")


class Uncacheable(Exception):
    """The request is valid JSON but must not be cached; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class KeyOptions:
    """Per-tenant keying policy."""

    collapse_whitespace: bool = False
    #: Cache non-deterministic requests too (a tenant policy can widen it).
    cache_nondeterministic: bool = False


@dataclass(frozen=True, slots=True)
class Scope:
    """What a key is scoped by, besides the request itself."""

    tenant: str
    model_version: str = ""
    epochs: tuple[int, ...] = ()

    def prefix(self) -> bytes:
        epochs = ",".join(str(e) for e in self.epochs)
        return f"{self.tenant}\x00{self.model_version}\x00{epochs}\x00".encode()


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


def _round(value: Any) -> Any:
    if isinstance(value, float):
        rounded = round(value, SAMPLING_DECIMALS)
        return int(rounded) if rounded.is_integer() else rounded
    return value


def _norm_text(text: str, collapse: bool) -> str:
    text = text.strip()
    return _WS.sub(" ", text) if collapse else text


def _norm_content(content: Any, collapse: bool) -> Any:
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


def is_deterministic(body: dict[str, Any], kind: str) -> bool:
    """True when the same request must produce the same answer."""
    if kind == "embeddings":
        return True
    seed = body.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        return True
    temperature = body.get("temperature")
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        return False
    return bool(_round(float(temperature)) == 0)


def canonical_body(body: dict[str, Any], kind: str, options: KeyOptions) -> dict[str, Any]:
    """The canonical form of a parsed request body (a new dict)."""
    collapse = options.collapse_whitespace
    out: dict[str, Any] = {}
    for name, value in body.items():
        if name in NON_SEMANTIC_FIELDS:
            continue
        if name in SAMPLING_FIELDS:
            out[name] = _round(value)
        elif name == "messages" and isinstance(value, list):
            out[name] = [
                {**m, "content": _norm_content(m["content"], collapse)}
                if isinstance(m, dict) and "content" in m
                else m
                for m in value
            ]
        elif name in {"prompt", "input"}:
            if isinstance(value, list):
                out[name] = [_norm_text(v, collapse) if isinstance(v, str) else v for v in value]
            else:
                out[name] = _norm_content(value, collapse)
        else:
            out[name] = value
    if kind != "embeddings":
        out["stream"] = bool(body.get("stream", False))
    return out


def make_key(
    body: dict[str, Any], kind: str, scope: Scope, options: KeyOptions = KeyOptions()
) -> CacheKey:
    """Key a parsed request body; raise :class:`Uncacheable` when it must not be cached."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise Uncacheable("no model")
    if not options.cache_nondeterministic and not is_deterministic(body, kind):
        raise Uncacheable("not deterministic (temperature != 0 and no seed)")
    canon = canonical_body(body, kind, options)
    canonical = (
        scope.prefix() + kind.encode() + b"\x00" + orjson.dumps(canon, option=orjson.OPT_SORT_KEYS)
    )
    return CacheKey(
        kind=kind,
        model=model,
        stream=bool(canon.get("stream", False)),
        canonical=canonical,
        digest=xxhash.xxh3_128_intdigest(canonical),
    )


def parse_body(raw: bytes) -> dict[str, Any] | None:
    """The request body as a JSON object, or None when it is not one."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return body if isinstance(body, dict) else None
