-- gatekeeper-wsgi: give back the slots of one admission.
--
-- KEYS: the admission's lease sets, then the window logs whose reservation is returned
--       (limits that count only some statuses, and this response's was not one of them).
-- ARGV[1]  lease id
-- ARGV[2]  how many of KEYS are lease sets
-- ARGV[3]  delay in microseconds (0: release now)
-- ARGV[4]  delay in milliseconds
--
-- A delayed release keeps the slot taken: the lease is renamed "<lease>:d" and scored by
-- when it matures, so admission removes it then like any expired lease.

local lease = ARGV[1]
local sets = tonumber(ARGV[2])
local delay = tonumber(ARGV[3])

if delay > 0 then
  local time = redis.call('TIME')
  local due = tonumber(time[1]) * 1000000 + tonumber(time[2]) + delay
  local delayed = lease .. ':d'
  for i = 1, sets do
    -- Add before removing, so the set (and its expiry) never vanishes in between.
    if redis.call('ZSCORE', KEYS[i], lease) then
      redis.call('ZADD', KEYS[i], due, delayed)
      redis.call('ZREM', KEYS[i], lease)
      redis.call('PEXPIRE', KEYS[i], ARGV[4], 'GT')
    end
  end
else
  for i = 1, sets do
    redis.call('ZREM', KEYS[i], lease)
  end
end
for i = sets + 1, #KEYS do
  redis.call('ZREM', KEYS[i], lease)
end
return 1
