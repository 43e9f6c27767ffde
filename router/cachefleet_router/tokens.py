"""Real token ids for a request, before the pure pick (``--tokenizer auto|approx|local:PATH``).

The precise prefix index (:mod:`cachefleet_router.kvindex`) matches a
request's token ids against the blocks the model servers say they hold, so
the router needs the tokens the server will make of the prompt:

* ``auto`` (default): the endpoint's own ``POST /tokenize`` (vLLM's):
  ``{"model", "messages", "add_generation_prompt"}`` for a chat request,
  ``{"model", "prompt"}`` otherwise; the answer's ``tokens``. Bounded by
  :data:`DEFAULT_TIMEOUT_S`; an endpoint that fails is not asked again for
  :data:`FAILURE_BACKOFF_S`; the endpoints are asked in turn.
* ``local:PATH``: a ``tokenizer.json`` (the ``tokenizers`` library) and the
  chat template of ``tokenizer_config.json`` (or ``chat_template.jinja``) in
  PATH, rendered with jinja2's sandbox as Hugging Face does: for routers that
  must not call out.
* ``approx``: no tokens; the router's estimate (characters / 4) as before.

Either way the answers are cached by prompt (model, messages or prompt, and
the generation-prompt flag), least recently used first out, at most
:data:`DEFAULT_CACHE_TOKENS` token ids in all. The async part
(:meth:`Tokenization.warm`) runs in the ext_proc stream before the decision;
the sync part (:meth:`Tokenization.apply`) puts the cached tokens into the
:class:`~cachefleet_router.endpoints.RouteRequest` that the pure picker sees.
Anything that fails leaves the request as it was: routed on the estimate.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import httpx
import orjson
import xxhash

from .endpoints import Endpoint, RouteRequest

log = logging.getLogger(__name__)

#: longest wait for one /tokenize answer, seconds (then the estimate)
DEFAULT_TIMEOUT_S = 0.1
#: an endpoint whose /tokenize failed is not asked again for this long, seconds
FAILURE_BACKOFF_S = 30.0
#: token ids kept in the cache, in all (8 bytes each: 16 MB)
DEFAULT_CACHE_TOKENS = 2_000_000
#: bodies whose prompt key is remembered between warm() and apply()
_BODY_MEMO = 256

MODES = ("auto", "approx", "local:PATH")


class TokenizerError(ValueError):
    """A ``--tokenizer`` value or a local tokenizer directory that cannot be used."""


def prompt_of(doc: Mapping[str, Any]) -> tuple[str, Any, bool] | None:
    """(kind, prompt, add_generation_prompt) of a request body; None without a prompt."""
    messages = doc.get("messages")
    if isinstance(messages, list):
        return "chat", messages, bool(doc.get("add_generation_prompt", True))
    prompt = doc.get("prompt")
    if isinstance(prompt, str):
        return "prompt", prompt, False
    return None


def tokens_from_answer(answer: Any) -> tuple[int, ...] | None:
    """The ``tokens`` of a ``/tokenize`` answer; None when it has none."""
    if not isinstance(answer, Mapping):
        return None
    tokens = answer.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        return None
    return tuple(tokens)


class Backend(Protocol):
    """Turns one prompt into token ids; None when it cannot."""

    async def tokenize(
        self, model: str | None, kind: str, prompt: Any, generation: bool, ready: Sequence[Endpoint]
    ) -> Sequence[int] | None: ...


class RemoteBackend:
    """The endpoints' own ``POST /tokenize``, asked in turn, each failure backed off."""

    def __init__(
        self,
        client: httpx.AsyncClient | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client or httpx.AsyncClient(timeout=timeout_s)
        self._own = client is None
        self.timeout_s = timeout_s
        self._clock = clock
        self._failed: dict[str, float] = {}
        self._next = 0

    async def tokenize(
        self, model: str | None, kind: str, prompt: Any, generation: bool, ready: Sequence[Endpoint]
    ) -> Sequence[int] | None:
        now = self._clock()
        usable = [e for e in ready if self._failed.get(e.address, 0.0) <= now]
        if not usable:
            return None
        endpoint = usable[self._next % len(usable)]
        self._next += 1
        body: dict[str, Any] = {"model": model} if model else {}
        if kind == "chat":
            body.update(messages=prompt, add_generation_prompt=generation)
        else:
            body["prompt"] = prompt
        try:
            answer = await self.client.post(
                f"http://{endpoint.address}/tokenize", json=body, timeout=self.timeout_s
            )
            tokens = tokens_from_answer(answer.json()) if answer.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("tokenize on %s failed: %s", endpoint.address, exc)
            tokens = None
        if tokens is None:
            self._failed[endpoint.address] = now + FAILURE_BACKOFF_S
        return tokens

    async def aclose(self) -> None:
        if self._own:
            await self.client.aclose()


class LocalBackend:
    """A ``tokenizer.json`` and a chat template from a directory (no calls out)."""

    def __init__(self, path: str | Path) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        directory = Path(path)
        file = directory / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(f"no tokenizer.json in {directory}")
        try:
            self.tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # the library raises its own exception types
            raise TokenizerError(f"{file}: {exc}") from exc
        config: dict[str, Any] = {}
        config_file = directory / "tokenizer_config.json"
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text())
            except ValueError as exc:
                raise TokenizerError(f"{config_file}: {exc}") from exc
        template = config.get("chat_template")
        jinja_file = directory / "chat_template.jinja"
        if not isinstance(template, str) and jinja_file.is_file():
            template = jinja_file.read_text()
        self.special = {
            name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "unk_token")
        }

        def raise_exception(message: str) -> None:
            raise TokenizerError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent)
        self.template = env.from_string(template) if isinstance(template, str) else None

    def encode(self, kind: str, prompt: Any, generation: bool) -> list[int] | None:
        if kind == "chat":
            if self.template is None:
                return None
            text = self.template.render(
                messages=prompt, add_generation_prompt=generation, **self.special
            )
            return list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer.encode(str(prompt), add_special_tokens=True).ids)

    async def tokenize(
        self, model: str | None, kind: str, prompt: Any, generation: bool, ready: Sequence[Endpoint]
    ) -> Sequence[int] | None:
        try:
            return self.encode(kind, prompt, generation)
        except Exception as exc:  # a template that fails on this request: the estimate
            log.debug("local tokenizer failed: %s", exc)
            return None

    async def aclose(self) -> None:
        return None


