-- gatekeeper-wsgi: read the totals of configured limits (status pages, scrapes: see gate.lua
-- for the sets' members) in one call. KEYS are totals sets and delayed sets, dropping what
-- ended first, and, for a limit without a wildcard, its path's own sorted set (it stands in
-- for both), read as it is: ARGV holds per key '' for a totals set, 'd' for a delayed set,
-- or that limit's rate window in us (0: none) for an own set.
-- Returns {now (us of Redis TIME), then per key: for a totals or delayed set {its live lease
-- members}, the count of its paths with a live rate window (0 for a delayed set); for an own
-- set the count of its live leases (held and delayed), and 1 if its rate window is live, else
-- 0}. Scores are whole microseconds, so now + 1 and -now - 1 bound the live ones exactly;
-- tombstones and marks score above BAND (see gate.lua) and are not read.
local BELOW = '(4503599627370496'
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local out = {now}
for i = 1, #KEYS do
  local window = ARGV[i]
  if window == '' or window == 'd' then
    if window == '' then
      redis.call('ZREMRANGEBYSCORE', KEYS[i], -now, now)
    else
      redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
    end
    out[#out + 1] = redis.call('ZRANGEBYSCORE', KEYS[i], now + 1, BELOW)
    if window == '' then
      out[#out + 1] = redis.call('ZCOUNT', KEYS[i], '-inf', -now - 1)
    else
      out[#out + 1] = 0
    end
  else
    -- Leases score when they end, window entries MINUS when they were taken: the window
    -- is live while an entry is newer than now - window (admissions drop the others).
    out[#out + 1] = redis.call('ZCOUNT', KEYS[i], now + 1, BELOW)
    local live = 0
    window = tonumber(window)
    if window > 0 and redis.call('ZCOUNT', KEYS[i], '-inf', '(' .. string.format('%d', window - now)) > 0 then
      live = 1
    end
    out[#out + 1] = live
  end
end
return out
