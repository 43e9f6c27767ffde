"""The Lua scripts of the contract: control state, the L2 tiers, epochs and key purges.

Each script's comment says its KEYS (built by :mod:`cachefleet_common.contract.names`)
and ARGV. Every key one script touches carries one hashtag, so each runs on one
cluster slot. :mod:`cachefleet_common.contract.ops` and the sidecar's L2 run them.
"""

from __future__ import annotations

from cachefleet_common.contract.names import GUEST_POOL

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

#: Lua pattern of a guest's entry key (names.entry_key of a names.guest): its capture is
#: the guest's scope, whose ``:usage`` (field ``bytes``) and ``:lru`` the scripts keep
#: beside the pool's accounting (names.guest_usage_key, names.guest_lru_key). Both are
#: in the entry's slot; the scripts derive them, as any entry of the pool may be evicted.
GUEST_OWNER_PATTERN = f"^(.*|{GUEST_POOL}}}:g:[^:]+):e:%x+$"
#: Most of the guests' pool one guest may hold when the pool's accounting names none
#: (spec.tenantDefaults.l2GuestMaxShare, stored with the pool's limit as field
#: :data:`GUEST_MAX_SHARE_FIELD`): a put over it evicts that guest's own least recently
#: used entries first, so one busy guest never takes the whole pool.
DEFAULT_GUEST_MAX_SHARE = 0.25
#: The field of the pool's accounting hash (names.usage_key of names.GUESTS) holding
#: the fraction of the pool one guest may hold, beside its ``limit``.
GUEST_MAX_SHARE_FIELD = "guest_max_share"

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
-- A guest's entry: the scope of its owner (whose :usage and :lru it also counts in).
local function owner_of(member)
  return string.match(member, '@GUEST_OWNER_PATTERN@')
end
-- Drop one entry and its accounting; returns 1 if the value still existed.
local function forget(meta, member)
  local size = tonumber(redis.call('HGET', meta[3], member) or '0')
  redis.call('HDEL', meta[3], member)
  redis.call('ZREM', meta[2], member)
  redis.call('ZREM', meta[4], member)
  local owner = owner_of(member)
  if owner then redis.call('ZREM', owner .. ':lru', member) end
  local existed = redis.call('UNLINK', member)
  if size > 0 then
    local left = redis.call('HINCRBY', meta[1], 'bytes', -size)
    if left < 0 then redis.call('HSET', meta[1], 'bytes', 0) end
    if owner and redis.call('HINCRBY', owner .. ':usage', 'bytes', -size) <= 0 then
      redis.call('DEL', owner .. ':usage')
    end
  end
  return existed
end
""".replace("@GUEST_OWNER_PATTERN@", GUEST_OWNER_PATTERN)
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
-- The most bytes of the pool one guest may hold (limit: the pool's, in force).
local function guest_cap(meta, limit)
  local share = tonumber(redis.call('HGET', meta[1], '@GUEST_MAX_SHARE_FIELD@') or '')
  if share == nil or share <= 0 or share > 1 then share = @DEFAULT_GUEST_MAX_SHARE@ end
  return math.floor(limit * share)
end
-- Store value under key within the tenant's quota; returns {status, evicted, reclaimed}.
-- A guest's key (owner) is stored within its own cap too: its oldest entries go first.
local function store(key, meta, value, ttl_ms, default_limit, max_n)
  local size = string.len(value)
  local limit = limit_of(meta, default_limit)
  if size > limit then return {-1, 0, 0} end
  local owner = owner_of(key)
  local each = 0
  if owner then
    each = guest_cap(meta, limit)
    if size > each then return {-1, 0, 0} end
  end
  local now = now_us()
  local reclaimed = reap(meta, math.floor(now / 1000), max_n)
  if redis.call('HEXISTS', meta[3], key) == 1 then forget(meta, key) end
  local evicted = 0
  local steps = 0
  if owner then
    local mine = tonumber(redis.call('HGET', owner .. ':usage', 'bytes') or '0')
    while mine + size > each and steps < max_n do
      local oldest = redis.call('ZRANGE', owner .. ':lru', 0, 0)
      if #oldest == 0 then
        redis.call('DEL', owner .. ':usage')
        mine = 0
        break
      end
      if forget(meta, oldest[1]) == 1 then evicted = evicted + 1 else reclaimed = reclaimed + 1 end
      steps = steps + 1
      mine = tonumber(redis.call('HGET', owner .. ':usage', 'bytes') or '0')
    end
    if mine + size > each then return {0, evicted, reclaimed} end
  end
  local used = tonumber(redis.call('HGET', meta[1], 'bytes') or '0')
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
  local at = stamp(meta[2], now)
  redis.call('ZADD', meta[2], at, key)
  redis.call('ZADD', meta[4], math.floor(now / 1000) + ttl_ms, key)
  redis.call('HINCRBY', meta[1], 'bytes', size)
  if owner then
    redis.call('ZADD', owner .. ':lru', at, key)
    redis.call('HINCRBY', owner .. ':usage', 'bytes', size)
  end
  return {1, evicted, reclaimed}
end
""".replace("@GUEST_MAX_SHARE_FIELD@", GUEST_MAX_SHARE_FIELD).replace(
        "@DEFAULT_GUEST_MAX_SHARE@", repr(DEFAULT_GUEST_MAX_SHARE)
    )
)

