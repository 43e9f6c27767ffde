"""Operations on the contract's keys: what the operator and the sidecars do in Redis.

Each operation is written once, as the commands and script calls it sends
(:class:`Command`, :class:`ScriptCall`) and the parsing of their replies.
:func:`run` sends them on either client: redis-py (:data:`RedisClient`: the
operator and tools, one call after the other) or the sidecar's own RESP client
(:class:`~cachefleet_common.resp.RespClient`: a batch goes out pipelined, each
call on its key's node). The operations on the invalidation path (fence,
announce, members and acks, key purges, heartbeats and acks) take either; the
operator's other steps take redis-py. The rules are in docs/redis-protocol.md.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cachefleet_common import resp
from cachefleet_common.contract.clients import RedisClient
from cachefleet_common.contract.fleet import FLEET_READ_MAX, FLEET_STREAM_MAXLEN
from cachefleet_common.contract.lua import (
    ACK_LUA,
    EPOCH_CAS_LUA,
    EPOCH_MERGE_LUA,
    EPOCH_RESTORE_LUA,
    HEARTBEAT_LUA,
    PUBLISH_QUOTAS_LUA,
    PURGE_CAS_LUA,
    PURGE_FENCE_LUA,
    REGISTER_TENANT_LUA,
)
from cachefleet_common.contract.messages import (
    ControlMessage,
    EpochAck,
    Heartbeat,
    QuotaAssignment,
    ack_epochs,
)
from cachefleet_common.contract.names import (
    ack_channel,
    acks_key,
    check_digest,
    control_channel,
    entry_key,
    epochs_key,
    fleet_samples_key,
    guest,
    is_guest_name,
    l2_meta_keys,
    l2_tenants_key,
    member_key,
    members_key,
    purge_log_key,
    quotas_key,
    tenant_data_pattern,
    tenant_epochs_key,
    tenant_tombstone_key,
    tombstone_key,
)
from cachefleet_common.epochs import PURGE_SCOPE, parse_epochs, valid_scope

#: How long a heartbeat keeps a sidecar a member, seconds.
DEFAULT_HEARTBEAT_TTL_S = 15.0
#: How often a sidecar re-reads control state even without a message, seconds.
DEFAULT_RESYNC_INTERVAL_S = 5.0
#: How long a deleted cache's tombstone keeps sidecars from writing its state, seconds.
TOMBSTONE_TTL_S = 24 * 3600
#: The members set outlives the last heartbeat by this many heartbeat TTLs.
MEMBERS_TTL_FACTOR = 4
#: Most CAS attempts of one :func:`advance_epoch` before it gives up.
MAX_CAS_ATTEMPTS = 1000
#: Purges the log keeps (older ones are trimmed; a sidecar that missed them empties its L1).
PURGE_LOG_MAX = 10000
#: Most entries one purge script call deletes (guests sharing one pool go in batches).
PURGE_BATCH = 500

#: Either client: an operation that takes this runs on both (see :func:`run`).
AnyClient = RedisClient | resp.RespClient


class EpochConflict(Exception):
    """:func:`advance_epoch` lost the CAS race :data:`MAX_CAS_ATTEMPTS` times in a row."""


# ------------------------------------------------------------------ calls, run


@dataclass(frozen=True)
class ScriptCall:
    """One script invocation: the Lua source, its KEYS and ARGV (any client runs it)."""

    source: str
    keys: list[str]
    args: list[str]


@dataclass(frozen=True)
class Command:
    """One plain command; ``key`` is the key whose slot it runs on (a cluster routes by it)."""

    args: tuple[str, ...]
    key: str


#: What :func:`run` sends.
Call = Command | ScriptCall


@functools.cache
def _lean_script(source: str) -> resp.Script:
    """``source`` as the RESP client runs it (EVALSHA; the SHA-1 computed once)."""
    return resp.Script(source)


async def run(
    client: AnyClient, calls: Sequence[Call], *, timeout_s: float | None = None
) -> list[Any]:
    """Send ``calls``; their replies, in order.

    On the RESP client they go out together, queued in this order (one node
    applies them in it; on a cluster each goes to its key's node), each within
    ``timeout_s`` (None: the client's default). On redis-py they are sent one
    after the other, under the client's own timeouts.
    """
    if isinstance(client, resp.RespClient):
        return list(await asyncio.gather(*(_send_resp(client, c, timeout_s) for c in calls)))
    return [await _send_redis_py(client, call) for call in calls]


def _send_resp(client: resp.RespClient, call: Call, timeout_s: float | None) -> Awaitable[Any]:
    if isinstance(call, ScriptCall):
        script = _lean_script(call.source)
        return client.run_script(script, call.keys, call.args, timeout_s=timeout_s)
    return client.execute(*call.args, key=call.key, timeout_s=timeout_s)


async def _send_redis_py(client: RedisClient, call: Call) -> Any:
    if isinstance(call, ScriptCall):
        return await client.eval(call.source, len(call.keys), *call.keys, *call.args)
    return await client.execute_command(*call.args)


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _pairs(reply: Any) -> Iterator[tuple[Any, Any]]:
    """An ``HGETALL`` reply as (field, value): redis-py makes it a dict, RESP a flat list."""
    if isinstance(reply, Mapping):
        return iter(reply.items())
    return zip(reply[::2], reply[1::2], strict=False)


# ------------------------------------------------------------ quotas, members


async def publish_quotas(client: RedisClient, cache: str, assignment: QuotaAssignment) -> int:
    """Store ``assignment`` if its generation is newer, then say "look now".

    Returns the generation stored afterwards (the assignment's own, or a
    newer one that was already there, in which case nothing is published).
    Only the operator publishes; doing so lifts a deleted namesake's tombstones.
    """
    await unbury(client, cache)
    stored = int(
        await client.eval(
            PUBLISH_QUOTAS_LUA,
            2,
            quotas_key(cache),
            tombstone_key(cache),
            str(assignment.generation),
            assignment.model_dump_json(),
        )
    )
    if stored == assignment.generation:
        message = ControlMessage(kind="quotas", generation=stored)
        await client.publish(control_channel(cache), message.model_dump_json())
    return stored


def heartbeat_call(
    cache: str, heartbeat: Heartbeat, ttl_s: float = DEFAULT_HEARTBEAT_TTL_S
) -> ScriptCall:
    """The :data:`HEARTBEAT_LUA` call that registers ``heartbeat`` for ``ttl_s`` seconds."""
    now = time.time()
    ttl_ms = max(1, int(ttl_s * 1000))
    return ScriptCall(
        HEARTBEAT_LUA,
        [members_key(cache), member_key(cache, heartbeat.pod), tombstone_key(cache)],
        [
            heartbeat.pod,
            repr(now + ttl_s),
            str(ttl_ms),
            heartbeat.model_dump_json(),
            repr(now),
            str(ttl_ms * MEMBERS_TTL_FACTOR),
        ],
    )


async def write_heartbeat(
    client: AnyClient, cache: str, heartbeat: Heartbeat, ttl_s: float = DEFAULT_HEARTBEAT_TTL_S
) -> None:
    """Register ``heartbeat`` as a live member for ``ttl_s`` seconds (not for a deleted cache)."""
    await run(client, [heartbeat_call(cache, heartbeat, ttl_s)])


async def bury(
    client: RedisClient,
    cache: str,
    uid: str,
    tenants: Iterable[str] = (),
    ttl_s: float = TOMBSTONE_TTL_S,
) -> None:
    """Set the tombstones of a deleted cache (the operator, before removing its state).

    One in the control slot, and one in the data slot of every registered
    tenant and of ``tenants`` (versioned L2 writes there are refused).
    """
    px = max(1, int(ttl_s * 1000))
    await client.set(tombstone_key(cache), uid or "deleted", px=px)
    raw = await client.smembers(l2_tenants_key(cache))
    names = {_text(t) for t in raw} | set(tenants)
    for tenant in sorted(names):
        await client.set(tenant_tombstone_key(cache, tenant), uid or "deleted", px=px)


async def unbury(client: RedisClient, cache: str) -> int:
    """Lift a deleted namesake's tenant tombstones (a cache of that name exists again).

    Only does work when the control tombstone is still there; returns how
    many tenant tombstones went.
    """
    if not await client.exists(tombstone_key(cache)):
        return 0
    gone = 0
    pattern = tenant_data_pattern(cache)
    async for key in client.scan_iter(match=pattern, count=500):
        name = _text(key)
        if name.endswith(":deleted"):
            gone += int(await client.unlink(name))
    return gone


async def remove_member(client: RedisClient, cache: str, pod: str) -> None:
    """Drop ``pod`` from the members at once (a sidecar shutting down cleanly)."""
    await client.zrem(members_key(cache), pod)
    await client.delete(member_key(cache, pod))
    await client.hdel(acks_key(cache), pod)


def _members_call(cache: str) -> Command:
    """The pods whose membership has not expired (not yet checked for a heartbeat key)."""
    key = members_key(cache)
    return Command(("ZRANGEBYSCORE", key, repr(time.time()), "+inf"), key)


def _acks_call(cache: str) -> Command:
    key = acks_key(cache)
    return Command(("HGETALL", key), key)


async def _heartbeats(
    client: AnyClient, cache: str, pods: Iterable[bytes | str], timeout_s: float | None
) -> list[tuple[str, bytes | str]]:
    """(pod, heartbeat JSON) of ``pods`` (a :func:`_members_call` reply) whose key exists."""
    names = sorted(_text(p) for p in pods)
    if not names:
        return []
    keys = [member_key(cache, pod) for pod in names]
    (beats,) = await run(client, [Command(("MGET", *keys), keys[0])], timeout_s=timeout_s)
    return [(pod, raw) for pod, raw in zip(names, beats, strict=True) if raw is not None]


async def live_members(
    client: AnyClient, cache: str, *, timeout_s: float | None = None
) -> list[Heartbeat]:
    """Heartbeats of every sidecar whose membership has not expired, by pod name."""
    (pods,) = await run(client, [_members_call(cache)], timeout_s=timeout_s)
    beats = await _heartbeats(client, cache, pods, timeout_s)
    return [Heartbeat.model_validate_json(raw) for _, raw in beats]


# ------------------------------------------------------------------------ epochs


def _merge_args(epochs: Mapping[str, int]) -> list[str]:
    args: list[str] = []
    for scope, epoch in sorted(epochs.items()):
        if not valid_scope(scope):
            raise ValueError(f"invalid epoch scope {scope!r}")
        args += [scope, str(int(epoch))]
    return args


async def read_epochs(client: RedisClient, cache: str) -> dict[str, int]:
    """The sequencer's epochs of ``cache`` (scopes never advanced are absent = 0)."""
    return parse_epochs(await client.hgetall(epochs_key(cache)))


async def restore_epochs(client: RedisClient, cache: str, epochs: Mapping[str, int]) -> int:
    """Raise the sequencer to at least ``epochs`` (never lowers); returns scopes moved.

    Writes nothing (returns -1) while the cache's tombstone exists.
    """
    if not epochs:
        return 0
    return int(
        await client.eval(
            EPOCH_RESTORE_LUA, 2, epochs_key(cache), tombstone_key(cache), *_merge_args(epochs)
        )
    )


async def advance_epoch(
    client: RedisClient,
    cache: str,
    scope: str,
    *,
    floor: int = 0,
    max_attempts: int = MAX_CAS_ATTEMPTS,
) -> int:
    """Advance ``scope`` by exactly one step with CAS; returns the new epoch.

    ``floor`` (e.g. the epoch the operator recorded in a status) is merged
    first, so a sequencer that lost its state never hands out an epoch that
    was already used. Raises :class:`EpochConflict` after ``max_attempts``
    lost races, ValueError on an invalid scope.
    """
    if not valid_scope(scope):
        raise ValueError(f"invalid epoch scope {scope!r}")
    key = epochs_key(cache)
    if floor > 0:
        await client.eval(EPOCH_MERGE_LUA, 1, key, scope, str(int(floor)))
    for _ in range(max_attempts):
        raw = await client.hget(key, scope)
        seen = int(raw) if raw is not None else 0
        ok, epoch = (int(x) for x in await client.eval(EPOCH_CAS_LUA, 1, key, scope, str(seen)))
        if ok == 1:
            return epoch
    raise EpochConflict(f"{cache} {scope}: lost the CAS {max_attempts} times")


async def register_tenant(client: RedisClient, cache: str, tenant: str) -> None:
    """Make ``tenant``'s data slot known to invalidators; call before its first L2 write.

    Adds the tenant to :func:`l2_tenants_key`, then copies the sequencer's
    epochs into the tenant's fence. Whichever order this races with an
    invalidator (CAS, then read the set, then fence), the fence ends up at
    the new epoch before this sidecar writes: either the invalidator saw the
    tenant, or this call read the sequencer after the CAS.
    """
    registered = await client.eval(
        REGISTER_TENANT_LUA, 2, l2_tenants_key(cache), tombstone_key(cache), tenant
    )
    if not int(registered):
        # a deleted cache: no fence, and the tenant's slot refuses versioned writes
        # for as long as the cache's tombstone lasts
        ttl_ms = int(await client.pttl(tombstone_key(cache)))
        if ttl_ms > 0:
            await client.set(tenant_tombstone_key(cache, tenant), "deleted", px=ttl_ms)
        return
    epochs = await read_epochs(client, cache)
    if epochs:
        await client.eval(
            EPOCH_MERGE_LUA, 1, tenant_epochs_key(cache, tenant), *_merge_args(epochs)
        )


def _announce(cache: str, epochs: Mapping[str, int]) -> Command:
    """The ``kind="epochs"`` notice of ``epochs`` on the control channel."""
    top = max(epochs.values(), default=0)
    message = ControlMessage(kind="epochs", generation=top, epochs=dict(epochs))
    channel = control_channel(cache)
    return Command(("PUBLISH", channel, message.model_dump_json()), channel)


async def _tenants(
    client: AnyClient, cache: str, tenants: Iterable[str] | None, timeout_s: float | None
) -> list[str]:
    """``tenants`` sorted, or (None) every tenant registered in :func:`l2_tenants_key`.

    A tenant named is also taken as a guest (:func:`guest`): a tenant listed
    now may have been unlisted when it wrote (or the other way round), and its
    fence must hold in both slots.
    """
    if tenants is not None:
        named = set(tenants)
        return sorted(named | {guest(t) for t in named if not is_guest_name(t)})
    key = l2_tenants_key(cache)
    (raw,) = await run(client, [Command(("SMEMBERS", key), key)], timeout_s=timeout_s)
    return sorted(_text(t) for t in raw)


async def fence_tenants(
    client: AnyClient,
    cache: str,
    epochs: Mapping[str, int],
    tenants: Iterable[str] | None = None,
    *,
    announce: bool = False,
    timeout_s: float | None = None,
) -> int:
    """Raise the fence of ``tenants`` (default: every registered tenant) to ``epochs``.

    Each fence once: every guest's is the pool's (:func:`tenant_epochs_key`), so a
    cache-wide invalidation costs one fence for all guests, however many registered.
    ``announce``: :func:`publish_epochs` in the same batch, queued after the
    fences (on one node Redis applies them first; on a cluster the RESP client
    may land them in any order, and the caller's wait starts only once every
    fence answered, which is what an acknowledged invalidation rests on).
    Returns how many fences were raised (a named tenant's two: see :func:`_tenants`).
    """
    names = await _tenants(client, cache, tenants, timeout_s)
    args = _merge_args(epochs)
    if not args:
        return 0
    fences = sorted({tenant_epochs_key(cache, t) for t in names})
    calls: list[Call] = [ScriptCall(EPOCH_MERGE_LUA, [fence], args) for fence in fences]
    if announce:
        calls.append(_announce(cache, epochs))
    await run(client, calls, timeout_s=timeout_s)
    return len(fences)


async def publish_epochs(
    client: AnyClient, cache: str, epochs: Mapping[str, int], *, timeout_s: float | None = None
) -> None:
    """Announce advanced epochs on the control channel (receivers max-merge them)."""
    await run(client, [_announce(cache, epochs)], timeout_s=timeout_s)


def ack_call(cache: str, ack: EpochAck) -> ScriptCall:
    """The :data:`ACK_LUA` call that records ``ack`` and announces it."""
    return ScriptCall(
        ACK_LUA,
        [acks_key(cache), tombstone_key(cache)],
        [ack.pod, ack.model_dump_json(), ack_channel(cache)],
    )


async def write_ack(client: AnyClient, cache: str, ack: EpochAck) -> None:
    """Record ``ack`` and announce it on :func:`ack_channel` (one round trip)."""
    await run(client, [ack_call(cache, ack)])


async def read_acks(
    client: AnyClient, cache: str, *, timeout_s: float | None = None
) -> dict[str, EpochAck]:
    """Every recorded acknowledgement of ``cache``, by pod (unreadable ones skipped)."""
    (reply,) = await run(client, [_acks_call(cache)], timeout_s=timeout_s)
    out: dict[str, EpochAck] = {}
    for pod, raw in _pairs(reply):
        try:
            ack = EpochAck.model_validate_json(raw)
        except ValueError:
            continue
        out[_text(pod)] = ack
    return out


async def live_acks(
    client: AnyClient, cache: str, *, timeout_s: float | None = None
) -> tuple[list[str], dict[str, dict[str, int]]]:
    """(live pods, acknowledged epochs by pod) read now: :func:`live_members` and
    :func:`read_acks` in one batch, the acks as plain JSON (no model per ack).

    A pod is live while its membership score has not passed and its heartbeat
    key exists. All keys are in the control slot (one node). Unreadable acks
    are skipped.
    """
    pods, flat = await run(client, [_members_call(cache), _acks_call(cache)], timeout_s=timeout_s)
    live = [pod for pod, _ in await _heartbeats(client, cache, pods, timeout_s)]
    out: dict[str, dict[str, int]] = {}
    for pod, raw in _pairs(flat):
        parsed = ack_epochs(raw)
        if parsed is not None:
            out[_text(pod)] = parsed[1]
    return live, out


# --------------------------------------------------------------------- key purges


async def log_purge(
    client: RedisClient,
    cache: str,
    digest: str,
    *,
    floor: int = 0,
    max_attempts: int = MAX_CAS_ATTEMPTS,
) -> int:
    """Advance ``purge`` by one and log ``digest`` under it, atomically; the new epoch.

    ``floor`` is merged first, as for :func:`advance_epoch`.
    """
    check_digest(digest)
    key = epochs_key(cache)
    if floor > 0:
        await client.eval(EPOCH_MERGE_LUA, 1, key, PURGE_SCOPE, str(int(floor)))
    for _ in range(max_attempts):
        raw = await client.hget(key, PURGE_SCOPE)
        seen = int(raw) if raw is not None else 0
        reply = await client.eval(
            PURGE_CAS_LUA, 2, key, purge_log_key(cache), str(seen), digest, str(PURGE_LOG_MAX)
        )
        ok, epoch = (int(x) for x in reply)
        if ok == 1:
            return epoch
    raise EpochConflict(f"{cache} purge: lost the CAS {max_attempts} times")


def _purge_log_call(cache: str, low: str, high: str) -> Command:
    """The purge log's members ``<seq>:<digest>`` with seq in [``low``, ``high``]."""
    key = purge_log_key(cache)
    return Command(("ZRANGEBYSCORE", key, low, high), key)


async def purge_logged(
    client: AnyClient, cache: str, digest: str, since: int, *, timeout_s: float | None = None
) -> int | None:
    """The sequence number ``digest`` was logged under at ``since`` or later, if any."""
    (members,) = await run(
        client, [_purge_log_call(cache, str(since), "+inf")], timeout_s=timeout_s
    )
    for raw in members:
        seq, _, logged = _text(raw).partition(":")
        if logged == digest:
            return int(seq)
    return None


async def purge_fence(
    client: AnyClient,
    cache: str,
    digest: str,
    epoch: int,
    tenants: Iterable[str] | None = None,
    *,
    announce: bool = False,
    timeout_s: float | None = None,
) -> int:
    """:data:`PURGE_FENCE_LUA` in the slot of ``tenants`` (default: every registered one).

    The guests of the pool share its accounting and fence, so theirs go in
    calls of :data:`PURGE_BATCH` entries, not one each: a purge with no tenant
    named costs a few calls however many guests registered (the digest names
    one guest's entry, but not which). ``announce``: the ``purge`` epoch is
    announced in the same batch, queued after the fences (see
    :func:`fence_tenants`). Returns the entries deleted.
    """
    names = await _tenants(client, cache, tenants, timeout_s)
    # entries by the (accounting, fence) they share: one listed tenant's, or the pool's
    shared: dict[tuple[str, ...], list[str]] = {}
    for t in names:
        head = (*l2_meta_keys(cache, t), tenant_epochs_key(cache, t))
        shared.setdefault(head, []).append(entry_key(cache, t, digest))
    calls: list[Call] = [
        ScriptCall(PURGE_FENCE_LUA, [*head, *entries[i : i + PURGE_BATCH]], [str(int(epoch))])
        for head, entries in shared.items()
        for i in range(0, len(entries), PURGE_BATCH)
    ]
    fences = len(calls)
    if announce:
        calls.append(_announce(cache, {PURGE_SCOPE: epoch}))
    replies = await run(client, calls, timeout_s=timeout_s)
    return sum(int(r) for r in replies[:fences])


async def purges_since(
    client: AnyClient, cache: str, after: int, upto: int, *, timeout_s: float | None = None
) -> tuple[list[str], bool]:
    """(digests purged with sequence numbers in (after, upto], whether the log held them all).

    What it holds costs memory in proportion to the log (at most :data:`PURGE_LOG_MAX`
    members), never to the range: a new pod asks from 0 up to a counter that may be
    in the tens of millions. The log held them all when it holds as many distinct
    numbers in the range as the range has.
    """
    if upto <= after:
        return [], True
    (raw,) = await run(
        client, [_purge_log_call(cache, f"({after}", str(upto))], timeout_s=timeout_s
    )
    digests: list[str] = []
    seen: set[int] = set()
    for member in raw:
        seq, _, digest = _text(member).partition(":")
        try:
            number = int(seq)
        except ValueError:
            continue
        if not after < number <= upto:
            continue
        seen.add(number)
        digests.append(digest)
    return digests, len(seen) == upto - after


# ------------------------------------------------------------------- fleet samples


async def add_fleet_batch(
    client: resp.RespClient, cache: str, payload: bytes, *, timeout_s: float | None = None
) -> None:
    """Append one batch (contract.fleet) to the fleet-sample stream, trimmed to its bound."""
    key = fleet_samples_key(cache)
    await client.execute(
        "XADD", key, "MAXLEN", "~", str(FLEET_STREAM_MAXLEN), "*", "b", payload,
        key=key, timeout_s=timeout_s,
    )  # fmt: skip


async def read_fleet_batches(
    client: RedisClient, cache: str, after: str | None, limit: int = FLEET_READ_MAX
) -> tuple[list[bytes], str | None]:
    """(payloads of the batches after stream id ``after`` (None: all kept), the last id read)."""
    key = fleet_samples_key(cache)
    out: list[bytes] = []
    last = after
    while len(out) < limit:
        start = "-" if last is None else f"({last}"
        page = await client.xrange(key, min=start, max="+", count=min(500, limit - len(out)))
        if not page:
            break
        for entry_id, fields in page:
            if entry_id is None:
                continue
            last = _text(entry_id)
            payload = (fields or {}).get(b"b")
            if payload is not None:
                out.append(payload if isinstance(payload, bytes) else str(payload).encode())
    return out, last
