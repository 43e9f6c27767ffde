"""Versioned, acknowledged invalidation: the operator's side, independent of kopf.

One invalidation of a scope (``cache``, ``tenant:<t>`` or ``model:<m>``, see
:mod:`cachefleet_sidecar.epochs`) goes:

1. **CAS** the scope's epoch in the cache's control slot
   (:func:`~cachefleet_sidecar.protocol.advance_epoch`: read, CAS to +1, retry
   on conflict; a ``floor`` taken from the operator's status is merged first,
   so a Redis that lost its state never hands out a used epoch again);
2. **fence** the data slot of every registered tenant (only the tenant's own
   slot for a tenant scope): from now on L2 refuses readers and writers with
   the older epoch, in the same round trip as the read;
3. **announce** the new epoch on the control channel;
4. **wait** until every *live* sidecar (fresh heartbeat) has acknowledged an
   epoch at least as new. Acks are read from the acks hash (level) and
   announced on the ack channel (edge, so the wait wakes at once); membership
   and the hash are re-read every ``poll_s``, so a sidecar whose heartbeat
   expires (gone) stops being waited for, and a lost message costs at most
   ``poll_s``. The result names the lagging pods when ``timeout_s`` passes.

Propagation time is measured on the invalidator's monotonic clock from the
moment the CAS reply arrived to the moment the last acknowledgement was seen.

Idempotent across operator restarts: the runner first records the epoch it
intends to reach in the object's status (phase ``Running``) and only then
CASes; a run that finds an intended epoch recorded advances only if Redis is
still below it (:meth:`Invalidator.advance_to`), so a restart mid-wait never
advances the epoch twice, and the status names the one advance there was.

:class:`InvalidationRunner` turns a CacheInvalidation object into a status
patch (:class:`~cachefleet_operator.outcome.Outcome`) for the thin kopf
handler in :mod:`cachefleet_operator.handlers`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import RedisError

from cachefleet_operator.api import (
    InferenceCacheSpec,
    InvalidationPhase,
    InvalidationScope,
    RedisEndpoint,
    ScopeType,
    SpecError,
    parse_invalidation_spec,
    parse_spec,
)
from cachefleet_operator.metrics import OperatorMetrics
from cachefleet_operator.outcome import Event, Outcome, SecretUnavailable, now_rfc3339
from cachefleet_operator.publisher import (
    REDIS_CONNECT_TIMEOUT_S,
    REDIS_SOCKET_TIMEOUT_S,
    ControlPlaneUnavailable,
)
from cachefleet_sidecar import protocol
from cachefleet_sidecar.epochs import CACHE_SCOPE, model_scope, tenant_scope
from cachefleet_sidecar.protocol import EpochAck, RedisClient

log = logging.getLogger(__name__)

#: Longest pause between two re-reads of membership and acks while waiting, seconds.
ACK_POLL_S = 0.1
#: How long a model-version change waits for acks inside one reconcile, seconds.
MODEL_ACK_WAIT_S = 2.0
#: Attempts at finding the referenced InferenceCache before the invalidation fails.
CACHE_LOOKUP_RETRIES = 5
_TENANT_PREFIX = tenant_scope("")
#: Ends the message of the intentional "retry at once" after recording the intended
#: epoch (kopf logs every TemporaryError as an error; run.py lowers this one to INFO).
RECORDED_MARK = "(recorded; continuing)"


@dataclass(frozen=True, slots=True)
class InvalidationResult:
    """How one invalidation went."""

    scope: str
    epoch: int
    #: Live sidecars when the wait ended (acked + lagging).
    expected: int
    acks: int
    lagging: list[str] = field(default_factory=list)
    #: From the CAS to the last acknowledgement, seconds; None if not all acked.
    propagation_s: float | None = None

    @property
    def completed(self) -> bool:
        return not self.lagging


def ack_progress(
    members: Iterable[str], acks: Mapping[str, EpochAck], wanted: Mapping[str, int]
) -> tuple[list[str], list[str]]:
    """(acked, lagging) pods among ``members`` for the epochs ``wanted`` (pure)."""
    acked: list[str] = []
    lagging: list[str] = []
    for pod in sorted(set(members)):
        ack = acks.get(pod)
        if ack is not None and all(ack.epochs.get(s, 0) >= e for s, e in wanted.items()):
            acked.append(pod)
        else:
            lagging.append(pod)
    return acked, lagging


def scope_name(scope: InvalidationScope) -> str:
    """The epoch scope of a CacheInvalidation's ``spec.scope``."""
    if scope.type is ScopeType.TENANT:
        assert scope.tenant is not None
        return tenant_scope(scope.tenant)
    if scope.type is ScopeType.MODEL:
        assert scope.model is not None
        return model_scope(scope.model)
    return CACHE_SCOPE


