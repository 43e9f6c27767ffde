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
bounded by ``op_timeout_s``, and a :class:`CircuitBreaker` *per Redis node*
stops calling a node after ``failure_threshold`` consecutive failures on it,
so once a node is known to be down an operation on its tenants returns at
once (``get`` -> None, ``put`` -> False) while the other nodes of a cluster
keep serving (their successes do not reset the dead node's breaker). After
``cooldown_s`` one probe is let through; when it succeeds the node is back
without a new object (the client reconnects by itself). Making a connection
is not an operation's cost: it runs in the background (eagerly at
:meth:`RedisL2.connect`), and an operation whose budget runs out while its
connection is still being made is a miss that does not count against the
breaker.

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
import enum
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, NamedTuple

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
    GUESTS,
    entry_key,
    l2_keys,
    l2_meta_keys,
    l2_versioned_keys,
    lru_key,
    own_lru_key,
    tenant_epochs_key,
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
from cachefleet_common.epochs import EpochVector, parse_epochs

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
#: Consecutive failures that open the breaker.
DEFAULT_FAILURE_THRESHOLD = 3
#: How long an open breaker refuses calls before letting one probe through, s.
DEFAULT_COOLDOWN_S = 1.0
#: Socket connect timeout of the registration client, seconds (the op timeout bounds it too).
DEFAULT_CONNECT_TIMEOUT_S = 0.25
#: Upper bound of making one hot-path connection (TCP, TLS, AUTH), in the background, s.
DEFAULT_SETUP_TIMEOUT_S = 2.0

#: What a versioned read returns for a stored value that is not an entry of
#: the reader's epochs (it is dropped from Redis): no entry is empty, so the
#: caller's decoder treats it as a corrupt entry.
CORRUPT: Final = b""

State = Literal["ok", "degraded", "down"]


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

    def neither(self) -> None:
        """The call said nothing about the node (still connecting): a probe may go again."""
        self._probing = False

    def copy(self) -> CircuitBreaker:
        """A fresh breaker with the same settings (one per Redis node)."""
        return CircuitBreaker(self.failure_threshold, self.cooldown_s, self._clock)


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
    #: Operations whose budget ran out while their connection was still being made.
    not_ready: int = 0
    #: Reads and writes refused because their epochs were behind the fence.
    stale_refused: int = 0


class _Failed(enum.Enum):
    """Marks an operation the breaker, the timeout or an error cut short."""

    FAILED = "failed"


_FAILED: Final = _Failed.FAILED


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


#: Most bytes of values one warm-up read asks for at once (one ``MGET``).
WARM_BATCH_BYTES = 1024 * 1024
#: Most values one warm-up read asks for at once.
WARM_BATCH_ENTRIES = 64


class Recent(NamedTuple):
    """What :meth:`RedisL2.recent` / :meth:`RedisL2.recent_guests` read for a warm-up."""

    #: (digest, value) or, for the guests' pool, (guest, digest, value); most recent first.
    values: list[Any]
    #: The fence the values are judged against.
    fence: dict[str, int]
    #: Entries not read because they did not fit in what was left of the budget.
    unread: int


def plan_reads(
    lengths: Sequence[int],
    budget_bytes: int,
    *,
    batch_bytes: int = WARM_BATCH_BYTES,
    batch_entries: int = WARM_BATCH_ENTRIES,
) -> tuple[list[list[int]], int]:
    """Which values to read, by index into ``lengths`` (most recent first), in batches.

    A value is read when it fits in what is left of ``budget_bytes`` (one that does not
    is skipped, a smaller one after it may still fit); a gone value (length 0) is not
    read. A batch holds at most ``batch_entries`` values and ``batch_bytes`` bytes (a
    larger value goes alone). Returns (the batches, how many values were left unread
    for the budget). Pure.
    """
    batches: list[list[int]] = []
    batch: list[int] = []
    in_batch = 0
    left = budget_bytes
    unread = 0
    for i, length in enumerate(lengths):
        if length <= 0:
            continue
        if length > left:
            unread += 1
            continue
        left -= length
        if batch and (len(batch) >= batch_entries or in_batch + length > batch_bytes):
            batches.append(batch)
            batch, in_batch = [], 0
        batch.append(i)
        in_batch += length
    if batch:
        batches.append(batch)
    return batches, unread


def _raise_errors(replies: Sequence[Any]) -> None:
    for reply in replies:
        if isinstance(reply, resp.ReplyError):
            raise reply


