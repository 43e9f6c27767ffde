"""A lean asyncio RESP2 client for the sidecar's hot Redis paths (L2 scripts, acks, pub/sub).

redis-py spends several times a loopback round trip in Python per command,
so on the data path it, not Redis, would set the latency. This client does
the least that the data path needs, on the caller's own event loop:

* **One connection per Redis node, pipelined.** Concurrent callers' commands
  are encoded with ``hiredis.pack_command``, queued and written together once
  per loop iteration (a command on an idle connection goes out at once);
  replies are parsed by ``hiredis.Reader`` and matched to the callers in
  order (RESP answers in order on one connection).
* **Deadlines, not cancellation.** Every command carries a deadline; when it
  passes, the caller gets :class:`CommandTimeout` and the reply, if it still
  comes, is dropped. One timer per connection, at the earliest deadline of
  its waiting commands, enforces them (not a timer per command). A connection
  that stays silent with commands waiting for :data:`STALL_S` is dropped and
  made again.
* **Connection set-up is not a command's cost.** Connecting (TCP, TLS, AUTH,
  SELECT) runs as its own task: a command waits for it within its deadline
  only, and a deadline that passes while the connection is still being made
  raises :class:`NotReady` (the caller may treat it as "not yet", not as a
  dead node); the connection keeps being made. Failed attempts back off
  exponentially (:data:`RECONNECT_BACKOFF_MIN_S` .. :data:`RECONNECT_BACKOFF_MAX_S`);
  a lost connection is made again in the background a bounded number of times
  (:data:`BACKGROUND_RECONNECTS`), after that on demand.
* **Scripts** run by ``EVALSHA``; a ``NOSCRIPT`` reply (Redis restarted,
  ``SCRIPT FLUSH``) loads the script with ``SCRIPT LOAD`` and runs it again.
* **Redis Cluster**: the slot map comes from ``CLUSTER SHARDS`` (``CLUSTER
  SLOTS`` on servers without it); ``MOVED`` updates the map and retries on
  the named node, ``ASK`` retries there once after ``ASKING``; a ``MOVED`` or
  a lost node makes the map be read again in the background. Keyed commands
  go to the node of their first key's slot (callers keep a script's keys in
  one slot with a hashtag).
* **Pub/sub**: :class:`Subscriber` is a dedicated connection in subscribed
  mode that delivers messages to a callback and re-subscribes after a
  reconnect.

Errors form one hierarchy under :class:`RespError`: :class:`ReplyError` (Redis
answered with an error), :class:`ConnectionLost` (no connection),
:class:`NotReady` (still connecting), :class:`CommandTimeout`. The client does
not know what a cache is; the L2 tier turns every error into a cache fault.

The client knows nothing of cachefleet's keys or URLs: callers pass a
:class:`NodeSettings` (see :func:`cachefleet_common.contract.clients.resp_client`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import ssl
from binascii import crc_hqx
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final, cast

import hiredis

log = logging.getLogger(__name__)

#: Upper bound of making one connection (TCP + TLS + AUTH + SELECT), seconds.
DEFAULT_CONNECT_TIMEOUT_S = 2.0
#: Deadline of a command when the caller gives none, seconds.
DEFAULT_COMMAND_TIMEOUT_S = 1.0
#: First and largest pause between failed connection attempts to one node, seconds.
RECONNECT_BACKOFF_MIN_S = 0.05
RECONNECT_BACKOFF_MAX_S = 1.0
#: Attempts to make a lost connection again in the background before waiting for demand.
BACKGROUND_RECONNECTS = 8
#: A connection with commands waiting and no byte received for this long is dropped, s.
STALL_S = 1.0
#: Most MOVED / ASK redirections one command follows.
MAX_REDIRECTS = 5
#: Shortest pause between two reads of a cluster's slot map, seconds.
SLOT_REFRESH_MIN_GAP_S = 0.2
#: Number of hash slots of a Redis Cluster.
SLOTS: Final = 16384

Address = tuple[str, int]

#: hiredis's command encoder: a tuple of arguments -> one RESP command (its stubs type
#: the argument as a 1-tuple).
pack_command = cast(Callable[[tuple[Any, ...]], bytes], hiredis.pack_command)
_pack = pack_command


class RespError(Exception):
    """Anything that went wrong talking to Redis."""


class ReplyError(RespError):
    """Redis answered with an error reply (the message is Redis's own)."""

    @property
    def code(self) -> str:
        """The error's first word (``NOSCRIPT``, ``MOVED``, ``ASK``, ``ERR`` ...)."""
        return str(self).split(" ", 1)[0]


class ConnectionLost(RespError, ConnectionError):
    """No usable connection to the node (refused, closed, reset, failed handshake)."""


class NotReady(ConnectionLost):
    """The command's deadline passed while its connection was still being made."""


class CommandTimeout(RespError, TimeoutError):
    """No reply before the command's deadline."""


@dataclass(frozen=True)
class NodeSettings:
    """How to reach and log in to a Redis node (the host and port vary per node)."""

    host: str
    port: int
    username: str | None = None
    password: str | None = None
    db: int = 0
    #: TLS context (``rediss://``); None for plain TCP.
    ssl_context: ssl.SSLContext | None = None
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S

    @property
    def address(self) -> Address:
        return (self.host, self.port)

    def at(self, address: Address) -> NodeSettings:
        """The same credentials for another node (a cluster peer)."""
        return replace(self, host=address[0], port=address[1])


def tls_context(ca_file: str | None) -> ssl.SSLContext:
    """A client TLS context that verifies the server against ``ca_file`` (or the system CAs)."""
    return ssl.create_default_context(cafile=ca_file)


class Script:
    """A Lua script run by EVALSHA (its SHA-1 computed once)."""

    __slots__ = ("sha", "source")

    def __init__(self, source: str) -> None:
        self.source = source.encode()
        self.sha = hashlib.sha1(self.source).hexdigest().encode()


#: Part of a command packed once for many calls: (number of arguments, their RESP bulk strings).
PackedArgs = tuple[int, bytes]


def pack_args(items: Sequence[Any]) -> PackedArgs:
    """``items`` as RESP bulk strings without the array header (see :func:`pack_script`)."""
    packed = _pack(tuple(items))
    return len(items), packed[packed.index(b"\r\n") + 2 :]


def pack_script(script: Script, nkeys: int, key: str, rest: PackedArgs) -> bytes:
    """``EVALSHA sha nkeys key *rest``: the keys after the first and the arguments packed once.

    The same bytes as packing the whole command, for less work on a hot path
    where only ``key`` changes from call to call.
    """
    k = key.encode()
    n = b"%d" % nkeys
    return b"*%d\r\n$7\r\nEVALSHA\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n%s" % (
        rest[0] + 4,
        len(script.sha),
        script.sha,
        len(n),
        n,
        len(k),
        k,
        rest[1],
    )


def key_slot(key: str | bytes) -> int:
    """The cluster hash slot of ``key`` (CRC16/XMODEM of its hashtag, or of the whole key)."""
    raw = key.encode() if isinstance(key, str) else key
    start = raw.find(b"{")
    if start >= 0:
        end = raw.find(b"}", start + 1)
        if end > start + 1:
            raw = raw[start + 1 : end]
    return crc_hqx(raw, 0) % SLOTS


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def abandon(futures: list[Any]) -> None:
    """Nobody will read these replies: keep their errors from being logged as unread."""
    for future in futures:
        future.add_done_callback(_retrieve)


async def _replies(futures: list[Any]) -> list[Any]:
    """The replies of commands sent together; an error reply is its item, other faults raise."""
    out: list[Any] = []
    for i, future in enumerate(futures):
        try:
            out.append(await future)
        except ReplyError as exc:
            out.append(exc)
        except BaseException:
            abandon(futures[i + 1 :])
            raise
    return out


# ----------------------------------------------------------------- connection


class _Wire(asyncio.Protocol):
    """One socket: batched writes, in-order replies, optional push delivery."""

    def __init__(self, node: Node) -> None:
        self._node = node
        self._loop = asyncio.get_running_loop()
        self._reader = hiredis.Reader()
        self.transport: asyncio.Transport | None = None
        self.pending: deque[asyncio.Future[Any]] = deque()
        #: the deadline (loop time) of each pending command, in the same order
        self._due: deque[float] = deque()
        #: one timer per connection, at the earliest deadline of a pending command (a timer
        #: per command costs more than the rest of the command's bookkeeping together)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._out: list[bytes] = []
        self._flush_scheduled = False
        #: loop time of the last byte received, or of the send that found nothing pending
        self.progress_at = self._loop.time()
        #: called with every reply that no command waits for (subscribed mode)
        self.push: Callable[[Any], None] | None = None
        self.closed = False
        self.lost = self._loop.create_future()

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.progress_at = self._loop.time()
        reader = self._reader
        reader.feed(data)
        pending = self.pending
        while True:
            try:
                reply = reader.gets()
            except hiredis.ProtocolError as exc:
                self.abort(f"protocol error: {exc}")
                return
            if reply is False:
                return
            if not pending:
                if self.push is not None:
                    self.push(reply)
                continue
            future = pending.popleft()
            self._due.popleft()
            if future.done():  # its deadline passed: nobody waits for this reply
                continue
            if isinstance(reply, hiredis.ReplyError):
                future.set_exception(ReplyError(str(reply)))
            else:
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._teardown(f": {exc}" if exc else "")

    def _teardown(self, why: str) -> None:
        """Fail whatever waits and tell the node (once, however the connection ended)."""
        if self.closed:
            return
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        reason = f"connection to {self._node.name} lost{why}"
        self._due.clear()
        while self.pending:
            future = self.pending.popleft()
            if not future.done():
                future.set_exception(ConnectionLost(reason))
        if not self.lost.done():
            self.lost.set_result(None)
        self._node._lost(self)

    # sending
    def send(self, packed: bytes, deadline: float = math.inf) -> asyncio.Future[Any]:
        """Queue a command; its future fails with CommandTimeout at ``deadline`` (loop time)."""
        if self.closed:
            raise ConnectionLost(f"connection to {self._node.name} lost")
        future: asyncio.Future[Any] = self._loop.create_future()
        if deadline < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = deadline
            self._timer = self._loop.call_at(deadline, self._expire)
        if not self.pending:
            self.progress_at = self._loop.time()
            if not self._flush_scheduled and self.transport is not None:
                # An idle connection (c=1): out now, no loop iteration of delay. Under
                # load replies are outstanding, and commands are gathered into one write.
                self.pending.append(future)
                self._due.append(deadline)
                self._node.writes += 1
                self.transport.write(packed)
                return future
        self.pending.append(future)
        self._due.append(deadline)
        self.write(packed)
        return future

    def send_many(self, packed: bytes, n: int, deadline: float = math.inf) -> list[Any]:
        """Queue ``n`` commands packed together, in one write: a future per reply, in order."""
        if self.closed:
            raise ConnectionLost(f"connection to {self._node.name} lost")
        create = self._loop.create_future
        # a versioned L2 read is two commands: no comprehension for them
        futures = [create(), create()] if n == 2 else [create() for _ in range(n)]
        if deadline < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = deadline
            self._timer = self._loop.call_at(deadline, self._expire)
        pending = self.pending
        idle = not pending
        pending.extend(futures)
        self._due.extend((deadline,) * n)
        if idle:
            self.progress_at = self._loop.time()
            if not self._flush_scheduled and self.transport is not None:
                self._node.writes += 1
                self.transport.write(packed)
                return futures
        self.write(packed)
        return futures

    def _expire(self) -> None:
        """Fail the commands whose deadline has passed; drop the connection if it stalled."""
        self._timer = None
        self._timer_at = math.inf
        if self.closed:
            return
        now = self._loop.time()
        expired = False
        next_at = math.inf
        for future, due in zip(self.pending, self._due, strict=True):
            if future.done():
                continue
            if due <= now:
                future.set_exception(CommandTimeout(self._node.name))
                expired = True
            elif due < next_at:
                next_at = due
        if expired and self.stalled(now):
            self._node.stalls += 1
            self.abort(f"no reply for {STALL_S:g}s")
            return
        if next_at < math.inf:
            self._timer_at = next_at
            self._timer = self._loop.call_at(next_at, self._expire)

    def write(self, packed: bytes) -> None:
        """Queue bytes; everything queued in one loop iteration goes out in one write."""
        self._out.append(packed)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        out, self._out = self._out, []
        if self.transport is not None and not self.closed and out:
            self._node.writes += 1
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    def stalled(self, now: float) -> bool:
        return bool(self.pending) and now - self.progress_at > STALL_S

    def abort(self, reason: str) -> None:
        if self.closed:
            return
        log.info("Redis %s: dropping the connection (%s)", self._node.name, reason)
        self._teardown(f" ({reason})")
        if self.transport is not None:
            self.transport.abort()


class Node:
    """One pipelined connection to one Redis node, made again when lost."""

    def __init__(
        self, settings: NodeSettings, *, background_reconnects: int = BACKGROUND_RECONNECTS
    ) -> None:
        self.settings = settings
        self._background_reconnects = background_reconnects
        self.address = settings.address
        self.name = f"{settings.host}:{settings.port}"
        self._wire: _Wire | None = None
        self._connecting: asyncio.Task[_Wire] | None = None
        self._backoff = RECONNECT_BACKOFF_MIN_S
        self._next_attempt_at = 0.0
        self._background_left = background_reconnects
        self._retry_handle: asyncio.TimerHandle | None = None
        self._closed = False
        #: Connections made (the first one included).
        self.connects = 0
        #: Socket writes (concurrent commands share one) and connections dropped as stalled.
        self.writes = 0
        self.stalls = 0
        #: Called with every reply that no command waits for (a subscriber's messages).
        self.push: Callable[[Any], None] | None = None
        #: Called after every new connection is ready (before commands use it).
        self.on_ready: Callable[[_Wire], None] | None = None

    @property
    def connected(self) -> bool:
        return self._wire is not None and not self._wire.closed

    # ------------------------------------------------------------- connecting

    def connect_soon(self) -> asyncio.Task[_Wire] | None:
        """Start making the connection now unless it exists or is being made."""
        if self._closed or self.connected:
            return None
        if self._connecting is None:
            self._connecting = asyncio.get_running_loop().create_task(
                self._connect(), name=f"resp-connect-{self.name}"
            )
            self._connecting.add_done_callback(_retrieve)
        return self._connecting

    async def _connect(self) -> _Wire:
        loop = asyncio.get_running_loop()
        s = self.settings
        wire: _Wire | None = None
        try:
            async with asyncio.timeout(s.connect_timeout_s):
                _, proto = await loop.create_connection(
                    lambda: _Wire(self),
                    s.host,
                    s.port,
                    ssl=s.ssl_context,
                    server_hostname=s.host if s.ssl_context is not None else None,
                )
                wire = proto
                handshake: list[asyncio.Future[Any]] = []
                if s.password is not None:
                    auth = ("AUTH", s.username, s.password) if s.username else ("AUTH", s.password)
                    handshake.append(wire.send(_pack(auth)))
                if s.db:
                    handshake.append(wire.send(_pack(("SELECT", s.db))))
                for future in handshake:
                    await future
        except BaseException as exc:
            if wire is not None:
                wire.push = None
                if wire.transport is not None:
                    wire.transport.abort()
            self._connecting = None
            self._next_attempt_at = loop.time() + self._backoff
            self._backoff = min(self._backoff * 2, RECONNECT_BACKOFF_MAX_S)
            if isinstance(exc, TimeoutError):
                raise ConnectionLost(f"connecting to {self.name}: timed out") from None
            if isinstance(exc, (OSError, ReplyError, ssl.SSLError)):
                raise ConnectionLost(f"connecting to {self.name}: {exc}") from exc
            raise
        self._connecting = None
        self._backoff = RECONNECT_BACKOFF_MIN_S
        self._background_left = self._background_reconnects
        self.connects += 1
        if self._closed:
            assert wire.transport is not None
            wire.transport.close()
            raise ConnectionLost(f"client of {self.name} closed")
        wire.push = self.push
        self._wire = wire
        if self.on_ready is not None:
            self.on_ready(wire)
        return wire

    def _lost(self, wire: _Wire) -> None:
        if self._wire is wire:
            self._wire = None
            if not self._closed and self._background_left > 0:
                self._background_left -= 1
                delay = max(0.0, self._next_attempt_at - asyncio.get_running_loop().time())
                self._retry_handle = asyncio.get_running_loop().call_later(
                    delay, self._background_connect
                )

    def _background_connect(self) -> None:
        self._retry_handle = None
        task = self.connect_soon()
        if task is not None:
            task.add_done_callback(self._after_background)

    def _after_background(self, task: asyncio.Task[_Wire]) -> None:
        if task.cancelled() or task.exception() is None or self._closed:
            return
        if self._background_left > 0:
            self._background_left -= 1
            delay = max(0.0, self._next_attempt_at - asyncio.get_running_loop().time())
            self._retry_handle = asyncio.get_running_loop().call_later(
                delay, self._background_connect
            )

    async def ready(self, deadline: float) -> _Wire:
        """The connection, made now if needed and allowed, within ``deadline`` (loop time)."""
        wire = self._wire
        if wire is not None and not wire.closed:
            return wire
        if self._closed:
            raise ConnectionLost(f"client of {self.name} closed")
        loop = asyncio.get_running_loop()
        task = self._connecting
        if task is None:
            wait = self._next_attempt_at - loop.time()
            if wait > 0:
                raise ConnectionLost(f"{self.name} unreachable; next attempt in {wait:.2f}s")
            task = self.connect_soon()
            assert task is not None
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise NotReady(f"connecting to {self.name}")
        done, _ = await asyncio.wait({task}, timeout=remaining)
        if not done:
            raise NotReady(f"still connecting to {self.name}")
        if task.cancelled():  # the client was closed meanwhile
            raise ConnectionLost(f"client of {self.name} closed")
        return task.result()

    # --------------------------------------------------------------- commands

    async def call(self, packed: bytes, deadline: float) -> Any:
        """Send one packed command and wait for its reply until ``deadline`` (loop time)."""
        wire = self._wire
        if wire is None or wire.closed:
            wire = await self.ready(deadline)
        return await wire.send(packed, deadline)

    async def call_asking(self, packed: bytes, deadline: float) -> Any:
        """``ASKING`` then the command, in one write (an ASK redirection)."""
        wire = self._wire
        if wire is None or wire.closed:
            wire = await self.ready(deadline)
        asking = wire.send(_pack(("ASKING",)))
        asking.add_done_callback(_retrieve)
        return await wire.send(packed, deadline)

    async def call_many(self, packed: bytes, n: int, deadline: float) -> list[Any]:
        """Send ``n`` packed commands in one write; their replies (see :func:`_replies`)."""
        wire = self._wire
        if wire is None or wire.closed:
            wire = await self.ready(deadline)
        return await _replies(wire.send_many(packed, n, deadline))

    async def aclose(self) -> None:
        self._closed = True
        if self._retry_handle is not None:
            self._retry_handle.cancel()
        task, self._connecting = self._connecting, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        wire, self._wire = self._wire, None
        if wire is not None and wire.transport is not None:
            wire.transport.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(wire.lost), 1.0)


