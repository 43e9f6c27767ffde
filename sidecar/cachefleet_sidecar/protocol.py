"""The Redis contract between the operator and the sidecars.

This module is the one place that names Redis keys and pub/sub channels and
defines the messages that travel through them (pydantic models), with the Lua
scripts and operations on them. The operator imports it; the sidecar imports
it; nobody else spells a key by hand. The key layout, the epoch, fence and
purge rules, the L2 quota rules and the Redis URL convention are described in
docs/redis-protocol.md.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Final, Literal
from urllib.parse import parse_qs, unquote, urlsplit, urlunsplit

import orjson
from pydantic import BaseModel, ConfigDict, Field
from redis.asyncio import Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode

from cachefleet_sidecar import resp
from cachefleet_sidecar.epochs import CACHE_SCOPE as CACHE_SCOPE
from cachefleet_sidecar.epochs import PURGE_SCOPE as PURGE_SCOPE
from cachefleet_sidecar.epochs import EpochVector, encode_vector, parse_epochs
from cachefleet_sidecar.epochs import model_scope as model_scope
from cachefleet_sidecar.epochs import namespace_scope as namespace_scope
from cachefleet_sidecar.epochs import tenant_scope as tenant_scope
from cachefleet_sidecar.epochs import valid_scope as valid_scope

PROTOCOL_VERSION = 1

#: Tenant and pod names that may appear in keys and metric labels.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")

#: How long a heartbeat keeps a sidecar a member, seconds.
DEFAULT_HEARTBEAT_TTL_S = 15.0
#: How often a sidecar re-reads control state even without a message, seconds.
DEFAULT_RESYNC_INTERVAL_S = 5.0


class Policy(StrEnum):
    """L1 replacement policy of a tenant partition."""

    LRU = "lru"
    LIRS = "lirs"
    SITS = "sits"


def valid_name(value: str) -> bool:
    """True if ``value`` may be used as a tenant or pod name in keys and labels."""
    return bool(NAME_RE.match(value))


def cache_ref(namespace: str, name: str) -> str:
    """The identity of an InferenceCache in keys: ``<namespace>/<name>``."""
    return f"{namespace}/{name}"


# --------------------------------------------------------------------------- keys


def _control(cache: str) -> str:
    return f"cf:{{cf:{cache}}}"


def quotas_key(cache: str) -> str:
    return f"{_control(cache)}:quotas"


def members_key(cache: str) -> str:
    return f"{_control(cache)}:members"


def member_key(cache: str, pod: str) -> str:
    return f"{_control(cache)}:member:{pod}"


def tombstone_key(cache: str) -> str:
    return f"{_control(cache)}:deleted"


def control_channel(cache: str) -> str:
    return f"{_control(cache)}:control"


def control_prefix(cache: str) -> str:
    """Prefix of every control key of ``cache`` (for cleanup by SCAN MATCH)."""
    return f"{_control(cache)}:"


def fleet_samples_key(cache: str) -> str:
    """Stream of the sidecars' fleet-sampled accesses (see "fleet samples" below)."""
    return f"{_control(cache)}:fleet-samples"


def _tenant(cache: str, tenant: str) -> str:
    return f"cf:{{cf:{cache}|{tenant}}}"


def entry_key(cache: str, tenant: str, digest_hex: str) -> str:
    return f"{_tenant(cache, tenant)}:e:{digest_hex}"


def usage_key(cache: str, tenant: str) -> str:
    return f"{_tenant(cache, tenant)}:usage"


def lru_key(cache: str, tenant: str) -> str:
    return f"{_tenant(cache, tenant)}:lru"


def sizes_key(cache: str, tenant: str) -> str:
    return f"{_tenant(cache, tenant)}:sizes"


def expiry_key(cache: str, tenant: str) -> str:
    return f"{_tenant(cache, tenant)}:exp"


def l2_keys(cache: str, tenant: str, digest_hex: str) -> list[str]:
    """KEYS of :data:`L2_GET_LUA` / :data:`L2_PUT_LUA`, in order."""
    return [entry_key(cache, tenant, digest_hex), *l2_meta_keys(cache, tenant)]


def l2_meta_keys(cache: str, tenant: str) -> list[str]:
    """KEYS of :data:`L2_USAGE_LUA`: usage, lru, sizes, exp of one tenant."""
    return [
        usage_key(cache, tenant),
        lru_key(cache, tenant),
        sizes_key(cache, tenant),
        expiry_key(cache, tenant),
    ]


def tenant_data_pattern(cache: str) -> str:
    """SCAN MATCH pattern for every data key of every tenant of ``cache``."""
    escaped = cache.replace("[", "\\[").replace("]", "\\]").replace("*", "\\*")
    return f"cf:{{cf:{escaped}|*"


# ----------------------------------------------------------------------- messages


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class TenantQuota(_Model):
    """What one tenant may use, as assigned by the operator."""

    l1_bytes: Annotated[int, Field(ge=0, description="L1 bytes on every pod")]
    l2_bytes: Annotated[int, Field(ge=0, description="L2 bytes in Redis, fleet-wide")]
    policy: Policy | None = Field(default=None, description="L1 policy; None = cache default")
    collapse_whitespace: bool | None = Field(
        default=None,
        description="Collapse whitespace inside message text when keying; None = sidecar default",
    )
    cache_nondeterministic: bool | None = Field(
        default=None,
        description="Cache requests with temperature > 0 and no seed; None = sidecar default",
    )
    semantic: bool | None = Field(
        default=None, description="Semantic tier (L3) on for this tenant; None = sidecar default"
    )
    semantic_threshold: float | None = Field(
        default=None, gt=0, le=1, description="L3 similarity threshold; None = sidecar default"
    )
    semantic_shadow: bool | None = Field(
        default=None,
        description="L3 measures would-be hits against upstream and serves none; None = default",
    )
    priority_class: Literal["Guaranteed", "Standard", "BestEffort"] | None = Field(
        default=None,
        description="The tenant's class (admission and routing order); None = Standard",
    )
    ttl_seconds: float | None = Field(
        default=None,
        gt=0,
        description="No tier serves an entry filled longer ago; None = the sidecar's default",
    )
    allow_bypass: bool | None = Field(
        default=None,
        description="Cache-Control no-cache / no-store obeyed; None = allowed",
    )
    allow_max_age: bool | None = Field(
        default=None, description="Cache-Control max-age obeyed; None = allowed"
    )


class QuotaAssignment(_Model):
    """The whole quota table of one cache; ``generation`` only moves forward."""

    protocol: int = PROTOCOL_VERSION
    generation: Annotated[int, Field(ge=0)]
    issued_at: float = Field(default_factory=time.time)
    default_policy: Policy = Policy.LRU
    model: str | None = None
    model_version: str | None = None
    tenants: dict[str, TenantQuota] = Field(default_factory=dict)
    #: How a tenant ``tenants`` does not name is treated (``spec.tenantDefaults``):
    #: admitted with a partition of its own on demand, its policy and class from
    #: here, and ``l1_bytes`` the pool all such tenants share on each pod (they
    #: stay in L1: ``l2_bytes`` is 0). None: such tenants are refused or mapped
    #: to the default tenant, as without quotas.
    default_tenant: TenantQuota | None = None
    #: TTL of tenants not in ``tenants`` (the InferenceCache's spec.ttlSeconds); None = none.
    ttl_seconds: float | None = Field(default=None, gt=0)


