"""The L2 tier: a shared Redis (standalone or Redis Cluster) with per-tenant quotas.

Each operation is on the keys of one tenant (one cluster slot) and one round
trip: a read is plain ``GET`` + fence ``HMGET`` commands in one write, a put
one Lua script from :mod:`cachefleet_common.contract.lua` that enforces the
tenant's byte quota atomically, and hits' LRU touches go later, batched (see
docs/redis-protocol.md for the exact rules).

The scripts run on the sidecar's own lean client (:mod:`cachefleet_common.resp`:
one pipelined connection per Redis node, EVALSHA, a deadline per command);
redis-py is used only to register a tenant for invalidation fencing (once
per tenant, off the request path).

The cache must never make a request fail or wait long: every operation is
bounded by ``op_timeout_s`` and goes through its Redis node's circuit breaker
(:mod:`cachefleet_sidecar.cache.l2_guard`), so once a node is known to be down
an operation on its tenants returns at once (``get`` -> None, ``put`` ->
False) while the other nodes of a cluster keep serving. Making a connection
is not an operation's cost: it runs in the background (eagerly at
:meth:`RedisL2.connect`). Warm-ups read a tenant's most recent entries in
batches (:mod:`cachefleet_sidecar.cache.l2_warm`).

Choosing the deployment: :meth:`RedisL2.from_url` follows the URL convention
of :func:`cachefleet_common.contract.urls.parse_redis_url`: ``redis://host:port/db``
is a standalone server, ``redis+cluster://h1:p1,h2:p2`` a Redis Cluster
(``cluster=True/False`` overrides the scheme).

Epochs (versioned invalidation, see docs/redis-protocol.md): ``get`` and
``put`` take the reader's / writer's :data:`~cachefleet_common.epochs.EpochVector`
and compare it with the tenant slot's fence in the same round trip: a reader
behind an invalidation gets a miss (counted in ``stale_refused``, and
``on_behind`` is called so the sidecar re-reads its epochs at once), a writer
behind one stores nothing. Before the first versioned write of a tenant the
tier registers the tenant (:func:`~cachefleet_common.contract.ops.register_tenant`)
so invalidators fence its slot; :meth:`RedisL2.forget_registrations` makes it
register again (after Redis lost its state).

Quota: ``set_limit(tenant, n)`` stores the tenant's limit in Redis (shared by
every sidecar) and, when it was lowered, evicts down to it at once; a limit
of 0 or none at all means ``default_limit_bytes`` given at construction
(:data:`DEFAULT_LIMIT_BYTES` unless changed).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from cachefleet_common import resp
from cachefleet_common.contract.clients import RedisClient, redis_from_url, resp_client
from cachefleet_common.contract.lua import (
    L2_FORGET_STALE_LUA,
    L2_PUT_LUA,
    L2_PUT_VERSIONED_LUA,
    L2_SET_LIMIT_LUA,
    L2_TOUCH_BATCH,
    L2_TOUCH_INTERVAL_S,
    L2_TOUCH_LUA,
    L2_USAGE_LUA,
)
from cachefleet_common.contract.names import (
    entry_key,
    l2_keys,
    l2_meta_keys,
    l2_versioned_keys,
    lru_key,
)
from cachefleet_common.contract.ops import register_tenant
from cachefleet_common.contract.versioned import (
    READ_BEHIND,
    READ_STALE_ENTRY,
    entry_head,
    fence_command,
    judge_entry,
    judge_versioned_read,
    l1_id_line,
    vector_args,
)
from cachefleet_common.epochs import EpochVector
from cachefleet_sidecar.cache.l2_guard import FAILED, CircuitBreaker
from cachefleet_sidecar.cache.l2_warm import L2WarmUp

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
#: Most entries one call of the set-limit script evicts or reclaims.
SET_LIMIT_BATCH = 1000
#: Most calls of the set-limit script one :meth:`RedisL2.set_limit` makes.
SET_LIMIT_MAX_CALLS = 100
#: Most tenants / epoch vectors whose script keys / arguments are kept ready (then cleared).
MEMO_LIMIT = 4096
#: Socket connect timeout of the registration client, seconds (the op timeout bounds it too).
DEFAULT_CONNECT_TIMEOUT_S = 0.25
#: Upper bound of making one hot-path connection (TCP, TLS, AUTH), in the background, s.
DEFAULT_SETUP_TIMEOUT_S = 2.0

#: What a versioned read returns for a stored value that is not an entry of
#: the reader's epochs (it is dropped from Redis): no entry is empty, so the
#: caller's decoder treats it as a corrupt entry.
CORRUPT: Final = b""


def _ints3(reply: Any) -> tuple[int, int, int]:
    first, second, third = (int(x) for x in reply)
    return first, second, third


_PUT = resp.Script(L2_PUT_LUA)
_USAGE = resp.Script(L2_USAGE_LUA)
_PUT_V = resp.Script(L2_PUT_VERSIONED_LUA)
_SET_LIMIT = resp.Script(L2_SET_LIMIT_LUA)
_TOUCH = resp.Script(L2_TOUCH_LUA)
_FORGET_STALE = resp.Script(L2_FORGET_STALE_LUA)
_SCRIPTS = (_PUT, _USAGE, _PUT_V, _SET_LIMIT, _TOUCH, _FORGET_STALE)


def _pack_get(key: str) -> bytes:
    """``GET key`` packed (the same bytes as :func:`resp.pack_command`, for less work)."""
    k = key.encode()
    return b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k)


@dataclass(slots=True)
class _ReadMemo:
    """What one tenant's versioned reads under ``vector`` share."""

    vector: EpochVector
    #: The fence's HMGET, packed.
    fence: bytes
    #: The head of the entries written under ``vector``.
    head: bytes
    #: The tenant's entry keys up to the digest (:func:`entry_key` of an empty digest).
    key_prefix: str
    #: The last fence reply found not ahead of ``vector`` (a pure verdict: the same
    #: reply is not judged again).
    fence_seen: Any = None


