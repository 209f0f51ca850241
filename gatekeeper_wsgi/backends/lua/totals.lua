-- gatekeeper-wsgi: read the totals sets in KEYS (status pages, scrapes: see gate.lua for
-- their members) in one call, dropping what ended first.
-- Returns {now (us of Redis TIME), then per key: {its live lease members}, the count of its
-- paths with a live rate window}. Scores are whole microseconds, so now + 1 and -now - 1
-- bound the live ones exactly.
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local out = {now}
for i = 1, #KEYS do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], -now, now)
  out[#out + 1] = redis.call('ZRANGEBYSCORE', KEYS[i], now + 1, '+inf')
  out[#out + 1] = redis.call('ZCOUNT', KEYS[i], '-inf', -now - 1)
end
return out