def newer_assignment(
    generation: bytes | str | None, raw: bytes | str | None, applied: int
) -> QuotaAssignment | None:
    """The quota table read from :func:`quotas_key` (``HMGET generation assignment``)
    when it is newer than generation ``applied``; None when it is not, or absent.

    Raises :class:`pydantic.ValidationError` for an assignment that does not parse.
    """
    if generation is None or raw is None or int(generation) <= applied:
        return None
    assignment = QuotaAssignment.model_validate_json(raw)
    return assignment if assignment.generation > applied else None


class ControlMessage(_Model):
    """A "look now" notice on the control channel.

    A ``kind="epochs"`` notice also carries the epochs just advanced (``epochs``,
    {scope: epoch}); receivers max-merge them, so a duplicate or a late one is
    harmless, and still confirm by reading :func:`epochs_key`.
    """

    protocol: int = PROTOCOL_VERSION
    kind: Literal["quotas", "epochs", "ping"]
    generation: int = 0
    epochs: dict[str, int] | None = None
    sent_at: float = Field(default_factory=time.time)


class Heartbeat(_Model):
    """What a live sidecar says about itself, refreshed every few seconds."""

    protocol: int = PROTOCOL_VERSION
    pod: str
    quota_generation: int = -1
    policy_by_tenant: dict[str, Policy] = Field(default_factory=dict)
    redis_ok: bool = True
    #: Admission is shedding: the pod's model server is saturated (docs/admission.md).
    shedding: bool = False
    sent_at: float = Field(default_factory=time.time)


# ------------------------------------------------------------------------ scripts

#: How long a deleted cache's tombstone keeps sidecars from writing its state, seconds.
TOMBSTONE_TTL_S = 24 * 3600
#: The members set outlives the last heartbeat by this many heartbeat TTLs.
MEMBERS_TTL_FACTOR = 4

#: KEYS[1] = quotas_key, KEYS[2] = tombstone_key; ARGV[1] = generation,
#: ARGV[2] = assignment JSON. Writes only if the generation is newer than the
#: stored one. Returns the generation now stored. Publishing means the cache
#: exists: a tombstone left by a deleted namesake goes.
PUBLISH_QUOTAS_LUA = """
redis.call('DEL', KEYS[2])
local cur = tonumber(redis.call('HGET', KEYS[1], 'generation') or '-1')
local gen = tonumber(ARGV[1])
if gen > cur then
  redis.call('HSET', KEYS[1], 'generation', ARGV[1], 'assignment', ARGV[2])
  return gen
end
return cur
"""

#: KEYS[1] = members_key, KEYS[2] = member_key, KEYS[3] = tombstone_key;
#: ARGV[1] = pod, ARGV[2] = expiry (unix s), ARGV[3] = ttl (ms), ARGV[4] =
#: heartbeat JSON, ARGV[5] = now (unix s), ARGV[6] = members set ttl (ms).
#: Registers the heartbeat and prunes members whose expiry has passed;
#: returns 0 and writes nothing for a deleted cache.
HEARTBEAT_LUA = """
if redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[6])
redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[5])
return 1
"""

# L2 scripts. Every key they touch carries the tenant's hashtag, so each runs
# on one cluster slot. Shared helpers first; ``meta`` is {usage, lru, sizes, exp}.
# A read needs only the first three helpers (the versioned GET defines no others:
# every helper is a closure made again on each call).
_L2_LUA_READ_HELPERS = """
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
-- A strictly increasing LRU stamp per tenant (ties would order by name).
local function stamp(lru, now)
  local top = redis.call('ZRANGE', lru, -1, -1, 'WITHSCORES')
  if top[2] ~= nil and tonumber(top[2]) >= now then
    return tonumber(top[2]) + 1
  end
  return now
end
-- Drop one entry and its accounting; returns 1 if the value still existed.
local function forget(meta, member)
  local size = tonumber(redis.call('HGET', meta[3], member) or '0')
  redis.call('HDEL', meta[3], member)
  redis.call('ZREM', meta[2], member)
  redis.call('ZREM', meta[4], member)
  local existed = redis.call('UNLINK', member)
  if size > 0 then
    local left = redis.call('HINCRBY', meta[1], 'bytes', -size)
    if left < 0 then redis.call('HSET', meta[1], 'bytes', 0) end
  end
  return existed
end
"""
_L2_LUA_PRELUDE = (
    _L2_LUA_READ_HELPERS
    + """
-- Reclaim up to n entries whose expiry has passed; returns how many.
local function reap(meta, now_ms, n)
  local gone = redis.call('ZRANGEBYSCORE', meta[4], '-inf', now_ms, 'LIMIT', 0, n)
  for _, member in ipairs(gone) do forget(meta, member) end
  return #gone
end
local function limit_of(meta, default)
  local limit = tonumber(redis.call('HGET', meta[1], 'limit') or '0') or 0
  if limit <= 0 then limit = tonumber(default) end
  return limit
end
-- Store value under key within the tenant's quota; returns {status, evicted, reclaimed}.
local function store(key, meta, value, ttl_ms, default_limit, max_n)
  local size = string.len(value)
  local limit = limit_of(meta, default_limit)
  if size > limit then return {-1, 0, 0} end
  local now = now_us()
  local reclaimed = reap(meta, math.floor(now / 1000), max_n)
  if redis.call('HEXISTS', meta[3], key) == 1 then forget(meta, key) end
  local used = tonumber(redis.call('HGET', meta[1], 'bytes') or '0')
  local evicted = 0
  local steps = 0
  while used + size > limit and steps < max_n do
    local oldest = redis.call('ZRANGE', meta[2], 0, 0)
    if #oldest == 0 then
      -- nothing left to evict: whatever is still counted is stale accounting
      redis.call('HSET', meta[1], 'bytes', 0)
      used = 0
      break
    end
    if forget(meta, oldest[1]) == 1 then evicted = evicted + 1 else reclaimed = reclaimed + 1 end
    steps = steps + 1
    used = tonumber(redis.call('HGET', meta[1], 'bytes') or '0')
  end
  if used + size > limit then return {0, evicted, reclaimed} end
  redis.call('SET', key, value, 'PX', ttl_ms)
  redis.call('HSET', meta[3], key, size)
  redis.call('ZADD', meta[2], stamp(meta[2], now), key)
  redis.call('ZADD', meta[4], math.floor(now / 1000) + ttl_ms, key)
  redis.call('HINCRBY', meta[1], 'bytes', size)
  return {1, evicted, reclaimed}
end
"""
)

#: Most keys one :data:`L2_TOUCH_LUA` call stamps (Lua's unpack has a stack limit).
L2_TOUCH_BATCH = 512
#: How long a sidecar holds hits' LRU touches before sending them, seconds.
L2_TOUCH_INTERVAL_S = 0.05

#: KEYS[1] = :func:`lru_key` of one tenant; ARGV = entry keys, least recent
#: first (at most :data:`L2_TOUCH_BATCH`). Stamps them as just used, in that
#: order; a key no longer in the LRU is left out (XX). Returns how many moved.
L2_TOUCH_LUA = (
    _L2_LUA_READ_HELPERS
    + """
local first = stamp(KEYS[1], now_us())
local args = {}
for i = 1, #ARGV do
  args[2 * i - 1] = first + i - 1
  args[2 * i] = ARGV[i]
end
if #args == 0 then return 0 end
return redis.call('ZADD', KEYS[1], 'XX', 'CH', unpack(args))
"""
)