class Invalidator:
    """CAS, fence, announce and wait for one cache, over one Redis client.

    ``waker`` (optional) is a plain connection to one node used only to
    SUBSCRIBE to the ack channel; without it the wait just polls.
    """

    def __init__(
        self,
        client: RedisClient,
        cache: str,
        *,
        waker: Redis | None = None,
        poll_s: float = ACK_POLL_S,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.client = client
        self.cache = cache
        self.poll_s = poll_s
        self.clock = clock
        self._waker = waker
        self._pubsub: PubSub | None = None

    @classmethod
    def from_url(cls, url: str, cache: str, **kwargs: Any) -> Invalidator:
        """An invalidator with its own clients for ``url`` (closed by :meth:`aclose`)."""
        timeouts: dict[str, Any] = {
            "socket_connect_timeout": REDIS_CONNECT_TIMEOUT_S,
            "socket_timeout": REDIS_SOCKET_TIMEOUT_S,
        }
        client = protocol.redis_from_url(url, **timeouts)
        target = protocol.parse_redis_url(url)
        host, port = target.nodes[0]
        waker = Redis(
            host=host,
            port=port,
            db=0 if target.cluster else target.db,
            username=target.username,
            password=target.password,
            ssl=target.tls,
            **timeouts,
        )
        return cls(client, cache, waker=waker, **kwargs)

    async def aclose(self) -> None:
        if self._pubsub is not None:
            with contextlib.suppress(RedisError, OSError):
                await self._pubsub.aclose()  # type: ignore[no-untyped-call]
            self._pubsub = None
        for client in (self._waker, self.client):
            if client is not None:
                with contextlib.suppress(RedisError, OSError):
                    await client.aclose()

    async def __aenter__(self) -> Invalidator:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------- steps

    async def listen(self) -> None:
        """Subscribe to the ack channel now (idempotent; a failure only means polling)."""
        if self._pubsub is not None or self._waker is None:
            return
        pubsub = self._waker.pubsub()
        try:
            await pubsub.subscribe(protocol.ack_channel(self.cache))
        except (RedisError, OSError) as exc:
            log.info("invalidation %s: no ack subscription (%s), polling", self.cache, exc)
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()  # type: ignore[no-untyped-call]
            return
        self._pubsub = pubsub

    async def advance(self, scope: str, *, floor: int = 0) -> tuple[int, float]:
        """CAS, fence and announce; returns (new epoch, clock() when the CAS answered)."""
        await self.listen()
        epoch = await protocol.advance_epoch(self.client, self.cache, scope, floor=floor)
        cas_at = self.clock()
        tenants = [scope.removeprefix(_TENANT_PREFIX)] if scope.startswith(_TENANT_PREFIX) else None
        await protocol.fence_tenants(self.client, self.cache, {scope: epoch}, tenants)
        await protocol.publish_epochs(self.client, self.cache, {scope: epoch})
        return epoch, cas_at

    async def current(self, scope: str) -> int:
        """The scope's epoch in Redis now (0 when never advanced)."""
        return int((await protocol.read_epochs(self.client, self.cache)).get(scope, 0))

    async def advance_to(self, scope: str, intended: int) -> tuple[int, float, bool]:
        """Make the scope's epoch at least ``intended``, advancing at most once.

        Returns (epoch now in force, clock() when it was known, whether this
        call advanced it). Fence and announcement are repeated either way
        (both are idempotent), so a run cut short between CAS and fence is
        completed.
        """
        await self.listen()
        current = await self.current(scope)
        advanced = current < intended
        if advanced:
            current = await protocol.advance_epoch(
                self.client, self.cache, scope, floor=intended - 1
            )
        at = self.clock()
        tenants = [scope.removeprefix(_TENANT_PREFIX)] if scope.startswith(_TENANT_PREFIX) else None
        await protocol.fence_tenants(self.client, self.cache, {scope: current}, tenants)
        await protocol.publish_epochs(self.client, self.cache, {scope: current})
        return current, at, advanced

    async def progress(self, wanted: Mapping[str, int]) -> tuple[list[str], list[str]]:
        """(acked, lagging) live pods for ``wanted``, read from Redis now."""
        members = [m.pod for m in await protocol.live_members(self.client, self.cache)]
        acks = await protocol.read_acks(self.client, self.cache)
        return ack_progress(members, acks, wanted)

    async def await_acks(
        self, scope: str, epoch: int, *, timeout_s: float, started_at: float | None = None
    ) -> InvalidationResult:
        """Wait until every live sidecar acknowledged ``epoch`` of ``scope`` (bounded)."""
        start = self.clock() if started_at is None else started_at
        deadline = self.clock() + timeout_s
        wanted = {scope: epoch}
        await self.listen()
        while True:
            members = [m.pod for m in await protocol.live_members(self.client, self.cache)]
            acks = await protocol.read_acks(self.client, self.cache)
            _acked, lagging_list = ack_progress(members, acks, wanted)
            lagging = set(lagging_list)
            next_poll = self.clock() + self.poll_s
            while True:
                now = self.clock()
                if not lagging:
                    done = len(members)
                    return InvalidationResult(scope, epoch, done, done, [], now - start)
                if now >= deadline:
                    behind = sorted(lagging)
                    return InvalidationResult(
                        scope, epoch, len(members), len(members) - len(behind), behind
                    )
                if now >= next_poll:
                    break
                pod = await self._next_ack(min(next_poll, deadline) - now, scope, epoch)
                if pod is not None:
                    lagging.discard(pod)

    async def invalidate(
        self, scope: str, *, timeout_s: float, floor: int = 0
    ) -> InvalidationResult:
        """The whole flow: CAS, fence, announce, wait."""
        epoch, cas_at = await self.advance(scope, floor=floor)
        return await self.await_acks(scope, epoch, timeout_s=timeout_s, started_at=cas_at)

    async def _next_ack(self, wait_s: float, scope: str, epoch: int) -> str | None:
        """The pod of the next announced ack that covers ``epoch`` of ``scope``, if any.

        Hot path of the wait (one call per ack): plain JSON, no model.
        """
        if self._pubsub is None:
            await asyncio.sleep(max(0.0, wait_s))
            return None
        try:
            message = await self._pubsub.get_message(
                ignore_subscribe_messages=True, timeout=max(0.0, wait_s)
            )
        except (RedisError, OSError):
            self._pubsub = None  # fall back to polling
            return None
        if message is None or message.get("type") != "message":
            return None
        try:
            doc = orjson.loads(message["data"])
            pod, epochs = doc["pod"], doc["epochs"]
            if int(epochs.get(scope, 0)) >= epoch:
                return str(pod)
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError):
            pass
        return None


