-- Extend every lease one replica holds, in one call per renewal tick.
--
-- KEYS: three per compartment, in order: state hash, lease expiry zset, lease tokens hash
-- ARGV[1] lease_ttl_s, ARGV[2] idle_ttl_ms, then per compartment: n, lease_id_1 .. lease_id_n
-- Returns the lease ids that were no longer held (reaped after expiring, or lost with a Redis
-- restart): their requests now run unaccounted, which the caller counts.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local expiry = now + tonumber(ARGV[1])
local idle_ttl_ms = tonumber(ARGV[2])
local lost = {}
local a = 3
for k = 1, #KEYS, 3 do
  local leases = KEYS[k + 1]
  local n = tonumber(ARGV[a])
  a = a + 1
  for _ = 1, n do
    local lease_id = ARGV[a]
    a = a + 1
    if redis.call('ZSCORE', leases, lease_id) then
      redis.call('ZADD', leases, 'XX', expiry, lease_id)
    else
      lost[#lost + 1] = lease_id
    end
  end
  redis.call('PEXPIRE', KEYS[k], idle_ttl_ms)
  redis.call('PEXPIRE', leases, idle_ttl_ms)
  redis.call('PEXPIRE', KEYS[k + 2], idle_ttl_ms)
end
return lost
