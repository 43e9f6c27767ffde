"""The request path's fast path: an L1 hit answered synchronously, from memory.

Read path of a cacheable request (``POST`` to a :data:`keys.CACHEABLE_PATHS`
endpoint with a deterministic JSON body):

1. resolve the tenant (header, API key, default, else 4xx with a reason);
2. canonical key (:mod:`keys`), scoped by tenant, model version and epochs
   (:class:`~cachefleet_sidecar.cache.keying.Keying`);
3. L1 (tenant partition); on a miss the request goes on down the slow path
   (:class:`~cachefleet_sidecar.cache.slowpath.SlowPath`: L2, L3, upstream,
   single-flight, store).

L1 hits are served only while the epochs were confirmed within the staleness
bound (one float comparison on the hit path); otherwise the request falls
through to L2 / upstream.

Steps 1-3 up to an L1 hit run synchronously in :meth:`Handler.fast`; the
connection calls the :class:`Handler` directly, and what a hit needs is bound
once, at construction, as attributes (:meth:`Keying.plain
<cachefleet_sidecar.cache.keying.Keying.plain>`, the L1 read, the hits'
bookkeeping). The handler owns only what a hit needs; everything else is its
:attr:`Handler.slow`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from cachefleet_common import keys
from cachefleet_sidecar.cache.entry import L1Value
from cachefleet_sidecar.cache.keying import Keying, Lookup, Plain
from cachefleet_sidecar.cache.l1 import TenantL1, TenantLimitError
from cachefleet_sidecar.cache.l3 import SemanticTier
from cachefleet_sidecar.cache.settings import CacheSettings
from cachefleet_sidecar.cache.slowpath import SlowPath
from cachefleet_sidecar.http.outbox import Outbox
from cachefleet_sidecar.http.relay import Relay
from cachefleet_sidecar.http.server import Connection, Refusal, Request
from cachefleet_sidecar.observe.metrics import SidecarMetrics
from cachefleet_sidecar.tasks import Background

if TYPE_CHECKING:
    from cachefleet_sidecar.cache.hits import HitBook
    from cachefleet_sidecar.cache.switcher import PolicySwitcher
    from cachefleet_sidecar.cache.tiers import L2, Tiers


class Handler:
    """The request handler shared by every connection (the :class:`server.Handler`):
    the fast path itself, and the :class:`SlowPath` for everything an L1 hit does not answer.

    It is built from the collaborators of the request path and keeps only
    those a hit needs; the others go to its :attr:`slow` path (the upstream, the
    gate and the rate limits are the ``relay``'s, freshness the ``tiers``').
    """

    def __init__(
        self,
        settings: CacheSettings,
        *,
        admin_on_proxy: bool,
        keying: Keying,
        tiers: Tiers,
        relay: Relay,
        resolve: Callable[[list[tuple[bytes, bytes]], str | None], str],
        l1: TenantL1[int, L1Value],
        l2: L2 | None,
        l3: SemanticTier,
        metrics: SidecarMetrics,
        switcher: PolicySwitcher | None,
        hits: HitBook,
        outbox: Outbox,
        background: Background,
        admin: Callable[[Request, Connection], Awaitable[None]],
    ) -> None:
        self.tracker = keying.tracker
        self.metrics = metrics
        #: Where the answers and their bookkeeping go: the connections that call this
        #: handler share it (their :class:`~cachefleet_sidecar.http.server.Limiter`'s).
        self.outbox = outbox
        #: Everything past an L1 hit: L2, single-flight, L3, upstream, store; the tasks.
        self.slow = SlowPath(
            settings,
            admin_on_proxy=admin_on_proxy,
            keying=keying,
            tiers=tiers,
            relay=relay,
            resolve=resolve,
            l2=l2,
            l3=l3,
            metrics=metrics,
            switcher=switcher,
            hits=hits,
            outbox=outbox,
            background=background,
            admin=admin,
        )
        # Bound once: the fast path calls these for every request.
        self._plain = keying.plain
        self._l1_get = l1.get
        self._l1_aged = tiers.l1_aged
        #: The L1 hits' bookkeeping, applied once per loop turn for the turn's hits.
        self._hit = hits.add
        self._begin = self.slow.begin

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
            return self._begin(request, lookup, key)
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

    def resume(self, request: Request) -> bytes | asyncio.Future[Any] | None:
        """What :meth:`fast` started is done (:meth:`SlowPath.resume`)."""
        return self.slow.resume(request)

    async def handle(self, request: Request, conn: Connection) -> None:
        """Any request :meth:`fast` did not answer, as a task (:meth:`SlowPath.handle`)."""
        await self.slow.handle(request, conn)


class HitsCountedHandler(Handler):
    """The handler with ``--limits-count-hits``: a rate-limited tenant's requests skip the
    fast path, so a hit is counted (and may be refused) before it is served; every other
    tenant's L1 hit is answered by :meth:`Handler.fast` as usual. Without the flag this
    class is not used and the hit path does not know that rate limits exist."""

    def fast(self, request: Request) -> bytes | asyncio.Future[Any] | None:
        rates = self.slow.rates
        if rates is not None and request.method == b"POST":
            try:
                tenant = self.slow.resolve(request.headers, request.peer)
            except Refusal:
                return super().fast(request)
            if rates.limited(tenant):
                return None
        return super().fast(request)
