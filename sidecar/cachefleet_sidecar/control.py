"""The sidecar's side of the control plane: quota sync and heartbeats.

:class:`ControlSync` keeps one sidecar in step with the operator through
Redis, level-triggered as the protocol prescribes:

* it subscribes to the cache's control channel (classic SUBSCRIBE, which also
  reaches subscribers on every node of a Redis Cluster); any message, and
  every ``resync_interval_s`` without one, makes it re-read the quotas hash,
  and it calls ``on_quotas`` whenever the stored generation is newer than the
  last one it applied; an older or equal generation is ignored;
* it writes a heartbeat every ``heartbeat_ttl_s / 3`` seconds so the operator
  sees it in :func:`cachefleet_sidecar.protocol.live_members`;
* when Redis goes away it reconnects with a bounded exponential backoff and
  re-reads the quotas right after re-subscribing, so nothing published while
  it was away is lost.

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
from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from cachefleet_sidecar import protocol
from cachefleet_sidecar.protocol import (
    ControlMessage,
    Heartbeat,
    QuotaAssignment,
    RedisClient,
    RedisTarget,
)

log = logging.getLogger(__name__)

#: Upper bound of one control-plane Redis call, seconds.
DEFAULT_CONTROL_OP_TIMEOUT_S = 2.0
#: First and largest pause between reconnect attempts, seconds.
RECONNECT_BACKOFF_MIN_S = 0.05
RECONNECT_BACKOFF_MAX_S = 2.0
#: Longest single wait for a pub/sub message, seconds (keeps the loop responsive).
MESSAGE_POLL_S = 1.0
#: How long stop() waits for the background tasks to finish, seconds.
STOP_TIMEOUT_S = 5.0

T = TypeVar("T")


class ControlSync:
    """Quota sync and heartbeat of one sidecar (``pod``) of one cache."""

    def __init__(
        self,
        redis_url: str,
        cache: str,
        pod: str,
        on_quotas: Callable[[QuotaAssignment], None],
        *,
        resync_interval_s: float = protocol.DEFAULT_RESYNC_INTERVAL_S,
        heartbeat_ttl_s: float = protocol.DEFAULT_HEARTBEAT_TTL_S,
        heartbeat: Callable[[], Heartbeat] | None = None,
        on_message: Callable[[ControlMessage], None] | None = None,
        cluster: bool | None = None,
        op_timeout_s: float = DEFAULT_CONTROL_OP_TIMEOUT_S,
    ) -> None:
        if not protocol.valid_name(pod):
            raise ValueError(f"invalid pod name {pod!r}")
        self.cache = cache
        self.pod = pod
        self.resync_interval_s = resync_interval_s
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.op_timeout_s = op_timeout_s
        self._on_quotas = on_quotas
        self._on_message = on_message
        self._heartbeat = heartbeat
        self._target = protocol.parse_redis_url(redis_url, cluster=cluster)
        self._url = redis_url
        self._client: RedisClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._applied = -1
        self._subscribed = False
        #: Redis failures seen (connect, read, write, heartbeat).
        self.errors = 0
        #: Quota assignments handed to ``on_quotas``.
        self.applied_count = 0
        #: time.time() of the last successful re-read of the quotas hash.
        self.last_sync_at: float | None = None

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
        self._client = protocol.redis_from_url(
            self._url,
            cluster=self._target.cluster,
            socket_connect_timeout=self.op_timeout_s,
            socket_timeout=self.op_timeout_s,
        )
        self._tasks = [
            asyncio.create_task(self._listen_loop(), name=f"control-listen-{self.pod}"),
            asyncio.create_task(self._heartbeat_loop(), name=f"control-heartbeat-{self.pod}"),
        ]

    async def stop(self, *, leave: bool = True) -> None:
        """Stop both loops and close the connections.

        With ``leave`` (the default, a graceful shutdown) the membership is
        removed at once (best effort, bounded), so the operator stops waiting
        for this pod's acknowledgements; otherwise the heartbeat just expires.
        """
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=STOP_TIMEOUT_S)
        client, self._client = self._client, None
        if client is not None and leave:
            try:
                await self._bounded(protocol.remove_member(client, self.cache, self.pod))
            except Exception as exc:  # best effort: the heartbeat expires anyway
                log.info("control %s: could not leave: %s", self.cache, str(exc) or type(exc))
        if client is not None:
            with contextlib.suppress(RedisError, OSError):
                await client.aclose()
        self._subscribed = False

    async def __aenter__(self) -> ControlSync:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    # ----------------------------------------------------------------- sync

    async def resync(self) -> bool:
        """Re-read the quotas now; True if a newer assignment was applied."""
        client = self._require_client()
        generation, raw = await self._bounded(
            client.hmget(protocol.quotas_key(self.cache), ["generation", "assignment"])
        )
        self.last_sync_at = time.time()
        if generation is None or raw is None or int(generation) <= self._applied:
            return False
        try:
            assignment = QuotaAssignment.model_validate_json(raw)
        except ValidationError as exc:
            self.errors += 1
            log.error("control %s: unreadable quota assignment: %s", self.cache, exc)
            return False
        if assignment.generation <= self._applied:
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
        return True

    async def _listen_loop(self) -> None:
        backoff = RECONNECT_BACKOFF_MIN_S
        attempt = 0
        while True:
            pubsub_client = self._pubsub_client(attempt)
            attempt += 1
            try:
                async with pubsub_client.pubsub() as pubsub:
                    await self._bounded(pubsub.subscribe(protocol.control_channel(self.cache)))
                    self._subscribed = True
                    await self.resync()
                    backoff = RECONNECT_BACKOFF_MIN_S
                    await self._consume(pubsub)
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
                with contextlib.suppress(RedisError, OSError):
                    await pubsub_client.aclose()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RECONNECT_BACKOFF_MAX_S)

    async def _consume(self, pubsub: PubSub) -> None:
        next_sync = time.monotonic() + self.resync_interval_s
        while True:
            remaining = next_sync - time.monotonic()
            if remaining <= 0:
                await self.resync()
                next_sync = time.monotonic() + self.resync_interval_s
                continue
            wait = min(remaining, MESSAGE_POLL_S)
            message = await self._bounded(
                pubsub.get_message(ignore_subscribe_messages=True, timeout=wait),
                extra_s=wait,
            )
            if message is None or message.get("type") != "message":
                continue
            self._notify(message.get("data"))
            await self.resync()
            next_sync = time.monotonic() + self.resync_interval_s

    def _notify(self, data: Any) -> None:
        try:
            parsed = ControlMessage.model_validate_json(data)
        except (ValidationError, TypeError, ValueError):
            log.warning("control %s: ignoring malformed control message", self.cache)
            return
        if self._on_message is not None:
            try:
                self._on_message(parsed)
            except Exception:
                log.exception("control %s: on_message failed", self.cache)

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
        client = self._require_client()
        await self._bounded(
            protocol.write_heartbeat(
                client, self.cache, self.current_heartbeat(), self.heartbeat_ttl_s
            )
        )

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

    def _pubsub_client(self, attempt: int) -> Redis:
        """A plain connection for SUBSCRIBE; on a cluster, the nodes in turn."""
        target: RedisTarget = self._target
        host, port = target.nodes[attempt % len(target.nodes)]
        return Redis(
            host=host,
            port=port,
            db=0 if target.cluster else target.db,
            username=target.username,
            password=target.password,
            ssl=target.tls,
            socket_connect_timeout=self.op_timeout_s,
            socket_timeout=self.op_timeout_s,
            retry=Retry(NoBackoff(), 0),
        )

    async def _bounded(self, awaitable: Awaitable[T], extra_s: float = 0.0) -> T:
        return await asyncio.wait_for(awaitable, self.op_timeout_s + extra_s)