@dataclass(slots=True)
class L2Read:
    """A versioned read in flight (:meth:`RedisL2.begin_read`): its replies' futures."""

    tenant: str
    digest_hex: str
    key: str
    #: What the tenant's reads under the read's vector share (its vector, fence, head).
    memo: _ReadMemo
    breaker: CircuitBreaker
    #: One per command sent (GET, then the fence's HMGET if any); the last is done last.
    futures: list[Any]


class RedisL2(L2WarmUp):
    """Per-tenant byte-bounded response cache in Redis for one InferenceCache.

    ``client`` runs the scripts; ``setup`` (redis-py, same Redis) registers
    tenants for invalidation fencing. ``breaker`` is the template of the
    per-node breakers (the first node uses that very object): every operation
    goes through its node's breaker (:class:`~cachefleet_sidecar.cache.l2_guard.L2Guard`);
    the warm-up reads are :class:`~cachefleet_sidecar.cache.l2_warm.L2WarmUp`'s.
    """

    def __init__(
        self,
        client: resp.RespClient,
        cache: str,
        *,
        setup: RedisClient | None = None,
        op_timeout_s: float = DEFAULT_OP_TIMEOUT_S,
        ttl_s: float = DEFAULT_TTL_S,
        default_limit_bytes: int = DEFAULT_LIMIT_BYTES,
        max_evict: int = DEFAULT_MAX_EVICT,
        breaker: CircuitBreaker | None = None,
    ) -> None:
        super().__init__(client, cache, op_timeout_s=op_timeout_s, breaker=breaker)
        self._setup = setup
        self.ttl_s = ttl_s
        self.default_limit_bytes = default_limit_bytes
        self.max_evict = max_evict
        self._registered: set[str] = set()
        #: Tenants whose registration is under way, shared by their first writes.
        self._registering: dict[str, asyncio.Future[bool]] = {}
        self._tails: dict[str, list[str]] = {}
        self._vector_args: dict[EpochVector, list[str]] = {}
        #: per tenant: what its reads under the vector it was last read under share
        self._reads: dict[str, _ReadMemo] = {}
        #: per tenant: entry keys hit since the last touch was sent, least recent first
        self._touches: dict[str, dict[str, None]] = {}
        self._touch_timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
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
        """Build the tier on new clients for ``url`` (see the module docstring)."""
        client = resp_client(
            url,
            cluster=cluster,
            command_timeout_s=op_timeout_s,
            connect_timeout_s=DEFAULT_SETUP_TIMEOUT_S,
        )
        setup = redis_from_url(
            url,
            cluster=cluster,
            socket_connect_timeout=DEFAULT_REGISTER_TIMEOUT_S,
            socket_timeout=DEFAULT_REGISTER_TIMEOUT_S,
            # No client-side retries: the breaker decides when to try again.
            retry=Retry(NoBackoff(), 0),
        )
        return cls(
            client,
            cache,
            setup=setup,
            op_timeout_s=op_timeout_s,
            ttl_s=ttl_s,
            default_limit_bytes=default_limit_bytes,
            max_evict=max_evict,
            breaker=breaker,
        )

    # ------------------------------------------------------------ operations

    async def connect(self, timeout_s: float = DEFAULT_WARMUP_TIMEOUT_S) -> bool:
        """Connect and load the scripts now, so the first request is one round trip.

        Call it at start-up: a cold client (TLS handshake, cluster discovery,
        script upload) can take longer than ``op_timeout_s``. Bounded by
        ``timeout_s``; never raises. On False the tier still works: the
        connections keep being made in the background and the breakers retry.
        """
        try:
            async with asyncio.timeout(timeout_s):
                await self._client.connect(timeout_s)
                await self._client.load_scripts(_SCRIPTS, timeout_s)
        except Exception as exc:  # a cache fault must never fail start-up
            self.counters.errors += 1
            self._fail(self.breaker, f"connect: {type(exc).__name__}: {exc}")
            return False
        for node in self._client.nodes:
            self.breaker_for(node.address).success()
        return True

    async def get(
        self, tenant: str, digest_hex: str, vector: EpochVector | None = None
    ) -> bytes | None:
        """The cached value or None (miss, Redis down, slow or broken).

        With ``vector`` the read is versioned (:func:`judge_versioned_read`):
        it is refused (None) when the tenant's fence is ahead of the vector, and
        only an entry written under exactly ``vector`` is returned; a stored
        value that is not such an entry is dropped and reported as
        :data:`CORRUPT`. A hit's LRU touch is sent later, batched.
        """
        key = entry_key(self.cache, tenant, digest_hex)
        if vector is None:
            raw = await self._call(key, ("GET", key))
            if raw is FAILED:
                return None
            if raw is None:
                self.counters.misses += 1
                return None
            self.counters.hits += 1
            self._touched(tenant, key)
            return bytes(raw)
        read = self.begin_read(tenant, digest_hex, vector)
        if read is not None:
            try:
                await read.futures[-1]  # replies come in order: the others are in too
            except asyncio.CancelledError:
                resp.abandon(read.futures)
                raise
            except Exception:  # finish_read reads every reply's fault
                pass
            return self.finish_read(read)
        # the general path: a breaker's probe or short circuit, a cluster, no connection yet
        memo = self._read_memo(tenant, vector)
        fence = memo.fence
        get = _pack_get(key)
        breaker = self.breaker_for(self._client.address_for(key))
        if not breaker.allow():
            self.counters.short_circuited += 1
            return None
        try:
            replies = await self._client.pipeline(
                key, (get, fence) if fence else (get,), timeout_s=self.op_timeout_s
            )
            for reply in replies:
                if isinstance(reply, resp.ReplyError):
                    raise reply
        except Exception as exc:  # a cache fault must never fail a request
            self._fault(breaker, exc)
            return None
        self._succeeded(breaker)
        return self._judge(tenant, digest_hex, key, vector, memo, replies, bool(fence))

    def _read_memo(self, tenant: str, vector: EpochVector) -> _ReadMemo:
        """What ``tenant``'s reads under ``vector`` share: the fence's HMGET packed, the
        entry head, the key prefix."""
        memo = self._reads.get(tenant)
        # the tracker hands out one vector object per (tenant, model) until an epoch moves
        if memo is None or (memo.vector is not vector and memo.vector != vector):
            if len(self._reads) >= MEMO_LIMIT:
                self._reads.clear()
            memo = self._reads[tenant] = _ReadMemo(
                vector,
                fence_command(self.cache, tenant, vector),
                entry_head(vector),
                entry_key(self.cache, tenant, ""),
            )
        return memo

    def begin_read(self, tenant: str, digest_hex: str, vector: EpochVector) -> L2Read | None:
        """Send a versioned read now, on an open connection; None when it cannot go that way.

        The fast path of an L2 hit: the GET and the fence's HMGET go out in one
        write, and the caller waits on the last future however it likes (a
        callback: no task, no coroutine), then calls :meth:`finish_read`. None
        (nothing sent, nothing counted) when the node's breaker is not closed,
        on a cluster, or while no connection is open: then use :meth:`get`.
        """
        client = self._client
        if client.cluster:  # send_now has no cluster path: nothing sent, nothing counted
            return None
        breaker = self._breakers[client.address_for(None)]  # the only node's
        if breaker.state != "closed":
            return None
        memo = self._read_memo(tenant, vector)
        key = memo.key_prefix + digest_hex  # entry_key(self.cache, tenant, digest_hex)
        fence = memo.fence
        futures = client.send_now(_pack_get(key) + fence, 2 if fence else 1, self.op_timeout_s)
        if futures is None:
            return None
        return L2Read(tenant, digest_hex, key, memo, breaker, futures)

    def finish_read(self, read: L2Read) -> bytes | None:
        """What :meth:`get` returns, for a :meth:`begin_read` whose futures are all done."""
        futures = read.futures
        try:
            # an error reply is its future's exception (resp._Wire): result() raises it
            value = futures[0].result()
            fence = futures[1].result() if len(futures) > 1 else ()
        except Exception as exc:  # a cache fault must never fail a request
            resp.abandon(futures)
            self._fault(read.breaker, exc)
            return None
        self._succeeded(read.breaker)
        memo = read.memo
        return self._judge(
            read.tenant, read.digest_hex, read.key, memo.vector, memo, [value, fence], True
        )

    def _judge(
        self,
        tenant: str,
        digest_hex: str,
        key: str,
        vector: EpochVector,
        memo: _ReadMemo,
        replies: list[Any],
        fenced: bool,
    ) -> bytes | None:
        """The verdict on a versioned read's replies (``memo``: the tenant's under
        ``vector``), counted; the entry of a hit."""
        head = memo.head
        try:
            fence = replies[1] if fenced else ()
            # memo.vector == vector (_read_memo): a fence reply judged once stays judged
            if fence == memo.fence_seen:
                verdict = judge_entry(replies[0], head)
            else:
                verdict = judge_versioned_read(replies[0], fence, vector, head)
                if verdict != READ_BEHIND:
                    memo.fence_seen = fence
        except (TypeError, ValueError, AttributeError):
            self.counters.errors += 1
            return None
        if type(verdict) is bytes:
            self.counters.hits += 1
            self._touched(tenant, key)
            return verdict
        if verdict == READ_BEHIND:
            self.counters.stale_refused += 1
            if self.on_behind is not None:
                self.on_behind()
            return None
        self.counters.misses += 1
        if verdict == READ_STALE_ENTRY:
            keys = l2_keys(self.cache, tenant, digest_hex)
            self._spawn(self._run(_FORGET_STALE, keys, (head,)))
            return CORRUPT
        return None

    # ------------------------------------------------------------- LRU touches

    def _touched(self, tenant: str, key: str) -> None:
        """Hold a hit's LRU touch; sent with the tenant's others (docs/redis-protocol.md)."""
        keys = self._touches.get(tenant)
        if keys is None:
            keys = self._touches[tenant] = {}
        else:
            keys.pop(key, None)
        keys[key] = None
        if len(keys) >= L2_TOUCH_BATCH:
            self._spawn(self._send_touches(tenant))
        elif self._touch_timer is None:
            self._touch_timer = asyncio.get_running_loop().call_later(
                L2_TOUCH_INTERVAL_S, self._touch_timer_fired
            )

    def _touch_timer_fired(self) -> None:
        self._touch_timer = None
        if self._touches:
            self._spawn(self._send_touches())

    async def _send_touches(self, tenant: str | None = None) -> None:
        """Send the held touches of ``tenant`` (of every tenant when None); never raises."""
        if tenant is None:
            batches, self._touches = self._touches, {}
        else:
            held = self._touches.pop(tenant, None)
            batches = {tenant: held} if held else {}
        for name, held in batches.items():
            lru = [lru_key(self.cache, name)]
            members = list(held)
            for i in range(0, len(members), L2_TOUCH_BATCH):
                await self._run(_TOUCH, lru, members[i : i + L2_TOUCH_BATCH])

    def _spawn(self, work: Awaitable[Any]) -> None:
        """Run ``work`` in the background, kept referenced until done."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _versioned_keys(self, tenant: str, digest_hex: str) -> list[str]:
        """:func:`l2_versioned_keys`, the tenant's part computed once."""
        tail = self._tails.get(tenant)
        if tail is None:
            if len(self._tails) >= MEMO_LIMIT:
                self._tails.clear()
            tail = self._tails[tenant] = l2_versioned_keys(self.cache, tenant, "")[1:]
        return [entry_key(self.cache, tenant, digest_hex), *tail]

    def _args_of(self, vector: EpochVector) -> list[str]:
        """:func:`vector_args` of ``vector``, computed once per vector."""
        args = self._vector_args.get(vector)
        if args is None:
            if len(self._vector_args) >= MEMO_LIMIT:
                self._vector_args.clear()
            args = self._vector_args[vector] = vector_args(vector)
        return args

    def forget_registrations(self) -> None:
        """Register every tenant again before its next versioned write."""
        self._registered.clear()

    async def put(
        self,
        tenant: str,
        digest_hex: str,
        value: bytes,
        vector: EpochVector | None = None,
        *,
        l1_id: int | None = None,
        ttl_s: float | None = None,
    ) -> bool:
        """Store ``value``; False when the quota, the fence, the breaker or an error refused it.

        With ``vector`` the write is versioned (see :meth:`get`); the tenant is
        registered for invalidation fencing first. ``l1_id`` (the writer's L1
        key) is stored with a versioned entry, for warm-ups (:meth:`recent`). The
        key expires after ``ttl_s`` (the tenant's TTL left to the entry) or the L2
        TTL, whichever is sooner.
        """
        versioned = vector is not None
        if versioned and l1_id is not None:
            value = l1_id_line(l1_id) + value
        keys = (
            self._versioned_keys(tenant, digest_hex)
            if versioned
            else l2_keys(self.cache, tenant, digest_hex)
        )
        args: list[Any] = [
            value,
            max(1, int(min(self.ttl_s, math.inf if ttl_s is None else ttl_s) * 1000)),
            self.default_limit_bytes,
            self.max_evict,
        ]
        if vector is not None:
            args += self._args_of(vector)

        registering = versioned and tenant not in self._registered
        if registering and not await self._registered_once(tenant, keys[0]):
            return False

        if tenant in self._touches:  # this sidecar's own eviction sees its own reads
            await self._send_touches(tenant)
        reply = await self._run(_PUT_V if versioned else _PUT, keys, args)
        if reply is FAILED:
            return False
        try:
            status, evicted, reclaimed = _ints3(reply)
        except (TypeError, ValueError):
            self.counters.errors += 1
            return False
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

    async def _registered_once(self, tenant: str, data_key: str) -> bool:
        """:meth:`_register` ``tenant`` once however many first writes wait for it.

        Each would otherwise register on its own set-up connection and write in
        the order those finished, not the order the answers came in, so the
        tenant's LRU (what a warm-up reads as "most recent") would start out of
        order. The waiters resume in the order they came: their writes go out
        in that order on the pipelined client.
        """
        pending = self._registering.get(tenant)
        if pending is None:
            pending = asyncio.ensure_future(self._register(tenant, data_key))
            self._registering[tenant] = pending
            pending.add_done_callback(lambda _: self._registering.pop(tenant, None))
            self._tasks.add(pending)  # cancelled by aclose like the other background work
            pending.add_done_callback(self._tasks.discard)
        return await asyncio.shield(pending)  # one waiter cancelled cancels not the others'

    async def _register(self, tenant: str, data_key: str) -> bool:
        """Register ``tenant`` for fencing (once per tenant, off the request path); known
        as registered before its waiters resume."""
        setup = self._setup
        if setup is None:
            return False
        breaker = self.breaker_for(self._client.address_for(data_key))
        if not breaker.allow():
            self.counters.short_circuited += 1
            return False
        try:
            # a few round trips to two slots, so it gets a longer bound
            async with asyncio.timeout(DEFAULT_REGISTER_TIMEOUT_S):
                await register_tenant(setup, self.cache, tenant)
        except Exception as exc:  # a cache fault must never fail a request
            self.counters.errors += 1
            self._fail(breaker, f"register {tenant}: {type(exc).__name__}: {exc}")
            return False
        breaker.success()
        self._registered.add(tenant)
        return True

    @property
    def _limit_timeout_s(self) -> float:
        # a batch of evictions is more than one lookup: off the request path, so a longer bound
        return max(self.op_timeout_s, DEFAULT_REGISTER_TIMEOUT_S)

    async def set_limit(
        self, tenant: str, l2_bytes: int, *, guest_max_share: float | None = None
    ) -> bool:
        """Set the tenant's limit (0 = the default limit); False if Redis refused.

        A lowered limit takes effect at once: the tenant's expired and least
        recently used entries go until its bytes fit (in bounded script calls,
        at most :data:`SET_LIMIT_MAX_CALLS` of :data:`SET_LIMIT_BATCH` entries).
        ``guest_max_share`` (the guests' pool only) is stored with the limit: the
        fraction of it one guest may hold (None: ``contract.lua.DEFAULT_GUEST_MAX_SHARE``).
        """
        keys = l2_meta_keys(self.cache, tenant)
        share = "" if guest_max_share is None else repr(float(guest_max_share))
        args = (max(0, int(l2_bytes)), self.default_limit_bytes, SET_LIMIT_BATCH, share)
        if tenant in self._touches:
            await self._send_touches(tenant)
        for _ in range(SET_LIMIT_MAX_CALLS):
            reply = await self._run(_SET_LIMIT, keys, args, self._limit_timeout_s)
            if reply is FAILED:
                return False
            try:
                evicted, reclaimed, over = _ints3(reply)
            except (TypeError, ValueError):
                self.counters.errors += 1
                return False
            self.counters.evictions += evicted
            self.counters.reclaimed_expired += reclaimed
            if over <= 0:
                return True
        return True

    async def usage(self, tenant: str) -> tuple[int, int]:
        """(bytes used, limit in force) of ``tenant``; (0, 0) when Redis is unavailable.

        Reclaims up to ``max_evict`` expired entries first, so the bytes of
        expired entries do not linger in the count.
        """
        keys = l2_meta_keys(self.cache, tenant)
        reply = await self._run(_USAGE, keys, (self.default_limit_bytes, self.max_evict))
        if reply is FAILED:
            return (0, 0)
        try:
            used, limit, reclaimed = _ints3(reply)
        except (TypeError, ValueError):
            self.counters.errors += 1
            return (0, 0)
        self.counters.reclaimed_expired += reclaimed
        return (used, limit)

    async def ping(self) -> bool:
        """One bounded PING that goes through the breaker (readiness probes)."""
        return bool(await self._call(None, ("PING",)) == b"PONG")

    def families(self) -> Iterator[Metric]:
        """The tier's state and counters, read at scrape time."""
        cache, counters = self.cache, self.counters
        up = GaugeMetricFamily(
            "cachefleet_redis_up", "1 while the L2 Redis answers.", labels=["cache"]
        )
        up.add_metric([cache], 1.0 if self.state == "ok" else 0.0)
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

    async def aclose(self) -> None:
        """Send the held LRU touches, then close the clients' connections (idempotent)."""
        if self._touch_timer is not None:
            self._touch_timer.cancel()
            self._touch_timer = None
        if self._touches:
            await self._send_touches()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._client.aclose()
        if self._setup is not None:
            try:
                await self._setup.aclose()
            except (RedisError, OSError) as exc:
                log.debug("closing the L2 set-up client: %s", exc)

    async def __aenter__(self) -> RedisL2:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()
