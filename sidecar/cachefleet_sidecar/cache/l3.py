"""The semantic tier as the sidecar runs it: source, index, per-tenant options, metrics.

Glue between :mod:`semantic` (pure: probes, guard, index) and
:mod:`embeddings` (the source adapters). :class:`SemanticTier` is consulted
by :mod:`handler` only after an exact L1 and L2 miss of a deterministic request
of a tenant that has L3 on, so its cost (parsing the body again, one
embedding, one matrix-vector product) never lands on an exact hit.

Shadow mode (a tenant's ``semantic.shadow``, or ``--semantic-shadow``): the
tenant's L3 looks up and indexes as usual but serves nothing. A would-be hit
(counted as ``result="shadow"``) goes upstream like a miss, carrying the
answer L3 would have served; once upstream has answered, the two answers
are compared in the background (:meth:`SemanticTier.compare`: the generated
texts equal after collapsing whitespace, or their embeddings at least
:data:`SHADOW_AGREE_SIMILARITY` alike) and counted per tenant as ``agree`` or
``disagree`` (``cachefleet_l3_shadow_comparisons_total``, :mod:`metrics`):
the false-hit rate an operator sees before turning serving on.
``--semantic-shadow-sample`` compares only a share of the would-be hits.

State (``/status`` ``semantic``): ``off`` (no ``--semantic-source``),
``starting`` (the local model is loading), ``on``, or ``unavailable`` with
the reason (the package is not installed, the model did not load). Only
``on`` serves; in every other state requests go on to upstream as if L3
did not exist, and a source that fails on one request makes that request a
miss (counted as ``cachefleet_cache_faults_total{kind="embedding_unavailable"}``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from cachefleet_common import keys
from cachefleet_sidecar.cache import semantic
from cachefleet_sidecar.cache.embeddings import EmbeddingSource, EmbeddingUnavailable, make_source
from cachefleet_sidecar.cache.settings import EMBED_TIMEOUT_S, SemanticSettings
from cachefleet_sidecar.observe.metrics import OTHER_TENANT

log = logging.getLogger("cachefleet.sidecar.l3")

#: Consecutive failed embeddings (errors, timeouts) after which L3 stops asking the source...
BREAKER_FAILURES = 5
#: ...for this many seconds (lookups count as ``open`` and go upstream at once).
BREAKER_OPEN_S = 5.0
#: Buckets of the similarity histogram (cosine of the most similar entry).
SIMILARITY_BUCKETS: tuple[float, ...] = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.98, 1.0)
LOOKUP_RESULTS = ("hit", "miss", "guard", "empty", "gone", "skipped", "error", "open", "shadow")
#: Cosine similarity two differing answer texts need to count as the same answer (shadow mode).
SHADOW_AGREE_SIMILARITY = 0.95
#: Outcomes of a shadow comparison: the same answer, another answer, or none could be made
#: (an answer without text, the embedding failed).
SHADOW_OUTCOMES = ("agree", "disagree", "error")


@dataclass(frozen=True, slots=True)
class Ref:
    """Where the answer an L3 entry stands for lives: its exact key in L1 and L2."""

    digest: int
    sha256_hex: str
    stream: bool


@dataclass(frozen=True, slots=True)
class Pending:
    """A probe and its embedding, kept from a missed lookup to index the answer."""

    probe: semantic.Probe
    vector: semantic.Vector
    #: Shadow mode: the body of the answer L3 would have served, and whether it is SSE.
    candidate: bytes | None = None
    stream: bool = False


@dataclass(slots=True)
class _Counts:
    lookups: dict[str, int]
    similarity: list[int]
    similarity_sum: float = 0.0


class SemanticTier:
    """One sidecar's L3: the embedding source, the index and the tenants' options."""

    def __init__(
        self,
        cache: str,
        source: EmbeddingSource | None,
        default: semantic.SemanticOptions,
        *,
        max_tenant_series: int = 64,
        timeout_s: float = EMBED_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        shadow_sample: float = 1.0,
        rng: random.Random | None = None,
    ) -> None:
        self.cache = cache
        #: Share of would-be hits compared in shadow mode, and where the draws come from.
        self.shadow_sample = shadow_sample
        self.rng = rng or random.Random()
        #: Where shadow outcomes are counted: ``(tenant, outcome)`` (the sidecar's metrics).
        self.on_shadow: Callable[[str, str], None] = lambda _t, _o: None
        self.timeout_s = timeout_s
        self.clock = clock
        #: Consecutive failed embeddings, and until when (clock) the source is not asked.
        self.failures = 0
        self.open_until = 0.0
        self.source = source
        self.default = default
        self.options: dict[str, semantic.SemanticOptions] = {}
        self.index = semantic.SemanticIndex(self._max_bytes)
        self.state = "off" if source is None else "starting"
        self.reason: str | None = None if source is not None else "no --semantic-source"
        self.max_tenant_series = max_tenant_series
        self._counts: dict[str, _Counts] = {}

    @classmethod
    def from_settings(
        cls, settings: SemanticSettings, *, cache: str, upstream: str, max_tenants: int
    ) -> SemanticTier:
        """The tier of ``settings`` for ``cache`` (``upstream``: the model server's URL)."""
        source = make_source(settings.source, upstream, model=settings.embeddings_model or None)
        default = semantic.SemanticOptions(
            enabled=settings.default_on,
            threshold=settings.threshold,
            max_bytes=settings.tenant_bytes,
            shadow=settings.shadow,
        )
        return cls(
            cache,
            source,
            default,
            max_tenant_series=max_tenants,
            timeout_s=settings.timeout_s,
            shadow_sample=settings.shadow_sample,
        )

    async def start(self) -> None:
        """Make the source ready; on failure L3 stays off and says why (never raises)."""
        if self.source is None:
            return
        try:
            await self.source.start()
        except EmbeddingUnavailable as exc:
            self.state, self.reason = "unavailable", str(exc)
            log.warning("semantic tier (L3) off: %s", exc)
            return
        except Exception as exc:  # anything else: the same, never the process's end
            self.state, self.reason = "unavailable", f"{type(exc).__name__}: {exc}"
            log.exception("semantic tier (L3) off")
            return
        self.state, self.reason = "on", None
        log.info("semantic tier (L3) on: %s", self.source.describe())

    async def aclose(self) -> None:
        if self.source is not None:
            await self.source.aclose()

    # ------------------------------------------------------------ options
    def tenant_options(self, tenant: str) -> semantic.SemanticOptions:
        return self.options.get(tenant, self.default)

    def enabled(self, tenant: str) -> bool:
        return self.state == "on" and self.tenant_options(tenant).enabled

    def shadowing(self, tenant: str) -> bool:
        """The tenant's L3 measures would-be hits and serves none."""
        return self.tenant_options(tenant).shadow

    def _max_bytes(self, tenant: str) -> int:
        opts = self.tenant_options(tenant)
        return opts.max_bytes if opts.enabled else 0

    def set_options(self, options: dict[str, semantic.SemanticOptions]) -> None:
        """The operator's per-tenant settings; tenants switched off lose their entries."""
        self.options = options
        for tenant in list(self.index.tenants()):
            if not self.tenant_options(tenant).enabled:
                self.index.forget(tenant)
        self.index.enforce_bounds()

    # ------------------------------------------------------------ lookups
    async def lookup(
        self,
        tenant: str,
        body: dict[str, Any],
        kind: str,
        scope: keys.Scope,
        key_options: keys.KeyOptions,
        query: bytes,
    ) -> tuple[semantic.Match | None, Pending | None]:
        """(the match, what to index if the request goes upstream); (None, None): not for L3."""
        probe = semantic.probe_for(body, kind, scope, key_options, query=query)
        if isinstance(probe, str):
            self.count(tenant, "skipped")
            return None, None
        assert self.source is not None
        if self.open_until > self.clock():
            self.count(tenant, "open")  # the source keeps failing: do not make requests wait
            return None, None
        try:
            vector = await asyncio.wait_for(
                self.source.embed(probe.text, probe.model), self.timeout_s
            )
        except (EmbeddingUnavailable, TimeoutError, ValueError) as exc:
            self.count(tenant, "error")
            self.failures += 1
            if self.failures >= BREAKER_FAILURES:
                self.open_until = self.clock() + BREAKER_OPEN_S
                self.failures = 0
                log.warning(
                    "semantic tier (L3): %d embeddings failed in a row (last: %s); "
                    "not asking the source for %.0f s",
                    BREAKER_FAILURES,
                    str(exc) or type(exc).__name__,
                    BREAKER_OPEN_S,
                )
            else:
                log.debug("embedding failed: %s", exc)
            return None, None
        self.failures = 0
        try:
            match = self.index.lookup(probe, vector, self.tenant_options(tenant).threshold)
        except ValueError as exc:  # the source changed dimension (a new model): start over
            log.warning("semantic index reset: %s", exc)
            self.index = semantic.SemanticIndex(self._max_bytes)
            match = semantic.Match("empty")
        result = "shadow" if match.result == "hit" and self.shadowing(tenant) else match.result
        self.count(tenant, result, match.similarity)
        return match, Pending(probe, vector)

    # ------------------------------------------------------------ shadow mode
    def shadow(self, pending: Pending, response: bytes, stream: bool) -> Pending:
        """A would-be hit not served: what to index, with its answer when it is sampled.

        ``response``: the complete HTTP response L3 would have sent.
        """
        if self.rng.random() >= self.shadow_sample:
            return pending
        body = response.partition(b"\r\n\r\n")[2]
        return Pending(pending.probe, pending.vector, body, stream)

    async def compare(self, tenant: str, pending: Pending, upstream_body: bytes) -> str:
        """Compare upstream's correct answer with the one L3 would have served; count it."""
        assert pending.candidate is not None
        mine = answer_text(pending.candidate, pending.stream)
        theirs = answer_text(upstream_body, pending.stream)
        outcome = "error"
        if mine is not None and theirs is not None:
            if " ".join(mine.split()) == " ".join(theirs.split()):
                outcome = "agree"
            elif self.source is not None and self.state == "on":
                model = pending.probe.model
                try:
                    a, b = await asyncio.wait_for(
                        asyncio.gather(
                            self.source.embed(mine, model), self.source.embed(theirs, model)
                        ),
                        2 * self.timeout_s,
                    )
                    similar = float(np.dot(a, b)) >= SHADOW_AGREE_SIMILARITY
                    outcome = "agree" if similar else "disagree"
                except (EmbeddingUnavailable, TimeoutError, ValueError) as exc:
                    log.debug("shadow comparison not made: %s", exc)
        self.on_shadow(tenant, outcome)
        return outcome

    def add(self, pending: Pending, ref: Ref) -> None:
        try:
            self.index.add(pending.probe, pending.vector, ref)
        except ValueError as exc:
            log.debug("not indexed: %s", exc)

    def gone(self, tenant: str, match: semantic.Match) -> None:
        """The entry's answer is no longer in L1 or L2: drop it (counted as ``gone``)."""
        if match.entry_id is not None:
            self.index.remove(match.entry_id)
        self._tenant_counts(tenant).lookups["gone"] += 1

    def retain(self, current: Callable[[str, str, str, tuple[int, ...]], bool]) -> int:
        """Drop partitions whose (tenant, model, model version, epochs) are not current."""
        return self.index.retain(lambda t, p: current(t, p[0], p[1], p[2]))

    def forget(self, tenant: str) -> None:
        self.index.forget(tenant)
        self._counts.pop(tenant, None)

    # ------------------------------------------------------------ metrics
    def _tenant_counts(self, tenant: str) -> _Counts:
        counts = self._counts.get(tenant)
        if counts is None:
            if len(self._counts) >= self.max_tenant_series and tenant not in self.options:
                tenant = OTHER_TENANT
                counts = self._counts.get(tenant)
            if counts is None:
                counts = self._new(tenant)
        return counts

    def _new(self, tenant: str) -> _Counts:
        counts = self._counts[tenant] = _Counts(
            dict.fromkeys(LOOKUP_RESULTS, 0), [0] * (len(SIMILARITY_BUCKETS) + 1)
        )
        return counts

    def count(self, tenant: str, result: str, similarity: float | None = None) -> None:
        counts = self._tenant_counts(tenant)
        counts.lookups[result] += 1
        if similarity is not None:
            counts.similarity[bisect_left(SIMILARITY_BUCKETS, similarity)] += 1
            counts.similarity_sum += similarity

    def families(self) -> Iterator[Metric]:
        cache = self.cache
        up = GaugeMetricFamily(
            "cachefleet_l3_available",
            "1 while the semantic tier (L3) can embed (its source is ready).",
            labels=["cache"],
        )
        up.add_metric([cache], 1.0 if self.state == "on" else 0.0)
        lookups = CounterMetricFamily(
            "cachefleet_l3_lookups",
            "L3 lookups by tenant and result (hit, miss, guard: refused by the false-hit "
            "guard, empty, gone: its answer was evicted, skipped: not for L3, error, "
            "shadow: a hit not served in shadow mode).",
            labels=["cache", "tenant", "result"],
        )
        sim = HistogramMetricFamily(
            "cachefleet_l3_similarity",
            "Cosine similarity of the most similar L3 entry, per lookup that found one.",
            labels=["cache", "tenant"],
        )
        for tenant, counts in list(self._counts.items()):
            for result, n in counts.lookups.items():
                if n:
                    lookups.add_metric([cache, tenant, result], n)
            acc, buckets = 0, []
            for bound, n in zip(SIMILARITY_BUCKETS, counts.similarity, strict=False):
                acc += n
                buckets.append((repr(bound), float(acc)))
            buckets.append(("+Inf", float(acc + counts.similarity[-1])))
            sim.add_metric([cache, tenant], buckets, counts.similarity_sum)
        entries = GaugeMetricFamily(
            "cachefleet_l3_entries",
            "Entries in the L3 index by tenant.",
            labels=["cache", "tenant"],
        )
        used = GaugeMetricFamily(
            "cachefleet_l3_index_bytes",
            "Bytes of the L3 index by tenant (vectors, texts, bookkeeping).",
            labels=["cache", "tenant"],
        )
        evictions = CounterMetricFamily(
            "cachefleet_l3_evictions",
            "L3 entries evicted to stay within a tenant's L3 bytes.",
            labels=["cache", "tenant"],
        )
        for tenant, stats in self.index.stats().items():
            entries.add_metric([cache, tenant], stats.entries)
            used.add_metric([cache, tenant], stats.used_bytes)
            evictions.add_metric([cache, tenant], stats.evictions)
        yield from (up, lookups, sim, entries, used, evictions)

    def describe(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "reason": self.reason,
            "source": None if self.source is None else self.source.describe(),
            "default": {
                "enabled": self.default.enabled,
                "threshold": self.default.threshold,
                "max_bytes": self.default.max_bytes,
                "shadow": self.default.shadow,
            },
            "shadow_sample": self.shadow_sample,
            "entries": len(self.index),
        }


def answer_text(body: bytes, stream: bool) -> str | None:
    """The generated text of an OpenAI-style answer (chat or completions, JSON or SSE).

    Choices are joined in index order; None when the body has no such text.
    """
    parts: dict[int, list[str]] = {}
    if stream:
        docs = []
        for line in body.split(b"\n"):
            data = line.strip()
            if data.startswith(b"data:") and data[5:].strip() != b"[DONE]":
                try:
                    docs.append(orjson.loads(data[5:]))
                except orjson.JSONDecodeError:
                    return None
    else:
        try:
            docs = [orjson.loads(body)]
        except orjson.JSONDecodeError:
            return None
    for doc in docs:
        choices = doc.get("choices") if isinstance(doc, dict) else None
        if not isinstance(choices, list):
            continue
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            holder = choice.get("delta" if stream else "message")
            text = holder.get("content") if isinstance(holder, dict) else choice.get("text")
            index = choice.get("index", 0)
            if isinstance(text, str) and isinstance(index, int):
                parts.setdefault(index, []).append(text)
    if not parts:
        return None
    return "\n".join("".join(parts[i]) for i in sorted(parts))


def with_similarity(response: bytes, similarity: float) -> bytes:
    """An L1 hit's ready bytes (``X-Cache: HIT-L1``) as an L3 hit with its similarity."""
    return response.replace(
        b"\r\nx-cache: HIT-L1\r\n\r\n",
        b"\r\nx-cache: HIT-L3\r\nx-cache-similarity: %.4f\r\n\r\n" % similarity,
        1,
    )


def l3_marker(similarity: float) -> bytes:
    """The ``X-Cache`` value (with the similarity header) for :meth:`Entry.response`."""
    return b"HIT-L3\r\nx-cache-similarity: %.4f" % similarity