#: KEYS = :func:`l2_keys`; ARGV[1] = the head (``<vector>\n``) a reader expected.
#: Drops the entry and its accounting when it is still not an entry of that
#: head (a write of those epochs meanwhile is kept). Returns 1 when dropped.
L2_FORGET_STALE_LUA = (
    _L2_LUA_READ_HELPERS
    + """
local meta = {KEYS[2], KEYS[3], KEYS[4], KEYS[5]}
local value = redis.call('GET', KEYS[1])
if value and string.sub(value, 1, string.len(ARGV[1])) == ARGV[1] then return 0 end
if value or redis.call('HEXISTS', meta[3], KEYS[1]) == 1 then
  forget(meta, KEYS[1])
  return 1
end
return 0
"""
)

#: KEYS = :func:`l2_keys`; ARGV[1] = value, ARGV[2] = ttl (ms), ARGV[3] =
#: default limit (bytes), ARGV[4] = max entries evicted or reclaimed per call.
#: Returns {status, evicted, reclaimed}: status 1 stored, 0 refused (does not
#: fit after the bounded eviction), -1 refused (larger than the whole limit).
L2_PUT_LUA = (
    _L2_LUA_PRELUDE
    + """
local meta = {KEYS[2], KEYS[3], KEYS[4], KEYS[5]}
return store(KEYS[1], meta, ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4]))
"""
)

#: KEYS = :func:`l2_meta_keys`; ARGV[1] = default limit (bytes), ARGV[2] = max
#: expired entries reclaimed. Returns {bytes used, limit in force, reclaimed}.
L2_USAGE_LUA = (
    _L2_LUA_PRELUDE
    + """
local meta = {KEYS[1], KEYS[2], KEYS[3], KEYS[4]}
local reclaimed = reap(meta, math.floor(now_us() / 1000), tonumber(ARGV[2]))
local used = tonumber(redis.call('HGET', meta[1], 'bytes') or '0')
return {used, limit_of(meta, ARGV[1]), reclaimed}
"""
)


#: KEYS = :func:`l2_meta_keys`; ARGV[1] = the tenant's new limit (0 = the
#: default), ARGV[2] = default limit (bytes), ARGV[3] = most entries reclaimed
#: or evicted by this call. Stores the limit, then reclaims expired entries and
#: evicts the tenant's least recently used ones until its bytes fit the limit in
#: force (a lowered limit takes effect at once, not over the next puts). Returns
#: {evicted, reclaimed, bytes still over the limit}; the caller calls again
#: while the last is positive (each call is bounded, so Redis is never blocked long).
L2_SET_LIMIT_LUA = (
    _L2_LUA_PRELUDE
    + """
local meta = {KEYS[1], KEYS[2], KEYS[3], KEYS[4]}
redis.call('HSET', meta[1], 'limit', ARGV[1])
local max_n = tonumber(ARGV[3])
local limit = limit_of(meta, ARGV[2])
local reclaimed = reap(meta, math.floor(now_us() / 1000), max_n)
local used = tonumber(redis.call('HGET', meta[1], 'bytes') or '0')
local evicted = 0
local steps = reclaimed
while used > limit and steps < max_n do
  local oldest = redis.call('ZRANGE', meta[2], 0, 0)
  if #oldest == 0 then
    redis.call('HSET', meta[1], 'bytes', 0)
    used = 0
    break
  end
  if forget(meta, oldest[1]) == 1 then evicted = evicted + 1 else reclaimed = reclaimed + 1 end
  steps = steps + 1
  used = tonumber(redis.call('HGET', meta[1], 'bytes') or '0')
end
local over = used - limit
if over < 0 then over = 0 end
return {evicted, reclaimed, over}
"""
)

# ------------------------------------------------------------------------ metrics
# The sidecar exports these; the operator reads them back through Prometheus.
# Every sidecar series carries the label ``cache="<namespace>/<name>"``.

#: Counter, labels cache, tenant, tier (l1 | l2 | l3 | upstream), result
#: (hit | miss | bypass | error). A hit is counted at the tier that served it;
#: misses and bypasses at tier ``upstream``.
METRIC_REQUESTS = "cachefleet_requests_total"
#: Histogram (seconds), labels cache, tenant, tier: whole request as the
#: client saw it.
METRIC_REQUEST_DURATION = "cachefleet_request_duration_seconds"
#: Histogram (seconds), labels cache, tenant: upstream call only.
METRIC_UPSTREAM_DURATION = "cachefleet_upstream_duration_seconds"


#: Histogram (bytes of cache), labels cache, tenant: estimated requests by the
#: LRU partition size that would have made them hits (SHARDS-sampled reuse
#: distances, :mod:`cachefleet_sidecar.mrc`); first accesses only in ``+Inf``.
METRIC_REUSE_DISTANCE = "cachefleet_reuse_distance_bytes"


#: Counter (bytes), labels cache, tenant: estimated bytes of first accesses (the
#: distinct data a tenant has shown; with no reuse yet, whether it could still fit).
METRIC_REUSE_COLD_BYTES = "cachefleet_reuse_cold_bytes_total"


def promql_cold_bytes(cache: str, window: str) -> str:
    """Per-tenant bytes of first accesses over ``window``, added over pods."""
    return f'sum by (tenant) (increase({METRIC_REUSE_COLD_BYTES}{{cache="{cache}"}}[{window}]))'


#: Counter, labels cache, tenant, policy, size_bytes: estimated hits of a tenant's own
#: (non-LRU) policy simulated at ``size_bytes`` on the SHARDS sample.
METRIC_POLICY_CURVE_HITS = "cachefleet_policy_curve_hits_total"
#: Counter, labels cache, tenant, policy: estimated requests behind those hits.
METRIC_POLICY_CURVE_REQUESTS = "cachefleet_policy_curve_requests_total"


def _summed_rate(by: str, selector: str, window: str) -> str:
    """``sum by (<by>) (rate(<selector>[<window>]))``: a per-tenant series added over pods."""
    return f"sum by ({by}) (rate({selector}[{window}]))"


def promql_policy_hits(cache: str, window: str) -> str:
    """Per-tenant, per-policy mini-simulation hits by size, added over pods."""
    sel = f'{METRIC_POLICY_CURVE_HITS}{{cache="{cache}"}}'
    return _summed_rate("tenant, policy, size_bytes", sel, window)


def promql_policy_requests(cache: str, window: str) -> str:
    """Per-tenant, per-policy mini-simulation requests, added over pods."""
    return _summed_rate(
        "tenant, policy", f'{METRIC_POLICY_CURVE_REQUESTS}{{cache="{cache}"}}', window
    )


def promql_reuse_buckets(cache: str, window: str) -> str:
    """Per-tenant reuse-distance buckets, added over pods (the miss-ratio curve's data)."""
    return _summed_rate("tenant, le", f'{METRIC_REUSE_DISTANCE}_bucket{{cache="{cache}"}}', window)


