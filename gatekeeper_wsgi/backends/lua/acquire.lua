-- gatekeeper-wsgi: admit one request on all of its slots, or on none (SPEC 4.1).
--
-- KEYS, slot by slot: the slot's lease set, then, for slots with a rate, its window log.
-- ARGV[1]  lease id (unique per admission); empty: only check, take nothing (peek)
-- ARGV[2]  max_hold in microseconds: a lease not released by then expires
-- ARGV[3]  max_hold in milliseconds (the lease set's PEXPIRE)
-- then four values per slot:
--   concurrency (-1: none), rate quota (0: none), rate window in microseconds, enforce (1/0)
--
-- Lease set: sorted set, member = lease id, score = expiry in microseconds of Redis TIME.
--   A delayed release renames the member to "<lease>:d", scored by when it matures.
-- Window log: sorted set, member = lease id, score = admission time in microseconds.
--
-- Returns {1, {shadowed slot indexes}, {slot indexes whose full window was not extended}}
-- (0-based) when admitted, or
-- {0, refusing slot index (0-based), kind (1 concurrency, 2 rate), retry after (us)}.

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local lease = ARGV[1]
local hold = tonumber(ARGV[2])
local hold_ms = ARGV[3]
local slots = (#ARGV - 3) / 4

local busy = {}
local over = {}
local full = {}
local k = 1
for i = 1, slots do
  local a = 3 + (i - 1) * 4
  local concurrency = tonumber(ARGV[a + 1])
  local quota = tonumber(ARGV[a + 2])
  local enforce = ARGV[a + 4] == '1'
  local leases = KEYS[k]
  k = k + 1
  -- Leases of crashed or vanished holders, and delayed releases that matured, end here.
  redis.call('ZREMRANGEBYSCORE', leases, '-inf', now)
  local held = redis.call('ZCARD', leases)
  busy[i] = held
  if concurrency >= 0 and held >= concurrency then
    if enforce then
      -- The soonest delayed release tells when a slot frees for sure; a running request
      -- may finish any moment.
      local retry = 0
      local first = redis.call('ZRANGE', leases, 0, 0, 'WITHSCORES')
      if first[1] and string.sub(first[1], -2) == ':d' then
        retry = tonumber(first[2]) - now
      end
      return {0, i - 1, 1, retry}
    end
    over[i] = true
  end
  if quota > 0 then
    local log = KEYS[k]
    k = k + 1
    local window = tonumber(ARGV[a + 3])
    redis.call('ZREMRANGEBYSCORE', log, '-inf', now - window)
    if redis.call('ZCARD', log) >= quota then
      if enforce then
        local oldest = redis.call('ZRANGE', log, 0, 0, 'WITHSCORES')
        return {0, i - 1, 2, tonumber(oldest[2]) + window - now}
      end
      over[i] = true
      full[i] = true
    end
  end
end

if lease == '' then
  -- A peek: the answer acquire would give. Expired entries were dropped; nothing added.
  return {1, {}, {}}
end

local shadowed = {}
local unrecorded = {}
k = 1
for i = 1, slots do
  local a = 3 + (i - 1) * 4
  local leases = KEYS[k]
  k = k + 1
  redis.call('ZADD', leases, now + hold, lease)
  -- An idle key vanishes when its last lease expires; never shorten a longer expiry
  -- (a delayed release, another host's longer max_hold).
  if busy[i] == 0 then
    redis.call('PEXPIRE', leases, hold_ms)
  else
    redis.call('PEXPIRE', leases, hold_ms, 'GT')
  end
  if tonumber(ARGV[a + 2]) > 0 then
    local log = KEYS[k]
    k = k + 1
    -- A shadow slot over its concurrency still counts in its window; a full window is
    -- not extended (enforce mode would not have admitted).
    if not full[i] then
      local window = tonumber(ARGV[a + 3])
      redis.call('ZADD', log, now, lease)
      redis.call('PEXPIRE', log, math.floor(window / 1000) + 1)
    end
  end
  if over[i] then
    shadowed[#shadowed + 1] = i - 1
  end
  if full[i] then
    unrecorded[#unrecorded + 1] = i - 1
  end
end
return {1, shadowed, unrecorded}
