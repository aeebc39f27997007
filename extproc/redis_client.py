"""The one way this project opens Redis: a bounded pool, short timeouts, no client retries.

Every Redis call sits on a request's critical path (an admission, a session lookup), so:
- the pool is bounded, because Redis runs scripts one at a time: past a handful of connections
  more add no throughput, and a burst opening one connection per request would spend its whole
  timeout connecting; waiting for a pooled connection counts against the same timeout;
- redis-py's own retries are off: a retried call could wait several timeouts, and what to do
  when Redis does not answer is the caller's documented policy, not the client's.
"""

from __future__ import annotations

from redis.asyncio import BlockingConnectionPool, Redis
from redis.backoff import NoBackoff
from redis.retry import Retry


def bounded_client(url: str, timeout_s: float, max_connections: int = 16) -> Redis:
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=timeout_s,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )
    return Redis.from_pool(pool)  # owns the pool: aclose() closes its connections