def promql_upstream_buckets(cache: str, window: str) -> str:
    """Per-tenant upstream latency buckets (what a miss costs)."""
    sel = f'{METRIC_UPSTREAM_DURATION}_bucket{{cache="{cache}"}}'
    return _summed_rate("tenant, le", sel, window)


def promql_hit_buckets(cache: str, window: str) -> str:
    """Per-tenant latency buckets of hits (L1 and L2)."""
    sel = f'{METRIC_REQUEST_DURATION}_bucket{{cache="{cache}",tier=~"l1|l2"}}'
    return _summed_rate("tenant, le", sel, window)


def promql_lookups(cache: str, window: str) -> str:
    """Per-tenant cacheable lookups per second (hits and misses): the curve's true total."""
    sel = f'{METRIC_REQUESTS}{{cache="{cache}",result=~"hit|miss"}}'
    return _summed_rate("tenant", sel, window)


def promql_p95_seconds(cache: str, window: str) -> str:
    """Per-tenant p95 of request latency over ``window`` (e.g. ``"1m"``)."""
    return (
        "histogram_quantile(0.95, sum by (tenant, le) "
        f'(rate({METRIC_REQUEST_DURATION}_bucket{{cache="{cache}"}}[{window}])))'
    )


def promql_hit_ratio(cache: str, window: str) -> str:
    """Per-tenant hit ratio (hits over hits + misses; bypasses excluded).

    A tenant with misses but no hit series yet gets 0, not "no data".
    """
    sel = f'cache="{cache}"'
    hits = f'sum by (tenant) (rate({METRIC_REQUESTS}{{{sel},result="hit"}}[{window}]))'
    looked = f'sum by (tenant) (rate({METRIC_REQUESTS}{{{sel},result=~"hit|miss"}}[{window}]))'
    return f"({hits} or ({looked} * 0)) / {looked}"


def promql_rps(cache: str, window: str) -> str:
    """Per-tenant request rate (all results)."""
    return f'sum by (tenant) (rate({METRIC_REQUESTS}{{cache="{cache}"}}[{window}]))'


#: Counter, labels cache, tenant, from_policy, to_policy: L1 policy switches of a
#: sidecar's switching engine (to ``sits``) and their rollbacks (from ``sits``). The
#: sidecar exports each tenant's two series at 0 before its first switch, so that
#: a first switch is a change Prometheus can see (docs/sits.md).
METRIC_POLICY_SWITCHES = "cachefleet_policy_switches_total"


#: Counter (seconds), labels cache, tenant, model: upstream seconds cache hits avoided
#: (each entry records the upstream time of its fill; a hit adds it).
METRIC_SAVED_MODEL_SECONDS = "cachefleet_saved_model_seconds_total"
#: Counter (tokens), labels cache, tenant, model, kind (prompt, completion): tokens
#: cache hits kept from the model (the usage of the stored answers).
METRIC_SAVED_TOKENS = "cachefleet_saved_tokens_total"


#: Counter (price units), labels cache, tenant, model: what the saved tokens cost by
#: the sidecar's --price-table.
METRIC_SAVED_COST = "cachefleet_saved_cost_total"


def promql_saved_model_seconds(cache: str, window: str) -> str:
    """Per-tenant model seconds cache hits saved over ``window``, added over pods and models."""
    sel = f'{METRIC_SAVED_MODEL_SECONDS}{{cache="{cache}"}}'
    return f"sum by (tenant) (increase({sel}[{window}]))"


def promql_saved_tokens(cache: str, window: str) -> str:
    """Per-tenant, per-kind (prompt, completion) tokens saved over ``window``."""
    sel = f'{METRIC_SAVED_TOKENS}{{cache="{cache}"}}'
    return f"sum by (tenant, kind) (increase({sel}[{window}]))"


def promql_saved_cost(cache: str, window: str) -> str:
    """Per-tenant price of the saved tokens over ``window`` (sidecars with a price table)."""
    return f'sum by (tenant) (increase({METRIC_SAVED_COST}{{cache="{cache}"}}[{window}]))'


def promql_policy_switches(cache: str, span: str) -> str:
    """Per tenant and (from, to): how many series (pods) counted a switch over ``span``.

    Each series' value now minus its value ``span`` ago (``offset``), not
    ``increase()``: evaluated at instants that tile time (each query's span
    starts where the last one ended), these differences add up exactly, with no
    change lost between two scrapes that straddle a boundary. A series new
    within the span counts if it is above 0; a counter reset is not counted.
    """
    x = f'{METRIC_POLICY_SWITCHES}{{cache="{cache}"}}'
    return (
        "count by (tenant, from_policy, to_policy) "
        f"((({x} - ({x} offset {span})) > 0) or ({x} > 0 unless ({x} offset {span})))"
    )


# --------------------------------------------------------------------- redis URLs

#: URL schemes that name a Redis Cluster, and the plain scheme of each node.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}

#: The client types :func:`redis_from_url` returns.
RedisClient = Redis | RedisCluster


@dataclass(frozen=True)
class RedisTarget:
    """A parsed Redis URL (see the module docstring for the convention)."""

    cluster: bool
    nodes: tuple[tuple[str, int], ...]
    tls: bool = False
    username: str | None = None
    password: str | None = None
    db: int = 0
    #: CA bundle that signs the server's certificate (``?ssl_ca_certs=PATH``), for rediss.
    ca_file: str | None = None


def redact_url(url: str) -> str:
    """``url`` with its password (or a lone user-info token) replaced by ``***``.

    For logs, ``/status`` and error messages: a URL that carries credentials
    is never shown whole.
    """
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if not at:
        return url
    user, colon, _ = userinfo.partition(":")
    masked = f"{user}:***" if colon else "***"
    return urlunsplit(parts._replace(netloc=f"{masked}@{hosts}"))