class RedisL2:
    """Per-tenant byte-bounded response cache in Redis for one InferenceCache.

    ``client`` runs the scripts; ``setup`` (redis-py, same Redis) registers
    tenants for invalidation fencing. ``breaker`` is the template of the
    per-node breakers (the first node uses that very object).
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
        self._client = client
        self._setup = setup
        self.cache = cache
        self.op_timeout_s = op_timeout_s
        self.ttl_s = ttl_s
        self.default_limit_bytes = default_limit_bytes
        self.max_evict = max_evict
        first = breaker if breaker is not None else CircuitBreaker()
        self._breakers: dict[resp.Address, CircuitBreaker] = {client.address_for(None): first}
        self.counters = L2Counters()
        self._last_error: str | None = None
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

    # ----------------------------------------------------------------- state

    @property
    def breaker(self) -> CircuitBreaker:
        """The breaker of the first node (the only one of a standalone Redis)."""
        return self._breakers[self._client.address_for(None)]

    def breaker_for(self, address: resp.Address) -> CircuitBreaker:
        """The breaker of the node at ``address`` (made on first use)."""
        breaker = self._breakers.get(address)
        if breaker is None:
            breaker = self._breakers[address] = self.breaker.copy()
        return breaker

    def node_states(self) -> dict[str, str]:
        """``host:port`` -> breaker state of every node this tier has used."""
        return {f"{h}:{p}": b.state for (h, p), b in sorted(self._breakers.items())}

    @property
    def state(self) -> State:
        """``down`` while every node's breaker is open, ``degraded`` after recent failures."""
        states = [b.state for b in self._breakers.values()]
        if all(state == "open" for state in states):
            return "down"
        if any(
            state != "closed" or b.consecutive_failures
            for state, b in zip(states, self._breakers.values(), strict=True)
        ):
            return "degraded"
        return "ok"

    @property
    def last_error(self) -> str | None:
        return self._last_error

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
            if raw is _FAILED:
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
        if reply is _FAILED:
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
            if reply is _FAILED:
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
        if reply is _FAILED:
            return (0, 0)
        try:
            used, limit, reclaimed = _ints3(reply)
        except (TypeError, ValueError):
            self.counters.errors += 1
            return (0, 0)
        self.counters.reclaimed_expired += reclaimed
        return (used, limit)

    async def recent(
        self, tenant: str, limit: int, timeout_s: float, budget_bytes: int
    ) -> Recent | None:
        """``tenant``'s ``limit`` most recently used (digest, stored value) that fit in
        ``budget_bytes``, most recent first, and its fence; None on any fault.

        For warm-ups (:mod:`cachefleet_sidecar.control.warm`), which judge each value as
        a read would; off the request path, so ``timeout_s`` bounds it, not the
        per-operation budget. The values are read in batches (:func:`plan_reads`), never
        more than ``budget_bytes`` in all, all on the tenant's one slot. The LRU order is
        as of the last batched touches.
        """
        lru = own_lru_key(self.cache, tenant)  # a guest's own entries, not the whole pool's
        got = await self._recent(
            lru, tenant_epochs_key(self.cache, tenant), limit, timeout_s, budget_bytes
        )
        if got is None:
            return None
        names, values, fence, unread = got
        out = [
            (name.rpartition(b":e:")[2].decode(), v) for name, v in zip(names, values, strict=True)
        ]
        return Recent(out, fence, unread)

    async def recent_guests(self, limit: int, timeout_s: float, budget_bytes: int) -> Recent | None:
        """The guests' pool's ``limit`` most recently used (guest, digest, stored value)
        within ``budget_bytes``, most recent first, and the guests' fence; None on any
        fault. As :meth:`recent`, on the pool's one slot (a guest is its plain name, not
        :func:`guest`'s)."""
        got = await self._recent(
            lru_key(self.cache, GUESTS),
            tenant_epochs_key(self.cache, GUESTS),
            limit,
            timeout_s,
            budget_bytes,
        )
        if got is None:
            return None
        names, values, fence, unread = got
        out: list[tuple[str, str, bytes | None]] = []
        for name, value in zip(names, values, strict=True):
            scope, _, digest = name.decode().rpartition(":e:")
            owner = scope.rpartition(":g:")[2]
            if owner and digest:
                out.append((owner, digest, value))
        return Recent(out, fence, unread)

    async def _recent(
        self, lru: str, fence_key: str, limit: int, timeout_s: float, budget_bytes: int
    ) -> tuple[list[bytes], list[bytes | None], dict[str, int], int] | None:
        """(the ``limit`` most recent members of ``lru`` read, most recent first, their
        values, the fence at ``fence_key``, how many were left unread for the budget) on
        ``lru``'s slot: the members, then each value's length, then the values in
        :func:`plan_reads`' batches, the fence read after the last (as a read reads it
        after its value); a gone member comes last, with None. None on a fault."""
        breaker = self.breaker_for(self._client.address_for(lru))
        if limit <= 0 or not breaker.allow():
            return None
        try:
            async with asyncio.timeout(timeout_s):
                members = await self._client.execute(
                    "ZRANGE", lru, -limit, -1, key=lru, timeout_s=timeout_s
                )
                names = [bytes(m) for m in reversed(members)]
                lengths: list[int] = []
                if names:
                    strlen = [resp.pack_command(("STRLEN", name)) for name in names]
                    replies = await self._client.pipeline(lru, strlen, timeout_s=timeout_s)
                    _raise_errors(replies)
                    lengths = [int(n) for n in replies]
                batches, unread = plan_reads(lengths, budget_bytes)
                read: list[bytes] = []
                values: list[bytes | None] = []
                fence_command = resp.pack_command(("HGETALL", fence_key))
                for n, batch in enumerate(batches):
                    chosen = [names[i] for i in batch]
                    commands = [resp.pack_command(("MGET", *chosen))]
                    if n == len(batches) - 1:
                        commands.append(fence_command)
                    replies = await self._client.pipeline(lru, commands, timeout_s=timeout_s)
                    _raise_errors(replies)
                    read += chosen
                    values += [None if v is None else bytes(v) for v in replies[0]]
                if not batches:
                    replies = await self._client.pipeline(lru, [fence_command], timeout_s=timeout_s)
                    _raise_errors(replies)
                flat = replies[-1]
        except Exception as exc:  # a cache fault never fails a warm-up: it ends it
            self._fault(breaker, exc)
            return None
        self._succeeded(breaker)
        gone = [names[i] for i, length in enumerate(lengths) if length <= 0]
        fence = parse_epochs(dict(zip(flat[::2], flat[1::2], strict=True)))
        return read + gone, values + [None] * len(gone), fence, unread

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

    # --------------------------------------------------------------- guards

    @property
    def _limit_timeout_s(self) -> float:
        # a batch of evictions is more than one lookup: off the request path, so a longer bound
        return max(self.op_timeout_s, DEFAULT_REGISTER_TIMEOUT_S)

    async def _run(
        self,
        script: resp.Script,
        keys: list[str],
        args: Sequence[Any],
        timeout_s: float | None = None,
        *,
        packed: bytes | None = None,
    ) -> Any | Literal[_Failed.FAILED]:
        """Run ``script`` on its keys' node through that node's breaker; never raises.

        ``packed`` is the whole command when the caller has packed it already
        (:func:`resp.pack_script`); ``keys`` then needs only the first key.
        """
        breaker = self.breaker_for(self._client.address_for(keys[0]))
        if not breaker.allow():
            self.counters.short_circuited += 1
            return _FAILED
        try:
            if packed is None:
                reply = await self._client.run_script(
                    script, keys, args, timeout_s=timeout_s or self.op_timeout_s
                )
            else:
                reply = await self._client.run_packed(
                    script, keys[0], packed, timeout_s=timeout_s or self.op_timeout_s
                )
        except Exception as exc:  # a cache fault must never fail a request
            return self._fault(breaker, exc)
        self._succeeded(breaker)
        return reply

    async def _call(self, key: str | None, args: tuple[Any, ...]) -> Any:
        """One plain command on ``key``'s node through its breaker; _FAILED on any fault."""
        breaker = self.breaker_for(self._client.address_for(key))
        if not breaker.allow():
            self.counters.short_circuited += 1
            return _FAILED
        try:
            reply = await self._client.execute(*args, key=key, timeout_s=self.op_timeout_s)
        except Exception as exc:  # a cache fault must never fail a request
            return self._fault(breaker, exc)
        self._succeeded(breaker)
        return reply

    def _succeeded(self, breaker: CircuitBreaker) -> None:
        if breaker.state != "closed":
            log.info("L2 %s: Redis answers again", self.cache)
        breaker.success()

    def _fault(self, breaker: CircuitBreaker, exc: Exception) -> Literal[_Failed.FAILED]:
        if isinstance(exc, resp.NotReady):
            # Connection set-up is not the operation's cost: a miss, not a node failure.
            self.counters.not_ready += 1
            breaker.neither()
            return _FAILED
        if isinstance(exc, resp.CommandTimeout):
            self.counters.timeouts += 1
            self._fail(breaker, "timeout")
            return _FAILED
        # ReplyError, ConnectionLost, or a reply of an unexpected shape.
        self.counters.errors += 1
        self._fail(breaker, f"{type(exc).__name__}: {exc}")
        return _FAILED

    def _fail(self, breaker: CircuitBreaker, reason: str) -> None:
        was_open = breaker.state != "closed"
        breaker.failure()
        if self._last_error is None or not was_open:
            log.warning("L2 %s: %s (state %s)", self.cache, reason, self.state)
        self._last_error = reason
