"""The one way this project opens Redis: a bounded pool, short timeouts, no client retries.

Every Redis call sits on a request's critical path (an admission, a session lookup), so:
- the pool is bounded, because Redis runs scripts one at a time: past a handful of connections
  more add no throughput, and a burst opening one connection per request would spend its whole
  timeout connecting; waiting for a pooled connection counts against the same timeout;
- redis-py's own retries are off: a retried call could wait several timeouts, and what to do
  when Redis does not answer is the caller's documented policy, not the client's.

Redis Cluster (and managed cluster-mode Redis) is selected by the URL scheme:
``redis+cluster://host:port`` (``rediss+cluster://`` with TLS), any node of the cluster as the
seed. The cluster client keeps one retry: after a primary fails over, the first call to its
slots is answered MOVED (or hits the dead node) and the client refreshes its slot map; the
retry then reaches the new primary within the same bounded call. Only calls that are safe to
resend go through it (the ledger's scripts are idempotent by lease id).
"""

from __future__ import annotations

from redis.asyncio import BlockingConnectionPool, Redis, RedisCluster
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException, RedisError
from redis.retry import Retry

AnyRedis = Redis | RedisCluster

# What a Redis call can raise when Redis is unreachable, slow or failing. The cluster client's
# RedisClusterException (e.g. no node reachable to build its slot map) is not a RedisError;
# TimeoutError is an OSError.
UNAVAILABLE: tuple[type[Exception], ...] = (RedisError, RedisClusterException, OSError)

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster_url(url: str) -> bool:
    return url.partition("://")[0].lower() in CLUSTER_SCHEMES


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


def cluster_client(url: str, timeout_s: float, max_connections: int = 16) -> RedisCluster:
    """A Redis Cluster client for a ``redis+cluster://`` URL (``max_connections`` per node)."""
    scheme, _, rest = url.partition("://")
    plain = f"{CLUSTER_SCHEMES[scheme.lower()]}://{rest}"
    return RedisCluster.from_url(
        plain,
        max_connections=max_connections,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1),
    )


def any_client(url: str, timeout_s: float, max_connections: int = 16) -> AnyRedis:
    """A single-node or cluster client, by the URL scheme."""
    if is_cluster_url(url):
        return cluster_client(url, timeout_s, max_connections)
    return bounded_client(url, timeout_s, max_connections)
