-- A tenant's use as it stands, fleet-wide, read only (for explain): its live leases (its
-- requests in flight on every replica) and its tokens-per-minute bucket refilled to now, as
-- reserve.lua would see them. Writes nothing: lapsed leases are skipped here and reaped by
-- the tenant's next reserve.
--
-- KEYS[1] the tenant's lease expiry zset   KEYS[2] its state hash (level, level_at)
-- ARGV[1] its tokens_per_minute (0: no such limit)
-- Returns {inflight, bucket_level}; the level as a string (Redis would truncate a Lua number).
local leases, state = KEYS[1], KEYS[2]
local rate = tonumber(ARGV[1]) or 0

local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000

local inflight = redis.call('ZCOUNT', leases, '(' .. string.format('%.17g', now), '+inf')
local level = 0
if rate > 0 then
  local ts = redis.call('HMGET', state, 'level', 'level_at')
  local prev = tonumber(ts[1])
  if prev == nil then
    level = rate
  else
    level = math.min(rate, prev + math.max(0, now - (tonumber(ts[2]) or now)) * rate / 60)
  end
end
return {inflight, tostring(level)}
