-- Atomic check-and-reserve for one (cluster, class) compartment. See extproc/ledger/redis.py
-- for the key layout. Time is the Redis server's clock, so every replica shares one time base.
--
-- KEYS[1] state hash   KEYS[2] lease expiry zset   KEYS[3] lease tokens hash
-- KEYS[4..6] the compartment's fleet-wide queue (queue.lua): queue zset, ticket expiry zset,
--            queue meta hash (its ticket helpers are tickets.lua's, loaded in front)
-- KEYS[7..8] (optional) the request's tenant: its lease expiry zset (lease id -> expiry: the
--            tenant's requests in flight, fleet-wide) and its state hash (level, level_at: its
--            tokens-per-minute bucket)
-- ARGV: lease_id, tokens, max_inflight_tokens, max_concurrent, tokens_per_second,
--       burst_tokens, lease_ttl_s, idle_ttl_ms, peek (1 = only report, reserve nothing),
--       queue mode ('' = ignore the queue: a charge that follows a failover; '-' = a new
--       request: it does not pass anyone queued; else the caller's queue ticket: granted only
--       at the head of the queue), ticket lease_s, freed channel, the tenant's max_concurrent
--       and tokens_per_minute (0: no such limit; the tenant is still counted), the request's
--       tenant in the queue's fair order ('' or absent: none)
-- Returns {granted, inflight_tokens, concurrent, bucket_level, rel_n, rel_tokens, rel_at,
--          rel_since, now, queued, queued_tokens, behind (1: refused because another
--          request heads the queue), tenant_refused (1: refused by the tenant's own limits,
--          nothing reserved), tenant_inflight, tenant_bucket, ahead, ahead_tokens (the queued
--          tickets a new ticket of the fair-order tenant would be served after, and their
--          tokens: those tagged at most the tag it would get; every ticket without one)};
--          floats as strings (Redis would truncate Lua numbers to integers).
local state, leases, lease_tokens = KEYS[1], KEYS[2], KEYS[3]
local queue, qexpiry, qmeta = KEYS[4], KEYS[5], KEYS[6]
local mode = ARGV[10] or ''
local ticket_lease = tonumber(ARGV[11]) or 0
local channel = ARGV[12] or ''
local lease_id = ARGV[1]
local need = tonumber(ARGV[2])
local max_tokens = tonumber(ARGV[3])
local max_concurrent = tonumber(ARGV[4])
local rate = tonumber(ARGV[5])
local burst = tonumber(ARGV[6])
local ttl = tonumber(ARGV[7])
local idle_ttl_ms = tonumber(ARGV[8])
local peek = ARGV[9] == '1'
local tenant_leases, tenant_state = KEYS[7], KEYS[8]
local tenant_max = tonumber(ARGV[13]) or 0
local tenant_rate = tonumber(ARGV[14]) or 0
local queue_tenant = ARGV[15] or ''

local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000

local s = redis.call('HMGET', state, 'tokens', 'count', 'level', 'level_at',
  'rel_n', 'rel_tokens', 'rel_at', 'rel_since')
local inflight = tonumber(s[1]) or 0
local count = tonumber(s[2]) or 0

-- Leases whose holder stopped renewing (crashed, partitioned) give their budget back here,
-- lazily, in the same atomic step that needs it. Bounded per call to bound script time.
local expired = redis.call('ZRANGEBYSCORE', leases, '-inf', now, 'LIMIT', 0, 512)
if #expired > 0 then
  local held = redis.call('HMGET', lease_tokens, unpack(expired))
  for i = 1, #expired do
    -- Tombstones of cancelled reserves (tokens -1) held nothing.
    if held[i] and tonumber(held[i]) >= 0 then
      inflight = inflight - tonumber(held[i])
      count = count - 1
    end
  end
  redis.call('ZREM', leases, unpack(expired))
  redis.call('HDEL', lease_tokens, unpack(expired))
end
if inflight < 0 then inflight = 0 end
if count < 0 then count = 0 end

local level = 0
if burst > 0 then
  local prev = tonumber(s[3])
  if prev == nil then
    level = burst
  else
    level = math.min(burst, prev + math.max(0, now - (tonumber(s[4]) or now)) * rate)
  end
end

-- The queue: lapsed tickets (their replica stopped renewing them) are reaped (tickets.lua).
local blocked = false
local queued, queued_tokens = 0, 0
if queue then
  reap_tickets(queue, qexpiry, qmeta, now)
  queued = redis.call('ZCARD', queue)
  if not peek and mode ~= '' and queued > 0 then
    local head = redis.call('ZRANGE', queue, 0, 0)
    -- A new request joins behind the waiters; a waiter goes only from the head.
    blocked = head[1] ~= mode
    if mode ~= '-' and ticket_lease > 0 then
      redis.call('ZADD', qexpiry, 'XX', now + ticket_lease, mode)
    end
  end