def parse_redis_url(url: str, *, cluster: bool | None = None) -> RedisTarget:
    """Parse a Redis URL; ``cluster`` overrides what the scheme says.

    Raises ValueError on a URL that is not ``redis``, ``rediss``,
    ``redis+cluster`` or ``rediss+cluster`` or that names no host.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in CLUSTER_SCHEMES:
        is_cluster, tls = True, CLUSTER_SCHEMES[scheme] == "rediss"
    elif scheme in ("redis", "rediss"):
        is_cluster, tls = False, scheme == "rediss"
    else:
        raise ValueError(f"not a Redis URL: {redact_url(url)!r}")
    if cluster is not None:
        is_cluster = cluster
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    nodes: list[tuple[str, int]] = []
    for item in hosts.split(","):
        if not item:
            continue
        node = urlsplit(f"//{item}")
        if not node.hostname:
            raise ValueError(f"no host in Redis URL {redact_url(url)!r}")
        nodes.append((node.hostname, node.port or 6379))
    if not nodes:
        raise ValueError(f"no host in Redis URL {redact_url(url)!r}")
    path = parts.path.strip("/")
    ca_files = parse_qs(parts.query).get("ssl_ca_certs")
    return RedisTarget(
        cluster=is_cluster,
        nodes=tuple(nodes),
        tls=tls,
        username=unquote(username) or None,
        password=unquote(password) or None,
        db=int(path) if path.isdigit() else 0,
        ca_file=ca_files[0] if ca_files else None,
    )


def redis_from_url(url: str, *, cluster: bool | None = None, **options: Any) -> RedisClient:
    """An asyncio client for ``url``: :class:`Redis` or :class:`RedisCluster`.

    ``options`` go to the client constructor (timeouts, ``retry``,
    ``decode_responses`` ...). The client connects lazily.
    """
    target = parse_redis_url(url, cluster=cluster)
    common: dict[str, Any] = {"username": target.username, "password": target.password}
    if target.tls:
        common["ssl"] = True
        if target.ca_file:
            common["ssl_ca_certs"] = target.ca_file
    if target.cluster:
        startup = [ClusterNode(host, port) for host, port in target.nodes]
        return RedisCluster(startup_nodes=startup, **common, **options)
    host, port = target.nodes[0]
    return Redis(host=host, port=port, db=target.db, **common, **options)


def resp_client(
    url: str,
    *,
    cluster: bool | None = None,
    command_timeout_s: float = resp.DEFAULT_COMMAND_TIMEOUT_S,
    connect_timeout_s: float = resp.DEFAULT_CONNECT_TIMEOUT_S,
) -> resp.RespClient:
    """The sidecar's lean hot-path client (:mod:`cachefleet_sidecar.resp`) for ``url``.

    Same URL convention, credentials (ACL user) and TLS (``rediss``, ``?ssl_ca_certs``)
    as :func:`redis_from_url`; it connects lazily (call ``connect()`` to warm up).
    """
    target = parse_redis_url(url, cluster=cluster)
    host, port = target.nodes[0]
    settings = resp.NodeSettings(
        host=host,
        port=port,
        username=target.username,
        password=target.password,
        db=0 if target.cluster else target.db,
        ssl_context=resp.tls_context(target.ca_file) if target.tls else None,
        connect_timeout_s=connect_timeout_s,
    )
    return resp.RespClient(
        settings,
        cluster=target.cluster,
        startup=target.nodes,
        command_timeout_s=command_timeout_s,
    )


# ------------------------------------------------------------------ Redis ACLs
# Least-privilege ACL rules (``ACL SETUSER <user> on ><password> <rules...>``) for the
# two kinds of Redis user; docs/security.md shows them and a test runs under them.

#: Commands a sidecar sends (connection set-up, L2 scripts, control sync, heartbeats).
SIDECAR_COMMANDS = (
    "+hello", "+auth", "+ping", "+select", "+client|setname",
    "+readonly", "+cluster|slots", "+cluster|shards", "+cluster|nodes",
    "+eval", "+evalsha", "+script|load",
    "+get", "+mget", "+hget", "+hmget", "+hgetall", "+hset", "+hdel", "+sadd", "+smembers",
    "+zrangebyscore", "+zrem", "+del",
    "+publish", "+spublish", "+subscribe", "+unsubscribe", "+ssubscribe", "+sunsubscribe",
    "+xadd",
)  # fmt: skip
#: Commands the L2 and control Lua scripts run on the caller's behalf.
SCRIPT_COMMANDS = (
    "+set", "+hexists", "+hincrby", "+time", "+unlink",
    "+zadd", "+zrange", "+zremrangebyscore", "+zscore",
    "+exists", "+pexpire",
)  # fmt: skip
#: Further commands of the operator (cleanup of a deleted cache scans its keys; the
#: key-purge script trims the purge log; the fleet curves read the fleet-sample stream).
OPERATOR_COMMANDS = ("+scan", "+zcard", "+zremrangebyrank", "+xrange")


def _cache_patterns(cache: str) -> list[str]:
    escaped = cache.replace("[", "\\[").replace("]", "\\]").replace("*", "\\*")
    escaped = escaped.replace("?", "\\?")
    return [f"~cf:{{cf:{escaped}}}:*", f"~cf:{{cf:{escaped}|*"]


def sidecar_acl(cache: str) -> list[str]:
    """ACL rules of a sidecar user: its cache's keys and channels, nothing else."""
    escaped = cache.replace("[", "\\[").replace("]", "\\]").replace("*", "\\*")
    return [
        "resetkeys",
        *_cache_patterns(cache),
        "resetchannels",
        f"&cf:{{cf:{escaped}}}:*",
        "nocommands",
        *SIDECAR_COMMANDS,
        *SCRIPT_COMMANDS,
    ]


def operator_acl() -> list[str]:
    """ACL rules of the operator's user: every cache's keys and channels (it serves them all)."""
    return [
        "resetkeys",
        "~cf:*",
        "resetchannels",
        "&cf:*",
        "nocommands",
        *SIDECAR_COMMANDS,
        *SCRIPT_COMMANDS,
        *OPERATOR_COMMANDS,
    ]


# ------------------------------------------------------ reference implementation


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


@dataclass(frozen=True)
class ScriptCall:
    """One script invocation: the Lua source, its KEYS and ARGV (any client runs it)."""

    source: str
    keys: list[str]
    args: list[str]


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
    client: RedisClient, cache: str, heartbeat: Heartbeat, ttl_s: float = DEFAULT_HEARTBEAT_TTL_S
) -> None:
    """Register ``heartbeat`` as a live member for ``ttl_s`` seconds (not for a deleted cache)."""
    call = heartbeat_call(cache, heartbeat, ttl_s)
    await client.eval(call.source, len(call.keys), *call.keys, *call.args)


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
    names = {t.decode() if isinstance(t, bytes) else str(t) for t in raw} | set(tenants)
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
        name = key.decode() if isinstance(key, bytes) else str(key)
        if name.endswith(":deleted"):
            gone += int(await client.unlink(name))
    return gone


async def remove_member(client: RedisClient, cache: str, pod: str) -> None:
    """Drop ``pod`` from the members at once (a sidecar shutting down cleanly)."""
    await client.zrem(members_key(cache), pod)
    await client.delete(member_key(cache, pod))
    await client.hdel(acks_key(cache), pod)


async def live_members(client: RedisClient, cache: str) -> list[Heartbeat]:
    """Heartbeats of every sidecar whose membership has not expired, by pod name."""
    pods = await client.zrangebyscore(members_key(cache), repr(time.time()), "+inf")
    names = sorted(p.decode() if isinstance(p, bytes) else str(p) for p in pods)
    if not names:
        return []
    raws = await client.mget([member_key(cache, pod) for pod in names])
    return [Heartbeat.model_validate_json(raw) for raw in raws if raw is not None]


# ------------------------------------------------------------------------ epochs
# Scope names and vector encoding are pure and live in cachefleet_sidecar.epochs;
# they are re-exported here because they are part of the contract.

#: Most CAS attempts of one :func:`advance_epoch` before it gives up.
MAX_CAS_ATTEMPTS = 1000


def epochs_key(cache: str) -> str:
    """The sequencer: scope -> epoch (control slot)."""
    return f"{_control(cache)}:epochs"


def l2_tenants_key(cache: str) -> str:
    """Set of tenants with L2 data (control slot)."""
    return f"{_control(cache)}:tenants"


def acks_key(cache: str) -> str:
    """Hash pod -> JSON :class:`EpochAck` (control slot)."""
    return f"{_control(cache)}:acks"


def ack_channel(cache: str) -> str:
    """Pub/sub channel on which every acknowledgement is also announced."""
    return f"{_control(cache)}:acked"


def tenant_epochs_key(cache: str, tenant: str) -> str:
    """The fence of one tenant's data slot: scope -> epoch."""
    return f"{_tenant(cache, tenant)}:epochs"


