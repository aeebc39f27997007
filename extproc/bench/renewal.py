"""``extproc bench renewal``: renewing one replica's leases, chunked vs one script.

For each lease count it reserves that many leases on a real ``redis-server`` (its own, on a
free 127.0.0.1 port, unless ``--redis-url``), then renews them all, several times, two ways
side by side:

- ``chunked``: what the gate runs (``RedisLedger.renew``): renew.lua per compartment, at most
  ``RENEW_CHUNK`` leases per call, pipelined, ``RENEW_BATCH`` leases per round trip;
- ``one script``: the former renew.lua (kept below as the baseline), every lease of the
  replica in a single script call.

Per way it reports the wall time of one whole renewal (what has to fit the Redis timeout per
round trip), the longest single script run inside Redis (SLOWLOG, calls over 100 µs: how long
Redis was blocked for every other client) and the worst PING latency another client saw
meanwhile (a probe pinging in a loop on its own connection).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from redis.asyncio import Redis

from extproc.bench.admission import _redis_server
from extproc.core.admission import Ticket
from extproc.ledger.redis import (
    RENEW_BATCH,
    RENEW_CHUNK,
    RedisLedger,
    _script,
    compartment_keys,
)

# The renewal script before chunking: every compartment and every lease in one call.
ONE_SCRIPT_RENEW = """
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
"""


# Long enough that no lease lapses while a big count is seeded and renewed on a slow machine
# (a lapsed lease would show up as "lost" and skip its update).
LEASE_TTL_S = 900.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--leases",
        default="8000,20000,50000,100000",
        help="comma-separated lease counts held by one replica",
    )
    parser.add_argument(
        "--compartments", type=int, default=8, help="(cluster, class) compartments they span"
    )
    parser.add_argument("--rounds", type=int, default=5, help="renewals timed per way")
    parser.add_argument(
        "--redis-url", default=None, help="use this Redis instead of starting redis-server"
    )
    parser.add_argument("--redis-server", default="redis-server", help="redis-server binary")


@dataclass(frozen=True, slots=True)
class Row:
    leases: int
    way: str
    wall_ms: list[float]
    script_ms: float
    ping_ms: float
    lost: int


async def _seed(ledger: RedisLedger, n: int, compartments: int) -> list[Ticket]:
    """Reserve ``n`` leases spread over ``compartments``, pipelined (seeding is not timed)."""
    client = ledger.client
    sha = await client.script_load(_script("reserve.lua"))
    tickets: list[Ticket] = []
    for start in range(0, n, 2000):
        pipe = client.pipeline(transaction=False)
        for i in range(start, min(n, start + 2000)):
            cluster, cls = f"c{i % compartments}", "short"
            lease = ledger.new_lease()
            keys = compartment_keys(ledger.prefix, cluster, cls)
            args: list[str | int] = [lease, 10, 0, 0, "0.0", 0, repr(LEASE_TTL_S), 3_600_000, 0]
            pipe.evalsha(sha, 3, *keys, *args)
            tickets.append(Ticket(cluster, cls, 10, lease, "redis"))
        await pipe.execute()
    return tickets


async def _one_script(ledger: RedisLedger, sha: str, tickets: list[Ticket]) -> int:
    groups: dict[tuple[str, str], list[str]] = {}
    for t in tickets:
        groups.setdefault((t.cluster, t.class_name), []).append(t.lease)
    keys: list[str] = []
    args: list[str | int] = [repr(LEASE_TTL_S), 3_600_000]
    for (cluster, cls), leases in groups.items():
        keys.extend(compartment_keys(ledger.prefix, cluster, cls))
        args.append(len(leases))
        args.extend(leases)
    lost = await ledger.client.evalsha(sha, len(keys), *keys, *args)
    return len(lost)


async def _probe(url: str, stop: asyncio.Event) -> float:
    """Worst PING round trip (ms) another client sees until ``stop``."""
    probe = Redis.from_url(url, socket_timeout=120)
    worst = 0.0
    try:
        await probe.ping()
        while not stop.is_set():
            started = time.perf_counter()
            await probe.ping()
            worst = max(worst, (time.perf_counter() - started) * 1000)
            await asyncio.sleep(0)
    finally:
        await probe.aclose()
    return worst


async def _max_script_ms(client: Redis) -> float:
    entries = await client.slowlog_get(10_000)
    durations = [
        int(e["duration"])
        for e in entries
        if e["command"].split(b" ", 1)[0].lower() in (b"evalsha", b"eval")
    ]
    return max(durations, default=0) / 1000


async def _bench_count(url: str, n: int, compartments: int, rounds: int) -> list[Row]:
    ledger = RedisLedger.from_url(url, lease_ttl_s=LEASE_TTL_S, timeout_s=30.0, max_connections=4)
    admin = Redis.from_url(url, socket_timeout=120)
    try:
        await admin.flushall()
        await ledger.load()
        one_sha = await admin.script_load(ONE_SCRIPT_RENEW)
        tickets = await _seed(ledger, n, compartments)
        rows: list[Row] = []

        async def chunked() -> int:
            return len(await ledger.renew(tickets))

        async def one_script() -> int:
            return await _one_script(ledger, one_sha, tickets)

        ways: dict[str, Callable[[], Awaitable[int]]] = {
            "chunked": chunked,
            "one script": one_script,
        }
        for way, call in ways.items():
            walls: list[float] = []
            lost_total = 0
            # Only calls over 100 µs are logged: the probe's PINGs (a few µs each) would flood it.
            await admin.config_set("slowlog-log-slower-than", 100)
            await admin.config_set("slowlog-max-len", 10_000)
            await admin.slowlog_reset()
            stop = asyncio.Event()
            probe = asyncio.create_task(_probe(url, stop))
            await asyncio.sleep(0.05)
            for _ in range(rounds):
                started = time.perf_counter()
                lost = await call()
                walls.append((time.perf_counter() - started) * 1000)
                lost_total += lost
            stop.set()
            ping = await probe
            script = await _max_script_ms(admin)
            await admin.config_set("slowlog-log-slower-than", 10_000)
            rows.append(Row(n, way, walls, script, ping, lost_total))
        return rows
    finally:
        await ledger.close()
        await admin.aclose()


async def _bench(args: argparse.Namespace, url: str) -> list[Row]:
    rows: list[Row] = []
    for n in (int(x) for x in args.leases.split(",") if x.strip()):
        rows.extend(await _bench_count(url, n, args.compartments, args.rounds))
    return rows


def _table(rows: list[Row]) -> str:
    head = (
        "| leases | way | renewal wall p50 (ms) | max (ms) | round trips | per round trip p50 (ms) "
        "| longest script in Redis (ms) | worst PING meanwhile (ms) | lost |"
    )
    out = [head, "|" + "---|" * 9]
    for r in rows:
        trips = math.ceil(r.leases / RENEW_BATCH) if r.way == "chunked" else 1
        wall = statistics.median(r.wall_ms)
        out.append(
            f"| {r.leases:,} | {r.way} | {wall:.1f} | {max(r.wall_ms):.1f} | {trips} | "
            f"{wall / trips:.1f} | {r.script_ms:.1f} | {r.ping_ms:.1f} | {r.lost} |"
        )
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    if args.rounds <= 0 or args.compartments <= 0:
        raise SystemExit("extproc bench renewal: --rounds and --compartments must be > 0")
    if args.redis_url:
        rows = asyncio.run(_bench(args, args.redis_url))
    else:
        with _redis_server(args.redis_server) as url:
            rows = asyncio.run(_bench(args, url))
    print(
        f"chunked: {RENEW_CHUNK} leases per script call, {RENEW_BATCH} per round trip; "
        f"{args.rounds} renewals per way, leases over {args.compartments} compartments"
    )
    print(_table(rows))
    return 0
