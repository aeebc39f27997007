-- The fleet-wide queue's ticket bookkeeping, shared by queue.lua and reserve.lua: a Redis
-- script cannot load another, so extproc/ledger/redis.py puts this file in front of both when
-- it loads them. Keys as in queue.lua: the queue zset (ticket -> tag), the ticket expiry zset
-- and the meta hash (vt, seq, t:<tenant> counters, k:/n:/i:<ticket> its tokens, tenant and
-- increment).

-- One ticket out of the queue (admitted); 1 when it was queued.
local function drop_ticket(queue, expiry, meta, ticket)
  local removed = redis.call('ZREM', queue, ticket)
  redis.call('ZREM', expiry, ticket)
  redis.call('HDEL', meta, 'k:' .. ticket, 'n:' .. ticket, 'i:' .. ticket)
  return removed
end

-- One ticket out of the queue unserved (it left, or its lease lapsed): its tenant's counter
-- gives back what the ticket moved it by (FairQueue.remove); 1 when it was queued.
local function withdraw_ticket(queue, expiry, meta, ticket)
  local f = redis.call('HMGET', meta, 'n:' .. ticket, 'i:' .. ticket)
  local removed = drop_ticket(queue, expiry, meta, ticket)
  local increment = tonumber(f[2])
  if removed == 1 and f[1] and increment and increment > 0 then
    local field = 't:' .. f[1]
    local counter = tonumber(redis.call('HGET', meta, field))
    if counter then
      redis.call('HSET', meta, field, string.format('%.17g', counter - increment))
    end
  end
  return removed
end

-- Tickets whose replica stopped renewing them (dead, partitioned) leave, so they block nobody
-- for longer than their lease. Bounded per call to bound script time.
local function reap_tickets(queue, expiry, meta, now)
  local lapsed = redis.call('ZRANGEBYSCORE', expiry, '-inf', now, 'LIMIT', 0, 512)
  for i = 1, #lapsed do withdraw_ticket(queue, expiry, meta, lapsed[i]) end
end

-- Nobody waits: nothing is owed to any tenant any more (V and the arrival count stay).
local function reset_if_idle(queue, meta)
  if redis.call('ZCARD', queue) == 0 then
    local kept = redis.call('HMGET', meta, 'vt', 'seq')
    redis.call('DEL', meta)
    redis.call('HSET', meta, 'vt', kept[1] or '0', 'seq', kept[2] or '0')
  end
end

-- The tokens of the tickets ranked first..last (0-based, inclusive; -1 is the last).
local function ticket_tokens(queue, meta, first, last)
  local sum = 0
  local tickets = redis.call('ZRANGE', queue, first, last)
  for i = 1, #tickets do
    sum = sum + (tonumber(redis.call('HGET', meta, 'k:' .. tickets[i])) or 0)
  end
  return sum
end

-- The tag a new ticket of `tenant` gets (queue.lua's join): max(V, the tenant's counter).
local function tag_for(meta, tenant)
  local vt = tonumber(redis.call('HGET', meta, 'vt')) or 0
  local last = tonumber(redis.call('HGET', meta, 't:' .. tenant)) or vt
  return math.max(vt, last)
end

-- {tokens of every ticket, tickets a new ticket of `tenant` would be served after, their
-- tokens}: those tagged at most the tag it would get (ties go to the earlier arrival, and it
-- arrives last), as FairQueue.ahead_for; every ticket when `tenant` is ''.
local function tokens_and_ahead(queue, meta, tenant)
  local limit = math.huge
  if tenant ~= '' then limit = tag_for(meta, tenant) end
  local entries = redis.call('ZRANGE', queue, 0, -1, 'WITHSCORES')
  local total, ahead, ahead_tokens = 0, 0, 0
  for i = 1, #entries, 2 do
    local tokens = tonumber(redis.call('HGET', meta, 'k:' .. entries[i])) or 0
    total = total + tokens
    if tonumber(entries[i + 1]) <= limit then
      ahead = ahead + 1
      ahead_tokens = ahead_tokens + tokens
    end
  end
  return total, ahead, ahead_tokens
end
