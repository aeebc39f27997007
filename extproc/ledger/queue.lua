-- The fleet-wide queue of one (cluster, class) compartment: requests of every replica waiting
-- for its budget, in one fair order (extproc/core/flow.py FairQueue, computed here so every
-- replica sees the same one). See extproc/ledger/redis.py for the key layout; the ticket
-- helpers (drop_ticket, reap_tickets, reset_if_idle, ticket_tokens, tag_for) are tickets.lua's.
--
-- KEYS[1] queue zset (ticket -> tag)   KEYS[2] ticket expiry zset   KEYS[3] queue meta hash
-- ARGV[1] op: 'join' | 'leave' | 'touch'
--   join:  ARGV[2] ticket, [3] tenant, [4] increment (service / weight), [5] tokens,
--          [6] lease_s, [7] max_queue, [8] idle_ttl_ms, [9] freed channel.
--          Returns {joined (1/0), ahead, ahead_tokens, tag, member, order}: ahead = tickets
--          served before it (all of them when it did not join: the queue was full); member =
--          its name in the queue (what leave, touch and reserve.lua take), order = its arrival
--          number in the compartment.
--   leave: ARGV[2] ticket, [3] freed channel, [4] the compartment's state key (the notice's
--          payload). Unserved: its tenant's counter gives its increment back. Returns 1 when
--          it was queued.
--   touch: ARGV[2] lease_s, ARGV[3..] tickets. Returns the tickets no longer queued.
--   charge: ARGV[2] tenant, [3] increment: the tenant's counter advances (output it was
--          served), while the compartment has a queue. Returns 1 when it did.
--
-- Tags: start-time fair queueing, as FairQueue: a tenant's ticket gets the tag
-- max(V, the tenant's counter) and moves the counter to that tag + increment (its service
-- over its weight: tokens, or 1); the smallest tag is served first, ties in
-- arrival order (the member starts with the zero-padded arrival number, and Redis orders
-- equal scores by member); V is the tag last admitted (reserve.lua). Tickets are leases: a replica renews its own
-- (touch); a dead replica's lapse and are reaped by the next call, so they block nobody for
-- longer than their lease.
local queue, expiry, meta = KEYS[1], KEYS[2], KEYS[3]
local op = ARGV[1]

local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000

if op == 'join' then
  local tenant = ARGV[3]
  local increment, tokens = tonumber(ARGV[4]), tonumber(ARGV[5])
  local lease, max_queue, idle_ttl_ms = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
  reap_tickets(queue, expiry, meta, now)
  reset_if_idle(queue, meta)
  local n = redis.call('ZCARD', queue)
  if n >= max_queue then
    return {0, n, ticket_tokens(queue, meta, 0, -1), '0', '', 0}
  end
  local order = redis.call('HINCRBY', meta, 'seq', 1)
  local ticket = string.format('%012d', order) .. '/' .. ARGV[2]
  local tag = tag_for(meta, tenant)
  local text = string.format('%.17g', tag)
  local counter = string.format('%.17g', tag + math.max(increment, 0))
  redis.call('ZADD', queue, text, ticket)
  redis.call('ZADD', expiry, now + lease, ticket)
  redis.call('HSET', meta, 't:' .. tenant, counter, 'k:' .. ticket, tokens,
    'n:' .. ticket, tenant, 'i:' .. ticket, string.format('%.17g', math.max(increment, 0)))
  local rank = redis.call('ZRANK', queue, ticket)
  local sum = 0
  if rank > 0 then sum = ticket_tokens(queue, meta, 0, rank - 1) end
  for _, key in ipairs({queue, expiry, meta}) do redis.call('PEXPIRE', key, idle_ttl_ms) end
  return {1, rank, sum, text, ticket, order}
elseif op == 'leave' then
  local ticket, channel = ARGV[2], ARGV[3]
  local head = redis.call('ZRANGE', queue, 0, 0)
  local removed = withdraw_ticket(queue, expiry, meta, ticket)
  reset_if_idle(queue, meta)
  if removed == 1 and head[1] == ticket and redis.call('ZCARD', queue) > 0 and channel ~= '' then
    -- The head left: the next one, on whichever replica, tries the budget now.
    redis.call('PUBLISH', channel, ARGV[4])
  end
  return removed
elseif op == 'charge' then
  if redis.call('ZCARD', queue) == 0 then return 0 end
  local counter = tag_for(meta, ARGV[2]) + tonumber(ARGV[3])
  redis.call('HSET', meta, 't:' .. ARGV[2], string.format('%.17g', counter))
  return 1
elseif op == 'touch' then
  local until_ = now + tonumber(ARGV[2])
  local lost, update = {}, {}
  if #ARGV >= 3 then
    local scores = redis.call('ZMSCORE', expiry, unpack(ARGV, 3, #ARGV))
    for i = 1, #scores do
      if scores[i] then
        update[#update + 1] = until_
        update[#update + 1] = ARGV[i + 2]
      else
        lost[#lost + 1] = ARGV[i + 2]
      end
    end
  end
  if #update > 0 then redis.call('ZADD', expiry, 'XX', unpack(update)) end
  return lost
end
return redis.error_reply('queue.lua: unknown op ' .. tostring(op))