def _token_text(value: Any) -> str:
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else ""


class Tokenization:
    """The cache of prompts' token ids, filled by a backend before the pick."""

    def __init__(
        self,
        backend: Backend,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        cache_tokens: int = DEFAULT_CACHE_TOKENS,
    ) -> None:
        self.backend = backend
        self.timeout_s = timeout_s
        self.cache_tokens = cache_tokens
        self._cache: OrderedDict[bytes, array[int]] = OrderedDict()
        self._cached = 0
        self._keys: OrderedDict[bytes, bytes | None] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.failures = 0

    def _key(self, body: bytes) -> tuple[bytes | None, dict[str, Any] | None]:
        """The body's prompt key (None: nothing to tokenize), and its parsed document."""
        memo = xxhash.xxh3_128_digest(body)
        if memo in self._keys:
            return self._keys[memo], None
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            doc = None
        key: bytes | None = None
        if isinstance(doc, dict):
            found = prompt_of(doc)
            if found is not None:
                model = doc.get("model") if isinstance(doc.get("model"), str) else None
                raw = orjson.dumps([model, *found], option=orjson.OPT_SORT_KEYS)
                key = xxhash.xxh3_128_digest(raw)
        self._keys[memo] = key
        while len(self._keys) > _BODY_MEMO:
            self._keys.popitem(last=False)
        return key, doc if isinstance(doc, dict) else None

    async def warm(self, body: bytes, ready: Sequence[Endpoint]) -> None:
        """Tokenize ``body``'s prompt unless cached (bounded by the timeout; never raises)."""
        key, doc = self._key(body)
        if key is None:
            return
        if key in self._cache:
            self._cache.move_to_end(key)
            return
        if doc is None:
            try:
                doc = orjson.loads(body)
            except orjson.JSONDecodeError:
                return
        found = prompt_of(doc) if isinstance(doc, dict) else None
        if found is None or not isinstance(doc, dict):
            return
        model = doc.get("model") if isinstance(doc.get("model"), str) else None
        try:
            tokens = await asyncio.wait_for(
                self.backend.tokenize(model, *found, ready), self.timeout_s
            )
        except TimeoutError:
            tokens = None
        except Exception:  # a tokenizer fault must not fail the request: the estimate
            log.exception("tokenization failed; routing on the estimate")
            tokens = None
        if tokens is None:
            self.failures += 1
            return
        ids = array("q", tokens)
        if len(ids) > self.cache_tokens:
            return
        self._cache[key] = ids
        self._cached += len(ids)
        while self._cached > self.cache_tokens:
            _old, gone = self._cache.popitem(last=False)
            self._cached -= len(gone)

    def apply(self, request: RouteRequest, body: bytes) -> RouteRequest:
        """``request`` with the prompt's cached token ids and their count (as it was if none)."""
        key, _doc = self._key(body)
        ids = self._cache.get(key) if key is not None else None
        if ids is None:
            if key is not None:
                self.misses += 1
            return request
        self.hits += 1
        return replace(request, token_ids=ids, tokens=len(ids))

    async def aclose(self) -> None:
        closer = getattr(self.backend, "aclose", None)
        if closer is not None:
            await closer()


def make_tokenization(
    mode: str, *, client: httpx.AsyncClient | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> Tokenization | None:
    """The tokenization a ``--tokenizer`` value names (None: ``approx``); TokenizerError."""
    if mode == "approx":
        return None
    if mode == "auto":
        return Tokenization(RemoteBackend(client, timeout_s=timeout_s), timeout_s=timeout_s)
    if mode.startswith("local:") and len(mode) > len("local:"):
        return Tokenization(LocalBackend(mode[len("local:") :]), timeout_s=timeout_s)
    raise TokenizerError(f"expected auto, approx or local:PATH, got {mode!r}")