# ------------------------------------------------------------------- clients


class RespClient:
    """Commands to a standalone Redis or a Redis Cluster, routed by key.

    ``cluster=False``: every command goes to the one node of ``settings``.
    ``cluster=True``: ``startup`` nodes are asked for the slot map; keyed
    commands go to their slot's node (see the module docstring).
    """

    def __init__(
        self,
        settings: NodeSettings,
        *,
        cluster: bool = False,
        startup: Sequence[Address] = (),
        command_timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S,
    ) -> None:
        self.settings = settings
        self.cluster = cluster
        self.command_timeout_s = command_timeout_s
        self._startup: list[Address] = list(startup) or [settings.address]
        self._nodes: dict[Address, Node] = {}
        self._slots: list[Address | None] = [None] * SLOTS if cluster else []
        self._refreshing: asyncio.Task[bool] | None = None
        self._refreshed_at = -1e9
        self._default = self.node(self._startup[0])
        self._closed = False
        #: Slot-map reads done, MOVED and ASK replies followed, scripts loaded after NOSCRIPT.
        self.refreshes = 0
        self.moved = 0
        self.asked = 0
        self.script_reloads = 0

    # ---------------------------------------------------------------- routing

    def node(self, address: Address) -> Node:
        """The node at ``address`` (made on first use)."""
        node = self._nodes.get(address)
        if node is None:
            node = self._nodes[address] = Node(self.settings.at(address))
        return node

    @property
    def nodes(self) -> list[Node]:
        """Every node known: the one of a standalone server; a cluster's slot owners."""
        if not self.cluster:
            return [self._default]
        owners = {a for a in self._slots if a is not None}
        return [self.node(a) for a in sorted(owners)] if owners else [self._default]

    def address_for(self, key: str | bytes | None) -> Address:
        """The node a command on ``key`` goes to now (the first startup node when unknown)."""
        if not self.cluster or key is None:
            return self._default.address
        owner = self._slots[key_slot(key)]
        return owner if owner is not None else self._default.address

    async def connect(self, timeout_s: float | None = None) -> None:
        """Make the connections (and read a cluster's slot map) now; raises RespError."""
        deadline = self._deadline(timeout_s)
        if self.cluster and not await self._refresh(deadline):
            raise ConnectionLost("no cluster node answered CLUSTER SHARDS")
        for node in self.nodes:
            await node.ready(deadline)

    # --------------------------------------------------------------- commands

    def _deadline(self, timeout_s: float | None) -> float:
        timeout = self.command_timeout_s if timeout_s is None else timeout_s
        return asyncio.get_running_loop().time() + timeout

    async def execute(
        self, *args: Any, key: str | bytes | None = None, timeout_s: float | None = None
    ) -> Any:
        """Run one command (on ``key``'s node) and return its reply; raises RespError."""
        return await self.execute_at(self._deadline(timeout_s), key, _pack(args))

    async def execute_at(self, deadline: float, key: str | bytes | None, packed: bytes) -> Any:
        """Run a packed command by an absolute deadline (loop time), following redirections."""
        if not self.cluster:
            return await self._default.call(packed, deadline)
        node = await self._owner(key, deadline)
        for _ in range(MAX_REDIRECTS):
            try:
                return await node.call(packed, deadline)
            except ReplyError as exc:
                code = exc.code
                if code == "MOVED":
                    slot, address = _redirect(exc)
                    self.moved += 1
                    self._slots[slot] = address
                    self.refresh_soon()
                    node = self.node(address)
                elif code == "ASK":
                    _, address = _redirect(exc)
                    self.asked += 1
                    return await self.node(address).call_asking(packed, deadline)
                else:
                    if code in ("CLUSTERDOWN", "TRYAGAIN"):
                        self.refresh_soon()
                    raise
            except ConnectionLost:
                self.refresh_soon()
                raise
        raise RespError(f"more than {MAX_REDIRECTS} redirections")

    def send_now(self, packed: bytes, n: int, timeout_s: float) -> list[Any] | None:
        """A standalone server's fast path: ``n`` packed commands written on its open connection.

        Their futures (await the last: replies come in order; on a fault call
        :func:`abandon`), or None when that path is not open (a cluster, no
        connection yet): then use :meth:`pipeline`. No coroutine layer between
        the caller and the replies.
        """
        if self.cluster:
            return None
        wire = self._default._wire
        if wire is None or wire.closed:
            return None
        return wire.send_many(packed, n, wire._loop.time() + timeout_s)

    async def pipeline(
        self, key: str | bytes | None, commands: Sequence[bytes], *, timeout_s: float | None = None
    ) -> list[Any]:
        """Packed ``commands`` on ``key``'s node in one write; a reply each, in order.

        A command's error reply is its item (a :class:`ReplyError`), not raised;
        a lost connection or the deadline raise. Every command must be on
        ``key``'s slot: a ``MOVED`` / ``ASK`` of the first sends them all again.
        """
        deadline = self._deadline(timeout_s)
        packed = b"".join(commands)
        n = len(commands)
        if not self.cluster:
            wire = self._default._wire
            if wire is not None and not wire.closed:
                return await _replies(wire.send_many(packed, n, deadline))
            return await self._default.call_many(packed, n, deadline)
        node = await self._owner(key, deadline)
        for _ in range(MAX_REDIRECTS):
            try:
                replies = await node.call_many(packed, n, deadline)
            except ConnectionLost:
                self.refresh_soon()
                raise
            first = replies[0]
            if not isinstance(first, ReplyError):
                return replies
            code = first.code
            if code == "MOVED":
                slot, address = _redirect(first)
                self.moved += 1
                self._slots[slot] = address
                self.refresh_soon()
                node = self.node(address)
                continue
            if code == "ASK":
                _, address = _redirect(first)
                self.asked += 1
                asking = _pack(("ASKING",))
                both = b"".join(asking + command for command in commands)
                return (await self.node(address).call_many(both, 2 * n, deadline))[1::2]
            if code in ("CLUSTERDOWN", "TRYAGAIN"):
                self.refresh_soon()
            return replies
        raise RespError(f"more than {MAX_REDIRECTS} redirections")

    async def run_script(
        self,
        script: Script,
        keys: Sequence[str],
        args: Sequence[Any],
        *,
        timeout_s: float | None = None,
    ) -> Any:
        """EVALSHA ``script``; on NOSCRIPT load it on that node and run it again."""
        packed = _pack((b"EVALSHA", script.sha, len(keys), *keys, *args))
        return await self.run_packed(script, keys[0] if keys else None, packed, timeout_s=timeout_s)

    async def run_packed(
        self, script: Script, key: str | None, packed: bytes, *, timeout_s: float | None = None
    ) -> Any:
        """:meth:`run_script` of a command already packed (:func:`pack_script`) on ``key``."""
        deadline = self._deadline(timeout_s)
        try:
            if not self.cluster:  # no redirections to follow: no coroutine layer between
                wire = self._default._wire
                if wire is not None and not wire.closed:
                    return await wire.send(packed, deadline)
                return await self._default.call(packed, deadline)
            return await self.execute_at(deadline, key, packed)
        except ReplyError as exc:
            if exc.code != "NOSCRIPT":
                raise
        self.script_reloads += 1
        await self.execute_at(deadline, key, _pack((b"SCRIPT", b"LOAD", script.source)))
        return await self.execute_at(deadline, key, packed)

    async def load_scripts(self, scripts: Sequence[Script], timeout_s: float | None = None) -> None:
        """SCRIPT LOAD every script on every node (a warm-up, so the first EVALSHA hits)."""
        deadline = self._deadline(timeout_s)
        for node in self.nodes:
            for script in scripts:
                await node.call(_pack((b"SCRIPT", b"LOAD", script.source)), deadline)

    # --------------------------------------------------------------- slot map

    async def _owner(self, key: str | bytes | None, deadline: float) -> Node:
        if key is None:
            return self._default
        slot = key_slot(key)
        owner = self._slots[slot]
        if owner is None:
            await self._refresh(deadline)
            owner = self._slots[slot]
            if owner is None:
                raise ConnectionLost(f"no node serves slot {slot}")
        return self.node(owner)

    def refresh_soon(self) -> None:
        """Read the slot map again in the background (at most every SLOT_REFRESH_MIN_GAP_S)."""
        if not self.cluster or self._refreshing is not None or self._closed:
            return
        loop = asyncio.get_running_loop()
        if loop.time() - self._refreshed_at < SLOT_REFRESH_MIN_GAP_S:
            return
        self._refreshing = loop.create_task(self._read_map(loop.time() + DEFAULT_COMMAND_TIMEOUT_S))
        self._refreshing.add_done_callback(_retrieve)

    async def _refresh(self, deadline: float) -> bool:
        task = self._refreshing
        if task is None:
            task = self._refreshing = asyncio.get_running_loop().create_task(
                self._read_map(max(deadline, asyncio.get_running_loop().time() + 0.5))
            )
            task.add_done_callback(_retrieve)
        remaining = deadline - asyncio.get_running_loop().time()
        done, _ = await asyncio.wait({task}, timeout=max(remaining, 0.0))
        return bool(done) and not task.cancelled() and task.exception() is None and task.result()

    async def _read_map(self, deadline: float) -> bool:
        try:
            known = [a for a in dict.fromkeys(self._slots) if a is not None]
            for address in dict.fromkeys([*known, *self._startup]):
                node = self.node(address)
                try:
                    slots = await self._shards(node, deadline)
                except RespError as exc:
                    log.debug("Redis %s: no slot map (%s)", node.name, exc)
                    continue
                if slots:
                    self._slots = slots
                    self.refreshes += 1
                    return True
            return False
        finally:
            self._refreshed_at = asyncio.get_running_loop().time()
            self._refreshing = None

    async def _shards(self, node: Node, deadline: float) -> list[Address | None]:
        slots: list[Address | None] = [None] * SLOTS
        try:
            reply = await node.call(_pack(("CLUSTER", "SHARDS")), deadline)
        except ReplyError:
            return self._from_cluster_slots(
                await node.call(_pack(("CLUSTER", "SLOTS")), deadline), node
            )
        for shard in reply:
            info = _pairs(shard)
            master = None
            for raw in info.get(b"nodes", []):
                fields = _pairs(raw)
                # A failed master keeps its slots until a replica takes over: commands for
                # them fail fast on its address (and its breaker), not on another node's.
                if fields.get(b"role") == b"master":
                    master = fields
            if master is None:
                continue
            host = master.get(b"ip") or master.get(b"endpoint") or node.address[0].encode()
            port = master.get(b"port") or master.get(b"tls-port")
            if self.settings.ssl_context is not None and master.get(b"tls-port"):
                port = master[b"tls-port"]
            if port is None:
                continue
            address = (host.decode() if isinstance(host, bytes) else str(host), int(port))
            ranges = info.get(b"slots", [])
            for lo, hi in zip(ranges[::2], ranges[1::2], strict=True):
                for slot in range(int(lo), int(hi) + 1):
                    slots[slot] = address
        return slots

    def _from_cluster_slots(self, reply: Any, node: Node) -> list[Address | None]:
        slots: list[Address | None] = [None] * SLOTS
        for lo, hi, master, *_ in reply:
            host = master[0].decode() if master[0] else node.address[0]
            address = (host, int(master[1]))
            for slot in range(int(lo), int(hi) + 1):
                slots[slot] = address
        return slots

    # ---------------------------------------------------------------- closing

    async def aclose(self) -> None:
        """Close every connection (idempotent)."""
        self._closed = True
        task, self._refreshing = self._refreshing, None
        if task is not None:
            task.cancel()
        for node in list(self._nodes.values()):
            await node.aclose()


