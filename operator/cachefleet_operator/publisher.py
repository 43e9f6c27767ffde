"""Publishing quotas to the sidecars, reading their membership and rate limits (Redis adapter).

Thin: every key, script and message comes from :mod:`cachefleet_common.contract`
(the rate limits' hash fields from :mod:`cachefleet_common.limits`, beside
the arithmetic that reads them).
A client is opened per operation with named timeouts and closed after it, so
a cache whose Redis is down costs nothing between attempts. Every Redis or
network failure becomes :class:`ControlPlaneUnavailable`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager, suppress
from typing import Protocol

from redis.exceptions import RedisError

from cachefleet_common.contract.clients import RedisClient, redis_from_url
from cachefleet_common.contract.messages import Heartbeat, QuotaAssignment
from cachefleet_common.contract.names import (
    control_prefix,
    rate_limit_key,
    tenant_data_pattern,
    tombstone_key,
)
from cachefleet_common.contract.ops import bury, live_members, publish_quotas, read_fleet_batches
from cachefleet_common.limits import STATE_FIELDS, tats_of_fields

#: Connect and per-command timeouts of the operator's Redis clients, seconds.
REDIS_CONNECT_TIMEOUT_S = 2.0
REDIS_SOCKET_TIMEOUT_S = 5.0
#: Keys per SCAN / UNLINK round trip during cleanup.
CLEANUP_BATCH = 500
#: How the tombstones of a deleted cache's tenant slots end (kept by the cleanup).
TOMBSTONE_SUFFIX = ":deleted"
#: Upper bound on keys removed by one cleanup (a later attempt continues).
CLEANUP_MAX_KEYS = 1_000_000


class ControlPlaneUnavailable(Exception):
    """Redis could not be reached or refused the operation."""


class ControlPlane(Protocol):
    """What the operator does with a cache's Redis (injectable)."""

    async def publish(self, cache: str, assignment: QuotaAssignment) -> int: ...

    async def live_members(self, cache: str) -> list[Heartbeat]: ...

    async def delete_cache_state(self, cache: str, uid: str = "") -> int: ...

    async def fleet_batches(self, cache: str, after: str | None) -> tuple[list[bytes], str | None]:
        """Fleet-sample batches after stream id ``after``, and the last id read."""
        ...

    async def rate_limit_state(
        self, cache: str, tenants: Iterable[str]
    ) -> tuple[float, dict[str, list[float]]]:
        """Redis's clock and each tenant's bucket arrival times, milliseconds."""
        ...


#: Builds a control plane from a Redis URL.
ControlPlaneFactory = Callable[[str], ControlPlane]


class RedisControlPlane:
    """The :class:`ControlPlane` over a standalone Redis or a Redis Cluster."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._where = _redacted(url)

    @asynccontextmanager
    async def _client(self) -> AsyncIterator[RedisClient]:
        try:
            client = redis_from_url(
                self.url,
                socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
                socket_timeout=REDIS_SOCKET_TIMEOUT_S,
            )
        except ValueError as exc:
            raise ControlPlaneUnavailable(f"bad Redis URL {self._where}: {exc}") from exc
        try:
            yield client
        except (RedisError, OSError, TimeoutError) as exc:
            raise ControlPlaneUnavailable(
                f"Redis at {self._where}: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            with suppress(RedisError, OSError):
                await client.aclose()

    async def publish(self, cache: str, assignment: QuotaAssignment) -> int:
        """Store and announce ``assignment``; returns the generation now stored."""
        async with self._client() as client:
            return await publish_quotas(client, cache, assignment)

    async def live_members(self, cache: str) -> list[Heartbeat]:
        async with self._client() as client:
            return await live_members(client, cache)

    async def fleet_batches(self, cache: str, after: str | None) -> tuple[list[bytes], str | None]:
        """The fleet-sample batches the sidecars wrote after stream id ``after`` (bounded)."""
        async with self._client() as client:
            return await read_fleet_batches(client, cache, after)

    async def rate_limit_state(
        self, cache: str, tenants: Iterable[str]
    ) -> tuple[float, dict[str, list[float]]]:
        """The rate limits' state as the sidecars' script keeps it: Redis's own clock (the
        script's, so the operator's does not matter) and each tenant's bucket arrival
        times, in milliseconds as the script counts (a tenant without a key: 0, full)."""
        async with self._client() as client:
            clock = await client.time()
            if isinstance(clock, dict):  # a cluster may answer per node: any one will do
                clock = next(iter(clock.values()))
            seconds, micros = clock
            now_ms = int(seconds) * 1000 + int(micros) // 1000  # as the script reads it
            tats = {}
            for tenant in tenants:  # each tenant's key is in its own slot
                values = await client.hmget(rate_limit_key(cache, tenant), list(STATE_FIELDS))
                tats[tenant] = tats_of_fields(values)
            return now_ms, tats

    async def delete_cache_state(self, cache: str, uid: str = "") -> int:
        """Remove the cache's control keys and its tenants' L2 data; returns keys removed.

        The tombstones go first (control slot and every registered tenant's
        data slot), so sidecars still running cannot write the state back
        while (or after) it is removed.
        """
        removed = 0
        tombstone = tombstone_key(cache)
        async with self._client() as client:
            await bury(client, cache, uid)
            for pattern in (
                _glob_escape(control_prefix(cache)) + "*",
                tenant_data_pattern(cache),
            ):
                batch: list[str | bytes] = []
                async for key in client.scan_iter(match=pattern, count=CLEANUP_BATCH):
                    name = key.decode() if isinstance(key, bytes) else key
                    if name == tombstone or name.endswith(TOMBSTONE_SUFFIX):
                        continue  # the tombstones stay (with their TTL)
                    batch.append(key)
                    if len(batch) >= CLEANUP_BATCH:
                        removed += await _unlink(client, batch)
                        batch = []
                    if removed >= CLEANUP_MAX_KEYS:
                        break
                if batch:
                    removed += await _unlink(client, batch)
        return removed


async def _unlink(client: RedisClient, keys: list[str | bytes]) -> int:
    total = 0
    for key in keys:  # keys of different tenants live in different cluster slots
        total += int(await client.unlink(key))
    return total


def _glob_escape(text: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


def _redacted(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.rsplit("@", 1)[1]
    return f"{scheme}{sep}{rest}"


def redis_control_plane(url: str) -> ControlPlane:
    """The default :data:`ControlPlaneFactory`."""
    return RedisControlPlane(url)
