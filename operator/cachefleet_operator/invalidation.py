"""Versioned, acknowledged invalidation: the operator's side, independent of kopf.

One invalidation of a scope (``cache``, ``tenant:<t>``, ``model:<m>`` or
``namespace:<t>/<n>``, see :mod:`cachefleet_common.epochs`) goes:

1. **CAS** the scope's epoch in the cache's control slot
   (:func:`~cachefleet_common.contract.ops.advance_epoch`: read, CAS to +1, retry
   on conflict; a ``floor`` taken from the operator's status is merged first,
   so a Redis that lost its state never hands out a used epoch again);
2. **fence** the data slot of every registered tenant (only the tenant's own
   slot for a tenant or namespace scope): from now on L2 refuses readers and
   writers with the older epoch, in the same round trip as the read;
3. **announce** the new epoch on the control channel (in one pipelined batch
   with the fences, queued after them; the wait starts once every fence
   answered);
4. **wait** until every *live* sidecar (fresh heartbeat) has acknowledged an
   epoch at least as new. Acks are read from the acks hash (level) and
   announced on the ack channel (edge: each is taken in as the subscriber
   parses it, and the wait wakes once, when the last one arrives); membership
   and the hash are re-read every ``poll_s``, so a sidecar whose heartbeat
   expires (gone) stops being waited for, and a lost message costs at most
   ``poll_s``. The result names the lagging pods when ``timeout_s`` passes.

A **key purge** (scope ``Key``: one entry, by the SHA-256 digest of its key)
takes the same four steps on the fence-only ``purge`` scope: the CAS also logs
the digest under the new number (:func:`~cachefleet_common.contract.ops.log_purge`,
one script), the fence step also deletes the entry in each tenant slot
(:func:`~cachefleet_common.contract.ops.purge_fence`), and a sidecar
acknowledges the number only once it has dropped the logged digests from its
L1. A resumed run advances again only if its digest is not logged at or after
the number it recorded (:meth:`Invalidator.purge_to`).

Propagation time is measured on the invalidator's monotonic clock from the
moment the CAS reply arrived to the moment the last acknowledgement was seen.
Steps 2-4 are on that path and run on the sidecar's lean RESP client
(:mod:`cachefleet_common.resp`: pipelined, one parse per ack, no model);
the CAS and the other reads stay on redis-py.

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

from redis.exceptions import RedisError

from cachefleet_common import resp
from cachefleet_common.contract.clients import RedisClient, redis_from_url, resp_client
from cachefleet_common.contract.messages import EpochAck, ack_epochs
from cachefleet_common.contract.names import ack_channel, cache_ref
from cachefleet_common.contract.ops import (
    AnyClient,
    advance_epoch,
    fence_tenants,
    live_acks,
    live_members,
    log_purge,
    purge_fence,
    purge_logged,
    read_acks,
    read_epochs,
)
from cachefleet_common.epochs import (
    CACHE_SCOPE,
    PURGE_SCOPE,
    model_scope,
    namespace_scope,
    tenant_scope,
)
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

log = logging.getLogger(__name__)

#: Longest pause between two re-reads of membership and acks while waiting, seconds.
ACK_POLL_S = 0.1
#: How long a model-version change waits for acks inside one reconcile, seconds.
MODEL_ACK_WAIT_S = 2.0
#: Attempts at finding the referenced InferenceCache before the invalidation fails.
CACHE_LOOKUP_RETRIES = 5
_TENANT_PREFIX = tenant_scope("")
_NAMESPACE_PREFIX = "namespace:"
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
    if scope.type is ScopeType.NAMESPACE:
        assert scope.tenant is not None
        assert scope.namespace is not None
        return namespace_scope(scope.tenant, scope.namespace)
    if scope.type is ScopeType.KEY:
        return PURGE_SCOPE
    return CACHE_SCOPE


def scope_tenant(scope: str) -> str | None:
    """The one tenant whose data slot a scope covers (tenant and namespace scopes), else None."""
    if scope.startswith(_TENANT_PREFIX):
        return scope.removeprefix(_TENANT_PREFIX)
    if scope.startswith(_NAMESPACE_PREFIX):
        return scope.removeprefix(_NAMESPACE_PREFIX).partition("/")[0]
    return None


class Invalidator:
    """CAS, fence, announce and wait for one cache.

    ``client`` (redis-py) runs the CAS and the reads that are not on the
    propagation path. ``lean`` (optional, the sidecar's lean RESP client)
    runs what is: fence, announce and the level reads of the wait, pipelined
    (without it, ``client`` runs the same operations one call after the other).
    ``waker`` (optional) is where a :class:`~cachefleet_common.resp.Subscriber`
    listens to the ack channel: each announced ack is taken in as it is
    parsed (no task, no wake-up per ack) and the wait wakes once, when the
    last lagging pod has acknowledged. Without it the wait just polls.
    """

    def __init__(
        self,
        client: RedisClient,
        cache: str,
        *,
        lean: resp.RespClient | None = None,
        waker: resp.NodeSettings | None = None,
        poll_s: float = ACK_POLL_S,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.client = client
        self.lean = lean
        #: The client of the propagation path: the lean one when there is one.
        self._fast: AnyClient = client if lean is None else lean
        self.cache = cache
        self.poll_s = poll_s
        self.clock = clock
        self._waker = waker
        self._subscriber: resp.Subscriber | None = None
        # the wait in progress: what it wants, who is still lagging, who was heard
        self._wanted: tuple[str, int] | None = None
        self._lagging: set[str] | None = None
        self._heard: set[str] = set()
        self._all_in: asyncio.Event | None = None
        self._all_in_at: float | None = None

    @classmethod
    def from_url(cls, url: str, cache: str, **kwargs: Any) -> Invalidator:
        """An invalidator with its own clients for ``url`` (closed by :meth:`aclose`)."""
        timeouts: dict[str, Any] = {
            "socket_connect_timeout": REDIS_CONNECT_TIMEOUT_S,
            "socket_timeout": REDIS_SOCKET_TIMEOUT_S,
        }
        client = redis_from_url(url, **timeouts)
        lean = resp_client(
            url,
            command_timeout_s=REDIS_SOCKET_TIMEOUT_S,
            connect_timeout_s=REDIS_CONNECT_TIMEOUT_S,
        )
        return cls(client, cache, lean=lean, waker=lean.settings, **kwargs)

    async def aclose(self) -> None:
        if self._subscriber is not None:
            await self._subscriber.aclose()
            self._subscriber = None
        if self.lean is not None:
            await self.lean.aclose()
        with contextlib.suppress(RedisError, OSError):
            await self.client.aclose()

    async def __aenter__(self) -> Invalidator:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------- steps

    async def listen(self) -> None:
        """Subscribe to the ack channel now (idempotent; a failure only means polling).

        The subscription outlives one invalidation and re-subscribes after a
        lost connection (acks missed meanwhile are read from the hash).
        """
        if self._waker is None:
            return
        if self._subscriber is not None:
            self._subscriber.node.connect_soon()  # no-op while connected or connecting
            return
        subscribed = asyncio.Event()
        subscriber = resp.Subscriber(
            self._waker,
            [ack_channel(self.cache)],
            self._ack_message,
            on_subscribed=subscribed.set,
        )
        self._subscriber = subscriber
        # wait for the SUBSCRIBE's confirmation too: an ack announced before it is
        # only seen by the next poll
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(REDIS_CONNECT_TIMEOUT_S):
                if await subscriber.start(REDIS_CONNECT_TIMEOUT_S):
                    await subscribed.wait()
        if not subscriber.subscribed:
            log.info("invalidation %s: no ack subscription yet, polling", self.cache)

    async def advance(self, scope: str, *, floor: int = 0) -> tuple[int, float]:
        """CAS, fence and announce; returns (new epoch, clock() when the CAS answered)."""
        await self.listen()
        epoch = await advance_epoch(self.client, self.cache, scope, floor=floor)
        cas_at = self.clock()
        await self._fence_and_announce(scope, epoch)
        return epoch, cas_at

    async def _fence_and_announce(self, scope: str, epoch: int) -> None:
        one = scope_tenant(scope)
        tenants = None if one is None else [one]
        # fences and announcement in one batch (the fences queued first)
        await fence_tenants(self._fast, self.cache, {scope: epoch}, tenants, announce=True)

    async def current(self, scope: str) -> int:
        """The scope's epoch in Redis now (0 when never advanced)."""
        return int((await read_epochs(self.client, self.cache)).get(scope, 0))

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
            current = await advance_epoch(self.client, self.cache, scope, floor=intended - 1)
        at = self.clock()
        await self._fence_and_announce(scope, current)
        return current, at, advanced

    async def purge(
        self, digest: str, *, tenant: str | None = None, floor: int = 0
    ) -> tuple[int, float]:
        """Key purge: CAS ``purge`` and log ``digest``, delete and fence, announce.

        Returns (new purge epoch, clock() when the CAS answered). ``tenant``
        narrows the delete to that tenant's slot.
        """
        await self.listen()
        epoch = await log_purge(self.client, self.cache, digest, floor=floor)
        at = self.clock()
        await self._purge_fence(digest, epoch, tenant)
        return epoch, at

    async def purge_to(
        self, digest: str, intended: int, *, tenant: str | None = None
    ) -> tuple[int, float, bool]:
        """Make sure ``digest`` is purged under a number at least ``intended``, once.

        A run that recorded ``intended`` and then stopped (operator restart)
        finds its digest logged at or after it and only repeats the delete,
        fence and announcement (idempotent); otherwise it purges now. Returns
        (the purge epoch, clock() when it was known, whether this call advanced it).
        """
        await self.listen()
        logged = await purge_logged(self.client, self.cache, digest, intended)
        advanced = logged is None
        if logged is None:
            logged = await log_purge(self.client, self.cache, digest, floor=intended - 1)
        at = self.clock()
        await self._purge_fence(digest, logged, tenant)
        return logged, at, advanced

    async def _purge_fence(self, digest: str, epoch: int, tenant: str | None) -> None:
        tenants = None if tenant is None else [tenant]
        await purge_fence(self._fast, self.cache, digest, epoch, tenants, announce=True)

    async def progress(self, wanted: Mapping[str, int]) -> tuple[list[str], list[str]]:
        """(acked, lagging) live pods for ``wanted``, read from Redis now."""
        members = [m.pod for m in await live_members(self.client, self.cache)]
        acks = await read_acks(self.client, self.cache)
        return ack_progress(members, acks, wanted)

    async def _lagging_now(self, scope: str, epoch: int) -> tuple[list[str], set[str]]:
        """(live pods, those whose recorded ack is below ``epoch`` of ``scope``), read now."""
        live, epochs = await live_acks(self._fast, self.cache)
        return live, {p for p in live if epochs.get(p, {}).get(scope, 0) < epoch}

    async def await_acks(
        self, scope: str, epoch: int, *, timeout_s: float, started_at: float | None = None
    ) -> InvalidationResult:
        """Wait until every live sidecar acknowledged ``epoch`` of ``scope`` (bounded)."""
        start = self.clock() if started_at is None else started_at
        deadline = self.clock() + timeout_s
        await self.listen()
        # acks announced from now on are heard; earlier ones are in the hash read below
        self._wanted, self._heard, self._lagging = (scope, epoch), set(), None
        self._all_in, self._all_in_at = asyncio.Event(), None
        try:
            while True:
                members, lagging = await self._lagging_now(scope, epoch)
                lagging -= self._heard
                self._lagging = lagging
                next_poll = self.clock() + self.poll_s
                now = self.clock()
                if not lagging:
                    done = len(members)
                    return InvalidationResult(scope, epoch, done, done, [], now - start)
                if now >= deadline:
                    behind = sorted(lagging)
                    return InvalidationResult(
                        scope, epoch, len(members), len(members) - len(behind), behind
                    )
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, min(next_poll, deadline) - now)):
                        await self._all_in.wait()
                if self._all_in.is_set():  # the last lagging pod's ack was announced
                    assert self._all_in_at is not None
                    done = len(members)
                    return InvalidationResult(scope, epoch, done, done, [], self._all_in_at - start)
        finally:
            self._wanted, self._lagging, self._all_in = None, None, None

    async def invalidate(
        self, scope: str, *, timeout_s: float, floor: int = 0
    ) -> InvalidationResult:
        """The whole flow: CAS, fence, announce, wait."""
        epoch, cas_at = await self.advance(scope, floor=floor)
        return await self.await_acks(scope, epoch, timeout_s=timeout_s, started_at=cas_at)

    def _ack_message(self, _channel: bytes, data: bytes) -> None:
        """One announced ack, taken in as it is parsed (hot path of the wait: one per ack)."""
        wanted = self._wanted
        if wanted is None:
            return
        parsed = ack_epochs(data)
        if parsed is None:
            return
        pod, epochs = parsed
        scope, epoch = wanted
        if epochs.get(scope, 0) < epoch:
            return
        self._heard.add(pod)
        lagging = self._lagging
        if lagging is not None and pod in lagging:
            lagging.discard(pod)
            if not lagging and self._all_in is not None:
                self._all_in_at = self.clock()
                self._all_in.set()


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
        # a key purge names its digest: "purge" alone says nothing about which entry
        label = f"purge (key {spec.scope.key})" if spec.scope.type is ScopeType.KEY else scope
        ref = cache_ref(namespace, spec.cache_ref.name)
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
                    message = f"advancing {label} to epoch {intended}"
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
                if spec.scope.type is ScopeType.KEY:
                    assert spec.scope.key is not None
                    epoch, at, advanced = await invalidator.purge_to(
                        spec.scope.key, recorded, tenant=spec.scope.tenant
                    )
                else:
                    epoch, at, advanced = await invalidator.advance_to(scope, recorded)
                resumed = not advanced
                result = await invalidator.await_acks(
                    scope, epoch, timeout_s=float(spec.timeout_seconds), started_at=at
                )
            finally:
                await invalidator.aclose()
        except (
            RedisError,
            resp.RespError,
            OSError,
            ControlPlaneUnavailable,
            SecretUnavailable,
        ) as exc:
            return _redis_unavailable(exc, recorded)
        return self._finished(result, label, resumed, spec.timeout_seconds, started, generation)

    def _finished(
        self,
        result: InvalidationResult,
        label: str,
        resumed: bool,
        timeout_s: int,
        started: str,
        generation: int | None,
    ) -> Outcome:
        """Completed (every live sidecar acknowledged) or Failed (the lagging pods named),
        with its Event, counted in the operator's metrics."""
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
                f"{label} advanced to epoch {result.epoch}; {result.acks} sidecar(s) "
                f"acknowledged in {result.propagation_s * 1000:.1f} ms"
            )
            if resumed:
                status["message"] += " (resumed: the epoch had already been advanced)"
            event = Event("Normal", "Invalidated", status["message"])
        else:
            status["phase"] = InvalidationPhase.FAILED.value
            status["laggingPods"] = result.lagging
            status["message"] = (
                f"{label} advanced to epoch {result.epoch}, but {len(result.lagging)} of "
                f"{result.expected} live sidecar(s) did not acknowledge within "
                f"{timeout_s}s: {', '.join(result.lagging)}"
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


def _redis_unavailable(exc: Exception, recorded: int | None) -> Outcome:
    """Redis out of reach: a temporary failure; a recorded intention stays recorded (phase
    Running, its epoch untouched)."""
    message = f"Redis unavailable: {type(exc).__name__}: {exc}"
    phase = InvalidationPhase.PENDING if recorded is None else InvalidationPhase.RUNNING
    return Outcome(
        status={"phase": phase.value, "message": message},
        events=[Event("Warning", "RedisUnavailable", message)],
        failure="temporary",
        failure_message=message,
    )
