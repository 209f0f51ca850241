-- gatekeeper-wsgi: apply a batch of releases, then admit one request on all of its slots or
-- on none (SPEC 4.1, 4.2). One script for both, so a request's thread waits for one round
-- trip: the releases its process placed since its last call ride along with its admission,
-- and the release sender flushes the others with this script and no admission.
--
-- One sorted set per concrete limit path. Members:
--   <lease>     a request in flight; score = when its lease expires (us of Redis TIME)
--   <lease>:d   a delayed release: the slot stays taken; score = when it matures
--   <lease>:w   an entry of the rate window; score = MINUS the admission time
-- and, in a band above every time (BAND + ...), which no count reads:
--   <lease>     in a route's first set: a give-back's tombstone; score = BAND + when it ends
--   ~ and ~~    the marks (a key without a window): a release must look at what is left
--               (see settle below); score BAND
-- Window entries score below zero and leases above, so one range tells them apart and one
-- ZREMRANGEBYSCORE [window - now, now] drops both slid-out entries and ended leases (on one
-- admission in 16: counts read only the live ranges). Scores
-- are whole microseconds, passed as numbers (Lua's tostring would round them); BAND + a time
-- is still below 2^53, so every score is exact.
--
-- Next to it, one totals set per configured wildcard limit path (the status page and scrapes
-- read it in O(limits + requests in flight), not O(keys)). Members:
--   <lease>|<path>  a lease of one of its keys; score = when it ends
--   <path>          a key with a rate window; score = MINUS when its newest entry slides out
-- and its delayed set, the delayed releases of its keys (<lease>|<path>, scored by when they
-- mature), which lives exactly as long as its latest one: a matured delayed release leaves
-- nothing behind. The totals set lives by its admissions (an eighth past their max_hold),
-- and a delayed release cuts it to its latest member.
-- Every member carries its own end, so a lease that expires by max_hold (a crashed holder)
-- leaves the totals as it leaves the counts, and one ZREMRANGEBYSCORE [-now, now] drops
-- whatever ended. Readers count only what is live, so nothing left unpruned is counted.
-- And its tracked set, the keys it tracks (max_keys, SPEC 4.5): <path> scored by when that
-- key is idle at the latest (its admission's lease end or window end, pushed further by each
-- admission and by a delayed release to when it matures; never lowered, so an upper bound).
-- A new key finds room among max_keys, else evicts an idle one (the keys scored before now,
-- then the first idle of the 64 that end soonest, looked at in their own sets), else the
-- admission is refused with nothing taken. It lives at least as long as the totals set, so
-- an admission reads its expiry only when the totals set's needs pushing; a delayed release
-- cuts it to the longer of the totals and delayed sets.
-- A limit without a wildcard has one concrete path, its own: its sorted set already holds
-- all it would, so it has none of these (the client passes that set alone, and its codes
-- and specs tell the script so).
--
-- An adaptive limit (concurrency = "auto") has a third key per path, a hash: its current
-- limit ('limit', which admissions enforce), its controller's state as the client wrote it
-- ('s': adaptive.Controller.state(), 'due': when its window is due, seconds of Redis time)
-- and the window being gathered ('n' samples, 'sum' of their latencies, 'drops', 'peak'
-- in flight), which releases add to. A release that finds the window due (and no claim
-- out) claims it: the script hands the state and that sample to the releasing process,
-- which feeds them to adaptive.Controller and writes the next state back in a later call
-- ('=' specs), guarded by the claim id; samples released meanwhile are kept and added.
-- Its 'cap' (seconds) is the most one good sample adds to 'sum', as the controller's own
-- sample() counts it (adaptive.SAMPLE_CEILING x its baseline; absent before it has one).
--
-- ARGV[1]  R, the number of releases; then R release specs, one per release, in words:
--            "<lease> <delay in us (0: free now)> <code> <code> ...", one code per slot it
--            owns in KEYS order: window in ms * 4, + 2 for a wildcard limit's slot (it
--            has four keys), + 1 when its window entry is given back (a limit that
--            counts only some statuses, and this response's was not one);
--            an adaptive slot's code is "<code>:" or, with the request's sample,
--            "<code>:<latency in us>:<faulty 1/0>";
--            "?<lease> ..." is a release sent again (it may have been applied already);
--            "!<lease> <tombstone life in us> <code> ..." gives back an admission whose
--            answer never came (freed now, and never taken if it runs later: a tombstone
--            in the route's first set);
--            "+<spec>" (before any of those marks) is a release of the admission's own
--            route: it has no keys of its own and reads the admission's (it comes after
--            every release that has);
--            "=<claim> <due> <limit> <n> <sum> <drops> <peak> <cap> <state>" writes a claimed
--            adaptive state (one key: the hash)
-- then, when an admission follows:
--   lease id (unique per admission; '' = only check and take nothing: a peek)
--   max_hold in us (a lease not released by then expires)
--   then one spec per slot: "<concurrency (-1: none; a<initial>:<min>:<max>: adaptive)> <rate quota
--   (0: none)> <rate window in us> <flags: enforce (1/0) + 2 for a wildcard limit's slot
--   + 4 for a limit with a queue (a newcomer is refused while its path's line has waiters,
--   so it lines up behind them; the lease id "^<lease>" is a waiter's turn, not barred)>
--   [<max_keys>, a wildcard limit's]", or for an enforced concurrency slot without a rate
--   its concurrency alone (one tonumber, no pattern to match), or for a wildcard limit's
--   "<-2 - concurrency> <max_keys>"
-- (Specs in words keep the command short: the client packs each argument anew.)
-- KEYS: the keys of the releases in order, then those of the admission: per slot its
-- path's sorted set, then a wildcard limit's totals, delayed and tracked sets, then an
-- adaptive slot's hash. (A limit without a wildcard used to send its set three times: each
-- KEYS entry costs the script an interned string and a table slot, ~900 instructions.)
--
-- Returns 1 after releases alone, and for an admission admitted plainly (4 when it took
-- the last slot of an enforced concurrency limit, see tight); an admission
-- admitted with shadow slots over their limits gets
-- {1, {shadowed slot indexes}, {slot indexes whose full window was not extended}}
-- (0-based); a refused one
-- {0, refusing slot index (0-based), kind (1 concurrency, 2 rate), retry after (us),
-- the limit in force}; one refused because a wildcard limit's max_keys keys are all busy
-- {3, slot index, kind (2 when a key is held by its window alone), retry after (us),
-- max_keys}. When releases claimed adaptive windows, the answer is wrapped:
-- {2, answer, claim, ...}, each claim {hash, claim id, latency us, in flight, faulty,
-- now us, s, n, sum, drops, peak} (the window's values before that sample).

-- Globals and library functions read once per call into locals: each use of a global is a
-- table lookup, and the Lua of Redis runs a bytecode in tens of machine instructions.
local call, KEYS, ARGV, tonumber = redis.call, KEYS, ARGV, tonumber
local byte, sub, find, match, gmatch = string.byte, string.sub, string.find, string.match, string.gmatch
local format, floor = string.format, math.floor
-- A text known to hold a number (ARGV the client wrote, TIME, a pattern's %d+) is read by
-- arithmetic, `text + 0`, not tonumber: tonumber converts it twice (lua_isnumber, then
-- lua_tonumber, each a strtod) behind a C call; the coercion converts once, in the VM
-- (callgrind: 5 300 instructions less per request of 3 levels + 1 rate). tonumber stays
-- where a text may not be a number.

-- A function a script defines is a closure made anew on each call (a script's body runs per
-- call), at about 1 300 instructions with its upvalues: the size of a command. So the call
-- makes none unless a rare path needs one: what is used in several places is written out
-- at each (reading TIME), or done once at the end of the call (settling keys), and the
-- adaptive sample's function is made by the first release that samples. (callgrind: the
-- four closures made per call before, settle, clock, sample and answer, cost 10 200
-- instructions of a request's 248 300 inside EVALSHA.)

-- The band above every time: tombstones and marks score in it, counts read below it.
local BAND = 4503599627370496 -- 2^52
local BAND_S, BELOW, ABOVE = '4503599627370496', '(4503599627370496', '(4503599627370496'

-- Numbers go to redis.call as strings made by format('%d', n) (written out at each use:
-- a helper function would be one more closure per call): Redis 7.0 turns a Lua number
-- argument into text with snprintf("%.17g"), which for a 16-digit time costs several times
-- what the command then does with it (callgrind: an eighth of the server's instructions
-- per request). %d prints every whole number below 2^53 exactly.
local MARK, MARK2 = '~', '~~'

-- The marks of a path's set say that a release must look at what is left there: the set
-- holds, or held when they were set, a delayed release, a tombstone, or (a rate key) another
-- request in flight. Unmarked, a release knows without looking that nothing else is live, so
-- the set vanishes with its last member or lives by its window alone. They are a pair, so
-- the count a release's ZREM returns says both whether the lease was there (odd) and whether
-- the set was marked (2 or more), even for a release applied twice.
--
-- A rate key (a window) is never marked: its releases always look (settle), one read while
-- nothing but leases is above its window entries, unless the call then admits on that key
-- (see unsettled). Under concurrency its set nearly always holds another request in
-- flight, so marking it cost each admission two members and each release the marks written
-- again; what the look costs instead is one read when the key is alone (the PEXPIRE to its
-- window follows either way).
--
-- settle: how long a path's set lives once a release changed it, from its latest member: a
-- request in flight (its admission set the expiry it needs), a pending delayed release
-- (until it matures), its window, or its latest tombstone, and not longer; while anything is
-- live a key without a window stays marked, so the next release looks again.
-- (Written out at the end of the call, the one place that settles: see unsettled.)

-- An adaptive hash idle this long (ms) goes: its path starts over from 'initial'.
local ADAPTIVE_LIFE_S = '3600000'
-- A claim not written back within this long (s; its process died) may be claimed again.
local CLAIM_LIFE = 1

-- Redis time in us, read (TIME) by the first part of the call that needs it: each reads it
-- with the same three lines where it needs it (a function would be a closure per call).
local now

local claims -- made by the first claim: most calls have none

-- Whether the admission took the last slot of an enforced concurrency limit, or the last
-- place of an enforced window: it answers 4 instead of 1, so that its release is sent the
-- moment the response ends, not left to ride along with the process's next admission
-- (another process's request, maybe the same client's next one, may be waiting for it; a
-- window's place comes back when a limit with `count` did not count the response).
local tight

-- One released request's sample on an adaptive path: into the window, or, when the
-- window is due and unclaimed, claimed for the releasing process to compute. Made by the
-- first release that samples (below), not by every call.
local sample

-- Keys a release changed, whose settle waits for the end of the call: key -> window in ms,
-- and the keys in order. The settle looks at what is left once the whole call ran, so one
-- look serves every release of the call on that key, and no function is made per call.
-- A rate key whose plain release left it (a clearable entry: its window in ms) is not
-- settled at all when the admission that follows takes a slot on it: the admission's own
-- expiry covers whatever is left there (its window entries, a pending delayed release or
-- tombstone whose expiry is already set, ended leases), so the look would only be
-- overwritten; under gunicorn a process's releases ride along with its next admission on
-- the same route, so that is the common case. Any other key a release changed (a delayed
-- release's, a marked key's: -1 - its window in ms) is settled whatever the admission
-- does: its marks must be put back while anything is left live, and a pending delay may
-- outlive the admission's lease.
local unsettled, unsettled_keys

-- --- releases (idempotent: a release applied twice, or after its lease ended, does nothing)
local releases = ARGV[1] + 0
local k = 1
for r = 2, releases + 1 do
  local spec = ARGV[r]
  if byte(spec, 1) == 61 then -- '=': a claimed adaptive state
    -- A claimed window's next state, from the process that claimed it: applied only if
    -- the claim is still its own; what was sampled since the claim is added to the new
    -- window.
    local hash = KEYS[k]
    k = k + 1
    local claim, due, limit, n, sum, drops, peak, cap, state =
      match(spec, '^=(%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (.*)$')
    local f = call('HMGET', hash, 'claim', 'n', 'sum', 'drops', 'n0', 'sum0', 'drops0', 'cpeak')
    if f[1] == claim then
      peak = tonumber(peak)
      local cpeak = tonumber(f[8]) or 0
      if cpeak > peak then
        peak = cpeak
      end
      call('HSET', hash, 's', state, 'due', due, 'limit', limit,
        'n', tonumber(n) + (tonumber(f[2]) or 0) - (tonumber(f[5]) or 0),
        'sum', tonumber(sum) + (tonumber(f[3]) or 0) - (tonumber(f[6]) or 0),
        'drops', tonumber(drops) + (tonumber(f[4]) or 0) - (tonumber(f[7]) or 0),
        'peak', peak, 'cap', cap)
      call('HDEL', hash, 'claim', 'until', 'n0', 'sum0', 'drops0', 'cpeak')
      call('PEXPIRE', hash, ADAPTIVE_LIFE_S)
    end
  else
  local lease, delay, codes = match(spec, '^(%S+) (%d+)(.*)$')
  -- A plain release's delay is '0', which one comparison of interned strings tells.
  delay = delay == '0' and 0 or delay + 0
  local mark = byte(lease, 1)
  local own_keys = k -- where this release's keys start
  if mark == 43 then
    -- '+<lease>': a release of the very route the admission of this call is for (under
    -- gunicorn, a process's release riding along with its next request): it sends no keys
    -- of its own and reads the admission's, which follow those of every other release (the
    -- client puts these releases last; releases of other leases commute).
    lease = sub(lease, 2)
    mark = byte(lease, 1)
  else
    own_keys = nil
  end
  local first = KEYS[k]
  local tombstone = 0
  if mark == 33 then
    -- '!<lease> <life in us>': a give-back of an admission whose answer never came. It is
    -- freed now like any release; it may also not have run yet (queued in a frozen Redis
    -- behind this release): its tombstone, below, makes it take nothing if it runs later.
    lease = sub(lease, 2)
    tombstone = delay
    delay = 0
  end
  local skip = false
  if mark == 63 then
    -- '?<lease>': sent again because the sender's call with it was still out. That call
    -- mostly ran first; one look at the route's first set tells (an applied release took
    -- the lease out of every set, in one go).
    lease = sub(lease, 2)
    local score = call('ZSCORE', first, lease)
    skip = not score or tonumber(score) >= BAND
  end
  for word in gmatch(codes, '%S+') do
    -- A plain code is a number (a concurrency slot's is '0', or '2' with a wildcard); only
    -- an adaptive slot's has more to it.
    local code = word == '0' and 0 or tonumber(word)
    local adaptive, latency, faulty
    if not code then
      code, adaptive, latency, faulty = match(word, '^(%d+)(:)(%d*):?(%d*)$')
      code = code + 0
    end
    local key = KEYS[k]
    local totals, delayed, tracking
    local tracked = code % 4 >= 2 -- a wildcard limit's slot: it has a totals set
    if tracked then
      totals, delayed, tracking = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3]
      k = k + 4
    else
      k = k + 1
    end
    local window_ms = (code - code % 4) / 4
    local hash
    if adaptive then
      if latency ~= '' then
        hash = KEYS[k]
        latency = tonumber(latency)
        faulty = tonumber(faulty)
        sample = sample or function(hash, key, latency, faulty, claim, extra)
          -- Add to a window field; one that is not a number (tampered with, or another
          -- version's) is set anew rather than failing the whole call.
          local function add(field, command, amount)
            local result = redis.pcall(command, hash, field, amount)
            if type(result) == 'table' and result.err then
              call('HSET', hash, field, amount)
            end
          end
          if not now then
            local time = call('TIME')
            now = time[1] * 1000000 + time[2]
          end
          local t = now
          -- itself included
          local inflight = call('ZCOUNT', key, format('%d', t + 1), BELOW) + extra
          local now_s = t / 1000000
          local f = call('HMGET', hash, 'due', 'claim', 'until', 'peak', 'cpeak', 'cap')
          local due = tonumber(f[1])
          if (not due or now_s >= due) and (not f[2] or (tonumber(f[3]) or 0) < now_s) then
            local w = call('HMGET', hash, 's', 'n', 'sum', 'drops', 'peak')
            call('HSET', hash, 'claim', claim, 'until', now_s + CLAIM_LIFE,
              'n0', w[2] or 0, 'sum0', w[3] or 0, 'drops0', w[4] or 0, 'cpeak', 0)
            call('PEXPIRE', hash, ADAPTIVE_LIFE_S)
            claims = claims or {}
            claims[#claims + 1] = {hash, claim, latency, inflight, faulty, t,
              w[1] or '', w[2] or '0', w[3] or '0', w[4] or '0', w[5] or '0'}
            return
          end
          add('n', 'HINCRBY', 1)
          if faulty == 1 then
            add('drops', 'HINCRBY', 1)
          else
            local seconds = latency / 1000000
            local cap = tonumber(f[6])
            if cap and cap > 0 and seconds > cap then
              seconds = cap
            end
            add('sum', 'HINCRBYFLOAT', seconds)
          end
          if inflight > (tonumber(f[4]) or 0) then
            call('HSET', hash, 'peak', inflight)
          end
          if f[2] and inflight > (tonumber(f[5]) or 0) then
            call('HSET', hash, 'cpeak', inflight)
          end
        end
      end
      k = k + 1
    end
    if not skip then
    -- The concrete path of a path's sorted set "<prefix>:{<project>}:z:<path>" (no path
    -- segment holds a '}'): only a totals set names it.
    local path = tracked and sub(key, find(key, '}:z:', 1, true) + 4)
    if code % 2 == 1 then
      call('ZREM', key, lease .. ':w')
      if tracked then
        -- The key's window now ends with the newest entry left (the lowest score), if any.
        local newest = call('ZRANGE', key, '0', '0', 'WITHSCORES')
        if newest[2] and tonumber(newest[2]) < 0 then
          call('ZADD', totals, format('%d', tonumber(newest[2]) - window_ms * 1000), path)
        else
          call('ZREM', totals, path)
        end
      end
    end
    if delay > 0 then
      -- Taken out first: its answer says whether the lease is still held (a release
      -- applied twice, or after max_hold, does nothing).
      if call('ZREM', key, lease) == 1 then
        if not now then
          local time = call('TIME')
          now = time[1] * 1000000 + time[2]
        end
        local t = now
        if hash then
          sample(hash, key, latency, faulty, lease, 1) -- itself, just taken out, included
        end
        -- Matured delays and ended leases go first, so a busy key holds only the
        -- delayed releases still pending.
        local matures = format('%d', t + delay)
        call('ZREMRANGEBYSCORE', key, '(0', format('%d', t))
        call('ZADD', key, matures, lease .. ':d')
        if tracked then
          -- From the totals set to the delayed set, which lives as long as its latest
          -- member: once it matured, nothing of it is left.
          local member = lease .. '|' .. path
          call('ZREM', totals, member)
          -- The totals set, once a delayed release took a lease out of it: it lives as long
          -- as its latest member and not longer (the latest lease's end is the highest
          -- score, the latest window's end minus the lowest), so a matured delayed release
          -- leaves it behind no longer than its delay, not 1.125 x max_hold after the last
          -- admission.
          local last = call('ZRANGE', totals, '-1', '-1', 'WITHSCORES')
          local totals_ms = 0 -- how long the totals set lives on (0: gone)
          if last[2] then -- else emptied: gone
            local ends = tonumber(last[2])
            local lowest = tonumber(call('ZRANGE', totals, '0', '0', 'WITHSCORES')[2])
            if -lowest > ends then
              ends = -lowest
            end
            if ends <= t then
              call('DEL', totals) -- nothing of it is live: readers would skip it all
            else
              totals_ms = floor((ends - t) / 1000) + 1
              call('PEXPIRE', totals, format('%d', totals_ms))
            end
          end
          call('ZREMRANGEBYSCORE', delayed, '-inf', format('%d', t))
          call('ZADD', delayed, matures, member)
          local life_ms = floor(delay / 1000) + 1
          local delayed_ms = call('PTTL', delayed)
          if delayed_ms < life_ms then
            delayed_ms = life_ms
            call('PEXPIRE', delayed, format('%d', life_ms))
          end
          -- The key stays live until the delay matures: its tracked set says so, and lives
          -- as long as the totals and delayed sets, which hold whatever of the limit is
          -- live, and not longer (as they, cut to their latest member).
          call('ZADD', tracking, 'GT', matures, path)
          if totals_ms > delayed_ms then
            delayed_ms = totals_ms
          end
          call('PEXPIRE', tracking, format('%d', delayed_ms))
        end
        -- The key lives as long as its latest member and not longer: when this was its last
        -- lease, it vanishes as the delay matures, not max_hold later (settled at the end).
        if not unsettled then
          unsettled, unsettled_keys = {}, {}
        end
        if not unsettled[key] then
          unsettled_keys[#unsettled_keys + 1] = key
        end
        unsettled[key] = -1 - window_ms
      end
    else
      local taken = call('ZREM', key, lease, MARK, MARK2)
      -- A release applied twice (sent again after a lost answer) samples once.
      if taken % 2 == 1 and hash then
        sample(hash, key, latency, faulty, lease, 1)
      end
      if tracked then
        call('ZREM', totals, lease .. '|' .. path)
      end
      -- A key lives max_hold after an admission, for its lease. Once no request is in
      -- flight on it, it lives only as long as what is left needs. A rate key always looks
      -- (it is never marked). Unmarked, a key without a window has nothing else live: an
      -- emptied key is gone already.
      if window_ms > 0 or taken == 3 then
        -- Settled at the end of the call; a rate key not even then if the admission takes
        -- a slot on it (see unsettled).
        if not unsettled then
          unsettled, unsettled_keys = {}, {}
        end
        local entry = unsettled[key]
        if not entry then
          unsettled_keys[#unsettled_keys + 1] = key
        end
        if window_ms == 0 then
          unsettled[key] = -1
        elseif not entry then
          unsettled[key] = window_ms
        end
      elseif taken == 2 then
        -- Applied before (a release sent again): nothing changed but the marks it took.
        call('ZADD', key, BAND_S, MARK, BAND_S, MARK2)
      end
    end
    end
  end
  if tombstone > 0 then
    -- In the route's first set, where the admission's first write finds it, for as long
    -- as its lease would live; ended ones go first. Marked: releases keep the set for it.
    if not now then
      local time = call('TIME')
      now = time[1] * 1000000 + time[2]
    end
    local t = now
    call('ZREMRANGEBYSCORE', first, ABOVE, format('%d', BAND + t))
    call('ZADD', first, format('%d', BAND + t + tombstone), lease, BAND_S, MARK, BAND_S, MARK2)
    local life_ms = floor(tombstone / 1000) + 1
    if call('PTTL', first) < life_ms then
      call('PEXPIRE', first, format('%d', life_ms))
    end
  end
  if own_keys then
    k = own_keys -- the admission's keys: read again by the admission and later releases
  end
  end
end

-- --- admission (when one follows), in a block every answer leaves by break: each goes
-- through the end of the call, where the settles still waiting are done.
local result = 1
-- The keys this admission added to its tracked sets (set, path, ...): taken out again if
-- it is refused after all.
local added
local a = releases + 2
repeat
  if #ARGV < a then
    break
  end
  if not now then
    local time = call('TIME')
    now = time[1] * 1000000 + time[2]
  end
  local t = now
  local lease = ARGV[a]
  -- '^<lease>': the first waiter of a line takes its turn, which the line does not bar.
  local turn = byte(lease, 1) == 94
  if turn then
    lease = sub(lease, 2)
  end
  local hold = ARGV[a + 1] + 0
  local hold_ms = floor(hold / 1000) + 1
  -- The scores and bounds every slot uses, as text once (see format above).
  local now_s = format('%d', t)
  local after = '(' .. now_s -- a lease scored after now is live (scores are whole us)
  local slots = #ARGV - a - 1
  -- Ended members of a totals set are dropped on one admission in 16 (the lease id's last
  -- hex digit is '0') rather than on each: readers skip them anyway, and what accumulates
  -- between two prunes is what 16 admissions leave.
  local prune = byte(lease, -1) == 48

  -- Per slot, four entries in one table made at its size for three slots: where its keys
  -- start, its quota, its window and what it holds (a table per field, grown entry by
  -- entry, cost more than the commands it fed). Slots over their limit (shadow mode) are
  -- rare: their tables are made only then.
  local seen = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}
  local over, full
  local kk = k
  for i = 1, slots do
    local spec = ARGV[a + 1 + i]
    local concurrency = tonumber(spec)
    local quota, window, enforce = 0, 0, true
    local at, width = kk, 1
    local max_keys -- a wildcard limit's, as text: read only when a new key comes
    if not concurrency and byte(spec, 1) == 45 then
      -- An enforced concurrency slot without a rate of a wildcard limit (four keys):
      -- -2 - its limit, and its max_keys. (Only a spec starting with '-' is tried: a
      -- rate slot's would fail the match on every request.)
      concurrency, max_keys = match(spec, '^(%-%d+) (%d+)$')
      if concurrency then
        concurrency = -2 - concurrency
        width = 4
      end
    end
    local queued = false
    local adaptive = false -- an adaptive limit's slot: its keys have a hash each
    if not concurrency then
      local flags
      concurrency, quota, window, flags, max_keys =
        match(spec, '^(%S+) (%d+) (%d+) (%d) ?(%d*)$')
      flags = flags + 0
      enforce = flags % 2 == 1
      if flags % 4 >= 2 then
        width = 4
      end
      queued = flags >= 4
      if byte(concurrency, 1) == 97 then
        -- 'a<initial>:<min>:<max>': adaptive; the limit in force is the one its hash
        -- holds, within the bounds configured now (a reload or a redeploy may have
        -- narrowed them since it was learned: a lowered max holds at once)
        local initial, low, high = match(concurrency, '^a(%d+):(%d+):(%d+)$')
        low, high = low + 0, high + 0
        concurrency = tonumber(call('HGET', KEYS[kk + width], 'limit')) or initial + 0
        if concurrency > high then
          concurrency = high
        elseif concurrency < low then
          concurrency = low
        end
        width = width + 1
        adaptive = true
      else
        concurrency = concurrency + 0
      end
      quota = quota + 0
      window = window + 0
    end
    kk = kk + width
    local key = KEYS[at]
    if queued and not turn then
      -- A limit with a queue: a newcomer lines up behind the waiters of the path's line
      -- (lua/queue.lua; the key beside this one, same hash tag), even when a slot is free:
      -- refused as full, it joins the line.
      local mark = find(key, '}:z:', 1, true)
      if call('ZCARD', sub(key, 1, mark) .. ':q:' .. sub(key, mark + 4)) > 0 then
        result = {0, i - 1, 1, 0, concurrency}
        break
      end
    end
    local held
    local entries = 0
    if quota > 0 then
      -- Window entries score MINUS when they were taken: live while newer than now - window,
      -- that is below window - now. Slid-out entries and ended leases are dropped on one
      -- admission in 16 (as the totals sets' ended members): the counts skip them anyway.
      local slid = format('%d', window - t)
      if prune then
        call('ZREMRANGEBYSCORE', key, slid, now_s)
      end
      held = call('ZCOUNT', key, after, BELOW)
      entries = call('ZCOUNT', key, '-inf', '(' .. slid)
    else
      -- Ended leases are not dropped here (the count skips them); a delayed release drops
      -- them, and the key's expiry ends them all once it is idle.
      held = call('ZCOUNT', key, after, BELOW)
    end
    local s = 4 * i
    -- A wildcard limit's slot (it has a totals set) keeps its keys' place negated.
    seen[s - 3], seen[s - 2], seen[s - 1], seen[s] = width > 2 and -at or at, quota, window, held
    if concurrency >= 0 and held >= concurrency then
      if enforce then
        -- The soonest delayed release tells when a slot frees for sure; a running request
        -- may finish any moment. Leases score by when they expire (max_hold), so one may
        -- come first: the first delayed release among the soonest 64 members (a refusal's
        -- cost only).
        local retry = 0
        local soonest = call('ZRANGEBYSCORE', key, after, BELOW, 'WITHSCORES', 'LIMIT', '0', '64')
        for m = 1, #soonest, 2 do
          if sub(soonest[m], -2) == ':d' then
            retry = tonumber(soonest[m + 1]) - t
            break
          end
        end
        result = {0, i - 1, 1, retry, concurrency}
        break
      end
      over = over or {}
      over[i] = true
    elseif enforce and concurrency >= 0 and held + 1 >= concurrency then
      tight = true -- this admission takes the last slot: its release is wanted at once
    end
    if quota > 0 and entries >= quota then
      if enforce then
        local oldest = call('ZREVRANGEBYSCORE', key, '(' .. format('%d', window - t), '-inf',
          'WITHSCORES', 'LIMIT', '0', '1')
        result = {0, i - 1, 2, window - tonumber(oldest[2]) - t, concurrency}
        break
      end
      over, full = over or {}, full or {}
      over[i] = true
      full[i] = true
    elseif enforce and quota > 0 and entries + 1 >= quota then
      tight = true -- the window's last place: a `count` limit's release may give it back
    end
    if width > 2 then
      -- A wildcard limit's slot: its key must be among the max_keys it tracks (SPEC 4.5).
      -- The tracked set holds them, each scored by when it is idle at the latest (its
      -- leases end, its window empties: pushed by each admission, and by a delayed release
      -- to when it matures). One ZADD GT both pushes a known key's score and says (1) that
      -- the key is new; a peek adds nothing.
      local tracking = KEYS[at + 3]
      local path = sub(key, find(key, '}:z:', 1, true) + 4)
      local life = quota > 0 and window > hold and window or hold
      local live = format('%d', t + life)
      local new
      if lease == '' then
        new = not call('ZSCORE', tracking, path)
      else
        new = call('ZADD', tracking, 'GT', live, path) == 1
      end
      if new then
        local count = call('ZCARD', tracking)
        local limit = max_keys + 0
        if lease == '' then
          count = count + 1 -- as if added
        end
        if count > limit then
          -- Room: first the keys sure to be idle by now, then, of the 64 that end soonest
          -- (as many as the memory backend looks at), the first found idle (nothing in
          -- flight, its window empty: so evicting loses nothing). A busy one goes to the
          -- back, CLOCK-like, so the next look sees others; its score stays an upper bound
          -- of when it is idle. An evicted key of an adaptive limit takes its hash along:
          -- the hashes are as bounded as the keys (max_keys), whatever a spray sends.
          local tag_end = find(key, '}:z:', 1, true)
          local hashes = adaptive and sub(key, 1, tag_end) .. ':a:'
          if hashes then
            local gone = call('ZRANGEBYSCORE', tracking, '-inf', now_s)
            for j = 1, #gone do
              call('DEL', hashes .. gone[j])
            end
          end
          count = count - call('ZREMRANGEBYSCORE', tracking, '-inf', now_s)
          local soonest -- us until a key idle but for its window is idle
          if count > limit then
            local base = sub(key, 1, tag_end + 3)
            local look = call('ZRANGE', tracking, '0', '63')
            for j = 1, #look do
              local other = look[j]
              if other ~= path then
                local set = base .. other
                local busy = call('ZCOUNT', set, after, BELOW) > 0
                if not busy and quota > 0 then
                  -- The newest window entry scores lowest (MINUS when it was taken).
                  local newest = call('ZRANGE', set, '0', '0', 'WITHSCORES')[2]
                  if newest and window - t - newest > 0 then
                    busy = true
                    if not soonest or window - t - newest < soonest then
                      soonest = window - t - newest
                    end
                  end
                end
                if not busy then
                  if lease ~= '' then
                    call('ZREM', tracking, other)
                    if hashes then
                      call('DEL', hashes .. other)
                    end
                  end
                  count = count - 1
                  -- More than one goes when a reload lowered max_keys below the count.
                  if count <= limit then
                    break
                  end
                elseif lease ~= '' then
                  call('ZADD', tracking, 'GT', live, other)
                end
              end
            end
          end
          if count > limit then
            -- None idle: refused by this limit, nothing taken (CapacityError).
            if lease ~= '' then
              call('ZREM', tracking, path)
            end
            result = {3, i - 1, soonest and 2 or 1, soonest or 1000000, limit}
            break
          end
        end
        if lease ~= '' then
          -- The set outlives its latest member, and its totals set (see below): the same
          -- expiry pushed an eighth further.
          local life_ms = floor(life / 1000) + 1
          life_ms = life_ms + floor(life_ms / 8)
          if call('PTTL', tracking) < life_ms then
            call('PEXPIRE', tracking, format('%d', life_ms))
          end
          added = added or {}
          added[#added + 1] = tracking
          added[#added + 1] = path
        end
      end
    end
  end

  if result ~= 1 or lease == '' then
    break -- refused, or a peek (the answer acquire would give; nothing added)
  end

  local ends, since, hold_s = format('%d', t + hold), '-' .. now_s, format('%d', hold_ms)
  for i = 1, slots do
    local s = 4 * i
    local at, quota, window, held = seen[s - 3], seen[s - 2], seen[s - 1], seen[s]
    local tracked = at < 0 -- a wildcard limit's slot: it has a totals set
    if tracked then
      at = -at
    end
    local key = KEYS[at]
    local totals = tracked and KEYS[at + 1]
    local ttl = hold_ms
    if prune and tracked then
      call('ZREMRANGEBYSCORE', totals, since, now_s)
    end
    -- A shadow slot over its concurrency still counts in its window; a full window is not
    -- extended (enforce mode would not have admitted).
    local windowed = quota > 0 and not (full and full[i])
    local there -- the first slot's add found something there already
    -- The lease alone, or with its window entry: no table to build and unpack.
    if not windowed then
      if i > 1 then
        call('ZADD', key, ends, lease)
      else
        there = call('ZADD', key, 'NX', ends, lease) == 0
      end
    else
      local window_ms = floor(window / 1000) + 1
      if window_ms > ttl then
        ttl = window_ms
      end
      if i > 1 then
        call('ZADD', key, ends, lease, since, lease .. ':w')
      else
        there = call('ZADD', key, 'NX', ends, lease, since, lease .. ':w') < 2
      end
    end
    if there then
      -- Something was there already: the marks, this admission's own first try (sent
      -- again after a connection broke), or its give-back's tombstone, which ran first
      -- (queued in a frozen Redis): then it takes nothing, and nobody waits for its answer.
      local score = call('ZSCORE', key, lease)
      if score and tonumber(score) > BAND then
        if windowed then
          call('ZREM', key, lease .. ':w')
        end
        result = {0, 0, 1, 0, 0}
        break
      end
    end
    if tracked then
      local path = sub(key, find(key, '}:z:', 1, true) + 4) -- as in a release
      if windowed then
        call('ZADD', totals, ends, lease .. '|' .. path, format('%d', -t - window), path)
      else
        call('ZADD', totals, ends, lease .. '|' .. path)
      end
    end
    -- A key with nothing in flight may be new (no expiry yet) or hold only ended entries:
    -- set its expiry. Otherwise never shorten a longer one (a delayed release, a long
    -- window, another host's longer max_hold).
    local ttl_s = ttl == hold_ms and hold_s or format('%d', ttl)
    if unsettled and (unsettled[key] or -1) >= 0 then
      unsettled[key] = nil -- this expiry covers what a release's settle would have looked at
    end
    if held == 0 then
      call('PEXPIRE', key, ttl_s)
    else
      call('PEXPIRE', key, ttl_s, 'GT')
    end
    -- The totals set must outlive its latest member. Its expiry is pushed an eighth
    -- further than needed, so most admissions find it long enough and only read it (a first
    -- admission finds none: -1).
    if tracked and call('PTTL', totals) < ttl then
      local life_s = format('%d', ttl + floor(ttl / 8))
      call('PEXPIRE', totals, life_s)
      -- The tracked set lives at least as long as the totals set (a new key sets it so as
      -- well), so a totals set long enough says it is too: read only with it.
      local tracking = KEYS[at + 3]
      if call('PTTL', tracking) < ttl + floor(ttl / 8) then
        call('PEXPIRE', tracking, life_s)
      end
    end
  end
  if result ~= 1 then
    break
  end
  if not over then
    if tight then
      result = 4
    end
    break
  end
  local shadowed, unrecorded = {}, {}
  for i = 1, slots do
    if over[i] then
      shadowed[#shadowed + 1] = i - 1
    end
    if full and full[i] then
      unrecorded[#unrecorded + 1] = i - 1
    end
  end
  result = {1, shadowed, unrecorded}
until true

if added and type(result) == 'table' and result[1] ~= 1 then
  -- Refused (or a give-back's tombstone found) after its new keys were added: out again.
  for i = 1, #added, 2 do
    call('ZREM', added[i], added[i + 1])
  end
end

-- --- the end of every call: the settles still waiting (see unsettled), then the answer,
-- with the claims made (if any).
if unsettled then
  if not now then
    local time = call('TIME')
    now = time[1] * 1000000 + time[2]
  end
  local t = now
  for i = 1, #unsettled_keys do
    local key = unsettled_keys[i]
    local window_ms = unsettled[key]
    if window_ms then
      if window_ms < 0 then
        window_ms = -1 - window_ms
      end
      -- settle (see above): from the latest member below the band, and the latest
      -- tombstone above it.
      local top = call('ZRANGE', key, '-1', '-1', 'WITHSCORES')
      if top[2] then -- else emptied: gone
        local tomb = 0
        local score = top[2] + 0
        if score >= BAND then -- a tombstone or a mark: the latest below the band
          tomb = score - BAND - t
          top = call('ZRANGE', key, BELOW, '-inf', 'BYSCORE', 'REV', 'LIMIT', '0', '1',
            'WITHSCORES')
        end
        local left = -1
        if top[2] then
          left = top[2] - t
        end
        if left > 0 and sub(top[1], -2) ~= ':d' then
          -- A request in flight: its admission set the expiry it needs.
          if window_ms == 0 then
            call('ZADD', key, BAND_S, MARK, BAND_S, MARK2)
          end
        else
          if tomb > left then
            left = tomb
          end
          local ttl = window_ms
          if left > 0 then
            if window_ms == 0 then
              call('ZADD', key, BAND_S, MARK, BAND_S, MARK2)
            end
            if left / 1000 > ttl then
              ttl = floor(left / 1000)
            end
          end
          call('PEXPIRE', key, format('%d', ttl + 1))
        end
      end
    end
  end
end
if not claims then
  return result
end
local wrapped = {2, result}
for i = 1, #claims do
  wrapped[#wrapped + 1] = claims[i]
end
return wrapped
