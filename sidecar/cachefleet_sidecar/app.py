"""The sidecar: cache lookups, single-flight, upstream forwarding, admin endpoints.

Read path of a cacheable request (``POST`` to a :data:`keys.CACHEABLE_PATHS`
endpoint with a deterministic JSON body):

1. resolve the tenant (header, API key, default, else 4xx with a reason);
2. canonical key (:mod:`keys`), scoped by tenant, model version and epochs;
3. L1 (tenant partition) -> L2 (Redis, fills L1) -> upstream (fills both);
   concurrent identical misses share one upstream call (single-flight).

Invalidation epochs (with Redis): keys are scoped by the (cache, tenant,
model) epochs of :attr:`Sidecar.tracker`, kept by the control sync; when an
epoch moves, :meth:`Sidecar.on_epochs` bumps a scope version and clears the
key memo *before* the acknowledgement goes out, so after its ack a sidecar
can no longer find an entry of an older epoch: a request keyed before the
change is keyed again, an L2 reply that arrives after it is dropped, and L2
itself refuses readers behind the tenant's fence. L1 hits are served only
while the epochs were confirmed within the staleness bound (one float
comparison on the hit path); otherwise the request falls through to L2 /
upstream.

Steps 1-3 up to an L1 hit run synchronously in :meth:`Sidecar.fast`; the
rest is a task per request. Anything the sidecar cannot parse goes upstream
untouched (``X-Cache: BYPASS``); any cache fault is counted and the request
is served from upstream; the upstream's answer is never changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import orjson
import xxhash
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from . import keys, protocol
from .config import SidecarConfig, parse_args
from .entry import HOP_BY_HOP, Entry, L1Value, reason_phrase
from .epochs import EpochTracker, EpochVector
from .host import HostPressure
from .l1 import TenantL1, TenantLimitError
from .metrics import SidecarMetrics, TierUsage
from .policies import available_policies
from .server import Connection, Request, simple_response
from .switching import SwitchingConfig, SwitchingEngine, gpu_pressure
from .telemetry import GpuTelemetry
from .upstream import UpstreamError, UpstreamPool

log = logging.getLogger("cachefleet.sidecar")

#: Headers never forwarded from the upstream as they are (we frame ourselves).
FORWARD_DROP = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"x-cache", b"trailer"}
)
#: How often the L2 bytes of each tenant are read for /metrics and /status, seconds.
L2_USAGE_REFRESH_S = 10.0
#: Largest sized upstream answer sent in one write once complete; larger ones stream.
MAX_BUFFERED_BYTES = 1024 * 1024
#: How long a successful upstream answer keeps /readyz green without a probe.
READY_FRESH_S = 5.0
#: Raw request bodies whose canonical key is remembered (cleared when full).
KEY_MEMO_MAX = 16384
ADMIN_PATHS = frozenset({b"/healthz", b"/readyz", b"/status", b"/metrics"})


class Refusal(Exception):
    """A request the sidecar must refuse, with a status and a reason."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason

    def response(self) -> bytes:
        body = orjson.dumps(
            {"error": {"message": self.reason, "type": "cachefleet_refused", "code": self.status}}
        )
        return simple_response(
            self.status, body, content_type=b"application/json", extra=b"x-cache: BYPASS\r\n"
        )


@dataclass(slots=True)
class Lookup:
    """What the fast path learnt about a request, reused by the slow path."""

    tenant: str
    key: keys.CacheKey | None
    bypass_reason: str | None
    no_cache: bool
    no_store: bool
    #: :attr:`Sidecar.scope_version` when the key was made.
    version: int = 0


