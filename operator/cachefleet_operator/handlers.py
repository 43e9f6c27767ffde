"""kopf handlers of InferenceCache and CacheInvalidation: thin glue to :mod:`reconcile`
and :mod:`invalidation`.

Importing this module registers the handlers with kopf's default registry.
Every dependency comes from the operator's memo (``memo.reconciler``, a
:class:`~cachefleet_operator.reconcile.Reconciler`), set by ``run.py`` or by
the tests. A per-object lock in the per-object memo keeps the change handler
and the rebalance timer from reconciling the same object at once.

Handlers (ids in parentheses): create / update / resume (``reconcile``),
a timer that rebalances every ``spec.rebalanceIntervalSeconds``
(``rebalance``), and a deletion handler behind kopf's finalizer that removes
the cache's Redis state (``cleanup``).

CacheInvalidation: an index of InferenceCaches by (namespace, name)
(``caches``: spec and status, so the handler needs no API client) and a
create handler (``invalidate``) that runs an
:class:`~cachefleet_operator.invalidation.InvalidationRunner` (from
``memo.invalidations``, or one built on ``memo.reconciler``) and writes its
status; it never runs twice for one object (the phase is final).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import kopf

from cachefleet_operator.api import (
    DEFAULT_REBALANCE_INTERVAL_S,
    GROUP,
    VERSION,
    SpecError,
    parse_spec,
)
from cachefleet_operator.invalidation import InvalidationRunner
from cachefleet_operator.outcome import Outcome, SecretUnavailable
from cachefleet_operator.publisher import ControlPlaneUnavailable
from cachefleet_operator.reconcile import Reconciler, retry_delay

PLURAL = "inferencecaches"
INVALIDATION_PLURAL = "cacheinvalidations"
#: Finalizer that guards the cleanup of Redis state.
FINALIZER = "cachefleet.io/finalizer"
#: How often the rebalance timer wakes to see whether a rebalance is due, seconds.
TIMER_TICK_S = 1.0
#: Attempts of the Redis cleanup on delete before the finalizer is released anyway.
CLEANUP_RETRIES = 5


def _reconciler(memo: Any) -> Reconciler:
    reconciler = memo.get("reconciler")
    if not isinstance(reconciler, Reconciler):
        raise kopf.PermanentError("operator misconfigured: no reconciler in memo")
    return reconciler


def _lock(memo: Any) -> asyncio.Lock:
    lock = memo.get("lock")
    if lock is None:
        lock = memo["lock"] = asyncio.Lock()
    return lock  # type: ignore[no-any-return]


def _emit(outcome: Outcome, body: kopf.Body, patch: kopf.Patch) -> None:
    for key, value in outcome.status.items():
        patch.status[key] = value
    for event in outcome.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Operator-wide settings: our finalizer name, quiet per-handler Events."""
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.WARNING


@kopf.on.resume(GROUP, VERSION, PLURAL, id="reconcile")
@kopf.on.create(GROUP, VERSION, PLURAL, id="reconcile")
@kopf.on.update(GROUP, VERSION, PLURAL, id="reconcile", field="spec")
async def reconcile(
    name: str,
    namespace: str | None,
    body: kopf.Body,
    spec: kopf.Spec,
    status: kopf.Status,
    meta: kopf.Meta,
    patch: kopf.Patch,
    memo: Any,
    retry: int,
    **_: Any,
) -> None:
    """Reconcile on every spec change (and when the operator starts)."""
    reconciler = _reconciler(memo)
    async with _lock(memo):
        outcome = await reconciler.reconcile(
            namespace or "", name, meta.get("generation"), dict(spec), dict(status), "change"
        )
        memo["last_attempt"] = time.monotonic()
        memo["failures"] = 0 if outcome.failure is None else memo.get("failures", 0) + 1
    _emit(outcome, body, patch)
    if outcome.failure == "permanent":
        raise kopf.PermanentError(outcome.failure_message)
    if outcome.failure == "temporary" and not outcome.applied:
        raise kopf.TemporaryError(outcome.failure_message, delay=retry_delay(retry))
    # a metrics fault with the spec in force: the rebalance timer retries (with its
    # own backoff), and the next spec edit is handled at once


