"""The cost of fair admission per waiting request, for ``extproc bench admission``.

What fair admission adds to a request that waits: naming its tenant (a digest of the tenant
header or API key, cached per process) and its place in the queue, FIFO or token-weighted
(extproc.core.flow.FairQueue in memory, extproc/ledger/queue.lua fleet-wide with Redis: one
join and one leave per waiter either way). Both orders run the same code with a different
increment, so the comparison shows what the order itself costs beside FIFO.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from extproc.core.flow import Fairness, FairQueue, FlowParams, TenantFallback
from extproc.core.tenants import resolve_tenant
from extproc.ledger.redis import RedisLedger

TENANTS = 20
SECRET = b"bench-secret-of-32-bytes-exactly"


@dataclass(frozen=True, slots=True)
class QueueRow:
    where: str
    fairness: str
    join_leave_us: list[float]


def tenant_us(requests: int) -> list[float]:
    """Naming the tenant of each request by its API key (20 keys, as a fleet sees them)."""
    out: list[float] = []
    clock = time.perf_counter_ns
    for i in range(requests):
        headers = {"authorization": f"Bearer sk-tenant-{i % TENANTS}"}
        t0 = clock()
        resolve_tenant(headers, None, "x-tenant", TenantFallback.API_KEY, SECRET)
        out.append((clock() - t0) / 1000)
    return out


def memory_rows(requests: int) -> list[QueueRow]:
    rows = []
    for fairness in (Fairness.FIFO, Fairness.TOKENS):
        flow = FlowParams(fairness=fairness)
        queue: FairQueue[int] = FairQueue()
        for i in range(64):  # a queue that is already contended
            queue.push(i, f"t{i % TENANTS}", 1.0, 1000, service=flow.service(1000))
        times: list[float] = []
        clock = time.perf_counter_ns
        for i in range(requests):
            claim = flow.claim(f"t{i % TENANTS}", None, 1000 + i % 7)
            t0 = clock()
            seq = queue.push(i, claim.tenant, claim.weight, 1000, service=claim.service)
            queue.remove(seq)
            times.append((clock() - t0) / 1000)
        rows.append(QueueRow("memory", fairness.value, times))
    return rows


async def redis_rows(url: str, requests: int) -> list[QueueRow]:
    rows = []
    for fairness in (Fairness.FIFO, Fairness.TOKENS):
        flow = FlowParams(fairness=fairness)
        ledger = RedisLedger.from_url(url, prefix=f"fleet-bench-q-{fairness.value}", timeout_s=2.0)
        try:
            times: list[float] = []
            clock = time.perf_counter_ns
            for i in range(requests):
                claim = flow.claim(f"t{i % TENANTS}", None, 1000 + i % 7)
                ticket = ledger.new_ticket()
                t0 = clock()
                joined = await ledger.join(
                    "c1", "long", ticket, claim.tenant, claim.increment, 1000, 1_000_000
                )
                await ledger.leave("c1", "long", joined.ticket)
                times.append((clock() - t0) / 1000)
        finally:
            await ledger.close()
        rows.append(QueueRow("redis", fairness.value, times))
    return rows