class InvalidatorFactory(Protocol):
    def __call__(self, url: str, cache: str) -> Invalidator: ...


def redis_invalidator(url: str, cache: str) -> Invalidator:
    """The default :class:`InvalidatorFactory`."""
    return Invalidator.from_url(url, cache)


# ------------------------------------------------------------ CacheInvalidation


def _floor(cache_status: Mapping[str, Any] | None, scope: str) -> int:
    epochs = (cache_status or {}).get("epochs") or {}
    try:
        return int(epochs.get(scope, 0))
    except (TypeError, ValueError):
        return 0


def _recorded_epoch(raw_status: Mapping[str, Any] | None) -> int | None:
    """The intended epoch a previous run recorded (phase Running), if any."""
    status = raw_status or {}
    if status.get("phase") != InvalidationPhase.RUNNING.value:
        return None
    try:
        return int(status["epoch"])
    except (KeyError, TypeError, ValueError):
        return None


class RedisAccess(Protocol):
    """What a run needs from the reconciler: the cache's Redis URL and the operator's metrics."""

    metrics: OperatorMetrics

    async def redis_url(self, namespace: str, spec: InferenceCacheSpec | RedisEndpoint) -> str: ...


class InvalidationRunner:
    """Runs one CacheInvalidation; every I/O dependency is injected."""

    def __init__(
        self,
        reconciler: RedisAccess,
        *,
        invalidator: InvalidatorFactory = redis_invalidator,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.reconciler = reconciler
        self.invalidator = invalidator
        self.clock = clock

    async def run(
        self,
        namespace: str,
        generation: int | None,
        raw_spec: Mapping[str, Any],
        raw_status: Mapping[str, Any] | None,
        cache: Mapping[str, Any] | None,
        retry: int = 0,
    ) -> Outcome:
        """``cache`` is the referenced InferenceCache's ``{"spec":..., "status":...}`` or None."""
        phase = (raw_status or {}).get("phase")
        if phase in (InvalidationPhase.COMPLETED.value, InvalidationPhase.FAILED.value):
            return Outcome(status={})  # one-shot: never again
        started = now_rfc3339(self.clock)
        try:
            spec = parse_invalidation_spec(dict(raw_spec))
        except SpecError as exc:
            return self._failed(generation, started, f"{exc.field}: {exc.message}", "InvalidSpec")
        if cache is None:
            message = f"InferenceCache {spec.cache_ref.name!r} not found in {namespace}"
            if retry + 1 < CACHE_LOOKUP_RETRIES:
                return Outcome(
                    status={"phase": InvalidationPhase.PENDING.value, "message": message},
                    failure="temporary",
                    failure_message=message,
                )
            return self._failed(generation, started, message, "CacheNotFound")
        try:
            cache_spec: InferenceCacheSpec = parse_spec(dict(cache.get("spec") or {}))
        except SpecError as exc:
            message = f"InferenceCache {spec.cache_ref.name!r} is invalid: {exc}"
            return self._failed(generation, started, message, "CacheInvalid")
        scope = scope_name(spec.scope)
        ref = protocol.cache_ref(namespace, spec.cache_ref.name)
        recorded = _recorded_epoch(raw_status)
        started = str((raw_status or {}).get("startTime") or started)
        resumed = False
        try:
            url = await self.reconciler.redis_url(namespace, cache_spec)
            invalidator = self.invalidator(url, ref)
            try:
                if recorded is None:
                    # record the intended epoch first: a restart after the CAS then
                    # finds it and does not advance again
                    floor = _floor(cache.get("status"), scope)
                    intended = max(await invalidator.current(scope), floor) + 1
                    message = f"advancing {scope} to epoch {intended}"
                    return Outcome(
                        status={
                            "phase": InvalidationPhase.RUNNING.value,
                            "epoch": intended,
                            "startTime": started,
                            "message": message,
                            "observedGeneration": generation,
                        },
                        failure="temporary",
                        failure_message=f"{message} {RECORDED_MARK}",
                        delay=0.0,
                    )
                epoch, at, advanced = await invalidator.advance_to(scope, recorded)
                resumed = not advanced
                result = await invalidator.await_acks(
                    scope, epoch, timeout_s=float(spec.timeout_seconds), started_at=at
                )
            finally:
                await invalidator.aclose()
        except (RedisError, OSError, ControlPlaneUnavailable, SecretUnavailable) as exc:
            message = f"Redis unavailable: {type(exc).__name__}: {exc}"
            # a recorded intention stays recorded (phase Running, its epoch untouched)
            phase = InvalidationPhase.PENDING if recorded is None else InvalidationPhase.RUNNING
            return Outcome(
                status={"phase": phase.value, "message": message},
                events=[Event("Warning", "RedisUnavailable", message)],
                failure="temporary",
                failure_message=message,
            )
        status: dict[str, Any] = {
            "epoch": result.epoch,
            "expectedAcks": result.expected,
            "acks": result.acks,
            "startTime": started,
            "completionTime": now_rfc3339(self.clock),
            "observedGeneration": generation,
        }
        metrics = self.reconciler.metrics
        metrics.invalidations.labels("completed" if result.completed else "failed").inc()
        if result.completed:
            assert result.propagation_s is not None
            metrics.invalidation_propagation.observe(result.propagation_s)
            status["phase"] = InvalidationPhase.COMPLETED.value
            status["propagationSeconds"] = round(result.propagation_s, 6)
            status["laggingPods"] = []
            status["message"] = (
                f"{scope} advanced to epoch {result.epoch}; {result.acks} sidecar(s) "
                f"acknowledged in {result.propagation_s * 1000:.1f} ms"
            )
            if resumed:
                status["message"] += " (resumed: the epoch had already been advanced)"
            event = Event("Normal", "Invalidated", status["message"])
        else:
            status["phase"] = InvalidationPhase.FAILED.value
            status["laggingPods"] = result.lagging
            status["message"] = (
                f"{scope} advanced to epoch {result.epoch}, but {len(result.lagging)} of "
                f"{result.expected} live sidecar(s) did not acknowledge within "
                f"{spec.timeout_seconds}s: {', '.join(result.lagging)}"
            )
            event = Event("Warning", "InvalidationFailed", status["message"])
        return Outcome(status=status, events=[event])

    def _failed(self, generation: int | None, started: str, message: str, reason: str) -> Outcome:
        return Outcome(
            status={
                "phase": InvalidationPhase.FAILED.value,
                "message": message,
                "startTime": started,
                "completionTime": now_rfc3339(self.clock),
                "observedGeneration": generation,
            },
            events=[Event("Warning", reason, message)],
        )
