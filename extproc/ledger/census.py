"""Each processor announces itself in Redis, so a wrong ``redis.replicas`` is seen.

While Redis is unreachable each replica admits against its local share, budget /
``redis.replicas``: with the setting below the real number of replicas (worker processes
count, each holds its own gate) the fleet admits more than the stated bound (RELIABILITY.md,
"Over-admission bound"); above it, less than the budget. Nothing else tells the two apart, so
every replica keeps a member in one sorted set, scored with its expiry on the Redis clock::

    P:replicas   ZSET  member replica id, score = expiry (Redis TIME, ms)

and reads the live count in the same call (``ANNOUNCE``: add or refresh itself, drop lapsed
members, count). A replica that stops announcing (SIGKILL) lapses after ``ttl_s``; a draining
or stopped one withdraws at once. A count that differs from the setting for longer than
``grace_s`` (so a rollout or a restart's lapse does not flap it) becomes a warning, in the log
and in readiness; the replica stays ready. A Redis call that fails leaves the verdict as it was:
the census is not on any request's path and says nothing about Redis health.
"""

from __future__ import annotations

import logging
import secrets

from extproc.ledger.redis_client import UNAVAILABLE, AnyRedis

log = logging.getLogger("extproc.ledger")

# One key, so on Redis Cluster the whole census lives in one slot.
ANNOUNCE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return redis.call('ZCARD', KEYS[1])
"""

# Announced every watch interval (1 s); a replica that stops is gone after this long.
REPLICA_TTL_S = 5.0
# How long the live count must differ from redis.replicas before it is a warning.
MISMATCH_GRACE_S = 10.0


def census_key(prefix: str) -> str:
    return f"{prefix}:replicas"


class ReplicaCensus:
    def __init__(
        self,
        client: AnyRedis,
        prefix: str,
        configured: int,
        *,
        ttl_s: float = REPLICA_TTL_S,
        grace_s: float = MISMATCH_GRACE_S,
        replica_id: str | None = None,
    ) -> None:
        self._client = client
        self._key = census_key(prefix)
        self.configured = configured
        self.replica_id = replica_id or secrets.token_hex(8)
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._grace_s = grace_s
        self.live: int | None = None
        self._mismatch_since: float | None = None
        self.warnings: list[str] = []

    def configure(self, configured: int) -> None:
        """A reload changed ``redis.replicas``: judge the count against the new setting."""
        if configured != self.configured:
            self.configured = configured
            self._mismatch_since = None

    async def announce(self, now: float) -> int | None:
        """Refresh this replica's member and judge the live count; None when Redis failed."""
        try:
            answer = await self._client.eval(ANNOUNCE, 1, self._key, self.replica_id, self._ttl_ms)
            live = int(answer)
        except UNAVAILABLE:
            return None
        self.live = live
        self._judge(live, now)
        return live

    async def withdraw(self) -> None:
        """Leave the census (drain or stop), so the others count one less at once."""
        try:
            await self._client.zrem(self._key, self.replica_id)
        except UNAVAILABLE:
            log.info("replica census: could not withdraw; the entry lapses with its TTL")

    async def aclose(self) -> None:
        await self._client.aclose()

    def _judge(self, live: int, now: float) -> None:
        if live == self.configured:
            self._mismatch_since = None
            if self.warnings:
                log.info("replica census: live replicas match redis.replicas", extra={"live": live})
            self.warnings = []
            return
        if self._mismatch_since is None:
            self._mismatch_since = now
        if now - self._mismatch_since < self._grace_s:
            return
        c = self.configured
        warning = (
            f"redis.replicas is {c} but {live} processor replicas announce themselves in Redis "
            f"(each worker process counts): while Redis is unreachable each admits budget / {c} "
            f"locally, {live}/{c} x budget together; set redis.replicas to {live}"
        )
        if self.warnings != [warning]:
            log.warning(warning, extra={"live": live, "configured": self.configured})
        self.warnings = [warning]
