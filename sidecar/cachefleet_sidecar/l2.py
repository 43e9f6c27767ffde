"""The L2 tier: a shared Redis (standalone or Redis Cluster) with per-tenant quotas.

Each operation is one Lua script from :mod:`cachefleet_sidecar.protocol` on
the keys of one tenant (one cluster slot), so a hit is one round trip and a
put enforces the tenant's byte quota atomically (see the protocol docstring
for the exact rules).

The cache must never make a request fail or wait long: every operation is
bounded by ``op_timeout_s``, and a :class:`CircuitBreaker` stops calling
Redis after ``failure_threshold`` consecutive failures, so once Redis is known
to be down an operation returns at once (``get`` -> None, ``put`` -> False).
After ``cooldown_s`` one probe is let through; when it succeeds the tier is
back without a new object (redis-py reconnects its pool by itself).

Choosing the deployment: :meth:`RedisL2.from_url` follows the URL convention
of :func:`cachefleet_sidecar.protocol.parse_redis_url`: ``redis://host:port/db``
is a standalone server, ``redis+cluster://h1:p1,h2:p2`` a Redis Cluster
(``cluster=True/False`` overrides the scheme).

Epochs (versioned invalidation, see the protocol docstring): ``get`` and
``put`` take the reader's / writer's :data:`~cachefleet_sidecar.epochs.EpochVector`
and then run the versioned scripts, which compare it with the tenant slot's
fence in the same round trip: a reader behind an invalidation gets a miss
(counted in ``stale_refused``, and ``on_behind`` is called so the sidecar
re-reads its epochs at once), a writer behind one stores nothing. Before the
first versioned write of a tenant the tier registers the tenant
(:func:`~cachefleet_sidecar.protocol.register_tenant`) so invalidators fence
its slot; :meth:`RedisL2.forget_registrations` makes it register again (after
Redis lost its state).

Quota: ``set_limit(tenant, n)`` stores the tenant's limit in Redis (shared by
every sidecar); a limit of 0 or none at all means ``default_limit_bytes``
given at construction (:data:`DEFAULT_LIMIT_BYTES` unless changed).
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeVar

from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError

from cachefleet_sidecar import protocol
from cachefleet_sidecar.epochs import EpochVector
from cachefleet_sidecar.protocol import RedisClient

log = logging.getLogger(__name__)

#: Upper bound of one L2 operation (including connecting), seconds.
DEFAULT_OP_TIMEOUT_S = 0.05
#: Lifetime of an L2 entry, seconds.
DEFAULT_TTL_S = 3600.0
#: Limit of a tenant whose limit is 0 or unset, bytes.
DEFAULT_LIMIT_BYTES = 64 * 1024 * 1024
#: Most entries one put may evict or reclaim.
DEFAULT_MAX_EVICT = 64
#: Upper bound of :meth:`RedisL2.connect` (start-up warm-up), seconds.
DEFAULT_WARMUP_TIMEOUT_S = 2.0
#: Upper bound of registering a tenant for invalidation fencing (once per tenant), s.
DEFAULT_REGISTER_TIMEOUT_S = 1.0
#: Consecutive failures that open the breaker.
DEFAULT_FAILURE_THRESHOLD = 3
#: How long an open breaker refuses calls before letting one probe through, s.
DEFAULT_COOLDOWN_S = 1.0
#: Socket connect timeout of the client, seconds (the op timeout bounds it too).
DEFAULT_CONNECT_TIMEOUT_S = 0.25

#: What a versioned read returns for a stored value that is not an entry of
#: the reader's epochs (it is dropped from Redis): no entry is empty, so the
#: caller's decoder treats it as a corrupt entry.
CORRUPT: Final = b""

State = Literal["ok", "degraded", "down"]
T = TypeVar("T")


class CircuitBreaker:
    """Closed -> open after N consecutive failures -> half-open probe after a cool-down.

    ``allow()`` says whether a call may go out now; the caller reports the
    outcome with ``success()`` or ``failure()``. In half-open state exactly
    one probe is allowed; its outcome closes or re-opens the breaker.
    """

    def __init__(
        self,
        failure_threshold: int = DEFAULT_FAILURE_THRESHOLD,
        cooldown_s: float = DEFAULT_COOLDOWN_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1:
            raise ValueError("failure_threshold must be at least 1")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._failures = 0
        self._opened_at: float | None = None
        self._probing = False

    @property
    def state(self) -> Literal["closed", "open", "half_open"]:
        if self._opened_at is None:
            return "closed"
        if self._probing or self._clock() - self._opened_at >= self.cooldown_s:
            return "half_open"
        return "open"

    @property
    def consecutive_failures(self) -> int:
        return self._failures

    def allow(self) -> bool:
        state = self.state
        if state == "closed":
            return True
        if state == "half_open" and not self._probing:
            self._probing = True
            return True
        return False

    def success(self) -> None:
        self._failures = 0
        self._opened_at = None
        self._probing = False

    def failure(self) -> None:
        self._failures += 1
        if self._probing or self._failures >= self.failure_threshold:
            self._opened_at = self._clock()
        self._probing = False


@dataclass
class L2Counters:
    """What the tier has seen since it was created (exported as metrics)."""

    hits: int = 0
    misses: int = 0
    stores: int = 0
    refused: int = 0
    evictions: int = 0
    reclaimed_expired: int = 0
    errors: int = 0
    timeouts: int = 0
    short_circuited: int = 0
    #: Reads and writes refused because their epochs were behind the fence.
    stale_refused: int = 0


class _Script:
    """A Lua script run by EVALSHA, loaded again when Redis has forgotten it."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, client: RedisClient, keys: list[str], args: list[Any]) -> Any:
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await client.eval(self.source, len(keys), *keys, *args)