def tenant_tombstone_key(cache: str, tenant: str) -> str:
    """The tombstone of one tenant's data slot (a deleted cache; see :func:`tombstone_key`)."""
    return f"{_tenant(cache, tenant)}:deleted"


def l2_versioned_keys(cache: str, tenant: str, digest_hex: str) -> list[str]:
    """KEYS of the versioned L2 scripts: :func:`l2_keys`, the tenant's fence and tombstone."""
    return [
        *l2_keys(cache, tenant, digest_hex),
        tenant_epochs_key(cache, tenant),
        tenant_tombstone_key(cache, tenant),
    ]


def vector_args(vector: EpochVector) -> list[str]:
    """ARGV tail of the versioned L2 scripts: the encoded vector, then scope, epoch pairs."""
    args = [encode_vector(vector)]
    for scope, epoch in vector:
        args += [scope, str(epoch)]
    return args


class EpochConflict(Exception):
    """:func:`advance_epoch` lost the CAS race :data:`MAX_CAS_ATTEMPTS` times in a row."""


class EpochAck(_Model):
    """A sidecar's acknowledgement: the epochs it has applied, and when."""

    protocol: int = PROTOCOL_VERSION
    pod: str
    epochs: dict[str, int] = Field(default_factory=dict)
    acked_at: float = Field(default_factory=time.time)


#: KEYS[1] = epochs_key; ARGV[1] = scope, ARGV[2] = the epoch the caller read.
#: Returns {1, new epoch} when the epoch was still ARGV[2] (now +1), else
#: {0, current epoch} (someone else advanced it: read again and retry).
EPOCH_CAS_LUA = """
local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if cur ~= tonumber(ARGV[2]) then return {0, cur} end
redis.call('HSET', KEYS[1], ARGV[1], string.format('%d', cur + 1))
return {1, cur + 1}
"""

#: KEYS[1] = an epoch hash (sequencer or fence); ARGV = scope, epoch pairs.
#: Raises each scope to at least the given epoch, never lowers one. Returns
#: how many scopes moved.
EPOCH_MERGE_LUA = """
local moved = 0
for i = 1, #ARGV, 2 do
  local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0')
  if tonumber(ARGV[i + 1]) > cur then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    moved = moved + 1
  end
end
return moved
"""

#: KEYS[1] = an epoch hash of the control slot, KEYS[2] = tombstone_key; ARGV as
#: :data:`EPOCH_MERGE_LUA`. Returns -1 and writes nothing for a deleted cache.
EPOCH_RESTORE_LUA = "if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end\n" + EPOCH_MERGE_LUA

#: KEYS[1] = l2_tenants_key, KEYS[2] = tombstone_key; ARGV[1] = tenant.
#: Returns 0 (nothing written) for a deleted cache.
REGISTER_TENANT_LUA = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('SADD', KEYS[1], ARGV[1])
return 1
"""

#: KEYS[1] = acks_key, KEYS[2] = tombstone_key; ARGV[1] = pod, ARGV[2] = JSON
#: EpochAck, ARGV[3] = ack_channel. Nothing is written for a deleted cache.
ACK_LUA = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PUBLISH', ARGV[3], ARGV[2])
return 1
"""

# 1 when every (scope, epoch) pair of ARGV from index `first` is at least the fence
# (the fence's scopes read with one HMGET: every redis.call adds a round of Lua glue).
_FENCE_LUA = """
local function current(fence, first)
  local scopes = {}
  for i = first, #ARGV, 2 do scopes[#scopes + 1] = ARGV[i] end
  if #scopes == 0 then return 1 end
  local seen = redis.call('HMGET', fence, unpack(scopes))
  for j = 1, #scopes do
    if tonumber(seen[j] or '0') > tonumber(ARGV[first + 2 * j - 1]) then return 0 end
  end
  return 1
end
"""


def fence_command(cache: str, tenant: str, vector: EpochVector) -> bytes:
    """The packed ``HMGET`` of ``tenant``'s fence for the scopes of ``vector``, in its order."""
    if not vector:
        return b""
    return resp.pack_command(("HMGET", tenant_epochs_key(cache, tenant), *(s for s, _ in vector)))


def entry_head(vector: EpochVector) -> bytes:
    """What a versioned entry written under ``vector`` starts with."""
    return encode_vector(vector).encode() + b"\n"


#: :func:`judge_versioned_read`'s verdicts besides a hit (which returns the value).
READ_MISS: Final = 0
READ_STALE_ENTRY: Final = 2
READ_BEHIND: Final = -1


def judge_versioned_read(
    value: bytes | None, fence: Sequence[bytes | None], vector: EpochVector, head: bytes
) -> bytes | int:
    """The verdict on a versioned read's ``GET`` and fence ``HMGET`` replies.

    The value without its head (a hit), :data:`READ_BEHIND` (a fence field is
    ahead of ``vector``: the reader missed an invalidation and must not be
    served), :data:`READ_MISS`, or :data:`READ_STALE_ENTRY` (a value that is
    not an entry of ``vector``: written under other epochs, or corrupt).
    """
    for seen, (_, epoch) in zip(fence, vector, strict=True):
        if seen is not None and int(seen) > epoch:
            return READ_BEHIND
    if value is None:
        return READ_MISS
    if not value.startswith(head):
        return READ_STALE_ENTRY
    body = value[len(head) :]
    if body[:1] == L1_ID_MARK:
        return split_l1_id(body)[1]
    return body


#: Starts the optional L1-key line between a versioned entry's head and the entry.
L1_ID_MARK: Final = b"#"


def l1_id_line(l1_id: int) -> bytes:
    """The line a writer puts before its entry: ``#<L1 key hex>\n``."""
    return b"#%x\n" % l1_id


def split_l1_id(body: bytes) -> tuple[int | None, bytes]:
    """(the writer's L1 key or None, the entry) of what follows a versioned entry's head."""
    if body[:1] != L1_ID_MARK:
        return None, body
    end = body.find(b"\n", 1, 40)
    if end < 0:
        return None, body
    try:
        return int(body[1:end], 16), body[end + 1 :]
    except ValueError:
        return None, body


#: KEYS = :func:`l2_versioned_keys`; ARGV[1] = value, ARGV[2] = ttl (ms),
#: ARGV[3] = default limit, ARGV[4] = max evicted, ARGV[5..] = :func:`vector_args`
#: of the writer. Returns {status, evicted, reclaimed} as :data:`L2_PUT_LUA`,
#: plus status -2: refused, the writer's epochs are below the fence or the
#: cache was deleted (the tenant slot's tombstone exists).
L2_PUT_VERSIONED_LUA = (
    _L2_LUA_PRELUDE
    + _FENCE_LUA
    + """
local meta = {KEYS[2], KEYS[3], KEYS[4], KEYS[5]}
if redis.call('EXISTS', KEYS[7]) == 1 then return {-2, 0, 0} end
if current(KEYS[6], 6) == 0 then return {-2, 0, 0} end
local value = ARGV[5] .. '\\n' .. ARGV[1]
return store(KEYS[1], meta, value, tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4]))
"""
)


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


