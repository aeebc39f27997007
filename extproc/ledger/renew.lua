-- Extend a chunk of one replica's leases in one (cluster, class) compartment.
--
-- One compartment (and its leases' tenant) per call keeps every key in one hash slot on Redis
-- Cluster (the ledger's one-slot layout there, extproc/ledger/redis.py), and the caller
-- bounds the chunk (extproc.ledger.redis.RENEW_CHUNK) so no call blocks Redis for long: two
-- variadic commands in C (ZMSCORE, ZADD XX) instead of a Lua loop of commands.
--
-- KEYS[1] state hash   KEYS[2] lease expiry zset   KEYS[3] lease tokens hash
-- KEYS[4] (optional) the leases' tenant's lease expiry zset (reserve.lua): extended alike
-- ARGV[1] lease_ttl_s, ARGV[2] idle_ttl_ms, ARGV[3..] lease ids
-- Returns the lease ids that were no longer held (reaped after expiring, or lost with a Redis
-- restart): their requests now run unaccounted, which the caller counts.
local state, leases, lease_tokens = KEYS[1], KEYS[2], KEYS[3]
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local expiry = now + tonumber(ARGV[1])
local idle_ttl_ms = tonumber(ARGV[2])
local lost = {}
local update = {}
if #ARGV >= 3 then
  local scores = redis.call('ZMSCORE', leases, unpack(ARGV, 3, #ARGV))
  for i = 1, #scores do
    local lease_id = ARGV[i + 2]
    if scores[i] then
      update[#update + 1] = expiry
      update[#update + 1] = lease_id
    else
      lost[#lost + 1] = lease_id
    end
  end
end
if #update > 0 then
  redis.call('ZADD', leases, 'XX', unpack(update))
  if KEYS[4] then
    redis.call('ZADD', KEYS[4], 'XX', unpack(update))
    redis.call('PEXPIRE', KEYS[4], idle_ttl_ms)
  end
end
redis.call('PEXPIRE', state, idle_ttl_ms)
redis.call('PEXPIRE', leases, idle_ttl_ms)
redis.call('PEXPIRE', lease_tokens, idle_ttl_ms)
return lost
