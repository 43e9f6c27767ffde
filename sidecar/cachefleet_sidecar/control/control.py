"""The sidecar's side of the control plane: quota sync, epoch sync and heartbeats.

:class:`ControlSync` keeps one sidecar in step with the operator through
Redis, level-triggered as the protocol prescribes:

* it subscribes to the cache's control channel (classic SUBSCRIBE, which also
  reaches subscribers on every node of a Redis Cluster); any message, and
  every ``resync_interval_s`` without one, makes it re-read the quotas hash,
  and it calls ``on_quotas`` whenever the stored generation is newer than the
  last one it applied; an older or equal generation is ignored;
* it writes a heartbeat every ``heartbeat_ttl_s / 3`` seconds so the operator
  sees it in :func:`cachefleet_common.contract.ops.live_members`;
* with an :class:`~cachefleet_common.epochs.EpochTracker` it also keeps the
  invalidation epochs: an ``epochs`` notice on the control channel is
  max-merged into the tracker at once (duplicates and late notices are
  harmless) and acknowledged; independently of the pub/sub connection, a
  bounded poll every ``epoch_poll_s`` (default a quarter of the staleness
  bound) reads the whole epoch hash, which *confirms* the tracker (keeps L1
  hits allowed), catches up on lost notices and, when Redis is behind what
  the sidecar knows (it restarted), writes the known epochs back. Every
  change is acknowledged with :func:`~cachefleet_common.contract.ops.write_ack`
  (acks are serialised and always carry the newest epochs, so they never go
  backwards); ``on_epochs`` is called first, so the sidecar has stopped using
  the old epochs before the ack says so. ``poke()`` asks for a poll now (the
  L2 tier calls it when a read was refused for being behind the fence);
* a newer ``purge`` epoch (key purges, see docs/redis-protocol.md)
  is never merged as it comes: the digests purged since the last one applied
  are read from the purge log and handed to ``on_purge`` (None: the log no
  longer holds them all, drop everything), and only then is the new number
  merged and acknowledged;
* when Redis goes away it reconnects with a bounded exponential backoff and
  re-reads the quotas right after re-subscribing, so nothing published while
  it was away is lost.

The subscription, the acknowledgements, the heartbeats and the reads of the
quotas and epochs run on the sidecar's lean client
(:mod:`cachefleet_common.resp`: a dedicated subscribed connection whose
messages are handled as they are parsed, and one pipelined connection for the
rest); redis-py only restores epochs after a Redis restart and removes the
membership at shutdown.

The callbacks run on the event loop and must not block.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pydantic import ValidationError
from redis.exceptions import RedisError

from cachefleet_common import resp
from cachefleet_common.contract.clients import RedisClient, redis_from_url, resp_client
from cachefleet_common.contract.lua import ACK_LUA, HEARTBEAT_LUA
from cachefleet_common.contract.messages import (
    ControlMessage,
    EpochAck,
    Heartbeat,
    QuotaAssignment,
    newer_assignment,
)
from cachefleet_common.contract.names import control_channel, epochs_key, quotas_key, valid_name
from cachefleet_common.contract.ops import (
    DEFAULT_HEARTBEAT_TTL_S,
    DEFAULT_RESYNC_INTERVAL_S,
    ack_call,
    heartbeat_call,
    purges_since,
    remove_member,
    restore_epochs,
)
from cachefleet_common.contract.urls import RedisTarget, parse_redis_url
from cachefleet_common.epochs import PURGE_SCOPE, EpochTracker, parse_epochs

log = logging.getLogger(__name__)

#: Upper bound of one control-plane Redis call, seconds.
DEFAULT_CONTROL_OP_TIMEOUT_S = 2.0
#: First and largest pause between reconnect attempts, seconds.
RECONNECT_BACKOFF_MIN_S = 0.05
RECONNECT_BACKOFF_MAX_S = 2.0
#: How long stop() waits for the background tasks to finish, seconds.
STOP_TIMEOUT_S = 5.0
#: Shortest pause between two epoch polls, even when poked, seconds.
EPOCH_POLL_MIN_GAP_S = 0.01

T = TypeVar("T")

_ACK = resp.Script(ACK_LUA)
_HEARTBEAT = resp.Script(HEARTBEAT_LUA)


class ControlSync:
    """Quota sync and heartbeat of one sidecar (``pod``) of one cache."""

    def __init__(
        self,
        redis_url: str,
        cache: str,
        pod: str,
        on_quotas: Callable[[QuotaAssignment], None],
        *,
        resync_interval_s: float = DEFAULT_RESYNC_INTERVAL_S,
        heartbeat_ttl_s: float = DEFAULT_HEARTBEAT_TTL_S,
        heartbeat: Callable[[], Heartbeat] | None = None,
        on_message: Callable[[ControlMessage], None] | None = None,
        cluster: bool | None = None,
        op_timeout_s: float = DEFAULT_CONTROL_OP_TIMEOUT_S,
        tracker: EpochTracker | None = None,
        on_epochs: Callable[[], None] | None = None,
        on_redis_reset: Callable[[], None] | None = None,
        epoch_poll_s: float | None = None,
        on_purge: Callable[[list[str] | None], Awaitable[None]] | None = None,
    ) -> None:
        if not valid_name(pod):
            raise ValueError(f"invalid pod name {pod!r}")
        self.cache = cache
        self.pod = pod
        self.resync_interval_s = resync_interval_s
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.op_timeout_s = op_timeout_s
        self._on_quotas = on_quotas
        self._on_message = on_message
        self._heartbeat = heartbeat
        self._target = parse_redis_url(redis_url, cluster=cluster)
        self._url = redis_url
        self._client: RedisClient | None = None
        self._resp: resp.RespClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._notices: set[asyncio.Task[None]] = set()
        self._resync_now = asyncio.Event()
        self._applied = -1
        self._subscribed = False
        #: Redis failures seen (connect, read, write, heartbeat).
        self.errors = 0
        #: Quota assignments handed to ``on_quotas``.
        self.applied_count = 0
        #: time.time() of the last successful re-read of the quotas hash.
        self.last_sync_at: float | None = None
        self.tracker = tracker
        self._on_epochs = on_epochs
        self._on_redis_reset = on_redis_reset
        default_poll = DEFAULT_RESYNC_INTERVAL_S if tracker is None else tracker.bound_s / 4
        self.epoch_poll_s = epoch_poll_s if epoch_poll_s is not None else default_poll
        self._acked: dict[str, int] | None = None
        self._ack_lock = asyncio.Lock()
        self._poke = asyncio.Event()
        #: Acknowledgements written.
        self.acks_written = 0
        #: Epoch polls that found Redis behind the tracker (and restored it).
        self.restores = 0
        self._on_purge = on_purge
        self._purge_lock = asyncio.Lock()
        #: Key purges applied, and purge ranges the log no longer held whole.
        self.purges_applied = 0
        self.purge_gaps = 0

    # ------------------------------------------------------------ properties

    @property
    def applied_generation(self) -> int:
        """Generation of the last assignment applied; -1 before the first."""
        return self._applied

    @property
    def connected(self) -> bool:
        """True while subscribed to the control channel."""
        return self._subscribed

    @property
    def running(self) -> bool:
        return any(not task.done() for task in self._tasks)

    # ------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start listening and heart-beating in the background (idempotent)."""
        if self.running:
            return
        self._client = redis_from_url(
            self._url,
            cluster=self._target.cluster,
            socket_connect_timeout=self.op_timeout_s,
            socket_timeout=self.op_timeout_s,
        )
        self._resp = resp_client(
            self._url,
            cluster=self._target.cluster,
            command_timeout_s=self.op_timeout_s,
            connect_timeout_s=self.op_timeout_s,
        )
        self._tasks = [
            asyncio.create_task(self._listen_loop(), name=f"control-listen-{self.pod}"),
            asyncio.create_task(self._heartbeat_loop(), name=f"control-heartbeat-{self.pod}"),
        ]
        if self.tracker is not None:
            self._tasks.append(
                asyncio.create_task(self._epoch_loop(), name=f"control-epochs-{self.pod}")
            )

    async def stop(self, *, leave: bool = True) -> None:
        """Stop both loops and close the connections.

        With ``leave`` (the default, a graceful shutdown) the membership is
        removed at once (best effort, bounded), so the operator stops waiting
        for this pod's acknowledgements; otherwise the heartbeat just expires.
        """
        tasks, self._tasks = self._tasks, []
        tasks += list(self._notices)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=STOP_TIMEOUT_S)
        client, self._client = self._client, None
        if client is not None and leave:
            try:
                await self._bounded(remove_member(client, self.cache, self.pod))
            except Exception as exc:  # best effort: the heartbeat expires anyway
                log.info("control %s: could not leave: %s", self.cache, str(exc) or type(exc))
        if client is not None:
            with contextlib.suppress(RedisError, OSError):
                await client.aclose()
        lean, self._resp = self._resp, None
        if lean is not None:
            await lean.aclose()
        self._subscribed = False

    async def __aenter__(self) -> ControlSync:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    # ----------------------------------------------------------------- sync

    async def resync(self) -> bool:
        """Re-read the quotas now; True if a newer assignment was applied."""
        client = self._require_resp()
        key = quotas_key(self.cache)
        generation, raw = await client.execute(
            "HMGET", key, "generation", "assignment", key=key, timeout_s=self.op_timeout_s
        )
        self.last_sync_at = time.time()
        try:
            assignment = newer_assignment(generation, raw, self._applied)
        except ValidationError as exc:
            self.errors += 1
            log.error("control %s: unreadable quota assignment: %s", self.cache, exc)
            return False
        if assignment is None:
            return False
        try:
            self._on_quotas(assignment)
        except Exception:
            log.exception(
                "control %s: on_quotas failed for generation %d", self.cache, assignment.generation
            )
            return False
        self._applied = assignment.generation
        self.applied_count += 1
        log.info("control %s: applied quota generation %d", self.cache, assignment.generation)
        try:
            await self.beat()  # tell the operator now, not at the next heartbeat tick
        except Exception as exc:  # the heartbeat loop says it again shortly
            self.errors += 1
            log.debug("control %s: heartbeat after quotas failed: %s", self.cache, exc)
        return True

    async def _listen_loop(self) -> None:
        backoff = RECONNECT_BACKOFF_MIN_S
        attempt = 0
        while True:
            confirmed = asyncio.Event()
            subscriber = resp.Subscriber(
                self._subscriber_settings(attempt),
                [control_channel(self.cache)],
                self._message,
                on_subscribed=confirmed.set,
                background_reconnects=0,  # this loop makes it again, on the next node
            )
            attempt += 1
            try:
                if not await subscriber.start(self.op_timeout_s):
                    raise resp.ConnectionLost(f"cannot connect to {subscriber.node.name}")
                await self._bounded(confirmed.wait())
                self._subscribed = True
                self.poke()  # notices may have been missed while away
                await self.resync()
                backoff = RECONNECT_BACKOFF_MIN_S
                await self._consume(subscriber)
            except Exception as exc:  # the loop must outlive any fault
                self.errors += 1
                log.warning(
                    "control %s: Redis unavailable (%s), retrying in %.2fs",
                    self.cache,
                    str(exc) or type(exc).__name__,
                    backoff,
                )
            finally:
                self._subscribed = False
                await subscriber.aclose()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RECONNECT_BACKOFF_MAX_S)

    async def _consume(self, subscriber: resp.Subscriber) -> None:
        """Re-read the quotas on a message and every resync interval until the connection ends."""
        lost = asyncio.ensure_future(subscriber.wait_lost())
        try:
            while True:
                woken = asyncio.ensure_future(self._resync_now.wait())
                try:
                    done, _ = await asyncio.wait(
                        {lost, woken},
                        timeout=self.resync_interval_s,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                finally:
                    woken.cancel()
                if lost in done:
                    raise resp.ConnectionLost("the control subscription was lost")
                self._resync_now.clear()
                await self.resync()
        finally:
            lost.cancel()

    def _message(self, _channel: bytes, data: bytes) -> None:
        """A control message, handled as it is parsed (on the event loop)."""
        parsed = self._notify(data)
        if parsed is not None and parsed.kind == "epochs":
            self._epoch_notice_now(parsed)
            return
        self._resync_now.set()

    def _epoch_notice_now(self, message: ControlMessage) -> None:
        """Apply an ``epochs`` notice as it is parsed: merge, then acknowledge at once.

        The hot path of an invalidation: the ack is written from this callback,
        with no task, lock or coroutine in between (one notice, one write). When
        that is not possible (an ack is being written by :meth:`ack`, no open
        connection, a cluster) it falls back to a task running
        :meth:`ack`.
        """
        tracker = self.tracker
        if tracker is None:
            return
        epochs = message.epochs
        purge = None if epochs is None else epochs.get(PURGE_SCOPE)
        if epochs is not None and purge is not None:
            epochs = {s: e for s, e in epochs.items() if s != PURGE_SCOPE}
        if epochs and tracker.merge(epochs):
            self._applied_epochs()
        elif purge is None:
            self.poke()  # a notice without news: make sure by reading the hash
        if purge is not None and purge > tracker.epoch(PURGE_SCOPE):
            work = self._purge_then_ack(purge)  # the log is read first: one more round trip
        elif not self._ack_lock.locked() and self._ack_now(tracker):
            return
        else:
            work = self._ack_logged()
        task = asyncio.get_running_loop().create_task(work)
        self._notices.add(task)
        task.add_done_callback(self._notices.discard)

    def _ack_now(self, tracker: EpochTracker) -> bool:
        """Write the ack of ``tracker.known`` now, without awaiting it; False if it cannot be.

        Acks never go backwards: this one carries the newest epochs, it is
        queued behind any earlier command on the same connection, and
        :meth:`ack` (the only other writer) is not running. A failure is logged
        and forgets what was acknowledged, so the next poll writes it again.
        """
        known = tracker.known
        if known == self._acked:
            return True
        client = self._resp
        if client is None:
            return False
        call = ack_call(self.cache, EpochAck(pod=self.pod, epochs=known))
        packed = resp.pack_script(
            _ACK, len(call.keys), call.keys[0], resp.pack_args([*call.keys[1:], *call.args])
        )
        futures = client.send_now(packed, 1, self.op_timeout_s)
        if futures is None:
            return False
        self._acked = known
        futures[0].add_done_callback(self._ack_written)
        return True

    def _ack_written(self, future: asyncio.Future[Any]) -> None:
        if future.cancelled():  # shutting down
            self._acked = None
            return
        exc = future.exception()
        if exc is None:
            self.acks_written += 1
            return
        self.errors += 1
        self._acked = None  # the poll acknowledges again (and reloads a flushed script)
        self.poke()
        log.warning("control %s: ack failed: %s", self.cache, str(exc) or type(exc).__name__)

    def _notify(self, data: Any) -> ControlMessage | None:
        try:
            parsed = ControlMessage.model_validate_json(data)
        except (ValidationError, TypeError, ValueError):
            log.warning("control %s: ignoring malformed control message", self.cache)
            return None
        if self._on_message is not None:
            try:
                self._on_message(parsed)
            except Exception:
                log.exception("control %s: on_message failed", self.cache)
        return parsed

    # --------------------------------------------------------------- epochs

    def poke(self) -> None:
        """Ask for an epoch poll now (bounded by :data:`EPOCH_POLL_MIN_GAP_S`)."""
        self._poke.set()

    async def apply_purges(self, upto: int) -> bool:
        """Apply the key purges up to sequence number ``upto``; True if any was new.

        Reads the purge log range not applied yet, hands its digests to
        ``on_purge`` (None when the log no longer holds the whole range), then
        merges ``purge`` into the tracker (which moves the sidecar's keys on,
        :meth:`_applied_epochs`). Raises on Redis faults (nothing merged then).
        """
        tracker = self.tracker
        if tracker is None:
            return False
        async with self._purge_lock:
            after = tracker.epoch(PURGE_SCOPE)
            if upto <= after:
                return False
            digests, whole = await purges_since(
                self._require_resp(), self.cache, after, upto, timeout_s=self.op_timeout_s
            )
            if not whole:
                self.purge_gaps += 1
                log.warning(
                    "control %s: purges %d..%d are no longer all logged: dropping all of L1",
                    self.cache,
                    after + 1,
                    upto,
                )
            if self._on_purge is not None:
                await self._on_purge(digests if whole else None)
            self.purges_applied += upto - after
            if tracker.merge({PURGE_SCOPE: upto}):
                self._applied_epochs()
            return True

    async def _purge_then_ack(self, upto: int) -> None:
        """A purge notice's slow path: apply the purges, then acknowledge (failures logged)."""
        try:
            await self.apply_purges(upto)
        except Exception as exc:  # the poll applies them later
            self.errors += 1
            self.poke()
            log.warning(
                "control %s: applying purges failed: %s", self.cache, str(exc) or type(exc).__name__
            )
            return
        await self._ack_logged()

    async def _ack_logged(self) -> None:
        """:meth:`ack`, with a failure logged (the poll acknowledges later)."""
        try:
            await self.ack()
        except Exception as exc:  # the poll acknowledges later
            self.errors += 1
            log.warning("control %s: ack failed: %s", self.cache, str(exc) or type(exc).__name__)

    def _applied_epochs(self) -> None:
        if self._on_epochs is None:
            return
        try:
            self._on_epochs()
        except Exception:
            log.exception("control %s: on_epochs failed", self.cache)

    async def sync_epochs(self) -> bool:
        """Read the epoch hash now: confirm, catch up, restore Redis, acknowledge.

        Returns True if a known epoch moved forward. Raises on Redis faults.
        """
        tracker = self.tracker
        if tracker is None:
            raise RuntimeError("ControlSync has no epoch tracker")
        client = self._require_client()
        sent_at = tracker.clock()
        key = epochs_key(self.cache)
        flat = await self._require_resp().execute(
            "HGETALL", key, key=key, timeout_s=self.op_timeout_s
        )
        current = parse_epochs(dict(zip(flat[::2], flat[1::2], strict=True)))
        purge = current.get(PURGE_SCOPE, 0)
        if purge > tracker.epoch(PURGE_SCOPE):
            await self.apply_purges(purge)  # before the confirmation can take the number
        confirmation = tracker.confirm(current, sent_at)
        if confirmation.changed:
            self._applied_epochs()
        if confirmation.redis_behind:
            self.restores += 1
            log.warning(
                "control %s: Redis lost epochs %s; restoring what this sidecar knows",
                self.cache,
                confirmation.redis_behind,
            )
            await self._bounded(restore_epochs(client, self.cache, confirmation.redis_behind))
            if self._on_redis_reset is not None:
                self._on_redis_reset()
        await self.ack()
        return confirmation.changed

    async def ack(self) -> bool:
        """Acknowledge the tracker's epochs if they moved since the last ack; True if written."""
        tracker = self.tracker
        if tracker is None:
            return False
        client = self._require_resp()
        async with self._ack_lock:
            known = tracker.known
            if known == self._acked:
                return False
            call = ack_call(self.cache, EpochAck(pod=self.pod, epochs=known))
            await client.run_script(_ACK, call.keys, call.args, timeout_s=self.op_timeout_s)
            self._acked = known
            self.acks_written += 1
            return True

    async def _epoch_loop(self) -> None:
        backoff = RECONNECT_BACKOFF_MIN_S
        while True:
            wait = self.epoch_poll_s
            self._poke.clear()
            try:
                await self.sync_epochs()
                backoff = RECONNECT_BACKOFF_MIN_S
            except Exception as exc:  # the loop must outlive any fault
                self.errors += 1
                self._acked = None  # write the ack again once Redis is back
                log.warning(
                    "control %s: epoch poll failed: %s", self.cache, str(exc) or type(exc).__name__
                )
                wait = min(wait, backoff)
                backoff = min(backoff * 2, RECONNECT_BACKOFF_MAX_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poke.wait(), wait)
            await asyncio.sleep(EPOCH_POLL_MIN_GAP_S)

    # ------------------------------------------------------------ heartbeat

    def current_heartbeat(self) -> Heartbeat:
        """The heartbeat to write now (the callback's, with this sidecar's pod)."""
        if self._heartbeat is None:
            return Heartbeat(pod=self.pod, quota_generation=self._applied)
        beat = self._heartbeat()
        if beat.pod != self.pod:
            beat = beat.model_copy(update={"pod": self.pod})
        return beat

    async def beat(self) -> None:
        """Write one heartbeat now."""
        client = self._require_resp()
        call = heartbeat_call(self.cache, self.current_heartbeat(), self.heartbeat_ttl_s)
        await client.run_script(_HEARTBEAT, call.keys, call.args, timeout_s=self.op_timeout_s)

    async def _heartbeat_loop(self) -> None:
        interval = self.heartbeat_ttl_s / 3
        while True:
            try:
                await self.beat()
            except Exception as exc:  # the loop must outlive any fault
                self.errors += 1
                log.warning(
                    "control %s: heartbeat failed: %s", self.cache, str(exc) or type(exc).__name__
                )
            await asyncio.sleep(interval)

    # -------------------------------------------------------------- helpers

    def _require_client(self) -> RedisClient:
        if self._client is None:
            raise RuntimeError("ControlSync is not started")
        return self._client

    def _require_resp(self) -> resp.RespClient:
        if self._resp is None:
            raise RuntimeError("ControlSync is not started")
        return self._resp

    def _subscriber_settings(self, attempt: int) -> resp.NodeSettings:
        """Where to SUBSCRIBE; on a cluster, the nodes in turn."""
        target: RedisTarget = self._target
        settings = self._require_resp().settings
        return settings.at(target.nodes[attempt % len(target.nodes)])

    async def _bounded(self, awaitable: Awaitable[T], extra_s: float = 0.0) -> T:
        # asyncio.timeout, not wait_for: no extra task per call (the ack path is hot)
        async with asyncio.timeout(self.op_timeout_s + extra_s):
            return await awaitable
