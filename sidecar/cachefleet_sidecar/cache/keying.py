"""Keys and their scope: the canonical key of a request, scoped by tenant, model
version, epochs and namespace, with the key memo; :class:`Lookup`, what keying
learnt about a request.

Invalidation epochs (with Redis): keys are scoped by the (cache, tenant,
model) epochs of :attr:`Keying.tracker`, kept by the control sync; when an
epoch moves, :meth:`Keying.on_epochs` bumps a scope version and clears the
key memo *before* the acknowledgement goes out, so after its ack a sidecar
can no longer find an entry of an older epoch: a request keyed before the
change is keyed again, an L2 reply that arrives after it is dropped, and L2
itself refuses readers behind the tenant's fence.

:meth:`Keying.plain`, :meth:`Keying.key_for` and :meth:`Keying.lookup` are on
the L1-hit path (:meth:`cachefleet_sidecar.cache.handler.Handler.fast`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import xxhash

from cachefleet_common import keys
from cachefleet_common.contract.names import valid_name
from cachefleet_common.epochs import EpochTracker, EpochVector
from cachefleet_sidecar.cache import directives
from cachefleet_sidecar.cache.l3 import SemanticTier
from cachefleet_sidecar.cache.settings import CacheSettings
from cachefleet_sidecar.http.server import Refusal, Request
from cachefleet_sidecar.observe.metrics import SidecarMetrics

if TYPE_CHECKING:
    from cachefleet_sidecar.cache.l2 import L2Read
    from cachefleet_sidecar.http.upstream import Begun

log = logging.getLogger("cachefleet.sidecar")

#: Raw request bodies whose canonical key is remembered (cleared when full).
KEY_MEMO_MAX = 16384
#: Bytes the key memo may hold (a key keeps its canonical form, about the body's size).
KEY_MEMO_MAX_BYTES = 64 * 1024 * 1024


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
        allowed: Mapping[str, directives.Allowed],
        l3: SemanticTier,
    ) -> None:
        self.settings = settings
        #: Invalidation epochs; until :meth:`enable_epochs` they do not gate L1.
        self.tracker = tracker
        self.metrics = metrics
        # bound once: the fast path calls it for every request
        self._resolve = resolve
        #: The directives each tenant may use (the freshness rules' table, kept current there).
        self._allowed = allowed
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
