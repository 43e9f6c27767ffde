"""The slow path: what the fast path (:class:`cachefleet_sidecar.cache.handler.Handler`)
does not answer from L1 at once.

Read path of a cacheable request past an L1 miss: L2 (Redis, fills L1) ->
L3 (semantic) -> upstream (fills the tiers); concurrent identical misses
share one upstream call (single-flight, :class:`~.keying.Flight`). The plain miss is
carried on without a task: the fast path hands it to :meth:`SlowPath.begin`
(the L2 read, else the upstream call sent at once) and the connection calls
:meth:`SlowPath.resume` when it is done. Everything else is a task per
request (:meth:`SlowPath.handle`): admin paths, requests that are not
cacheable, Cache-Control directives, rate limits, admission, L3, streams.
Anything the sidecar cannot parse goes upstream untouched (``X-Cache:
BYPASS``); any cache fault is counted and the request is served from
upstream; the upstream's answer is never changed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from cachefleet_common import keys
from cachefleet_sidecar.cache.entry import (
    STORE_DROP,
    V_COMPLETION,
    V_PROMPT,
    V_RESPONSE,
    V_UPSTREAM_S,
    CorruptEntry,
    Entry,
    L1Value,
    answer_problem,
    check_header_block,
    usage_of,
)
from cachefleet_sidecar.cache.keying import Flight, Keying, Lookup
from cachefleet_sidecar.cache.l1 import TenantLimitError
from cachefleet_sidecar.cache.l3 import Pending, Ref, SemanticTier, l3_marker, with_similarity
from cachefleet_sidecar.cache.settings import CacheSettings
from cachefleet_sidecar.cache.tiers import L2HitBook
from cachefleet_sidecar.http.outbox import Outbox
from cachefleet_sidecar.http.relay import MAX_BUFFERED_BYTES, RateTicket, Relay
from cachefleet_sidecar.http.server import Connection, Refusal, Request, error_response
from cachefleet_sidecar.observe.metrics import SidecarMetrics
from cachefleet_sidecar.tasks import Background

if TYPE_CHECKING:
    from cachefleet_sidecar.cache.hits import HitBook
    from cachefleet_sidecar.cache.switcher import PolicySwitcher
    from cachefleet_sidecar.cache.tiers import L2, Tiers

log = logging.getLogger("cachefleet.sidecar")

ADMIN_PATHS = frozenset({b"/healthz", b"/readyz", b"/status", b"/metrics"})


class SlowPath:
    """The request path past the fast path: L2, single-flight, L3, upstream, store."""

    def __init__(
        self,
        settings: CacheSettings,
        *,
        admin_on_proxy: bool,
        keying: Keying,
        tiers: Tiers,
        relay: Relay,
        resolve: Callable[[list[tuple[bytes, bytes]], str | None], str],
        l2: L2 | None,
        l3: SemanticTier,
        metrics: SidecarMetrics,
        switcher: PolicySwitcher | None,
        hits: HitBook,
        outbox: Outbox,
        background: Background,
        admin: Callable[[Request, Connection], Awaitable[None]],
    ) -> None:
        #: The admin endpoints are served here too (no --admin-listen of their own).
        self.admin_on_proxy = admin_on_proxy
        self.keying = keying
        self.tracker = keying.tracker
        self.tiers = tiers
        self.relay = relay
        self.l2 = l2
        self.l3 = l3
        self.metrics = metrics
        self.upstream = relay.upstream
        self.gate = relay.gate
        self.outbox = outbox
        #: The L1 hits' bookkeeping (a hit after a directive or a re-keying).
        self.hits = hits
        self.background = background
        self.admin = admin
        #: The tenant of a request's headers (the same rules as the fast path's keying).
        self.resolve = resolve
        #: Largest answer stored in L1 (larger ones are passed through).
        self.max_entry_bytes = settings.max_entry_bytes
        #: Flights in progress by L1 key (single-flight).
        self.inflight: dict[int, Flight] = {}
        #: Per-tenant rate limits (docs/rate-limits.md); None: none configured.
        self.rates = relay.rates
        # Bound once: the miss path calls these for every miss.
        self._lookup = keying.lookup
        self._l1_fresh = tiers.l1_fresh
        self._l1_put = tiers.l1_put
        self._l2_begin = tiers.l2_begin
        self._l2_entry = tiers.l2_entry
        self._l2_rendered = tiers.l2_rendered
        self._l2_allowed = tiers.l2_allowed
        self._saved = tiers.saved
        self._upstream_headers = relay.upstream_headers
        self._relay_head = relay.relay_head
        self._forwarded = relay.forwarded
        #: The L2 hits' bookkeeping, applied once per loop turn for the turn's hits.
        self.l2_hits = L2HitBook(
            tiers,
            metrics,
            outbox,
            switching=None if switcher is None else switcher.engine,
            on_observed=None if switcher is None else switcher.switch_due,
        )
        self._l2_hit = self.l2_hits.add
        #: Feeds the switching engine (None when switching is off).
        self._observe = None if switcher is None else switcher.observe

    # ------------------------------------------------- the plain miss, without a task
    def begin(
        self, request: Request, lookup: Lookup, key: keys.CacheKey
    ) -> asyncio.Future[Any] | None:
        """The fast path's L1 miss: start the L2 read (when the tenant uses L2), else send
        the request upstream at once; the future to wait on, or None for :meth:`handle`."""
        if self.l2 is not None and self._l2_allowed(lookup.tenant):
            return self._l2_begin(lookup, key)
        return self._upstream_begin(request, lookup, key)

    def resume(self, request: Request) -> bytes | asyncio.Future[Any] | None:
        """What :meth:`begin` started is done: the answer, a future to wait on, or None.

        After the L2 read: a hit's answer (its promotion to L1 and its
        bookkeeping follow once the turn's answers are written,
        :class:`~cachefleet_sidecar.cache.tiers.L2HitBook`), or on a miss the upstream call sent
        at once (:meth:`_upstream_begin`). After the upstream call: the answer
        when it came whole (:meth:`_upstream_answer`). None hands the request
        to :meth:`handle`, which never asks L2 twice nor sends upstream twice.
        """
        lookup = request.memo
        assert isinstance(lookup, Lookup)
        key = lookup.key
        assert key is not None
        if lookup.begun is not None:
            return self._upstream_answer(request, lookup, key)
        assert self.l2 is not None
        assert lookup.l2_read is not None
        data = self.l2.finish_read(lookup.l2_read)
        entry = None if data is None else self._l2_entry(lookup, key, data)
        if entry is None:
            return self._upstream_begin(request, lookup, key)
        tenant = lookup.tenant
        response, promoted = self._l2_rendered(tenant, key, entry)
        # its promotion to L1, metrics, savings and switching follow at the turn's end
        self._l2_hit(tenant, key, entry, promoted, time.perf_counter() - request.started)
        return response

    def _upstream_begin(
        self, request: Request, lookup: Lookup, key: keys.CacheKey
    ) -> asyncio.Future[None] | None:
        """Send a cacheable miss upstream now, without a task; the future of its head.

        Only the plain case: no identical miss in flight (that one is joined),
        no semantic tier to ask first, storing allowed, and an idle upstream
        connection. Anything else is None: :meth:`handle` does it.
        """
        tenant = lookup.tenant
        if (
            lookup.no_store
            or key.digest in self.inflight
            or self.l3.enabled(tenant)
            or not self.keying.current(lookup)
            or (self.gate is not None and self.gate.busy)  # admission decides in handle()
            or (self.rates is not None and self.rates.limited(tenant))  # so do rate limits
        ):
            return None
        headers = self._upstream_headers(request.headers, tenant, b"accept-encoding")
        started = time.perf_counter()
        begun = self.upstream.begin(request.method, request.url, headers, request.body)
        if begun is None:
            return None
        flight = Flight(asyncio.get_running_loop().create_future())
        self.inflight[key.digest] = flight
        lookup.begun, lookup.flight, lookup.begun_at = begun, flight, started
        return begun.future

    def _upstream_answer(
        self, request: Request, lookup: Lookup, key: keys.CacheKey
    ) -> bytes | None:
        """The client's answer to a begun miss whose upstream answer came whole and sized.

        Storing it, the metrics and the joiners follow right after the answer
        is written (:meth:`_upstream_done`); anything else (an error, a body
        still arriving, a stream) is None and :meth:`handle` relays it.
        """
        begun = lookup.begun
        assert begun is not None
        whole = begun.complete_body(MAX_BUFFERED_BYTES)
        if whole is None:
            return None
        status, resp_headers, body = whole
        head = self._relay_head(request, status, resp_headers, len(body), _miss_marker(key))
        begun.release()
        self._after_write(self._upstream_done, request, lookup, key, status, resp_headers, body)
        return head + body

    def _upstream_done(
        self,
        request: Request,
        lookup: Lookup,
        key: keys.CacheKey,
        status: int,
        resp_headers: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> None:
        """What follows the answer of a begun miss: metrics, store, joiners, switching."""
        flight = lookup.flight
        assert flight is not None
        answer: Entry | None = None
        try:
            now = time.perf_counter()
            cost = now - lookup.begun_at
            self._forwarded(lookup.tenant, b"MISS", cost, now - request.started)
            if 200 <= status < 300:  # a whole answer: its first token came with it
                self.relay.answered(lookup.tenant, key.model, now - request.started, None)
            captured = body if len(body) <= self.max_entry_bytes else None
            answer = self._store_answer(request, lookup, key, status, resp_headers, captured, cost)
        finally:
            self._fly_home(key, flight, answer, None)
        if self._observe is not None:
            self._observe(lookup.tenant, time.perf_counter() - request.started, key.digest)

    def _after_write(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` once this turn's answers are written (:meth:`Outbox.later`):
        the bookkeeping of an answer written without a task is not on its latency."""
        self.outbox.later(fn, *args)

    def _l1_hit_done(
        self, tenant: str, key: keys.CacheKey, hit: L1Value, seconds: float, observe: bool = True
    ) -> None:
        """What follows an L1 hit, counted now: the curves' access, the metrics, savings
        and (unless the caller observes the request itself) switching (:class:`HitBook`)."""
        self.hits.add(tenant, key, hit, seconds, observe)
        self.hits.flush()

    # ------------------------------------------------------------- the task
    async def handle(self, request: Request, conn: Connection) -> None:
        path, _, query = request.url.partition(b"?")
        if path in ADMIN_PATHS and self.admin_on_proxy:
            await self.admin(request, conn)
            return
        kind = keys.CACHEABLE_PATHS.get(path) if request.method == b"POST" else None
        if kind is None:
            # Whatever the path (a variant of a cached one included), what reaches the
            # model server carries a decided identity: the same rules, the same refusals.
            try:
                tenant = self.resolve(request.headers, request.peer)
            except Refusal as exc:
                conn.write(exc.response())
                return
            if self.keying.only_if_cached(request.headers):
                conn.write(_not_cached())  # nothing on this path is ever cached
                return
            await self.relay.passthrough(
                request, conn, tenant=tenant, reason=keys.NOT_CACHED_ENDPOINT
            )
            return
        memo = request.memo
        if memo is None or (
            isinstance(memo, Lookup)
            and memo.version != self.keying.scope_version
            and memo.begun is None
        ):
            # Keys moved since the fast path (new epochs): key again, but the identity
            # was decided once for this request (and its mismatches counted once).
            known = memo.tenant if isinstance(memo, Lookup) else None
            try:
                memo = self._lookup(request, kind, query, known)
            except Refusal as exc:
                memo = exc
        if isinstance(memo, Refusal):
            conn.write(memo.response())
            return
        assert isinstance(memo, Lookup)
        if memo.key is None:
            if memo.only_if_cached:  # nothing uncacheable is ever stored
                conn.write(_not_cached())
                return
            await self.relay.passthrough(
                request, conn, tenant=memo.tenant, reason=memo.bypass_reason
            )
            return
        await self._cached(request, conn, memo, memo.key)
        if self._observe is not None:
            self._observe(memo.tenant, time.perf_counter() - request.started, memo.key.digest)

    async def _cached(
        self, request: Request, conn: Connection, lookup: Lookup, key: keys.CacheKey
    ) -> None:
        tenant = lookup.tenant
        tm = self.metrics.tenant(tenant)
        if lookup.begun is not None:  # the fast path sent it upstream already
            assert lookup.flight is not None
            answer: Entry | None = None
            try:
                answer = await self._miss(request, conn, lookup, key)
            finally:
                self._fly_home(key, lookup.flight, answer, None)
            return
        # -- rate limits, --limits-count-hits: every request counts, a hit too (tokens do not)
        rates = self.rates
        counted = False
        if rates is not None and rates.count_hits and rates.limited(tenant):
            refused = (await rates.admit(tenant, request.body, tokens=False)).refusal
            if refused is not None:
                conn.write(refused)
                return
            counted = True
        # --
        if not lookup.no_cache:
            try:
                hit = self._l1_fresh(lookup, key, key.digest)
            except TenantLimitError:
                if lookup.only_if_cached:
                    conn.write(_not_cached())
                    return
                await self.relay.passthrough(
                    request,
                    conn,
                    tenant=tenant,
                    reason="tenant limit",
                    counted=counted,
                    model=key.model,
                )
                return
            if hit is not None:
                conn.write(hit[V_RESPONSE])
                seconds = time.perf_counter() - request.started
                self._l1_hit_done(tenant, key, hit, seconds, False)  # handle() observes
                return
            entry = None if lookup.l2_read is not None else await self.tiers.l2_get(lookup, key)
            if entry is not None:
                response, promoted = self._l2_rendered(tenant, key, entry)
                self.tiers.l2_promoted(tenant, key, entry, promoted)
                conn.write(response)
                tm.request("l2", "hit", time.perf_counter() - request.started)
                self._saved(
                    tenant,
                    key.model,
                    entry.prompt_tokens,
                    entry.completion_tokens,
                    entry.upstream_s,
                )
                return
        if lookup.only_if_cached and not self.l3.enabled(tenant):
            conn.write(_not_cached())  # RFC 9111 5.2.1.7: nothing stored, nothing sent
            return
        if lookup.no_cache and lookup.no_store:
            await self.relay.passthrough(
                request,
                conn,
                tenant=tenant,
                reason="no-cache, no-store",
                counted=counted,
                model=key.model,
            )
            return
        leader = None if lookup.only_if_cached else self.inflight.get(key.digest)
        if leader is not None:
            self.metrics.single_flight_joins += 1
            leader.joiners += 1
            shared = await asyncio.shield(leader.future)
            if shared is not None:
                conn.write(shared)
                result = "hit" if leader.tier == "l3" else "miss"
                tm.request(leader.tier, result, time.perf_counter() - request.started)
                return
        flight = Flight(asyncio.get_running_loop().create_future())
        self.inflight[key.digest] = flight
        answer = None
        l3_answer: bytes | None = None
        try:
            pending: Pending | None = None
            # L3 is not asked for namespaced requests: its neighbours are per tenant only
            if not lookup.no_cache and not lookup.namespace and self.l3.enabled(tenant):
                l3_answer, pending = await self._l3_get(request, lookup, key)
                if l3_answer is not None:
                    flight.tier = "l3"
                    conn.write(l3_answer)
                    tm.request("l3", "hit", time.perf_counter() - request.started)
                    return
            if lookup.only_if_cached:
                conn.write(_not_cached())
                return
            # -- rate limits (docs/rate-limits.md): a request that reaches the model server
            ticket: RateTicket | None = None
            if rates is not None and rates.limited(tenant):
                ticket = await rates.admit(tenant, request.body, request=not counted)
                if ticket.refusal is not None:
                    conn.write(ticket.refusal)
                    return
            # --
            if (
                self.gate is not None
                and (refused := await self.relay.admit(tenant, request.headers)) is not None
            ):
                if ticket is not None and rates is not None:
                    rates.settle(ticket, None, None)  # never sent: its tokens go back
                conn.write(refused)
                return
            answer = await self._miss(request, conn, lookup, key, pending, ticket)
        finally:
            self._fly_home(key, flight, answer, l3_answer)

    def _fly_home(
        self, key: keys.CacheKey, flight: Flight, answer: Entry | None, l3_answer: bytes | None
    ) -> None:
        """The leader of a flight is done: its joiners get its answer (None: go yourselves)."""
        if self.inflight.get(key.digest) is flight:
            del self.inflight[key.digest]
        # The answer is copied into a response for joiners only when there are some.
        if l3_answer is None and answer is not None and flight.joiners:
            l3_answer = answer.response(b"MISS", None, key.sha256_hex)
        flight.future.set_result(l3_answer)

    async def _miss(
        self,
        request: Request,
        conn: Connection,
        lookup: Lookup,
        key: keys.CacheKey,
        pending: Pending | None = None,
        ticket: RateTicket | None = None,
    ) -> Entry | None:
        """Call upstream (or finish the call the fast path sent), forward, store when correct.

        Returns the answer for joiners; see :meth:`_store_answer`. ``ticket``: the rate
        limits' admission (its headers go with the answer; the answer's usage settles it).
        """
        tenant = lookup.tenant
        if lookup.begun is not None:
            headers: list[tuple[bytes, bytes]] = []
            started = lookup.begun_at
        else:
            headers = self._upstream_headers(request.headers, tenant, b"accept-encoding")
            started = time.perf_counter()
        marker = _miss_marker(key)
        if ticket is not None:
            marker += ticket.x_cache_tail
        captured = await self.relay.forward(
            request,
            conn,
            headers,
            marker,
            tenant=tenant,
            capture=self.max_entry_bytes,
            begun=lookup.begun,
            started=started,
            model=key.model,
        )
        cost = time.perf_counter() - started  # upstream seconds a hit will save
        if ticket is not None and self.rates is not None:
            if captured is None:
                self.rates.settle(ticket, None, None)
            else:
                self.rates.settle(ticket, captured[0], captured[2])
        if captured is None:
            return None
        status, resp_headers, body = captured
        if (  # L3 shadow mode: compare a correct answer with the one L3 would have served
            pending is not None
            and pending.candidate is not None
            and body is not None
            and answer_problem(status, resp_headers, body, stream=key.stream) is None
        ):
            self.background.spawn(self.l3.compare(tenant, pending, body))
        return self._store_answer(request, lookup, key, status, resp_headers, body, cost, pending)

    def _store_answer(
        self,
        request: Request,
        lookup: Lookup,
        key: keys.CacheKey,
        status: int,
        resp_headers: list[tuple[bytes, bytes]],
        body: bytes | None,
        cost: float,
        pending: Pending | None = None,
    ) -> Entry | None:
        """Store an upstream answer in L1 (and L2, L3) when correct; the answer for joiners.

        Only a correct answer (:func:`entry.answer_problem`) of the form the
        request asked for is stored; an answer larger than the largest entry
        (``body`` None) is neither stored nor kept for joiners.
        """
        tenant = lookup.tenant
        if body is None:
            self.metrics.fault("entry_too_large")
            return None
        entry_headers = b"".join(
            name + b": " + value + b"\r\n" for name, value in resp_headers if name not in STORE_DROP
        )
        entry = Entry(
            status,
            entry_headers,
            body,
            stream=key.stream,
            tenant=tenant,
            filled_at=time.time(),
            upstream_s=cost,
        )
        if lookup.no_store:
            return entry
        problem = answer_problem(status, resp_headers, body, stream=key.stream)
        if problem is None:
            try:  # what is stored must read back: never store a header block loads refuses
                check_header_block(entry_headers)
            except CorruptEntry as exc:
                problem = str(exc)
        if problem is not None:
            if status == 200:
                self.metrics.fault("answer_not_stored")
                log.debug("answer to %s not stored: %s", request.url, problem)
            return entry
        entry.prompt_tokens, entry.completion_tokens = usage_of(body, stream=key.stream)
        if self.keying.current(lookup):
            # an answer fetched before a purge (or any epoch move) is not kept in L1
            self._l1_put(tenant, key, entry, cost)
        if pending is not None and lookup.version == self.keying.scope_version:
            self.l3.add(pending, Ref(key.digest, key.sha256_hex, key.stream))
        self.tiers.l2_store(lookup, key, entry)
        return entry

    async def _l3_get(
        self, request: Request, lookup: Lookup, key: keys.CacheKey
    ) -> tuple[bytes | None, Pending | None]:
        """An L3 hit's response, or (None, what to index once upstream has answered).

        Like L1, L3 serves only while the epochs are confirmed; the hit's answer
        is the neighbour's exact entry, read from L1 or else L2 (an entry evicted
        from both drops its L3 row). Any fault is a miss, never an error.
        """
        tenant = lookup.tenant
        if self.tracker.valid_until <= time.monotonic():
            return None, None
        body = keys.parse_body(request.body)
        if body is None:
            return None, None
        keying = self.keying
        epochs: tuple[int, ...] = ()
        if keying.versioned:
            epochs = self.tracker.values_for(tenant, key.model)
        scope = keys.Scope(tenant, keying.model_version, epochs)
        query = request.url.partition(b"?")[2]
        try:
            match, pending = await self.l3.lookup(
                tenant, body, key.kind, scope, keying.key_options(tenant), query
            )
        except Exception:  # never the client's problem: counted, the request goes upstream
            self.metrics.fault("l3")
            log.exception("L3 lookup failed")
            return None, None
        if lookup.version != keying.scope_version:
            return None, None  # the epochs moved while the embedding was computed
        if match is None or match.result != "hit" or match.similarity is None:
            return None, pending
        ref: Ref = match.ref
        if ref.stream != key.stream:
            return None, pending
        answer: bytes | None = None
        ref_key = keys.CacheKey(key.kind, key.model, ref.stream, b"", ref.digest, ref.sha256_hex)
        saved = (0, 0, 0.0)
        try:  # the neighbour's entry, within the TTL and max-age like any hit
            hit = self._l1_fresh(lookup, ref_key, ref.digest)
        except TenantLimitError:
            hit = None
        if hit is not None:
            answer = with_similarity(hit[1], match.similarity)
            saved = (hit[V_PROMPT], hit[V_COMPLETION], hit[V_UPSTREAM_S])
        else:
            entry = await self.tiers.l2_get(lookup, ref_key)
            if entry is not None and lookup.version == keying.scope_version:
                answer = entry.response(
                    l3_marker(match.similarity), entry.age(time.time()), ref.sha256_hex
                )
                saved = (entry.prompt_tokens, entry.completion_tokens, entry.upstream_s)
        if answer is None:
            self.l3.gone(tenant, match)
            return None, pending
        if pending is not None and self.l3.shadowing(tenant):
            return None, self.l3.shadow(pending, answer, key.stream)  # measured, not served
        self._saved(tenant, key.model, *saved)
        return answer, None


def _miss_marker(key: keys.CacheKey) -> bytes:
    """The ``X-Cache`` value of a cacheable miss, with the entry's ``X-Cache-Key`` after it."""
    return b"MISS\r\nx-cache-key: " + key.sha256_hex.encode()


def _not_cached() -> bytes:
    """The answer to ``Cache-Control: only-if-cached`` when nothing is cached (RFC 9111)."""
    return error_response(
        504,
        "only-if-cached: no cached answer for this request",
        "cachefleet_not_cached",
        extra=b"x-cache: MISS\r\n",
    )