@kopf.timer(
    GROUP, VERSION, PLURAL, id="rebalance", interval=TIMER_TICK_S, initial_delay=TIMER_TICK_S
)
async def rebalance(
    name: str,
    namespace: str | None,
    body: kopf.Body,
    spec: kopf.Spec,
    status: kopf.Status,
    meta: kopf.Meta,
    patch: kopf.Patch,
    memo: Any,
    logger: logging.Logger | logging.LoggerAdapter[Any],
    **_: Any,
) -> None:
    """Rebalance when ``rebalanceIntervalSeconds`` (or the fault backoff) has passed."""
    try:
        parsed = parse_spec(dict(spec))
    except SpecError:
        return  # the change handler reported it; nothing to rebalance until the spec is fixed
    interval = float(parsed.rebalance_interval_seconds or DEFAULT_REBALANCE_INTERVAL_S)
    failures = int(memo.get("failures", 0))
    wait = min(interval, retry_delay(failures - 1)) if failures else interval
    last = memo.get("last_attempt")
    if last is not None and time.monotonic() - float(last) < wait:
        return
    reconciler = _reconciler(memo)
    async with _lock(memo):
        outcome = await reconciler.reconcile(
            namespace or "", name, meta.get("generation"), dict(spec), dict(status), "timer"
        )
        memo["last_attempt"] = time.monotonic()
        memo["failures"] = 0 if outcome.failure is None else failures + 1
    if outcome.failure is not None:
        logger.warning("rebalance degraded: %s", outcome.failure_message)
    _emit(outcome, body, patch)


@kopf.on.delete(GROUP, VERSION, PLURAL, id="cleanup", retries=CLEANUP_RETRIES)
async def cleanup(
    name: str,
    namespace: str | None,
    body: kopf.Body,
    spec: kopf.Spec,
    meta: kopf.Meta,
    memo: Any,
    retry: int,
    logger: logging.Logger | logging.LoggerAdapter[Any],
    **_: Any,
) -> None:
    """Remove the cache's Redis control state (and L2 data) before the object goes."""
    reconciler = _reconciler(memo)
    try:
        removed = await reconciler.cleanup(
            namespace or "", name, dict(spec), str(meta.get("uid") or "")
        )
    except SpecError as exc:
        kopf.warn(body, reason="CleanupFailed", message=f"no Redis named, state left: {exc}")
        return
    except (ControlPlaneUnavailable, SecretUnavailable) as exc:
        if retry + 1 >= CLEANUP_RETRIES:
            kopf.warn(body, reason="CleanupFailed", message=f"Redis state left behind: {exc}")
            return
        raise kopf.TemporaryError(f"Redis cleanup failed: {exc}", delay=retry_delay(retry)) from exc
    logger.info("removed %d Redis keys of %s/%s", removed, namespace, name)


# ---------------------------------------------------------------- CacheInvalidation


@kopf.index(GROUP, VERSION, PLURAL, id="caches")
async def caches(
    name: str, namespace: str | None, spec: kopf.Spec, status: kopf.Status, **_: Any
) -> dict[tuple[str, str], dict[str, Any]]:
    """InferenceCaches by (namespace, name): what an invalidation needs to know."""
    return {(namespace or "", name): {"spec": dict(spec), "status": dict(status)}}


def _runner(memo: Any) -> InvalidationRunner:
    runner = memo.get("invalidations")
    if not isinstance(runner, InvalidationRunner):
        runner = memo["invalidations"] = InvalidationRunner(_reconciler(memo))
    return runner


@kopf.on.create(GROUP, VERSION, INVALIDATION_PLURAL, id="invalidate")
async def invalidate(
    namespace: str | None,
    body: kopf.Body,
    spec: kopf.Spec,
    status: kopf.Status,
    meta: kopf.Meta,
    patch: kopf.Patch,
    memo: Any,
    retry: int,
    **kwargs: Any,
) -> None:
    """CAS, fence, announce, wait for every live sidecar; Completed or Failed."""
    caches: kopf.Index[tuple[str, str], dict[str, Any]] = kwargs["caches"]  # the index above
    ns = namespace or ""
    ref = (spec.get("cacheRef") or {}).get("name")
    found = next(iter(caches.get((ns, str(ref)), [])), None)
    outcome = await _runner(memo).run(
        ns, meta.get("generation"), dict(spec), dict(status), found, retry
    )
    _emit(outcome, body, patch)
    if outcome.failure == "temporary":
        delay = outcome.delay if outcome.delay is not None else retry_delay(retry)
        raise kopf.TemporaryError(outcome.failure_message, delay=delay)