end

-- The tenant: leases whose holder stopped renewing them (crashed, partitioned) stop counting,
-- as the compartment's do; what is left is its requests in flight on every replica.
local tenant_count, tenant_level, tenant_ok = 0, 0, true
if tenant_leases then
  redis.call('ZREMRANGEBYSCORE', tenant_leases, '-inf', now)
  tenant_count = redis.call('ZCARD', tenant_leases)
  if tenant_rate > 0 then
    local ts = redis.call('HMGET', tenant_state, 'level', 'level_at')
    local prev = tonumber(ts[1])
    if prev == nil then
      tenant_level = tenant_rate
    else
      local gained = math.max(0, now - (tonumber(ts[2]) or now)) * tenant_rate / 60
      tenant_level = math.min(tenant_rate, prev + gained)
    end
  end
  -- A request larger than the whole bucket waits for a full one, not forever.
  tenant_ok = (tenant_max == 0 or tenant_count < tenant_max)
    and (tenant_rate == 0 or tenant_level >= math.min(need, tenant_rate))
end

local granted = 0
local tenant_refused = 0
if not tenant_ok and (peek or (blocked and not redis.call('HGET', lease_tokens, lease_id))) then
  -- Over its own limits: refused now, not queued behind the waiters (nor, for a peek, told
  -- that the queue is the only obstacle).
  tenant_refused = 1
end
if not peek and not blocked then
  local prior = tonumber(redis.call('HGET', lease_tokens, lease_id))
  if prior and prior < 0 then
    -- Its caller gave up and already cancelled it (release.lua): this call arrived late,
    -- queued behind a stall. Refuse, so nobody holds a reservation no one will release.
    granted = 0
  elseif prior then
    -- A retried call whose first attempt did reserve: answer the same, charge nothing twice.
    granted = 1
  elseif not tenant_ok then
    tenant_refused = 1
  elseif (max_tokens == 0 or inflight + need <= max_tokens)
      and (max_concurrent == 0 or count + 1 <= max_concurrent)
      and (burst == 0 or level >= need) then
    granted = 1
    inflight = inflight + need
    count = count + 1
    if burst > 0 then level = level - need end
    redis.call('ZADD', leases, now + ttl, lease_id)
    redis.call('HSET', lease_tokens, lease_id, need)
    if tenant_leases then
      -- Renewed and released with the compartment's lease (renew.lua, release.lua).
      redis.call('ZADD', tenant_leases, now + ttl, lease_id)
      tenant_count = tenant_count + 1
      if tenant_rate > 0 then
        tenant_level = tenant_level - need
        redis.call('HSET', tenant_state, 'level', tostring(tenant_level), 'level_at',
          tostring(now))
      end
      redis.call('PEXPIRE', tenant_leases, idle_ttl_ms)
      redis.call('PEXPIRE', tenant_state, idle_ttl_ms)
    end
  end
end

if granted == 1 and queue and mode ~= '' and mode ~= '-' then
  local tag = redis.call('ZSCORE', queue, mode)
  if tag then
    drop_ticket(queue, qexpiry, qmeta, mode)
    local vt = tonumber(redis.call('HGET', qmeta, 'vt')) or 0
    if tonumber(tag) > vt then redis.call('HSET', qmeta, 'vt', tag) end
    queued = queued - 1
    if queued == 0 then
      reset_if_idle(queue, qmeta)
    elseif channel ~= '' then
      -- The release may have freed room for more: the next head, on any replica, tries.
      redis.call('PUBLISH', channel, state)
    end
  end
end
local ahead, ahead_tokens = 0, 0
if queue and queued > 0 then
  queued_tokens, ahead, ahead_tokens = tokens_and_ahead(queue, qmeta, queue_tenant)
end

redis.call('HSET', state, 'tokens', inflight, 'count', count)
if burst > 0 then
  redis.call('HSET', state, 'level', tostring(level), 'level_at', tostring(now))
end
-- Idle compartments (no reserve, release or renewal for idle_ttl) vanish whole; by then every
-- lease in them has expired too, since idle_ttl is longer than the lease TTL.
redis.call('PEXPIRE', state, idle_ttl_ms)
redis.call('PEXPIRE', leases, idle_ttl_ms)
redis.call('PEXPIRE', lease_tokens, idle_ttl_ms)

return {granted, inflight, count, tostring(level), s[5] or '0', s[6] or '0', s[7] or '0',
  s[8] or '0', tostring(now), queued, queued_tokens, blocked and 1 or 0, tenant_refused,
  tenant_count, tostring(tenant_level), ahead, ahead_tokens}