async def fence_tenants(
    client: RedisClient, cache: str, epochs: Mapping[str, int], tenants: Iterable[str] | None = None
) -> int:
    """Raise the fence of ``tenants`` (default: every registered tenant) to ``epochs``.

    Returns how many tenant slots were fenced.
    """
    if tenants is None:
        raw = await client.smembers(l2_tenants_key(cache))
        names = sorted(t.decode() if isinstance(t, bytes) else str(t) for t in raw)
    else:
        names = sorted(set(tenants))
    args = _merge_args(epochs)
    if not args:
        return 0
    for tenant in names:
        await client.eval(EPOCH_MERGE_LUA, 1, tenant_epochs_key(cache, tenant), *args)
    return len(names)


async def publish_epochs(client: RedisClient, cache: str, epochs: Mapping[str, int]) -> None:
    """Announce advanced epochs on the control channel (receivers max-merge them)."""
    top = max(epochs.values(), default=0)
    message = ControlMessage(kind="epochs", generation=top, epochs=dict(epochs))
    await client.publish(control_channel(cache), message.model_dump_json())


def ack_call(cache: str, ack: EpochAck) -> ScriptCall:
    """The :data:`ACK_LUA` call that records ``ack`` and announces it."""
    return ScriptCall(
        ACK_LUA,
        [acks_key(cache), tombstone_key(cache)],
        [ack.pod, ack.model_dump_json(), ack_channel(cache)],
    )


async def write_ack(client: RedisClient, cache: str, ack: EpochAck) -> None:
    """Record ``ack`` and announce it on :func:`ack_channel` (one round trip)."""
    call = ack_call(cache, ack)
    await client.eval(call.source, len(call.keys), *call.keys, *call.args)


async def read_acks(client: RedisClient, cache: str) -> dict[str, EpochAck]:
    """Every recorded acknowledgement of ``cache``, by pod (unreadable ones skipped)."""
    out: dict[str, EpochAck] = {}
    for pod, raw in (await client.hgetall(acks_key(cache))).items():
        try:
            ack = EpochAck.model_validate_json(raw)
        except ValueError:
            continue
        out[pod.decode() if isinstance(pod, bytes) else str(pod)] = ack
    return out


# ------------------------------------------------ the invalidation path, lean client
# The operator's steps after the CAS (fence, announce, read members and acks) are on
# the propagation path: these run them on :mod:`cachefleet_sidecar.resp` (pipelined,
# no pydantic per ack). Same keys and scripts as the redis-py functions above.

#: :data:`EPOCH_MERGE_LUA` as the lean client runs it (EVALSHA).
EPOCH_MERGE_SCRIPT = resp.Script(EPOCH_MERGE_LUA)


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


async def fence_tenants_lean(
    client: resp.RespClient,
    cache: str,
    epochs: Mapping[str, int],
    tenants: Iterable[str] | None = None,
    *,
    announce: bool = False,
    timeout_s: float | None = None,
) -> int:
    """:func:`fence_tenants` on the lean client: every tenant's fence in one pipelined batch.

    ``announce``: :func:`publish_epochs` in the same batch, queued after the
    fences (on one node Redis applies them first; on a cluster they may land
    in any order, and the caller's wait starts only once every fence answered,
    which is what an acknowledged invalidation rests on). Returns how many
    tenant slots were fenced.
    """
    if tenants is None:
        key = l2_tenants_key(cache)
        raw = await client.execute("SMEMBERS", key, key=key, timeout_s=timeout_s)
        names = sorted(_text(t) for t in raw)
    else:
        names = sorted(set(tenants))
    args = _merge_args(epochs)
    if not args:
        return 0
    batch: list[Awaitable[Any]] = [
        client.run_script(
            EPOCH_MERGE_SCRIPT, [tenant_epochs_key(cache, t)], args, timeout_s=timeout_s
        )
        for t in names
    ]
    if announce:
        batch.append(publish_epochs_lean(client, cache, epochs, timeout_s=timeout_s))
    await asyncio.gather(*batch)
    return len(names)


async def publish_epochs_lean(
    client: resp.RespClient,
    cache: str,
    epochs: Mapping[str, int],
    *,
    timeout_s: float | None = None,
) -> None:
    """:func:`publish_epochs` on the lean client."""
    top = max(epochs.values(), default=0)
    message = ControlMessage(kind="epochs", generation=top, epochs=dict(epochs))
    channel = control_channel(cache)
    await client.execute(
        "PUBLISH", channel, message.model_dump_json(), key=channel, timeout_s=timeout_s
    )


def ack_epochs(raw: bytes | str) -> tuple[str, dict[str, int]] | None:
    """(pod, epochs) of one JSON :class:`EpochAck` (hash value or announcement), or None.

    The invalidation wait reads one per sidecar; plain JSON, no model.
    """
    try:
        doc = orjson.loads(raw)
        pod, epochs = doc["pod"], doc["epochs"]
        if not isinstance(pod, str) or not isinstance(epochs, dict):
            return None
        return pod, {str(s): int(e) for s, e in epochs.items()}
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


async def live_acks_lean(
    client: resp.RespClient, cache: str, *, timeout_s: float | None = None
) -> tuple[list[str], dict[str, dict[str, int]]]:
    """(live pods, acknowledged epochs by pod) read now: :func:`live_members` + :func:`read_acks`.

    A pod is live while its membership score has not passed and its heartbeat
    key exists. All keys are in the control slot (one node), so the reads are
    pipelined. Unreadable acks are skipped.
    """
    members, acks = members_key(cache), acks_key(cache)
    pods, flat = await asyncio.gather(
        client.execute(
            "ZRANGEBYSCORE", members, repr(time.time()), "+inf", key=members, timeout_s=timeout_s
        ),
        client.execute("HGETALL", acks, key=acks, timeout_s=timeout_s),
    )
    names = sorted(_text(p) for p in pods)
    live: list[str] = []
    if names:
        keys = [member_key(cache, pod) for pod in names]
        beats = await client.execute("MGET", *keys, key=keys[0], timeout_s=timeout_s)
        live = [pod for pod, raw in zip(names, beats, strict=True) if raw is not None]
    out: dict[str, dict[str, int]] = {}
    for i in range(0, len(flat) - 1, 2):
        parsed = ack_epochs(flat[i + 1])
        if parsed is not None:
            out[_text(flat[i])] = parsed[1]
    return live, out


# --------------------------------------------------------------------- key purges

#: Purges the log keeps (older ones are trimmed; a sidecar that missed them empties its L1).
PURGE_LOG_MAX = 10000
#: What a purge names: the SHA-256 hex digest of an entry's key (``X-Cache-Key``).
DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")


def purge_log_key(cache: str) -> str:
    """The purge log: sorted set ``<seq>:<digest>`` -> seq (control slot)."""
    return f"{_control(cache)}:purges"


#: KEYS[1] = epochs_key, KEYS[2] = purge_log_key; ARGV[1] = the ``purge`` epoch the
#: caller read, ARGV[2] = digest, ARGV[3] = PURGE_LOG_MAX. Returns {1, new epoch}
#: (advanced and logged) or {0, current epoch} (someone else advanced it: retry).
PURGE_CAS_LUA = """
local cur = tonumber(redis.call('HGET', KEYS[1], 'purge') or '0')
if cur ~= tonumber(ARGV[1]) then return {0, cur} end
local new = cur + 1
redis.call('HSET', KEYS[1], 'purge', string.format('%d', new))
redis.call('ZADD', KEYS[2], new, string.format('%d', new) .. ':' .. ARGV[2])
local n = redis.call('ZCARD', KEYS[2])
local keep = tonumber(ARGV[3])
if n > keep then redis.call('ZREMRANGEBYRANK', KEYS[2], 0, n - keep - 1) end
return {1, new}
"""

