"""Tenants and their priority classes, from the operator's quota table in Redis.

:class:`TenantClasses` is the table (pure): ``class_of(tenant)`` is the
tenant's ``TenantQuota.priority_class`` in the newest
:class:`~cachefleet_common.contract.messages.QuotaAssignment` applied; for a tenant
the table does not name, the class of its ``default_tenant`` (the
InferenceCache's ``tenantDefaults``), else None (Standard), as for everyone
when the router runs without Redis. ``objective_class(name)`` is the class a
GIE InferenceObjective lowers a request to (the table's ``objectives`` over
the ``--objectives`` flag's; docs/router.md, "GIE's headers").

:class:`TenantSync` keeps it current the way the sidecars do (level-triggered,
:mod:`cachefleet_common.contract`): it subscribes to the cache's
``control_channel`` and re-reads ``quotas_key`` on any message there, and
every ``poll_s`` without one (a bounded poll catches a lost notice); only a
newer ``generation`` is applied. When Redis goes away the last table stays
in force and the loop reconnects with a bounded backoff. The router only
reads: it never heartbeats or acknowledges, so the operator does not count
it as a member.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from cachefleet_common.contract.messages import QuotaAssignment, newer_assignment
from cachefleet_common.contract.names import control_channel, quotas_key

log = logging.getLogger(__name__)

#: seconds between reads of the quota table without a control message
DEFAULT_POLL_S = 10.0
#: bound on one Redis call, seconds
OP_TIMEOUT_S = 2.0
BACKOFF_MIN_S = 0.2
BACKOFF_MAX_S = 10.0


class TenantClasses:
    """tenant -> priority class, from the newest quota assignment applied."""

    def __init__(self, objectives: dict[str, str] | None = None) -> None:
        self.generation = -1
        self._classes: dict[str, str | None] = {}
        self._default: str | None = None
        self._flag_objectives = dict(objectives or {})
        self._objectives = dict(self._flag_objectives)

    def apply(self, assignment: QuotaAssignment) -> bool:
        """Take ``assignment`` if it is newer than the one applied; True if it was."""
        if assignment.generation <= self.generation:
            return False
        self._classes = {name: q.priority_class for name, q in assignment.tenants.items()}
        default = assignment.default_tenant
        self._default = None if default is None else default.priority_class
        self._objectives = {**self._flag_objectives, **assignment.objectives}
        self.generation = assignment.generation
        return True

    def class_of(self, tenant: str) -> str | None:
        return self._classes.get(tenant, self._default)

    def objective_class(self, objective: str) -> str | None:
        """The class a request naming ``objective`` is lowered to (None: not in the table)."""
        return self._objectives.get(objective.strip())

    def tenants(self) -> list[str]:
        return sorted(self._classes)


class TenantSync:
    """Keeps a :class:`TenantClasses` in step with ``quotas_key(cache)``."""

    def __init__(
        self,
        redis_url: str,
        cache: str,
        table: TenantClasses,
        *,
        poll_s: float = DEFAULT_POLL_S,
    ) -> None:
        self.redis_url = redis_url
        self.cache = cache
        self.table = table
        self.poll_s = poll_s
        self.reads = 0
        self.errors = 0
        self.subscribed = asyncio.Event()
        self._healthy = False

    async def read_once(self, client: Redis) -> bool:
        """Read the stored table; True if a newer generation was applied."""
        key = quotas_key(self.cache)
        generation, raw = await asyncio.wait_for(
            client.hmget(key, ["generation", "assignment"]), OP_TIMEOUT_S
        )
        self.reads += 1
        try:
            assignment = newer_assignment(generation, raw, self.table.generation)
        except ValidationError as exc:
            self.errors += 1
            log.error("tenants of %s: unreadable quota assignment: %s", self.cache, exc)
            return False
        if assignment is not None and self.table.apply(assignment):
            log.info(
                "tenants of %s: generation %d, %d tenants",
                self.cache,
                assignment.generation,
                len(assignment.tenants),
            )
            return True
        return False

    async def _session(self) -> None:
        client = Redis.from_url(self.redis_url, socket_timeout=None, socket_connect_timeout=5)
        try:
            pubsub = client.pubsub()
            try:
                await asyncio.wait_for(pubsub.subscribe(control_channel(self.cache)), OP_TIMEOUT_S)
                self.subscribed.set()
                self._healthy = True
                await self.read_once(client)  # notices may have been missed while away
                while True:
                    message = await pubsub.get_message(
                        ignore_subscribe_messages=True, timeout=self.poll_s
                    )
                    del message  # any notice, or none within poll_s: look now
                    await self.read_once(client)
            finally:
                self.subscribed.clear()
                # PubSub.aclose is annotated in some redis-py releases and not in others:
                # called through an Any-typed handle so mypy's verdict cannot flip.
                close: Any = pubsub.aclose
                with contextlib.suppress(RedisError, OSError):
                    await close()
        finally:
            with contextlib.suppress(RedisError, OSError):
                await client.aclose()

    async def run(self) -> None:
        backoff = BACKOFF_MIN_S
        while True:
            self._healthy = False
            try:
                await self._session()
            except (RedisError, OSError, TimeoutError, ValueError) as exc:
                self.errors += 1
                log.warning(
                    "tenants of %s: Redis unavailable (%s), retrying in %.1fs",
                    self.cache,
                    str(exc) or type(exc).__name__,
                    backoff,
                )
            if self._healthy:  # it was up: the next try is quick again
                backoff = BACKOFF_MIN_S
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)