def _pairs(raw: Any) -> dict[bytes, Any]:
    """A RESP2 flat map ``[k1, v1, k2, v2 ...]`` as a dict."""
    if isinstance(raw, dict):
        return raw
    return dict(zip(raw[::2], raw[1::2], strict=True))


def _redirect(exc: ReplyError) -> tuple[int, Address]:
    """``MOVED 3999 127.0.0.1:6381`` -> (3999, ("127.0.0.1", 6381))."""
    _, slot, where = str(exc).split(" ")[:3]
    host, _, port = where.rpartition(":")
    return int(slot), (host, int(port))


# --------------------------------------------------------------------- pub/sub


class Subscriber:
    """A dedicated subscribed connection: ``on_message(channel, data)`` for each message.

    Subscribes again after every reconnect and calls ``on_subscribed`` then
    (so the caller can re-read state it may have missed while away).
    """

    def __init__(
        self,
        settings: NodeSettings,
        channels: Sequence[str],
        on_message: Callable[[bytes, bytes], None],
        *,
        on_subscribed: Callable[[], None] | None = None,
        background_reconnects: int = BACKGROUND_RECONNECTS,
    ) -> None:
        self.channels = list(channels)
        self._on_message = on_message
        self._on_subscribed = on_subscribed
        self.node = Node(settings, background_reconnects=background_reconnects)
        self.node.push = self._push
        self.node.on_ready = self._subscribe
        self._confirmed = 0
        #: Messages delivered.
        self.messages = 0

    @property
    def subscribed(self) -> bool:
        return self.node.connected and self._confirmed >= len(self.channels)

    def _subscribe(self, wire: _Wire) -> None:
        self._confirmed = 0
        wire.write(_pack(("SUBSCRIBE", *self.channels)))

    def _push(self, reply: Any) -> None:
        if not isinstance(reply, list) or len(reply) < 3:
            return
        kind = reply[0]
        if kind == b"message":
            self.messages += 1
            try:
                self._on_message(reply[1], reply[2])
            except Exception:
                log.exception("Redis subscriber: on_message failed")
        elif kind == b"subscribe":
            self._confirmed += 1
            if self._confirmed == len(self.channels) and self._on_subscribed is not None:
                try:
                    self._on_subscribed()
                except Exception:
                    log.exception("Redis subscriber: on_subscribed failed")

    async def start(self, timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> bool:
        """Connect and subscribe (in the background when it takes longer); True when connected."""
        try:
            await self.node.ready(asyncio.get_running_loop().time() + timeout_s)
        except RespError:
            return False
        return True

    async def keep_alive(self, deadline: float) -> bool:
        """Make the connection again if it was lost (within ``deadline``); True when up."""
        try:
            await self.node.ready(deadline)
        except RespError:
            return False
        return True

    async def wait_lost(self) -> None:
        """Return when the current connection ends (at once when there is none)."""
        wire = self.node._wire
        if wire is not None and not wire.closed:
            await asyncio.shield(wire.lost)

    async def aclose(self) -> None:
        await self.node.aclose()