#: KEYS = :func:`l2_keys` of the digest, then the tenant's fence; ARGV[1] = the purge
#: epoch. Raises the fence's ``purge`` to it and deletes the entry with its
#: accounting. Returns 1 when an entry was deleted.
PURGE_FENCE_LUA = (
    _L2_LUA_READ_HELPERS
    + """
local meta = {KEYS[2], KEYS[3], KEYS[4], KEYS[5]}
local cur = tonumber(redis.call('HGET', KEYS[6], 'purge') or '0')
if tonumber(ARGV[1]) > cur then redis.call('HSET', KEYS[6], 'purge', ARGV[1]) end
if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('HEXISTS', meta[3], KEYS[1]) == 1 then
  return forget(meta, KEYS[1])
end
return 0
"""
)
PURGE_FENCE_SCRIPT = resp.Script(PURGE_FENCE_LUA)


def check_digest(digest: str) -> str:
    """``digest`` if it is a SHA-256 hex digest (64 lower-case hex digits); else ValueError."""
    if not DIGEST_RE.match(digest):
        raise ValueError(f"not a SHA-256 hex digest (64 of 0-9a-f): {digest[:80]!r}")
    return digest


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


async def purge_logged(client: RedisClient, cache: str, digest: str, since: int) -> int | None:
    """The sequence number ``digest`` was logged under at ``since`` or later, if any."""
    members = await client.zrangebyscore(purge_log_key(cache), since, "+inf")
    for raw in members:
        seq, _, logged = (raw.decode() if isinstance(raw, bytes) else str(raw)).partition(":")
        if logged == digest:
            return int(seq)
    return None


async def purge_fence_lean(
    client: resp.RespClient,
    cache: str,
    digest: str,
    epoch: int,
    tenants: Iterable[str] | None = None,
    *,
    announce: bool = False,
    timeout_s: float | None = None,
) -> int:
    """:data:`PURGE_FENCE_LUA` in the slot of ``tenants`` (default: every registered one).

    ``announce``: the ``purge`` epoch is announced in the same batch, queued
    after the fences (see :func:`fence_tenants_lean`). Returns the entries deleted.
    """
    if tenants is None:
        key = l2_tenants_key(cache)
        raw = await client.execute("SMEMBERS", key, key=key, timeout_s=timeout_s)
        names = sorted(_text(t) for t in raw)
    else:
        names = sorted(set(tenants))
    batch: list[Awaitable[Any]] = [
        client.run_script(
            PURGE_FENCE_SCRIPT,
            [*l2_keys(cache, t, digest), tenant_epochs_key(cache, t)],
            [str(int(epoch))],
            timeout_s=timeout_s,
        )
        for t in names
    ]
    if announce:
        batch.append(publish_epochs_lean(client, cache, {PURGE_SCOPE: epoch}, timeout_s=timeout_s))
    replies = await asyncio.gather(*batch)
    return sum(int(r) for r in replies[: len(names)])


async def purges_since_lean(
    client: resp.RespClient, cache: str, after: int, upto: int, *, timeout_s: float | None = None
) -> tuple[list[str], bool]:
    """(digests purged with sequence numbers in (after, upto], whether the log held them all)."""
    if upto <= after:
        return [], True
    key = purge_log_key(cache)
    raw = await client.execute(
        "ZRANGEBYSCORE", key, f"({after}", str(upto), key=key, timeout_s=timeout_s
    )
    digests: list[str] = []
    seen: set[int] = set()
    for member in raw:
        seq, _, digest = _text(member).partition(":")
        try:
            seen.add(int(seq))
        except ValueError:
            continue
        digests.append(digest)
    return digests, seen >= set(range(after + 1, upto + 1))


# ------------------------------------------------------------------- fleet samples
# Every sidecar forwards the accesses of the keys whose sampling hash (the bits the
# miss-ratio curves sample by, cachefleet_sidecar.mrc) is below one fleet-wide
# threshold: every pod samples the same keys, so the operator can replay them as one
# key stream and measure reuse the whole fleet sees (L2 answers a key's first access
# on a pod). One stream entry is one batch of one pod, field ``b``:
#   {"pod": P, "thr": threshold, "t0": unix ms, "s": {tenant: [key, size, dt_ms, ...]}}
# where ``key`` is the upper 64 bits of the 128-bit key digest (its low 24 bits are the
# sampling hash) and ``dt_ms`` the access's time after ``t0``.

#: Fraction of the key space every sidecar forwards (the same on every pod).
FLEET_SAMPLE_RATE = 1 / 16
#: Batches the stream keeps (XADD MAXLEN ~): a bound on its memory, not a window.
FLEET_STREAM_MAXLEN = 600
#: Accesses one batch carries at most; more in one flush interval are dropped.
FLEET_BATCH_MAX = 2048
#: How often a sidecar sends its batch, seconds.
FLEET_FLUSH_S = 1.0
#: Batches the operator reads from one stream per rebalance at most.
FLEET_READ_MAX = 6000


@dataclass(frozen=True, slots=True)
class FleetSample:
    """One forwarded access: ``key`` (upper 64 bits of the digest), bytes, unix seconds."""

    tenant: str
    key: int
    size: int
    at: float


def encode_fleet_batch(
    pod: str, threshold: int, samples: Iterable[tuple[str, int, int, float]]
) -> bytes:
    """One stream entry's payload from (tenant, digest, size, unix seconds) accesses."""
    by_tenant: dict[str, list[int]] = {}
    rows = list(samples)
    t0 = int(min((s[3] for s in rows), default=time.time()) * 1000)
    for tenant, digest, size, at in rows:
        flat = by_tenant.get(tenant)
        if flat is None:
            flat = by_tenant[tenant] = []
        flat += (digest >> 64, size, int(at * 1000) - t0)
    return orjson.dumps({"pod": pod, "thr": threshold, "t0": t0, "s": by_tenant})


def decode_fleet_batch(raw: bytes | str) -> tuple[int, list[FleetSample]]:
    """(threshold, samples) of one payload; ValueError when it is not one."""
    try:
        body = orjson.loads(raw)
        threshold, t0, groups = int(body["thr"]), int(body["t0"]), body["s"]
        out: list[FleetSample] = []
        for tenant, flat in groups.items():
            if not valid_name(tenant) or len(flat) % 3:
                raise ValueError(f"bad fleet sample group {tenant[:70]!r}")
            for i in range(0, len(flat), 3):
                key, size, dt = int(flat[i]), int(flat[i + 1]), int(flat[i + 2])
                out.append(FleetSample(tenant, key, size, (t0 + dt) / 1000.0))
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a fleet sample batch: {exc}") from exc
    return threshold, out


async def add_fleet_batch_lean(
    client: resp.RespClient, cache: str, payload: bytes, *, timeout_s: float | None = None
) -> None:
    """Append one batch to the cache's fleet-sample stream, trimmed to about its bound."""
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
