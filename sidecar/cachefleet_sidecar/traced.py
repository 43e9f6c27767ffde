"""The traced request path: the parts :func:`compose.build` puts in when tracing is on.

Without tracing none of this is used (nor imported): the connections call the
cache :class:`~cachefleet_sidecar.cache.handler.Handler` directly and its
collaborators are the plain ones, so the L1 hit path is exactly the untraced
one. With tracing, each part below is the plain part plus its span
(:mod:`cachefleet_sidecar.observe.tracing`):

* :class:`TracedHandler` wraps the handler the connections call: it starts a
  request's :class:`~cachefleet_sidecar.observe.tracing.RequestTrace`, sets
  :data:`~cachefleet_sidecar.observe.tracing.CURRENT` around the synchronous
  fast path and inside the request's task, records the fast path's L1 (and L2)
  lookups and ends the request span with the answer's head. A miss the fast
  path sent upstream is finished by the handler's slow path (its task), so
  that the upstream span and the store are in the request's context;
* :func:`traced_resolve` times identity;
* :class:`TracedTiers`, :class:`TracedSemanticTier`: the slow path's L2 read,
  L3 lookups and stores;
* :class:`TracedGate`: the admission wait;
* :class:`TracedUpstream`: the ``traceparent`` sent to the model server (a
  fresh hop naming the upstream span, in the client's trace), and the
  upstream span with its ``first_token`` event.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, cast

from cachefleet_common import keys
from cachefleet_sidecar.cache.handler import Handler
from cachefleet_sidecar.cache.keying import Lookup
from cachefleet_sidecar.cache.l3 import SemanticTier
from cachefleet_sidecar.cache.slowpath import ADMIN_PATHS
from cachefleet_sidecar.cache.tiers import Tiers
from cachefleet_sidecar.http.gate import AdmissionGate
from cachefleet_sidecar.http.server import Connection, Refusal, Request
from cachefleet_sidecar.http.upstream import Begun, UpstreamPool, UpstreamResponse
from cachefleet_sidecar.observe.tracing import CURRENT, RequestTrace, Tracing

if TYPE_CHECKING:
    from cachefleet_sidecar.cache.entry import Entry
    from cachefleet_sidecar.http.upstream import _Connection

Resolve = Callable[[list[tuple[bytes, bytes]], str | None], str]


def traced_resolve(resolve: Resolve) -> Resolve:
    """``resolve`` (the tenant of a request's headers), timed as ``cachefleet.identity``."""

    def traced(headers: list[tuple[bytes, bytes]], peer: str | None) -> str:
        trace = CURRENT.get()
        if trace is None:
            return resolve(headers, peer)
        start = time.perf_counter()
        try:
            tenant = resolve(headers, peer)
        except Refusal as exc:
            trace.span(
                "cachefleet.identity",
                start,
                time.perf_counter(),
                {"cachefleet.identity.refused": exc.status},
            )
            raise
        trace.identified(tenant, start, time.perf_counter())
        return tenant

    return traced


class TracedHandler:
    """The :class:`server.Handler` of a traced sidecar: ``handler`` with spans around it."""

    def __init__(self, handler: Handler, tracing: Tracing) -> None:
        self.handler = handler
        self.tracing = tracing
        #: Traces of the requests in progress, by ``id(request)``.
        self._traces: dict[int, RequestTrace] = {}

    def _start(self, request: Request) -> RequestTrace:
        path = request.url.partition(b"?")[0]
        trace = self.tracing.request(
            request.headers,
            request.started,
            {
                "http.request.method": request.method.decode("latin-1"),
                "url.path": path.decode("latin-1"),
            },
        )
        self._traces[id(request)] = trace
        return trace

    def _finish(self, request: Request, head: bytes | None) -> None:
        trace = self._traces.pop(id(request), None)
        if trace is not None:
            trace.finish(time.perf_counter(), head)

    def fast(self, request: Request) -> bytes | asyncio.Future[Any] | None:
        if request.url.partition(b"?")[0] in ADMIN_PATHS:  # probes and scrapes: no spans
            return self.handler.fast(request)
        trace = self._start(request)
        token = CURRENT.set(trace)
        try:
            start = time.perf_counter()
            answer = self.handler.fast(request)
            end = time.perf_counter()
        except BaseException:
            self._finish(request, None)
            raise
        finally:
            CURRENT.reset(token)
        memo = request.memo
        looked = isinstance(memo, Lookup) and memo.key is not None and not memo.slow
        if answer is not None or looked:
            since = trace.identified_at or start
            outcome = "hit" if isinstance(answer, bytes) else "miss"
            trace.lookup("l1", outcome, since, trace.next_step_at or end)
        if isinstance(answer, bytes):
            self._finish(request, answer)
        return answer

    def resume(self, request: Request) -> bytes | asyncio.Future[Any] | None:
        trace = self._traces.get(id(request))  # always one: admin paths never resume
        memo = request.memo
        if trace is None or not isinstance(memo, Lookup):
            return self.handler.resume(request)
        if memo.begun is not None:
            return None  # the slow path finishes the miss, in the request's task
        token = CURRENT.set(trace)
        try:
            answer = self.handler.resume(request)
        finally:
            CURRENT.reset(token)
        if trace.l2 is not None:
            trace.lookup("l2", "hit" if trace.l2_hit else "miss", trace.l2, time.perf_counter())
            trace.l2 = None
        if isinstance(answer, bytes):
            self._finish(request, answer)
        return answer

    async def handle(self, request: Request, conn: Connection) -> None:
        trace = self._traces.get(id(request))
        if trace is None:  # not traced (admin paths): as it is
            await self.handler.handle(request, conn)
            return
        CURRENT.set(trace)  # the task's own context
        watched = _Watched(conn)
        try:
            await self.handler.handle(request, cast(Connection, watched))
        finally:
            self._finish(request, watched.head)


class _Watched:
    """A connection whose first write (the answer's head) is kept for the request span."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.head: bytes | None = None

    def write(self, data: bytes) -> None:
        if self.head is None:
            self.head = data[: data.find(b"\r\n\r\n") + 4] if b"\r\n\r\n" in data else data
        self._conn.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


class TracedTiers(Tiers):
    """:class:`Tiers` with the L2 lookups and the stores as spans."""

    def l2_begin(self, lookup: Lookup, key: keys.CacheKey) -> asyncio.Future[Any] | None:
        trace = CURRENT.get()
        start = time.perf_counter()
        future = super().l2_begin(lookup, key)
        if trace is not None and future is not None:
            trace.l2 = start
            trace.next_step_at = trace.next_step_at or start
        return future

    def l2_entry(self, lookup: Lookup, key: keys.CacheKey, data: bytes) -> Entry | None:
        entry = super().l2_entry(lookup, key, data)
        trace = CURRENT.get()
        if trace is not None:
            trace.l2_hit = entry is not None
        return entry

    async def l2_get(self, lookup: Lookup, key: keys.CacheKey) -> Entry | None:
        trace = CURRENT.get()
        start = time.perf_counter()
        entry = await super().l2_get(lookup, key)
        if trace is not None and self.l2 is not None and self.l2_allowed(lookup.tenant):
            trace.lookup("l2", "miss" if entry is None else "hit", start, time.perf_counter())
        return entry

    def l1_put(self, tenant: str, key: keys.CacheKey, entry: Entry, *args: Any, **kw: Any) -> None:
        trace = CURRENT.get()
        start = time.perf_counter()
        super().l1_put(tenant, key, entry, *args, **kw)
        if trace is not None:
            trace.span(
                "cachefleet.store", start, time.perf_counter(), {"cachefleet.cache.tier": "l1"}
            )

    def l2_store(self, lookup: Lookup, key: keys.CacheKey, entry: Entry) -> None:
        trace = CURRENT.get()
        start = time.perf_counter()
        super().l2_store(lookup, key, entry)
        if trace is not None and self.l2 is not None and self.l2_allowed(lookup.tenant):
            # the write itself goes on in the background: this is its hand-off
            trace.span(
                "cachefleet.store", start, time.perf_counter(), {"cachefleet.cache.tier": "l2"}
            )


class TracedSemanticTier(SemanticTier):
    """:class:`SemanticTier` with its lookups (embedding and neighbour search) as spans."""

    async def lookup(self, *args: Any, **kw: Any) -> Any:
        trace = CURRENT.get()
        start = time.perf_counter()
        match, pending = await super().lookup(*args, **kw)
        if trace is not None and (match is not None or pending is not None):
            outcome = "miss" if match is None else str(match.result)
            trace.lookup("l3", outcome, start, time.perf_counter())
        return match, pending


class TracedGate(AdmissionGate):
    """:class:`AdmissionGate` with the admission wait as a span."""

    async def admit(self, *args: Any, **kw: Any) -> bytes | None:
        trace = CURRENT.get()
        start = time.perf_counter()
        refused: bytes | None = await super().admit(*args, **kw)
        if trace is not None:
            trace.span(
                "cachefleet.admission",
                start,
                time.perf_counter(),
                {"cachefleet.admission.outcome": "admitted" if refused is None else "refused"},
            )
        return refused


class TracedUpstream(UpstreamPool):
    """:class:`UpstreamPool` that sends the trace context and spans the upstream call."""

    async def request(
        self,
        method: bytes,
        path: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes = b"",
    ) -> UpstreamResponse:
        trace = CURRENT.get()
        if trace is not None:
            headers = trace.upstream_begins(headers, method, path)
        try:
            return await super().request(method, path, headers, body)
        except Exception as exc:
            if trace is not None:
                trace.upstream_ends(None, error=type(exc).__name__)
            raise

    def begin(
        self,
        method: bytes,
        path: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes = b"",
    ) -> Begun | None:
        trace = CURRENT.get()
        if trace is not None:
            headers = trace.upstream_begins(headers, method, path)
        begun = super().begin(method, path, headers, body)
        if begun is None and trace is not None:
            trace.upstream_abandoned()  # nothing was sent: request() will send it
        return begun

    def make_response(self, conn: _Connection) -> UpstreamResponse:
        # The traced response notes the first body bytes and ends the upstream span.
        trace = CURRENT.get()
        if trace is None:
            return super().make_response(conn)
        return _TracedResponse(conn, self, trace)


class _TracedResponse(UpstreamResponse):
    def __init__(self, conn: _Connection, pool: UpstreamPool, trace: RequestTrace) -> None:
        super().__init__(conn, pool)
        self._trace = trace

    async def chunks(self) -> AsyncIterator[bytes]:
        trace = self._trace
        error = "incomplete"
        try:
            async for chunk in super().chunks():
                trace.first_token()
                yield chunk
            error = ""
        finally:
            trace.upstream_ends(self.status, error=error)
