-- Return one lease to its (cluster, class) compartment and count the completion for the
-- release-rate estimate. Idempotent: an unknown lease (already released, or expired and
-- reaped) changes nothing.
--
-- With cancel_ttl_s > 0 this is also the reconciliation of a reserve whose caller gave up
-- (timed out or cancelled) without knowing whether Redis ran it: an unknown lease then leaves
-- a tombstone (tokens -1, expiring like a lease), so a reserve of that id that Redis runs
-- later (it was still queued on the dropped connection) is refused instead of becoming a
-- reservation nobody owns.
--
-- KEYS[1] state hash   KEYS[2] lease expiry zset   KEYS[3] lease tokens hash
-- KEYS[4] (optional) the lease's tenant's lease expiry zset (reserve.lua): it leaves it too
-- ARGV: lease_id, rate_tau_s, idle_ttl_ms, cancel_ttl_s (0: a plain release),
--       freed_channel (optional: where a release is announced to waiting replicas)
-- Returns 1 when the lease was held, 0 otherwise.
local state, leases, lease_tokens = KEYS[1], KEYS[2], KEYS[3]
local lease_id = ARGV[1]
local tau = tonumber(ARGV[2])
local idle_ttl_ms = tonumber(ARGV[3])
local cancel_ttl = tonumber(ARGV[4]) or 0
local freed_channel = ARGV[5]

local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000

if KEYS[4] then redis.call('ZREM', KEYS[4], lease_id) end

local held = redis.call('HGET', lease_tokens, lease_id)
local tokens = held and tonumber(held) or -1
if tokens < 0 then
  if not held and cancel_ttl > 0 then
    redis.call('HSET', lease_tokens, lease_id, -1)
    redis.call('ZADD', leases, now + cancel_ttl, lease_id)
    redis.call('PEXPIRE', leases, idle_ttl_ms)
    redis.call('PEXPIRE', lease_tokens, idle_ttl_ms)
  end
  return 0
end
redis.call('HDEL', lease_tokens, lease_id)
redis.call('ZREM', leases, lease_id)

local s = redis.call('HMGET', state, 'tokens', 'count', 'rel_n', 'rel_tokens', 'rel_at',
  'rel_since')
local inflight = math.max(0, (tonumber(s[1]) or 0) - tokens)
local count = math.max(0, (tonumber(s[2]) or 0) - 1)
local rel_n = tonumber(s[3]) or 0
local rel_tokens = tonumber(s[4]) or 0
local rel_at = tonumber(s[5]) or now
local rel_since = tonumber(s[6])
if rel_n == 0 or rel_since == nil then rel_since = now end
-- Exponentially decayed completion counters (see ReleaseStats in extproc/core/admission.py).
local decay = math.exp(-math.max(0, now - rel_at) / tau)
rel_n = rel_n * decay + 1
rel_tokens = rel_tokens * decay + tokens

redis.call('HSET', state, 'tokens', inflight, 'count', count, 'rel_n', tostring(rel_n),
  'rel_tokens', tostring(rel_tokens), 'rel_at', tostring(now), 'rel_since', tostring(rel_since))
redis.call('PEXPIRE', state, idle_ttl_ms)
redis.call('PEXPIRE', leases, idle_ttl_ms)
redis.call('PEXPIRE', lease_tokens, idle_ttl_ms)
if freed_channel and freed_channel ~= '' then
  -- Wakes the requests queued for this compartment on every replica (extproc/ledger/waiters.py).
  -- The key names are the payload, so the subscriber needs no parsing of its own layout.
  redis.call('PUBLISH', freed_channel, state)
end
return 1
