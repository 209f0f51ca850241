-- gatekeeper-wsgi: would acquire.lua admit these slots now? Reads only, changes nothing.
--
-- KEYS and ARGV as for acquire.lua (ARGV[1..3] are ignored).
-- Returns {1} when it would admit, else
-- {0, refusing slot index (0-based), kind (1 concurrency, 2 rate), retry after (us)}.

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local slots = (#ARGV - 3) / 4
local k = 1
for i = 1, slots do
  local a = 3 + (i - 1) * 4
  local concurrency = tonumber(ARGV[a + 1])
  local quota = tonumber(ARGV[a + 2])
  local enforce = ARGV[a + 4] == '1'
  local leases = KEYS[k]
  k = k + 1
  if enforce and concurrency >= 0 then
    -- Leases scored <= now have expired (or matured) even if not removed yet.
    if redis.call('ZCOUNT', leases, '(' .. string.format('%.0f', now), '+inf') >= concurrency then
      local retry = 0
      local first = redis.call(
        'ZRANGEBYSCORE', leases, '(' .. string.format('%.0f', now), '+inf',
        'WITHSCORES', 'LIMIT', 0, 1)
      if first[1] and string.sub(first[1], -2) == ':d' then
        retry = tonumber(first[2]) - now
      end
      return {0, i - 1, 1, retry}
    end
  end
  if quota > 0 then
    local log = KEYS[k]
    k = k + 1
    if enforce then
      local window = tonumber(ARGV[a + 3])
      local cutoff = '(' .. string.format('%.0f', now - window)
      if redis.call('ZCOUNT', log, cutoff, '+inf') >= quota then
        local oldest = redis.call('ZRANGEBYSCORE', log, cutoff, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
        return {0, i - 1, 2, tonumber(oldest[2]) + window - now}
      end
    end
  end
end
return {1}