class Sidecar:
    """The request handler shared by every connection (the :class:`server.Handler`)."""

    def __init__(
        self,
        config: SidecarConfig,
        *,
        metrics: SidecarMetrics | None = None,
        l2: Any = None,
        telemetry: GpuTelemetry | None = None,
        staleness_bound_s: float | None = None,
        host: HostPressure | None = None,
    ) -> None:
        self.config = config
        if staleness_bound_s is None:
            staleness_bound_s = config.staleness_bound_s
        self.metrics = metrics or SidecarMetrics(config.cache)
        self.l1: TenantL1[int, L1Value] = TenantL1(
            config.l1_bytes, default_policy=config.policy.value, max_tenants=config.max_tenants
        )
        self.l2 = l2
        self.upstream = UpstreamPool(config.upstream, read_timeout_s=config.upstream_timeout_s)
        self.telemetry = telemetry or GpuTelemetry()
        self.tenant_header = config.tenant_header.lower().encode()
        self.known_tenants: set[str] = set(config.tenants)
        self.quota_generation = -1
        self.quotas: dict[str, protocol.TenantQuota] = {}
        self._key_memo: dict[tuple[str, str, int], keys.CacheKey | str] = {}
        self._model_version = config.model_version
        #: Invalidation epochs; until :meth:`enable_epochs` they do not gate L1.
        self.tracker = EpochTracker(staleness_bound_s)
        self.tracker.valid_until = math.inf
        self._versioned = False
        self._scope_version = 0
        self._key_options: dict[str, keys.KeyOptions] = {}
        self._default_options = keys.KeyOptions(
            collapse_whitespace=config.collapse_whitespace,
            cache_nondeterministic=config.cache_nondeterministic,
        )
        self._tenant_memo: dict[bytes, str] = {}
        self._inflight: dict[int, asyncio.Future[bytes | None]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._last_upstream_ok = 0.0
        self.started_at = time.time()
        #: (bytes, limit) per tenant in L2, refreshed in the background by the server.
        self.l2_usage: dict[str, tuple[int, int]] = {}
        self.metrics.usage_source = self._usage
        self.metrics.gauge_sources.append(self.telemetry.collect)
        self.metrics.gauge_sources.append(self._redis_families)
        self.host = host or HostPressure()
        #: The P99-driven policy switching engine (None when switched off).
        self.switching = (
            SwitchingEngine(SwitchingConfig(window_s=config.switch_window_s), now=time.monotonic())
            if config.switch_window_s > 0
            else None
        )

    # ------------------------------------------------------------------ tenants
    def resolve_tenant(self, request: Request) -> str:
        raw = request.header(self.tenant_header)
        if raw is None and self.config.api_keys:
            auth = request.header(b"authorization")
            if auth is not None and auth[:7].lower() == b"bearer ":
                mapped = self.config.api_keys.get(auth[7:].strip().decode("latin-1"))
                if mapped is not None:
                    raw = mapped.encode()
        if raw is None:
            if self.config.default_tenant is not None:
                return self.config.default_tenant
            raise Refusal(
                403, f"no tenant: set the {self.config.tenant_header} header (or a mapped API key)"
            )
        tenant = self._tenant_memo.get(raw)
        if tenant is not None:
            return tenant
        text = raw.decode("latin-1")
        if not protocol.valid_name(text):
            raise Refusal(400, f"invalid tenant name {text[:80]!r}: use 1-63 of [A-Za-z0-9._-]")
        if self.known_tenants and text not in self.known_tenants:
            if self.config.default_tenant is not None:
                return self.config.default_tenant
            raise Refusal(403, f"unknown tenant {text!r}")
        if len(self._tenant_memo) < 4096:
            self._tenant_memo[raw] = text
        return text

    def key_options(self, tenant: str) -> keys.KeyOptions:
        return self._key_options.get(tenant, self._default_options)

    # ---------------------------------------------------------------- fast path
    def _key_for(self, tenant: str, kind: str, raw: bytes) -> keys.CacheKey | str:
        """The canonical key of a raw body, or why it is not cacheable (memoised).

        Byte-identical bodies have identical keys, so a repeated request skips
        parsing and canonicalisation: the memo is indexed by the xxh3-128 of
        the raw body within (tenant, endpoint) and cleared whenever anything
        that scopes keys changes.
        """
        memo_key = (tenant, kind, xxhash.xxh3_128_intdigest(raw))
        found = self._key_memo.get(memo_key)
        if found is not None:
            return found
        body = keys.parse_body(raw)
        result: keys.CacheKey | str
        if body is None:
            result = "body is not a JSON object"
        else:
            epochs: tuple[int, ...] = ()
            if self._versioned:
                model = body.get("model")
                epochs += self.tracker.values_for(tenant, model if isinstance(model, str) else "")
            scope = keys.Scope(tenant, self._model_version, epochs)
            try:
                result = keys.make_key(body, kind, scope, self.key_options(tenant))
            except keys.Uncacheable as exc:
                result = exc.reason
        if len(self._key_memo) >= KEY_MEMO_MAX:
            self._key_memo.clear()
        self._key_memo[memo_key] = result
        return result

    def _lookup(self, request: Request, kind: str) -> Lookup:
        tenant = self.resolve_tenant(request)
        no_cache = no_store = False
        cc = request.header(b"cache-control")
        if cc is not None:
            directives = {d.strip().split(b"=")[0] for d in cc.lower().split(b",")}
            no_cache = b"no-cache" in directives
            no_store = b"no-store" in directives
        version = self._scope_version
        key = self._key_for(tenant, kind, request.body)
        if isinstance(key, str):
            return Lookup(tenant, None, key, no_cache, no_store, version)
        return Lookup(tenant, key, None, no_cache, no_store, version)

    # Everything that scopes keys goes through these, so the key memo stays true.
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

    def _rescope(self) -> None:
        self._scope_version += 1
        self._key_memo.clear()

    def enable_epochs(self) -> None:
        """Scope keys by the tracker's epochs and gate L1 on their confirmation."""
        self._versioned = True
        self.tracker.expire()
        self._rescope()

    def on_epochs(self) -> None:
        """The tracker's epochs moved: stop using keys made under the old ones."""
        self._rescope()
        log.info("epochs now %s", self.tracker.known)

    def fast(self, request: Request) -> bytes | None:
        """Answer an L1 hit synchronously; None sends the request down the slow path."""
        if request.method != b"POST":
            return None
        kind = keys.CACHEABLE_PATHS.get(request.url)
        if kind is None:
            return None
        try:
            lookup = self._lookup(request, kind)
        except Refusal as exc:
            request.memo = exc
            return None
        request.memo = lookup
        if lookup.key is None or lookup.no_cache:
            return None
        if self.tracker.valid_until <= time.monotonic():
            return None  # epochs not confirmed within the bound: no L1 hits
        try:
            hit = self.l1.get(lookup.tenant, lookup.key.digest)
        except TenantLimitError:
            return None
        if hit is None:
            return None
        if hit[0] != lookup.tenant:
            self.metrics.cross_tenant_hits += 1
            return None
        seconds = time.perf_counter() - request.started
        self.metrics.tenant(lookup.tenant).request("l1", "hit", seconds)
        if self.switching is not None:
            self._observe(lookup.tenant, seconds, lookup.key.digest)
        return hit[1]

    # ---------------------------------------------------------------- slow path
    async def handle(self, request: Request, conn: Connection) -> None:
        path = request.url.split(b"?", 1)[0]
        if path in ADMIN_PATHS and self.config.admin_listen is None:
            await self.admin(request, conn)
            return
        kind = keys.CACHEABLE_PATHS.get(path) if request.method == b"POST" else None
        if kind is None:
            await self._passthrough(request, conn, tenant=None, reason="not a cached endpoint")
            return
        memo = request.memo
        if memo is None or (isinstance(memo, Lookup) and memo.version != self._scope_version):
            try:
                memo = self._lookup(request, kind)
            except Refusal as exc:
                memo = exc
        if isinstance(memo, Refusal):
            conn.write(memo.response())
            return
        assert isinstance(memo, Lookup)
        if memo.key is None:
            await self._passthrough(request, conn, tenant=memo.tenant, reason=memo.bypass_reason)
            return
        await self._cached(request, conn, memo, memo.key)
        if self.switching is not None:
            self._observe(memo.tenant, time.perf_counter() - request.started, memo.key.digest)

    async def _cached(
        self, request: Request, conn: Connection, lookup: Lookup, key: keys.CacheKey
    ) -> None:
        tenant = lookup.tenant
        tm = self.metrics.tenant(tenant)
        if not lookup.no_cache:
            try:
                hit = (
                    self.l1.get(tenant, key.digest)
                    if self.tracker.valid_until > time.monotonic()
                    else None
                )
            except TenantLimitError:
                await self._passthrough(request, conn, tenant=tenant, reason="tenant limit")
                return
            if hit is not None and hit[0] == tenant:
                conn.write(hit[1])
                tm.request("l1", "hit", time.perf_counter() - request.started)
                return
            entry = await self._l2_get(lookup, key)
            if entry is not None:
                self._l1_put(tenant, key, entry)
                conn.write(entry.response(b"HIT-L2"))
                tm.request("l2", "hit", time.perf_counter() - request.started)
                return
        if lookup.no_cache and lookup.no_store:
            await self._passthrough(request, conn, tenant=tenant, reason="no-cache, no-store")
            return
        leader = self._inflight.get(key.digest)
        if leader is not None:
            self.metrics.single_flight_joins += 1
            shared = await asyncio.shield(leader)
            if shared is not None:
                conn.write(shared)
                tm.request("upstream", "miss", time.perf_counter() - request.started)
                return
        future: asyncio.Future[bytes | None] = asyncio.get_running_loop().create_future()
        self._inflight[key.digest] = future
        shared_bytes: bytes | None = None
        try:
            shared_bytes = await self._miss(request, conn, lookup, key)
        finally:
            self._inflight.pop(key.digest, None)
            future.set_result(shared_bytes)

    async def _miss(
        self, request: Request, conn: Connection, lookup: Lookup, key: keys.CacheKey
    ) -> bytes | None:
        """Call upstream, forward, store when complete; returns the answer for joiners."""
        tenant = lookup.tenant
        headers = [(n, v) for n, v in request.headers if n != b"accept-encoding"]
        started = time.perf_counter()
        captured = await self._forward(request, conn, headers, b"MISS", tenant=tenant)
        cost = time.perf_counter() - started  # upstream seconds a hit will save
        if captured is None:
            return None
        status, resp_headers, body = captured
        entry_headers = b"".join(
            name + b": " + value + b"\r\n" for name, value in resp_headers if name not in HOP_BY_HOP
        )
        entry = Entry(status, entry_headers, body, stream=key.stream, tenant=tenant)
        if 200 <= status < 300 and not lookup.no_store and self._storable(entry, resp_headers):
            self._l1_put(tenant, key, entry, cost)
            if self.l2 is not None:
                self._spawn(self._l2_put(lookup, key, entry))
        return entry.response(b"MISS")

    @staticmethod
    def _storable(entry: Entry, headers: list[tuple[bytes, bytes]]) -> bool:
        ctype = next((v for n, v in headers if n == b"content-type"), b"")
        if entry.stream or ctype.startswith(b"text/event-stream"):
            return ctype.startswith(b"text/event-stream") and entry.body.endswith(b"\n\n")
        try:
            orjson.loads(entry.body)
        except orjson.JSONDecodeError:
            return False
        return True

    async def _passthrough(
        self, request: Request, conn: Connection, *, tenant: str | None, reason: str | None
    ) -> None:
        captured = await self._forward(request, conn, request.headers, b"BYPASS", tenant=tenant)
        if tenant is not None:
            result = "bypass" if captured is not None else "error"
            self.metrics.tenant(tenant).request(
                "upstream", result, time.perf_counter() - request.started
            )
        if reason is not None:
            log.debug("bypass %s: %s", request.url, reason)

    async def _forward(
        self,
        request: Request,
        conn: Connection,
        headers: list[tuple[bytes, bytes]],
        x_cache: bytes,
        *,
        tenant: str | None,
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes] | None:
        """Forward to upstream and stream the answer back; None when it broke."""
        t0 = time.perf_counter()
        try:
            resp = await self.upstream.request(request.method, request.url, headers, request.body)
        except UpstreamError as exc:
            body = orjson.dumps(
                {
                    "error": {
                        "message": f"upstream unavailable: {exc}",
                        "type": "cachefleet_upstream",
                    }
                }
            )
            conn.write(
                simple_response(
                    504 if exc.timed_out else 502,
                    body,
                    content_type=b"application/json",
                    extra=b"x-cache: %s\r\n" % x_cache,
                )
            )
            if tenant is not None:
                self.metrics.tenant(tenant).request(
                    "upstream", "error", time.perf_counter() - request.started
                )
            return None
        head = [b"HTTP/1.1 %d %s\r\n" % (resp.status, reason_phrase(resp.status))]
        head += [n + b": " + v + b"\r\n" for n, v in resp.headers if n not in FORWARD_DROP]
        length = resp.content_length
        no_body = request.method == b"HEAD" or resp.status in (204, 304) or 100 <= resp.status < 200
        chunked = length is None and not no_body
        if length is not None:
            head.append(b"content-length: %d\r\n" % length)
        elif chunked:
            head.append(b"transfer-encoding: chunked\r\n")
        head.append(b"x-cache: %s\r\n\r\n" % x_cache)
        # A sized answer that fits is sent in one write once complete (one syscall,
        # and a truncated body can still become a clean 502); anything else
        # (SSE, chunked, large) is relayed as it arrives, the head with the first bytes.
        buffered = length is not None and length <= MAX_BUFFERED_BYTES
        pending = b"".join(head)
        parts: list[bytes] = []
        try:
            async for chunk in resp.chunks():
                parts.append(chunk)
                if buffered:
                    continue
                data = b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk
                conn.write(pending + data if pending else data)
                pending = b""
        except UpstreamError as exc:
            log.warning("upstream broke mid-response for %s: %s", request.url, exc)
            if buffered:
                message = f"upstream answer incomplete: {exc}"
                conn.write(
                    simple_response(
                        502,
                        orjson.dumps(
                            {"error": {"message": message, "type": "cachefleet_upstream"}}
                        ),
                        content_type=b"application/json",
                        extra=b"x-cache: %s\r\n" % x_cache,
                    )
                )
            else:
                conn.abort()
            if tenant is not None:
                self.metrics.tenant(tenant).request(
                    "upstream", "error", time.perf_counter() - request.started
                )
            return None
        if buffered or pending:
            conn.write(pending + b"".join(parts) if buffered else pending)
        if chunked:
            conn.write(b"0\r\n\r\n")
        self._last_upstream_ok = time.monotonic()
        if tenant is not None:
            tm = self.metrics.tenant(tenant)
            tm.upstream.observe(time.perf_counter() - t0)
            if x_cache == b"MISS":
                tm.request("upstream", "miss", time.perf_counter() - request.started)
        return resp.status, resp.headers, b"".join(parts)

    # -------------------------------------------------------------- cache tiers
    def _l1_put(
        self, tenant: str, key: keys.CacheKey, entry: Entry, cost: float | None = None
    ) -> None:
        value, size = entry.l1_value()
        try:
            evicted = self.l1.put(tenant, key.digest, value, size, cost)
        except TenantLimitError:
            self.metrics.fault("tenant_limit")
            return
        self.metrics.tenant(tenant).evicted("l1", evicted)

    def _vector(self, lookup: Lookup, key: keys.CacheKey) -> EpochVector | Literal[False] | None:
        """The epochs to check in L2; None when unversioned; False when the key is outdated."""
        if not self._versioned:
            return None
        if lookup.version != self._scope_version:
            return False
        return self.tracker.vector(lookup.tenant, key.model)

    async def _l2_get(self, lookup: Lookup, key: keys.CacheKey) -> Entry | None:
        if self.l2 is None:
            return None
        tenant = lookup.tenant
        vector = self._vector(lookup, key)
        if vector is False:
            return None
        data = await self.l2.get(tenant, key.sha256_hex, vector)
        if data is None:
            return None
        if vector is not None and lookup.version != self._scope_version:
            return None  # the epochs moved while the read was out: do not serve it
        try:
            entry = Entry.loads(data)
        except ValueError:
            self.metrics.fault("corrupt_entry")
            return None
        if entry.tenant != tenant:
            self.metrics.cross_tenant_hits += 1
            return None
        return entry

    async def _l2_put(self, lookup: Lookup, key: keys.CacheKey, entry: Entry) -> None:
        assert self.l2 is not None
        vector = self._vector(lookup, key)
        if vector is False:
            return  # keyed under epochs that have moved on: nobody can read it
        await self.l2.put(lookup.tenant, key.sha256_hex, entry.dumps(), vector)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -------------------------------------------------------------- switching
    def _observe(self, tenant: str, seconds: float, digest: int) -> None:
        """Feed the switching engine; close its windows when one has ended."""
        engine = self.switching
        assert engine is not None
        engine.observe(tenant, seconds, digest)
        now = time.monotonic()
        if now >= engine.next_window_at:
            try:
                self.switch_tick(now)
            except Exception:  # never the request's problem: counted, logged
                self.metrics.fault("policy_switching")
                log.exception("policy switching failed; the L1 keeps its policies")

    def switch_tick(self, now: float) -> None:
        """Apply GPU pressure, close ended windows and apply their decisions."""
        engine = self.switching
        if engine is None:
            return
        pressure = gpu_pressure(self.telemetry.samples())
        engine.set_pressure(pressure)
        engine.set_host_pressure(self.host.sample().pressure)
        self.l1.set_pressure(pressure)
        policies = {t: s.policy for t, s in self.l1.stats().items()}
        for d in engine.tick(now, policies):
            # One synchronous step: the entries migrate, no request sees a gap.
            self.l1.set_policy(d.tenant, d.to_policy if d.action == "switch" else None)
            self.metrics.policy_switch(d.tenant, d.from_policy, d.to_policy)
            log.info("policy %s %s", d.action, orjson.dumps(d.as_dict()).decode())

    # -------------------------------------------------------------- control
    def apply_quotas(self, assignment: protocol.QuotaAssignment) -> None:
        """Apply the operator's quota table (idempotent; older generations ignored)."""
        if assignment.generation <= self.quota_generation:
            return
        self.quota_generation = assignment.generation
        self.quotas = dict(assignment.tenants)
        self.known_tenants = set(self.config.tenants) | set(assignment.tenants)
        self._tenant_memo.clear()
        base = self._default_options
        self._key_options = {
            t: keys.KeyOptions(
                collapse_whitespace=base.collapse_whitespace
                if q.collapse_whitespace is None
                else q.collapse_whitespace,
                cache_nondeterministic=base.cache_nondeterministic
                if q.cache_nondeterministic is None
                else q.cache_nondeterministic,
            )
            for t, q in assignment.tenants.items()
        }
        self._key_memo.clear()
        if assignment.tenants:
            self.l1.set_quotas(
                {
                    t: (q.l1_bytes, self._usable_policy(q.policy or assignment.default_policy))
                    for t, q in assignment.tenants.items()
                }
            )
        else:
            self.l1.set_quotas(None)
        if self.l2 is not None:
            for tenant, quota in assignment.tenants.items():
                self._spawn(self.l2.set_limit(tenant, quota.l2_bytes))
        log.info(
            "applied quotas generation %d for %d tenants",
            assignment.generation,
            len(assignment.tenants),
        )

    def _usable_policy(self, wanted: protocol.Policy) -> str:
        """``wanted`` if this sidecar implements it, else LIRS (logged, counted)."""
        if wanted.value in available_policies():
            return wanted.value
        log.warning("policy %r is not available in this sidecar; using lirs", wanted.value)
        self.metrics.fault("policy_unavailable")
        return protocol.Policy.LIRS.value

    def heartbeat(self) -> protocol.Heartbeat:
        stats = self.l1.stats()
        return protocol.Heartbeat(
            pod=self.config.pod,
            quota_generation=self.quota_generation,
            policy_by_tenant={t: protocol.Policy(s.policy) for t, s in stats.items()},
            redis_ok=self.l2 is None or self.l2.state == "ok",
        )

    # -------------------------------------------------------------- admin
    def _usage(self) -> list[TierUsage]:
        out = [
            TierUsage(t, "l1", s.used_bytes, s.capacity_bytes, s.policy)
            for t, s in self.l1.stats().items()
        ]
        out += [TierUsage(t, "l2", used, limit) for t, (used, limit) in self.l2_usage.items()]
        return out

    def _redis_families(self) -> Iterator[Metric]:
        """L2 and epoch state, read at scrape time from their owners."""
        cache = self.config.cache
        if self.l2 is not None:
            counters = self.l2.counters
            up = GaugeMetricFamily(
                "cachefleet_redis_up", "1 while the L2 Redis answers.", labels=["cache"]
            )
            up.add_metric([cache], 1.0 if self.l2.state == "ok" else 0.0)
            errors = CounterMetricFamily(
                "cachefleet_redis_errors",
                "Redis operations of the L2 tier that failed or timed out.",
                labels=["cache"],
            )
            errors.add_metric([cache], counters.errors + counters.timeouts)
            stale = CounterMetricFamily(
                "cachefleet_l2_stale_refused",
                "L2 reads and writes refused because their epochs were behind the fence.",
                labels=["cache"],
            )
            stale.add_metric([cache], counters.stale_refused)
            yield from (up, errors, stale)
        if self._versioned:
            epoch = GaugeMetricFamily(
                "cachefleet_epoch",
                "Invalidation epoch this sidecar knows, by scope (cache, tenant:<t>, model:<m>).",
                labels=["cache", "scope"],
            )
            for scope, value in self.tracker.known.items():
                epoch.add_metric([cache, scope], value)
            confirmed = GaugeMetricFamily(
                "cachefleet_epochs_confirmed",
                "1 while the epochs were confirmed within the staleness bound (L1 may serve).",
                labels=["cache"],
            )
            confirmed.add_metric([cache], 1.0 if self.tracker.fresh() else 0.0)
            yield from (epoch, confirmed)

    async def refresh_l2_usage(self) -> None:
        """Read each tenant's L2 bytes and limit (for /metrics and /status)."""
        if self.l2 is None:
            return
        for tenant in set(self.quotas) | set(self.l1.stats()):
            used, limit = await self.l2.usage(tenant)
            if limit:
                self.l2_usage[tenant] = (used, limit)

    def status(self) -> dict[str, Any]:
        stats = self.l1.stats()
        return {
            "cache": self.config.cache,
            "pod": self.config.pod,
            "upstream": self.config.upstream,
            "uptime_s": round(time.time() - self.started_at, 3),
            "quota_generation": self.quota_generation,
            "model_version": self.model_version,
            "invalidation_epochs": self.tracker.known,
            "epochs_confirmed": self.tracker.valid_until > time.monotonic(),
            "l1": {
                "capacity_bytes": self.config.l1_bytes,
                "default_policy": self.config.policy.value,
            },
            "tenants": {
                t: {
                    "policy": s.policy,
                    "l1_bytes": s.used_bytes,
                    "l1_quota_bytes": s.capacity_bytes,
                    "l1_entries": s.entries,
                    "l1_evictions": s.evictions,
                    "l2_quota_bytes": self.quotas[t].l2_bytes if t in self.quotas else None,
                    "l2_bytes": self.l2_usage[t][0] if t in self.l2_usage else None,
                }
                for t, s in stats.items()
            },
            "known_tenants": sorted(self.known_tenants),
            "redis": None if self.l2 is None else self.l2.state,
            "gpu_telemetry": self.telemetry.describe(),
            "policy_switching": {"enabled": False}
            if self.switching is None
            else {"enabled": True, **self.switching.status(), "host": self.host.describe()},
            "degraded": {
                "redis": self.l2 is not None and self.l2.state != "ok",
                "gpu_telemetry": not self.telemetry.available,
            },
        }

    async def ready(self) -> bool:
        if time.monotonic() - self._last_upstream_ok < READY_FRESH_S:
            return True
        ok = await self.upstream.probe()
        if ok:
            self._last_upstream_ok = time.monotonic()
        return ok

    async def admin(self, request: Request, conn: Connection) -> None:
        path = request.url.split(b"?", 1)[0]
        if path == b"/healthz":
            conn.write(simple_response(200, b"ok\n"))
        elif path == b"/readyz":
            ok = await self.ready()
            conn.write(
                simple_response(200, b"ready\n")
                if ok
                else simple_response(503, b"upstream unreachable\n")
            )
        elif path == b"/status":
            conn.write(
                simple_response(
                    200,
                    orjson.dumps(self.status(), option=orjson.OPT_INDENT_2),
                    content_type=b"application/json",
                )
            )
        elif path == b"/metrics":
            conn.write(
                simple_response(
                    200, self.metrics.render(), content_type=b"text/plain; version=0.0.4"
                )
            )
        else:
            conn.write(simple_response(404, b"not found\n"))

    async def aclose(self) -> None:
        for task in list(self._background):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, 1.0)
        await self.upstream.aclose()