#: Most keys one :data:`L2_TOUCH_LUA` call stamps (Lua's unpack has a stack limit).
L2_TOUCH_BATCH = 512
#: How long a sidecar holds hits' LRU touches before sending them, seconds.
L2_TOUCH_INTERVAL_S = 0.05

#: KEYS[1] = :func:`lru_key` of one tenant; ARGV = entry keys, least recent
#: first (at most :data:`L2_TOUCH_BATCH`), all of one tenant. Stamps them as just
#: used, in that order (a guest's in its own LRU too); a key no longer in the LRU
#: is left out (XX). Returns how many moved.
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
local owner = owner_of(ARGV[1])
if owner then redis.call('ZADD', owner .. ':lru', 'XX', unpack(args)) end
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
#: or evicted by this call, ARGV[4] = the fraction of the limit one guest may
#: hold (the guests' pool; empty: :data:`DEFAULT_GUEST_MAX_SHARE`, a guest over
#: a lowered one gives back the excess on its next put). Stores both, then
#: reclaims expired entries and evicts the tenant's least recently used ones until
#: its bytes fit the limit in force (a lowered limit takes effect at once, not
#: over the next puts). Returns {evicted, reclaimed, bytes still over the limit};
#: the caller calls again while the last is positive (each call is bounded, so
#: Redis is never blocked long).
L2_SET_LIMIT_LUA = (
    _L2_LUA_PRELUDE
    + """
local meta = {KEYS[1], KEYS[2], KEYS[3], KEYS[4]}
redis.call('HSET', meta[1], 'limit', ARGV[1])
if ARGV[4] == nil or ARGV[4] == '' then
  redis.call('HDEL', meta[1], '@GUEST_MAX_SHARE_FIELD@')
else
  redis.call('HSET', meta[1], '@GUEST_MAX_SHARE_FIELD@', ARGV[4])
end
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
""".replace("@GUEST_MAX_SHARE_FIELD@", GUEST_MAX_SHARE_FIELD)
)


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

#: KEYS = the accounting of one or more tenants' entries (:func:`l2_meta_keys`), their
#: fence, then the digest's entry key in the key scope of each (one for a listed
#: tenant; many guests of the pool, which share its accounting and fence, in one
#: call); ARGV[1] = the purge epoch. Raises the fence's ``purge`` to it and deletes
#: each entry with its accounting. Returns how many entries were deleted.
PURGE_FENCE_LUA = (
    _L2_LUA_READ_HELPERS
    + """
local meta = {KEYS[1], KEYS[2], KEYS[3], KEYS[4]}
local cur = tonumber(redis.call('HGET', KEYS[5], 'purge') or '0')
if tonumber(ARGV[1]) > cur then redis.call('HSET', KEYS[5], 'purge', ARGV[1]) end
local deleted = 0
for i = 6, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 or redis.call('HEXISTS', meta[3], KEYS[i]) == 1 then
    deleted = deleted + forget(meta, KEYS[i])
  end
end
return deleted
"""
)

# --------------------------------------------------------------------------- rate limits

#: Per-tenant request and token limits, fleet-wide (docs/rate-limits.md): the GCRA of
#: :func:`cachefleet_common.limits.decide`, in milliseconds of Redis's clock.
#: KEYS[1] = names.rate_limit_key (a hash: field ``r``, ``t``, ``d`` = each bucket's
#: theoretical arrival time, ms). ARGV[1] = ``take`` (admit all-or-nothing: charge every
#: bucket only if the cost fits in each) or ``force`` (a correction, charged as is; a
#: negative cost refunds); then three ``limit, period_ms, cost`` triples, in the order
#: requests per minute, tokens per minute, tokens per day (limit 0: no such bucket).
#: Returns ``{allowed, r_remaining, r_reset_ms, r_retry_ms, t_..., d_...}`` (integers;
#: zeros for a bucket without a limit). The key expires once every bucket is full again.
RATE_LIMIT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local force = ARGV[1] == 'force'
local fields = {'r', 't', 'd'}
local tats = redis.call('HMGET', KEYS[1], 'r', 't', 'd')
local plan = {}
local allowed = 1
for i = 1, 3 do
  local limit = tonumber(ARGV[3 * i - 1])
  if limit > 0 then
    local period = tonumber(ARGV[3 * i])
    local cost = tonumber(ARGV[3 * i + 1])
    if not force and cost > limit then cost = limit end
    local interval = period / limit
    local tat = tonumber(tats[i]) or 0
    local base = math.max(tat, now)
    local new_tat = math.max(base + cost * interval, now)
    local fits = force or cost <= 0 or new_tat - period <= now
    if not fits then allowed = 0 end
    plan[i] = {limit, period, interval, tat, new_tat, fits}
  end
end
local out = {allowed}
local expire_at = now
for i = 1, 3 do
  local p = plan[i]
  if p == nil then
    out[#out + 1] = 0
    out[#out + 1] = 0
    out[#out + 1] = 0
  else
    local after = p[4]
    if allowed == 1 then
      after = p[5]
      redis.call('HSET', KEYS[1], fields[i], string.format('%.3f', after))
    end
    after = math.max(after, now)
    if after > expire_at then expire_at = after end
    out[#out + 1] = math.max(0, math.floor((now + p[2] - after) / p[3] + 1e-9))
    out[#out + 1] = math.ceil(after - now)
    if p[6] then
      out[#out + 1] = 0
    else
      out[#out + 1] = math.max(1, math.ceil(p[5] - p[2] - now))
    end
  end
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('PEXPIRE', KEYS[1], math.ceil(expire_at - now) + 1000)
end
return out
"""
