-- gatekeeper-wsgi: the line of a queued limit path, shared by every process on one Redis
-- (SPEC 4.4): FIFO across processes and hosts, and at most `size` waiters in all.
--
-- KEYS[1]  the line: a sorted set, ticket -> its place (the order it joined in)
-- KEYS[2]  the tickets' last signs of life: a hash, ticket -> Redis time (us) it last
--          looked; field '#' counts the places handed out
-- ARGV[1]  'join', 'first' or 'leave'; ARGV[2] the ticket; ARGV[3] the size (join);
-- ARGV[4]  how long (us) a ticket may go without looking before it counts as gone (its
--          process died: a live waiter looks every few milliseconds)
--
-- join   -> 1, or 0 when `size` live waiters hold a place already
-- first  -> 1 when the ticket is the first live one (its turn), else 0; a ticket that was
--           dropped as gone (its process stalled that long) joins again at the end
-- leave  -> 1
-- Both keys live as long as a waiter could, and no longer.

local call = redis.call
local line, life, op, ticket = KEYS[1], KEYS[2], ARGV[1], ARGV[2]
local stale = tonumber(ARGV[4])
local time = call('TIME')
local now = time[1] * 1000000 + time[2]
local ttl = string.format('%d', math.floor(stale / 1000) * 4 + 1000)

if op == 'leave' then
  call('ZREM', line, ticket)
  call('HDEL', life, ticket)
  return 1
end

-- Gone waiters (not seen within `stale`) are dropped, so a dead process never holds a
-- place: from the head only when looking for the first, from the whole line on a join
-- (read in pages: HMGET takes its fields as arguments, which Lua's unpack caps).
local function gone(tickets)
  local seen = call('HMGET', life, unpack(tickets))
  local dropped = 0
  for i = 1, #tickets do
    local at = tonumber(seen[i])
    if tickets[i] ~= ticket and (not at or now - at > stale) then
      call('ZREM', line, tickets[i])
      call('HDEL', life, tickets[i])
      dropped = dropped + 1
    end
  end
  return dropped
end

local function live_count()
  local count, from = 0, 0
  while true do
    local page = call('ZRANGE', line, from, from + 499)
    if #page == 0 then
      return count
    end
    local dropped = gone(page)
    count = count + #page - dropped
    from = from + #page - dropped
  end
end

local function drop_gone_heads()
  while true do
    local head = call('ZRANGE', line, 0, 0)
    if #head == 0 or gone(head) == 0 then
      return
    end
  end
end

local function place()
  call('ZADD', line, call('HINCRBY', life, '#', 1), ticket)
  call('HSET', life, ticket, string.format('%d', now))
  call('PEXPIRE', line, ttl)
  call('PEXPIRE', life, ttl)
end

if op == 'join' then
  if live_count() >= tonumber(ARGV[3]) then
    return 0
  end
  place()
  return 1
end

-- 'first'
if not call('ZSCORE', line, ticket) then
  place() -- dropped as gone while its process stalled: at the end of the line again
else
  call('HSET', life, ticket, string.format('%d', now))
  call('PEXPIRE', line, ttl)
  call('PEXPIRE', life, ttl)
end
drop_gone_heads()
local head = call('ZRANGE', line, 0, 0)
return head[1] == ticket and 1 or 0