class _Failed(enum.Enum):
    """Marks an operation the breaker, the timeout or an error cut short."""

    FAILED = "failed"


_FAILED: Final = _Failed.FAILED


def _ints3(reply: Any) -> tuple[int, int, int]:
    first, second, third = (int(x) for x in reply)
    return first, second, third


_GET = _Script(protocol.L2_GET_LUA)
_PUT = _Script(protocol.L2_PUT_LUA)
_USAGE = _Script(protocol.L2_USAGE_LUA)
_GET_V = _Script(protocol.L2_GET_VERSIONED_LUA)
_PUT_V = _Script(protocol.L2_PUT_VERSIONED_LUA)


class RedisL2:
    """Per-tenant byte-bounded response cache in Redis for one InferenceCache."""

    def __init__(
        self,
        client: RedisClient,
        cache: str,
        *,
        op_timeout_s: float = DEFAULT_OP_TIMEOUT_S,
        ttl_s: float = DEFAULT_TTL_S,
        default_limit_bytes: int = DEFAULT_LIMIT_BYTES,
        max_evict: int = DEFAULT_MAX_EVICT,
        breaker: CircuitBreaker | None = None,
    ) -> None:
        self._client = client
        self.cache = cache
        self.op_timeout_s = op_timeout_s
        self.ttl_s = ttl_s
        self.default_limit_bytes = default_limit_bytes
        self.max_evict = max_evict
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        self.counters = L2Counters()
        self._last_error: str | None = None
        self._abandoned: set[asyncio.Future[Any]] = set()
        self._registered: set[str] = set()
        #: Called (synchronously) when a read was refused for being behind the fence.
        self.on_behind: Callable[[], None] | None = None

    @classmethod
    def from_url(
        cls,
        url: str,
        cache: str,
        *,
        cluster: bool | None = None,
        op_timeout_s: float = DEFAULT_OP_TIMEOUT_S,
        ttl_s: float = DEFAULT_TTL_S,
        default_limit_bytes: int = DEFAULT_LIMIT_BYTES,
        max_evict: int = DEFAULT_MAX_EVICT,
        breaker: CircuitBreaker | None = None,
    ) -> RedisL2:
        """Build the tier on a new client for ``url`` (see the module docstring)."""
        options: dict[str, Any] = {
            "socket_connect_timeout": min(DEFAULT_CONNECT_TIMEOUT_S, max(op_timeout_s, 0.01)),
            "socket_timeout": max(op_timeout_s * 4, 0.05),
            # No client-side retries: the breaker decides when to try again.
            "retry": Retry(NoBackoff(), 0),
        }
        client = protocol.redis_from_url(url, cluster=cluster, **options)
        return cls(
            client,
            cache,
            op_timeout_s=op_timeout_s,
            ttl_s=ttl_s,
            default_limit_bytes=default_limit_bytes,
            max_evict=max_evict,
            breaker=breaker,
        )

    # ----------------------------------------------------------------- state

    @property
    def state(self) -> State:
        """``down`` while the breaker is open, ``degraded`` after recent failures."""
        breaker_state = self.breaker.state
        if breaker_state == "open":
            return "down"
        if breaker_state == "half_open" or self.breaker.consecutive_failures:
            return "degraded"
        return "ok"

    @property
    def last_error(self) -> str | None:
        return self._last_error

    # ------------------------------------------------------------ operations

    async def connect(self, timeout_s: float = DEFAULT_WARMUP_TIMEOUT_S) -> bool:
        """Connect and load the scripts now, so the first request is one round trip.

        Call it at start-up: a cold client (cluster discovery, script upload)
        can take longer than ``op_timeout_s``. Bounded by ``timeout_s``; never
        raises. On False the tier still works: the breaker retries later.
        """
        try:
            async with asyncio.timeout(timeout_s):
                for script in (_GET, _PUT, _USAGE, _GET_V, _PUT_V):
                    await self._client.script_load(script.source)
        except Exception as exc:  # a cache fault must never fail start-up
            self.counters.errors += 1
            self._fail(f"connect: {type(exc).__name__}: {exc}")
            return False
        self.breaker.success()
        return True

    async def get(
        self, tenant: str, digest_hex: str, vector: EpochVector | None = None
    ) -> bytes | None:
        """The cached value or None (miss, Redis down, slow or broken).

        With ``vector`` the read is versioned: it is refused (None) when the
        tenant's fence is ahead of the vector, and only an entry written under
        exactly ``vector`` is returned; a stored value that is not such an
        entry is dropped and reported as :data:`CORRUPT`.
        """
        if vector is not None:
            return await self._get_versioned(tenant, digest_hex, vector)
        keys = protocol.l2_keys(self.cache, tenant, digest_hex)

        async def call() -> bytes | None:
            raw = await _GET(self._client, keys, [])
            return None if raw is None else bytes(raw)

        found = await self._guarded(call)
        if found is _FAILED:
            return None
        if found is None:
            self.counters.misses += 1
            return None
        self.counters.hits += 1
        return found

    async def _get_versioned(
        self, tenant: str, digest_hex: str, vector: EpochVector
    ) -> bytes | None:
        keys = protocol.l2_versioned_keys(self.cache, tenant, digest_hex)
        args = protocol.vector_args(vector)

        async def call() -> tuple[int, bytes | None]:
            reply = await _GET_V(self._client, keys, args)
            status = int(reply[0])
            return status, (bytes(reply[1]) if status == 1 else None)

        found = await self._guarded(call)
        if found is _FAILED:
            return None
        status, value = found
        if status == -1:
            self.counters.stale_refused += 1
            if self.on_behind is not None:
                self.on_behind()
            return None
        if status == 2:
            self.counters.misses += 1
            return CORRUPT
        if value is None:
            self.counters.misses += 1
            return None
        self.counters.hits += 1
        return value

    def forget_registrations(self) -> None:
        """Register every tenant again before its next versioned write."""
        self._registered.clear()

    async def put(
        self, tenant: str, digest_hex: str, value: bytes, vector: EpochVector | None = None
    ) -> bool:
        """Store ``value``; False when the quota, the fence, the breaker or an error refused it.

        With ``vector`` the write is versioned (see :meth:`get`); the tenant is
        registered for invalidation fencing first.
        """
        versioned = vector is not None
        keys = (
            protocol.l2_versioned_keys(self.cache, tenant, digest_hex)
            if versioned
            else protocol.l2_keys(self.cache, tenant, digest_hex)
        )
        args: list[Any] = [
            value,
            max(1, int(self.ttl_s * 1000)),
            self.default_limit_bytes,
            self.max_evict,
        ]
        if vector is not None:
            args += protocol.vector_args(vector)

        if versioned and tenant not in self._registered:
            # Once per tenant, off the request path (puts run in the background):
            # a few round trips to two slots, so it gets a longer bound.
            async def register() -> bool:
                await protocol.register_tenant(self._client, self.cache, tenant)
                return True

            if await self._guarded(register, DEFAULT_REGISTER_TIMEOUT_S) is not True:
                return False
            self._registered.add(tenant)

        async def call() -> tuple[int, int, int]:
            script = _PUT_V if versioned else _PUT
            return _ints3(await script(self._client, keys, args))

        reply = await self._guarded(call)
        if reply is _FAILED:
            return False
        status, evicted, reclaimed = reply
        self.counters.evictions += evicted
        self.counters.reclaimed_expired += reclaimed
        if status == 1:
            self.counters.stores += 1
            return True
        if status == -2:
            self.counters.stale_refused += 1
            return False
        self.counters.refused += 1
        return False

    async def set_limit(self, tenant: str, l2_bytes: int) -> bool:
        """Set the tenant's limit (0 = the default limit). False if Redis refused."""
        key = protocol.usage_key(self.cache, tenant)

        async def call() -> bool:
            await self._client.hset(key, "limit", str(max(0, int(l2_bytes))))
            return True

        return await self._guarded(call) is True

    async def usage(self, tenant: str) -> tuple[int, int]:
        """(bytes used, limit in force) of ``tenant``; (0, 0) when Redis is unavailable.

        Reclaims up to ``max_evict`` expired entries first, so the bytes of
        expired entries do not linger in the count.
        """
        keys = protocol.l2_meta_keys(self.cache, tenant)
        args: list[Any] = [self.default_limit_bytes, self.max_evict]

        async def call() -> tuple[int, int, int]:
            return _ints3(await _USAGE(self._client, keys, args))

        reply = await self._guarded(call)
        if reply is _FAILED:
            return (0, 0)
        used, limit, reclaimed = reply
        self.counters.reclaimed_expired += reclaimed
        return (used, limit)

    async def ping(self) -> bool:
        """One bounded PING that goes through the breaker (readiness probes)."""

        async def call() -> bool:
            return bool(await self._client.ping())

        return await self._guarded(call) is True

    async def aclose(self) -> None:
        """Close the client's connections (idempotent)."""
        for task in list(self._abandoned):
            task.cancel()
        try:
            await self._client.aclose()
        except (RedisError, OSError) as exc:
            log.debug("closing the L2 client: %s", exc)

    async def __aenter__(self) -> RedisL2:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    # --------------------------------------------------------------- guards

    async def _guarded(
        self, call: Callable[[], Coroutine[Any, Any, T]], timeout_s: float | None = None
    ) -> T | Literal[_Failed.FAILED]:
        """Run ``call`` through the breaker and the timeout; never raises."""
        if not self.breaker.allow():
            self.counters.short_circuited += 1
            return _FAILED
        # Not asyncio.wait_for: it waits for the cancelled call to clean up,
        # which a client reconnecting to a dead node can stretch well past the
        # timeout. The call is abandoned instead and finishes in the background.
        task = asyncio.ensure_future(call())
        try:
            await asyncio.wait({task}, timeout=timeout_s or self.op_timeout_s)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not task.done():
            task.cancel()
            self._abandoned.add(task)
            task.add_done_callback(self._forget_abandoned)
            self.counters.timeouts += 1
            self._fail("timeout")
            return _FAILED
        try:
            result = task.result()
        except Exception as exc:  # a cache fault must never fail a request
            # RedisError, OSError, RedisClusterException (not a RedisError),
            # or a reply of an unexpected shape.
            self.counters.errors += 1
            self._fail(f"{type(exc).__name__}: {exc}")
            return _FAILED
        if self.breaker.state != "closed":
            log.info("L2 %s: Redis answers again", self.cache)
        self.breaker.success()
        return result

    def _forget_abandoned(self, task: asyncio.Future[Any]) -> None:
        self._abandoned.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved, so asyncio does not log it

    def _fail(self, reason: str) -> None:
        was_open = self.breaker.state != "closed"
        self.breaker.failure()
        if self._last_error is None or not was_open:
            log.warning("L2 %s: %s (state %s)", self.cache, reason, self.state)
        self._last_error = reason
