"""The L2 tier's warm-up reads: a tenant's (or the guests' pool's) most recently used
entries, read in pipelined batches within a byte budget (:func:`plan_reads`), with the
fence they are judged against (:mod:`cachefleet_sidecar.control.warm` judges them).

Off the request path: a timeout of its own bounds each, not the per-operation
budget; a fault ends the warm-up, never anything else.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, NamedTuple

from cachefleet_common import resp
from cachefleet_common.contract.names import GUESTS, lru_key, own_lru_key, tenant_epochs_key
from cachefleet_common.epochs import parse_epochs
from cachefleet_sidecar.cache.l2_guard import L2Guard

#: Most bytes of values one warm-up read asks for at once (one ``MGET``).
WARM_BATCH_BYTES = 1024 * 1024
#: Most values one warm-up read asks for at once.
WARM_BATCH_ENTRIES = 64


class Recent(NamedTuple):
    """What :meth:`L2WarmUp.recent` / :meth:`L2WarmUp.recent_guests` read for a warm-up."""

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


class L2WarmUp(L2Guard):
    """The warm-up reads of an L2 tier, through its nodes' breakers."""

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
