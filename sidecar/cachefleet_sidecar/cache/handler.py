"""The request path: keying and scope, the fast path (L1 hit), the slow path, single-flight.

Read path of a cacheable request (``POST`` to a :data:`keys.CACHEABLE_PATHS`
endpoint with a deterministic JSON body):

1. resolve the tenant (header, API key, default, else 4xx with a reason);
2. canonical key (:mod:`keys`), scoped by tenant, model version and epochs
   (:class:`Keying`);
3. L1 (tenant partition) -> L2 (Redis, fills L1) -> upstream (fills both);
   concurrent identical misses share one upstream call (single-flight).

Invalidation epochs (with Redis): keys are scoped by the (cache, tenant,
model) epochs of :attr:`Keying.tracker`, kept by the control sync; when an
epoch moves, :meth:`Keying.on_epochs` bumps a scope version and clears the
key memo *before* the acknowledgement goes out, so after its ack a sidecar
can no longer find an entry of an older epoch: a request keyed before the
change is keyed again, an L2 reply that arrives after it is dropped, and L2
itself refuses readers behind the tenant's fence. L1 hits are served only
while the epochs were confirmed within the staleness bound (one float
comparison on the hit path); otherwise the request falls through to L2 /
upstream.

Steps 1-3 up to an L1 hit run synchronously in :meth:`Handler.fast`; the
rest is a task per request. Anything the sidecar cannot parse goes upstream
untouched (``X-Cache: BYPASS``); any cache fault is counted and the request
is served from upstream; the upstream's answer is never changed.

The L1-hit code (:meth:`Handler.fast`, :meth:`Keying.plain`, :meth:`Keying.lookup`,
:meth:`Keying.key_for`, :meth:`Handler._l1_fresh`, :meth:`Handler._l1_hit_done`,
:meth:`Handler._after_write`) stays together in this module. The connection
calls the :class:`Handler` directly; what a hit needs is bound once, at
construction, as attributes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import xxhash

from cachefleet_common import keys
from cachefleet_common.contract.names import valid_name
from cachefleet_common.epochs import EpochTracker, EpochVector
from cachefleet_sidecar.adapt.mrc import MissRatioCurves
from cachefleet_sidecar.cache import directives
from cachefleet_sidecar.cache.entry import (
    L1_OVERHEAD_BYTES,
    STORE_DROP,
    V_COMPLETION,
    V_EXPIRES_AT,
    V_FILLED_AT,
    V_PROMPT,
    V_RESPONSE,
    V_UPSTREAM_S,
    CorruptEntry,
    Entry,
    L1Value,
    answer_problem,
    check_header_block,
    reaged,
    usage_of,
)
from cachefleet_sidecar.cache.l1 import TenantL1, TenantLimitError
from cachefleet_sidecar.cache.l3 import Pending, Ref, SemanticTier, l3_marker, with_similarity
from cachefleet_sidecar.cache.settings import CacheSettings
from cachefleet_sidecar.cache.tiers import L2HitBook
from cachefleet_sidecar.http.gate import AdmissionGate
from cachefleet_sidecar.http.relay import MAX_BUFFERED_BYTES, RateTicket, Relay
from cachefleet_sidecar.http.server import Connection, Outbox, Refusal, Request, error_response
from cachefleet_sidecar.http.upstream import Begun, UpstreamPool
from cachefleet_sidecar.observe.metrics import SidecarMetrics
from cachefleet_sidecar.tasks import Background

if TYPE_CHECKING:
    from cachefleet_sidecar.cache.hits import HitBook
    from cachefleet_sidecar.cache.l2 import L2Read
    from cachefleet_sidecar.cache.switcher import PolicySwitcher
    from cachefleet_sidecar.cache.tiers import L2, Freshness, Tiers

log = logging.getLogger("cachefleet.sidecar")

#: Raw request bodies whose canonical key is remembered (cleared when full).
KEY_MEMO_MAX = 16384
#: Bytes the key memo may hold (a key keeps its canonical form, about the body's size).
KEY_MEMO_MAX_BYTES = 64 * 1024 * 1024
ADMIN_PATHS = frozenset({b"/healthz", b"/readyz", b"/status", b"/metrics"})


class Flight:
    """One upstream call that concurrent identical misses share (single-flight)."""

    __slots__ = ("future", "joiners", "tier")

    def __init__(self, future: asyncio.Future[bytes | None]) -> None:
        self.future = future
        #: Requests waiting for this call's answer.
        self.joiners = 0
        #: Where the shared answer came from, as the joiners count it: "upstream" or "l3".
        self.tier = "upstream"


@dataclass(slots=True)
class Lookup:
    """What the fast path learnt about a request, reused by the slow path."""

    tenant: str
    key: keys.CacheKey | None
    bypass_reason: str | None
    no_cache: bool
    no_store: bool
    #: :attr:`Keying.scope_version` when the key was made.
    version: int = 0
    #: The L2 read the fast path sent for this key: L2 was asked.
    l2_read: L2Read | None = None
    #: The upstream call the fast path sent for this miss, its flight and its start.
    begun: Begun | None = None
    flight: Flight | None = None
    begun_at: float = 0.0
    #: The request's cache namespace (--namespace-header); "" when it names none.
    namespace: str = ""
    #: Cache-Control max-age (seconds) and only-if-cached, as the tenant may use them.
    max_age: int | None = None
    only_if_cached: bool = False
    #: Some directive needs the slow path (no-cache, max-age, only-if-cached).
    slow: bool = False


#: What :meth:`Keying.plain` gives a request an L1 hit may answer: tenant, key,
#: namespace and :attr:`Keying.scope_version` (made into a :class:`Lookup` only on a miss).
Plain = tuple[str, keys.CacheKey, str, int]


class Keying:
    """Keys and their scope: tenant, model version, epochs, namespace; the key memo.

    Everything that scopes keys goes through this class, so the key memo stays true.
    """

    def __init__(
        self,
        settings: CacheSettings,
        *,
        tracker: EpochTracker,
        metrics: SidecarMetrics,
        resolve: Callable[[list[tuple[bytes, bytes]], str | None], str],
        freshness: Freshness,
        l3: SemanticTier,
    ) -> None:
        self.settings = settings
        #: Invalidation epochs; until :meth:`enable_epochs` they do not gate L1.
        self.tracker = tracker
        self.metrics = metrics
        # bound once: the fast path calls it for every request
        self._resolve = resolve
        self._allowed = freshness.allowed
        self.l3 = l3
        self.namespace_header = settings.namespace_header.lower().encode()
        self._key_memo: dict[tuple[str, str, bytes, int], keys.CacheKey | str] = {}
        self._key_memo_bytes = 0
        self._model_version = settings.model_version
        #: True once keys are scoped by the tracker's epochs (with Redis).
        self.versioned = False
        self._scope_version = 0
        self._key_options: dict[str, keys.KeyOptions] = {}
        self.default_options = keys.KeyOptions(
            collapse_whitespace=settings.collapse_whitespace,
            cache_nondeterministic=settings.cache_nondeterministic,
        )

    def key_options(self, tenant: str) -> keys.KeyOptions:
        return self._key_options.get(tenant, self.default_options)

    def set_key_options(self, options: dict[str, keys.KeyOptions]) -> None:
        """Per-tenant key options (the operator's quota table); keys made before are forgotten."""
        self._key_options = options
        self.clear_key_memo()

    def key_for(
        self, tenant: str, kind: str, query: bytes, raw: bytes, namespace: str = ""
    ) -> keys.CacheKey | str:
        """The canonical key of a raw body, or why it is not cacheable (memoised).

        Byte-identical bodies have identical keys, so a repeated request skips
        parsing and canonicalisation: the memo is indexed by the xxh3-128 of
        the raw body within (tenant, endpoint, query string) and cleared
        whenever anything that scopes keys changes.
        """
        who = f"{tenant}/{namespace}" if namespace else tenant
        memo_key = (who, kind, query, xxhash.xxh3_128_intdigest(raw))
        found = self._key_memo.get(memo_key)
        if found is not None:
            return found
        body = keys.keyable_body(raw)
        result: keys.CacheKey | str
        if isinstance(body, str):
            result = body
        else:
            epochs: tuple[int, ...] = ()
            if self.versioned:
                model = body.get("model")
                name = model if isinstance(model, str) else ""
                epochs += self.tracker.values_for(tenant, name, namespace)
            scope = keys.Scope(tenant, self._model_version, epochs, namespace)
            try:
                result = keys.make_key(body, kind, scope, self.key_options(tenant), query=query)
            except keys.Uncacheable as exc:
                result = exc.reason
        cost = 2 * (len(raw) + len(query)) + 256
        if len(self._key_memo) >= KEY_MEMO_MAX or self._key_memo_bytes + cost > KEY_MEMO_MAX_BYTES:
            self.clear_key_memo()
        if cost <= KEY_MEMO_MAX_BYTES // 64:  # a huge body is keyed again, not remembered
            self._key_memo[memo_key] = result
            self._key_memo_bytes += cost
        return result

    def lookup(
        self, request: Request, kind: str, query: bytes, tenant: str | None = None
    ) -> Lookup:
        """Tenant, key and cache directives of a request (``tenant`` when already decided:
        keyed again, its ignored directives were counted the first time)."""
        first = tenant is None
        if tenant is None:
            tenant = self._resolve(request.headers, request.peer)
        version = self._scope_version
        raw_ns, cc = self._scan(request.headers)
        namespace = "" if raw_ns is None else self._namespace(raw_ns)
        key = self.key_for(tenant, kind, query, request.body, namespace)
        return self._lookup_of(tenant, key, cc, version, namespace, first)

    def plain(self, request: Request, kind: str, query: bytes) -> Plain | Lookup:
        """:meth:`lookup` without the :class:`Lookup` for the common request an L1 hit
        may answer at once (a cacheable body, no ``Cache-Control``): its tenant, key,
        namespace and scope version. Any other request gets its :class:`Lookup`."""
        tenant = self._resolve(request.headers, request.peer)
        version = self._scope_version
        raw_ns, cc = self._scan(request.headers)
        namespace = "" if raw_ns is None else self._namespace(raw_ns)
        key = self.key_for(tenant, kind, query, request.body, namespace)
        if cc is None and not isinstance(key, str):
            return tenant, key, namespace, version
        return self._lookup_of(tenant, key, cc, version, namespace, True)

    def _scan(self, headers: list[tuple[bytes, bytes]]) -> tuple[bytes | None, bytes | None]:
        """The first namespace header value and the ``Cache-Control`` field (None when
        absent), in one pass over the (lowercased) headers. ``Cache-Control`` field lines
        combine into one list, in order (RFC 9110 5.3)."""
        ns_name = self.namespace_header
        ns: bytes | None = None
        cc: bytes | None = None
        for name, value in headers:
            if name == ns_name and ns is None:
                ns = value
            if name == b"cache-control":
                cc = value if cc is None else cc + b"," + value
        return ns, cc

    def only_if_cached(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether the request's ``Cache-Control`` says ``only-if-cached`` (any tenant may)."""
        return directives.parse(self._scan(headers)[1]).only_if_cached

    def _lookup_of(
        self,
        tenant: str,
        key: keys.CacheKey | str,
        cc: bytes | None,
        version: int,
        namespace: str,
        first: bool,
    ) -> Lookup:
        if cc is None:
            if isinstance(key, str):
                return Lookup(tenant, None, key, False, False, version, namespace=namespace)
            return Lookup(tenant, key, None, False, False, version, namespace=namespace)
        asked = directives.parse(cc, self._allowed.get(tenant, directives.ALL_ALLOWED))
        if asked.ignored and first:
            tm = self.metrics.tenant(tenant)
            for directive in asked.ignored:
                tm.directive_ignored(directive)
        found = Lookup(
            tenant,
            None if isinstance(key, str) else key,
            key if isinstance(key, str) else None,
            asked.no_cache,
            asked.no_store,
            version,
            namespace=namespace,
        )
        found.max_age, found.only_if_cached = asked.max_age, asked.only_if_cached
        found.slow = asked.no_cache or asked.only_if_cached or asked.max_age is not None
        return found

    def _namespace(self, raw: bytes) -> str:
        """The cache namespace a namespace header names; :class:`Refusal` for a bad one."""
        text = raw.decode("latin-1")
        if not valid_name(text):
            raise Refusal(
                400,
                f"invalid {self.settings.namespace_header} {text[:80]!r}: "
                "use 1-63 of [A-Za-z0-9._-]",
            )
        return text

    @property
    def model_version(self) -> str:
        return self._model_version

    @model_version.setter
    def model_version(self, value: str) -> None:
        self._model_version = value
        self._rescope()

    @property
    def scope_version(self) -> int:
        """Moves whenever anything that scopes keys changes."""
        return self._scope_version

    def current(self, lookup: Lookup) -> bool:
        """Whether ``lookup``'s key is still the one its request would get now."""
        return not self.versioned or lookup.version == self._scope_version

    def vector(self, lookup: Lookup, key: keys.CacheKey) -> EpochVector | Literal[False] | None:
        """The epochs to check in L2; None when unversioned; False when the key is outdated."""
        if not self.versioned:
            return None
        if lookup.version != self._scope_version:
            return False
        return self.tracker.vector(lookup.tenant, key.model, lookup.namespace)

    def _rescope(self) -> None:
        self._scope_version += 1
        self.clear_key_memo()
        self._l3_retain()

    def _l3_retain(self) -> None:
        """Drop L3 partitions of another model version or older epochs (as L1/L2 keys move)."""
        if not len(self.l3.index):
            return
        version, versioned, tracker = self._model_version, self.versioned, self.tracker

        def current(tenant: str, model: str, model_version: str, epochs: tuple[int, ...]) -> bool:
            if model_version != version:
                return False
            return not versioned or epochs == tracker.values_for(tenant, model)

        self.l3.retain(current)

    def clear_key_memo(self) -> None:
        self._key_memo.clear()
        self._key_memo_bytes = 0

    def enable_epochs(self) -> None:
        """Scope keys by the tracker's epochs and gate L1 on their confirmation."""
        self.versioned = True
        self.tracker.expire()
        self._rescope()

    def on_epochs(self) -> None:
        """The tracker's epochs moved: stop using keys made under the old ones."""
        self._rescope()
        log.info("epochs now %s", self.tracker.known)


class Handler:
    """The request handler shared by every connection (the :class:`server.Handler`)."""

    def __init__(
        self,
        settings: CacheSettings,
        *,
        admin_on_proxy: bool,
        keying: Keying,
        tiers: Tiers,
        freshness: Freshness,
        relay: Relay,
        resolve: Callable[[list[tuple[bytes, bytes]], str | None], str],
        l1: TenantL1[int, L1Value],
        l2: L2 | None,
        l3: SemanticTier,
        mrc: MissRatioCurves | None,
        metrics: SidecarMetrics,
        upstream: UpstreamPool,
        gate: AdmissionGate | None,
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
        self.l1 = l1
        self.l2 = l2
        self.l3 = l3
        self.mrc = mrc
        self.metrics = metrics
        self.upstream = upstream
        self.gate = gate
        self.outbox = outbox
        #: The L1 hits' bookkeeping, applied once per loop turn for the turn's hits.
        self.hits = hits
        self.background = background
        self.admin = admin
        #: Largest answer stored in L1 (larger ones are passed through).
        self.max_entry_bytes = settings.max_entry_bytes
        #: Flights in progress by L1 key (single-flight).
        self.inflight: dict[int, Flight] = {}
        # Bound once: the request path calls these for every request.
        self._resolve = resolve
        self._lookup = keying.lookup
        self._plain = keying.plain
        self._l1_get = l1.get
        self._l1_put = tiers.l1_put
        self._l2_begin = tiers.l2_begin
        self._l2_entry = tiers.l2_entry
        self._l2_rendered = tiers.l2_rendered
        self._upstream_headers = relay.upstream_headers
        self._relay_head = relay.relay_head
        self._forwarded = relay.forwarded
        self._l2_allowed = tiers.l2_allowed
        self._saved = tiers.saved
        self._hit = hits.add
        #: The L2 hits' bookkeeping, applied once per loop turn for the turn's hits.
        self.l2_hits = L2HitBook(
            tiers,
            metrics,
            outbox,
            switching=None if switcher is None else switcher.engine,
            on_observed=None if switcher is None else switcher.switch_due,
        )
        self._l2_hit = self.l2_hits.add
        self.ttl_of = freshness.ttl_of
        #: Feeds the switching engine (None when switching is off).
        self._observe = None if switcher is None else switcher.observe
        #: Per-tenant rate limits (docs/rate-limits.md); None: none configured.
        self.rates = relay.rates

    # ---------------------------------------------------------------- fast path
    def fast(self, request: Request) -> bytes | asyncio.Future[Any] | None:
        """Answer an L1 hit synchronously, or start the L2 read (:meth:`resume` answers it).

        None sends the request down the slow path (:meth:`handle`).
        """
        if request.method != b"POST":
            return None
        kind = keys.CACHEABLE_PATHS.get(request.url)
        query = b""
        if kind is None:
            path, sep, query = request.url.partition(b"?")
            kind = keys.CACHEABLE_PATHS.get(path) if sep else None
            if kind is None:
                return None
        try:
            found = self._plain(request, kind, query)
        except Refusal as exc:
            request.memo = exc
            return None
        # A hit needs no Lookup: it is made (and kept for the slow path) on any other outcome.
        if isinstance(found, Lookup):
            request.memo = found
            if found.key is None or found.slow:
                return None
            tenant, key = found.tenant, found.key
        else:
            tenant, key, _, _ = found
        now = time.monotonic()
        if self.tracker.valid_until <= now:
            # epochs not confirmed within the bound: no L1 hits
            request.memo = self._unplain(found)
            return None
        try:
            hit = self._l1_get(tenant, key.digest)
        except TenantLimitError:
            request.memo = self._unplain(found)
            return None
        if hit is not None and hit[2] <= now:  # V_CHECK_AT: Age out of date, or expired
            hit = self._l1_aged(tenant, key, hit, now)
        if hit is None:
            lookup = request.memo = self._unplain(found)
            if self.l2 is not None and self._l2_allowed(tenant):
                return self._l2_begin(lookup, key)
            return self._upstream_begin(request, lookup, key)
        if hit[0] != tenant:
            request.memo = self._unplain(found)
            self.metrics.cross_tenant_hits += 1
            return None
        self._hit(tenant, key, hit, time.perf_counter() - request.started)
        return hit[1]

    @staticmethod
    def _unplain(found: Plain | Lookup) -> Lookup:
        """The :class:`Lookup` of what :meth:`Keying.plain` found."""
        if isinstance(found, Lookup):
            return found
        tenant, key, namespace, version = found
        return Lookup(tenant, key, None, False, False, version, namespace=namespace)

    def _after_write(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` once this turn's answers are written (:meth:`Outbox.later`):
        the bookkeeping of a fast-path answer is not on its latency."""
        self.outbox.later(fn, *args)

    def _l1_hit_done(
        self, tenant: str, key: keys.CacheKey, hit: L1Value, seconds: float, observe: bool = True
    ) -> None:
        """What follows an L1 hit, counted now: the curves' access, the metrics, savings
        and (unless the caller observes the request itself) switching (:class:`HitBook`)."""
        self.hits.add(tenant, key, hit, seconds, observe)
        self.hits.flush()

    def _l1_aged(
        self, tenant: str, key: keys.CacheKey, hit: L1Value, mono: float
    ) -> L1Value | None:
        """An L1 hit found past its check time: None when its TTL is over (it is
        dropped), else the value with its ``Age`` brought up to date (kept in L1)."""
        if mono >= hit[V_EXPIRES_AT]:
            self.l1.remove(tenant, key.digest)
            return None
        value = reaged(hit, mono)
        with contextlib.suppress(TenantLimitError):
            evicted = self.l1.put(
                tenant,
                key.digest,
                value,
                len(value[V_RESPONSE]) + L1_OVERHEAD_BYTES,
                value[V_UPSTREAM_S],
            )
            if evicted:  # one more Age digit can push a full partition over
                self.metrics.tenant(tenant).evicted("l1", evicted)
        return value

    def _l1_fresh(self, lookup: Lookup, key: keys.CacheKey, digest: int) -> L1Value | None:
        """The slow path's L1 hit on ``digest``: owned, within the TTL and ``max-age``."""
        tenant = lookup.tenant
        mono = time.monotonic()
        if self.tracker.valid_until <= mono:
            return None
        hit = self.l1.get(tenant, digest)
        if hit is None or hit[0] != tenant:
            return None
        if hit[2] <= mono:
            hit = self._l1_aged(tenant, key, hit, mono)
            if hit is None:
                return None
        if lookup.max_age is not None and mono - hit[V_FILLED_AT] > lookup.max_age:
            return None
        return hit

    def resume(self, request: Request) -> bytes | asyncio.Future[Any] | None:
        """What :meth:`fast` started is done: the answer, a future to wait on, or None.

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

    # ---------------------------------------------------------------- slow path
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
                tenant = self._resolve(request.headers, request.peer)
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


class HitsCountedHandler(Handler):
    """The handler with ``--limits-count-hits``: a rate-limited tenant's requests skip the
    fast path, so a hit is counted (and may be refused) before it is served; every other
    tenant's L1 hit is answered by :meth:`Handler.fast` as usual. Without the flag this
    class is not used and the hit path does not know that rate limits exist."""

    def fast(self, request: Request) -> bytes | asyncio.Future[Any] | None:
        rates = self.rates
        if rates is not None and request.method == b"POST":
            try:
                tenant = self._resolve(request.headers, request.peer)
            except Refusal:
                return super().fast(request)
            if rates.limited(tenant):
                return None
        return super().fast(request)


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