class AdminHandler:
    """Handler for the admin port: only the admin endpoints."""

    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar

    def fast(self, request: Request) -> bytes | None:
        return None

    async def handle(self, request: Request, conn: Connection) -> None:
        await self.sidecar.admin(request, conn)


class SidecarServer:
    """Owns the listening sockets, the Redis tiers and the control sync."""

    def __init__(self, config: SidecarConfig, sidecar: Sidecar | None = None) -> None:
        self.config = config
        self.sidecar = sidecar or Sidecar(config)
        self.connections: set[Connection] = set()
        self.servers: list[asyncio.Server] = []
        self.control: Any = None
        self._usage_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        cfg = self.config
        if cfg.redis_url and self.sidecar.l2 is None:
            from .l2 import RedisL2

            self.sidecar.l2 = RedisL2.from_url(cfg.redis_url, cfg.cache, ttl_s=cfg.l2_ttl_s)
            await self.sidecar.l2.connect()
        if cfg.redis_url:
            from .control import ControlSync

            l2 = self.sidecar.l2
            self.sidecar.enable_epochs()
            self.control = ControlSync(
                cfg.redis_url,
                cfg.cache,
                cfg.pod,
                self.sidecar.apply_quotas,
                heartbeat=self.sidecar.heartbeat,
                tracker=self.sidecar.tracker,
                on_epochs=self.sidecar.on_epochs,
                on_redis_reset=getattr(l2, "forget_registrations", None),
            )
            if l2 is not None and hasattr(l2, "on_behind"):
                l2.on_behind = self.control.poke
            await self.control.start()
            self._usage_task = loop.create_task(self._refresh_usage())
        main = await loop.create_server(
            lambda: Connection(self.sidecar, self.connections), *cfg.listen, reuse_address=True
        )
        self.servers.append(main)
        if cfg.admin_listen is not None:
            admin = AdminHandler(self.sidecar)
            self.servers.append(
                await loop.create_server(
                    lambda: Connection(admin, self.connections),
                    *cfg.admin_listen,
                    reuse_address=True,
                )
            )
        log.info(
            "cachefleet sidecar on %s:%d -> %s (L1 %d bytes, policy %s, redis %s)",
            *cfg.listen,
            cfg.upstream,
            cfg.l1_bytes,
            cfg.policy.value,
            "on" if cfg.redis_url else "off",
        )

    async def _refresh_usage(self) -> None:
        while True:
            await asyncio.sleep(L2_USAGE_REFRESH_S)
            try:
                await self.sidecar.refresh_l2_usage()
            except Exception as exc:  # never fatal: the gauges just stay older
                log.debug("L2 usage refresh failed: %s", exc)

    @property
    def ports(self) -> list[int]:
        return [int(s.sockets[0].getsockname()[1]) for s in self.servers]

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop accepting, let in-flight requests finish (bounded), then close."""
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        for server in self.servers:
            server.close()
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            for conn in list(self.connections):
                if not conn.busy and not conn.pending:
                    conn.close()
            if not self.connections:
                break
            await asyncio.sleep(0.02)
        for conn in list(self.connections):
            conn.close()
        if self._usage_task is not None:
            self._usage_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._usage_task
        if self.control is not None:
            await self.control.stop()
        await self.sidecar.aclose()
        if self.sidecar.l2 is not None:
            await self.sidecar.l2.aclose()


async def serve(config: SidecarConfig) -> None:
    server = SidecarServer(config)
    await server.start()
    # Everything allocated so far lives as long as the process: keep it out of
    # the cyclic GC's full collections, whose pauses would land on requests.
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: finishing in-flight requests (up to %gs)", config.shutdown_grace_s)
    await server.stop()


def main(argv: list[str]) -> int:
    config = parse_args(argv)
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.run
    try:
        runner(serve(config))
    except OSError as exc:
        log.error("cannot start: %s", exc)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))
