"""Requests waiting for budget: per-(cluster, class) fair queues, woken as budget is released.

The order is the core's (:class:`extproc.core.flow.FairQueue`: FIFO per tenant, weighted fair
across tenants); this module adds the waiting. Only the queue's head re-tries the ledger: a
release wakes the head, the head reserves, and when it got in it wakes the next head (the
release may have freed room for more). So a release costs one reserve attempt, not one per
waiter, and a waiter behind the head is never admitted before it.

What wakes the head:

- in memory: the release itself (:meth:`Waiters.freed`, called by the gate), event-driven;
- with Redis: every release, of any replica, is announced by release.lua on the pub/sub
  channel ``P:freed`` (payload: the compartment's state key), which :func:`listen_for_releases`
  turns into :meth:`Waiters.freed`. A notice can be lost (a reconnect) and budget can free
  without a release (a lease that lapsed with its dead holder), so while Redis is in use the
  head also re-checks every ``flow.redis_poll_ms`` (RELIABILITY.md has the
  measured wake-up latency of both);
- a token-rate limit frees budget with time alone: the head sleeps until the bucket holds
  enough.

A waiter leaves the queue at once when its client goes away (the stream's task is cancelled),
when its ``max_wait_s`` is up (a 429 with a hint updated for its position) or when admitted.
Nothing is held while waiting: the reservation is taken only by the successful attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from random import Random
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisClusterException, RedisError

from extproc.core.admission import (
    TENANT_REASONS,
    Admitted,
    Demand,
    LedgerAnswer,
    Reason,
    Reject,
    queued_wait,
    verdict,
)
from extproc.core.flow import FairCharge, FairClaim, FairQueue, WaitPolicy
from extproc.ledger.metrics import LedgerMetrics
from extproc.ledger.redis import TICKET_LEASE_S
from extproc.ledger.redis_client import any_client, is_cluster_url

if TYPE_CHECKING:
    from extproc.ledger.gate import AdmissionGate
    from extproc.ledger.redis import Joined, RedisLedger

log = logging.getLogger("extproc.ledger")

Key = tuple[str, str]


class Waiter:
    __slots__ = ("key", "seq", "ticket", "wake")

    def __init__(self, key: Key, ticket: str | None = None) -> None:
        self.key = key
        self.seq = -1
        # Its place in the fleet-wide queue (Redis, queue.lua); None: this replica's alone.
        self.ticket = ticket
        self.wake = asyncio.Event()


class Waiters:
    """The queues of one replica."""

    def __init__(self, metrics: LedgerMetrics) -> None:
        self._m = metrics
        self._queues: dict[Key, FairQueue[Waiter]] = {}

    def depth(self, cluster: str, class_name: str) -> int:
        queue = self._queues.get((cluster, class_name))
        return len(queue) if queue is not None else 0

    def ahead(self, cluster: str, class_name: str, tenant: str) -> tuple[int, int]:
        """(waiters, their tokens) a request of ``tenant`` joining now would be served after,
        under the queue's order (:meth:`FairQueue.ahead_for`)."""
        queue = self._queues.get((cluster, class_name))
        return queue.ahead_for(tenant) if queue is not None else (0, 0)

    def position(self, waiter: Waiter) -> tuple[int, int]:
        queue = self._queues.get(waiter.key)
        return queue.ahead_of(waiter.seq) if queue is not None else (0, 0)

    def join(
        self,
        key: Key,
        claim: FairClaim,
        tokens: int,
        joined: Joined | None = None,
    ) -> Waiter:
        """Queue a waiter; ``joined``: its place in the fleet-wide queue (then this replica's
        waiters keep the fleet-wide order, so its local head is the first of them there)."""
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = FairQueue()
        if joined is None:
            waiter = Waiter(key)
            waiter.seq = queue.push(
                waiter, claim.tenant, claim.weight, tokens, service=claim.service
            )
        else:
            waiter = Waiter(key, joined.ticket)
            waiter.seq = queue.push(
                waiter, claim.tenant, claim.weight, tokens, joined.tag, joined.order
            )
        self._m.queue_depth.labels(*key).set(len(queue))
        return waiter

    def is_head(self, waiter: Waiter) -> bool:
        queue = self._queues.get(waiter.key)
        return queue is not None and queue.head_id() == waiter.seq

    def leave(self, waiter: Waiter) -> None:
        """Withdraw ``waiter`` (idempotent); when it was the head, the next one takes over."""
        queue = self._queues.get(waiter.key)
        if queue is None:
            return
        was_head = queue.head_id() == waiter.seq
        if not queue.remove(waiter.seq):
            return
        self._m.queue_depth.labels(*waiter.key).set(len(queue))
        if not queue:
            del self._queues[waiter.key]
        elif was_head:
            self._wake_head(queue)

    def charge(self, key: Key, tenant: str, service: float, weight: float) -> None:
        """A tenant served through this queue was served ``service`` more (its output)."""
        queue = self._queues.get(key)
        if queue is not None:
            queue.charge(tenant, service, weight)

    def fair_view(self, key: Key, claim: FairClaim) -> dict[str, object]:
        """The tenant's standing in this replica's queue of ``key``, for explain: its counter
        past V (how much more than the least-served waiting tenant it has been served, per
        weight) and the waiters a request of ``claim`` joining now would be served after."""
        queue = self._queues.get(key)
        if queue is None:
            return {"queued": 0, "counter_over_v": 0.0, "would_follow": 0}
        return {
            "queued": len(queue),
            "counter_over_v": round(queue.counter(claim.tenant) - queue.virtual, 3),
            "would_follow": queue.place_for(claim.tenant),
        }

    def freed(self, cluster: str, class_name: str) -> None:
        """Budget was released on (cluster, class): the head tries again."""
        queue = self._queues.get((cluster, class_name))
        if queue is not None:
            self._wake_head(queue)

    @staticmethod
    def _wake_head(queue: FairQueue[Waiter]) -> None:
        head = queue.head()
        if head is not None:
            head.wake.set()

    def tickets(self) -> dict[Key, list[str]]:
        """The fleet-wide queue tickets of this replica's waiters, per (cluster, class)."""
        out: dict[Key, list[str]] = {}
        for key, queue in self._queues.items():
            held = [w.ticket for w in queue if w.ticket is not None]
            if held:
                out[key] = held
        return out

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())


@dataclass(slots=True)
class Queued:
    """One request in its queue; :meth:`wait` ends as Admitted or a 429 (or a 503 when the
    shared ledger became unreachable under the closed policy); :meth:`cancel` withdraws it."""

    gate: AdmissionGate
    demand: Demand
    waiter: Waiter
    policy: WaitPolicy
    poll_s: float
    clock: Callable[[], float]
    rng: Random
    started: float
    answer: LedgerAnswer
    # Its tenant's claim on the fair order (what its output is charged to, once served).
    claim: FairClaim
    done: bool = False
    # Admitted by the Redis ledger, which took its ticket off the fleet-wide queue itself.
    _granted_shared: bool = False

    @property
    def max_wait_s(self) -> float:
        return self.policy.max_wait_s

    @property
    def fair(self) -> FairCharge:
        demand, claim = self.demand, self.claim
        return FairCharge(demand.cluster, demand.class_name, claim.tenant, claim.weight)

    def _finish(self, result: str) -> None:
        if self.done:
            return
        self.done = True
        self.gate.waiters.leave(self.waiter)
        ticket = self.waiter.ticket
        if ticket is not None and not self._granted_shared:
            self.gate.leave_shared(self.demand.cluster, self.demand.class_name, ticket)
        m = self.gate.metrics
        m.waits.labels(self.demand.class_name, result).inc()
        m.wait_seconds.labels(self.demand.class_name, result).observe(
            max(0.0, self.clock() - self.started)
        )

    def cancel(self) -> None:
        """The client went away before :meth:`wait` ended: leave, holding nothing."""
        self._finish("cancelled")

    async def wait(self) -> Admitted | Reject:
        waiters = self.gate.waiters
        deadline = self.started + self.policy.max_wait_s
        waiter = self.waiter
        try:
            while True:
                # Cleared before the attempt: a release during a Redis round trip sets it
                # again, so the next sleep returns at once instead of missing the wake-up.
                waiter.wake.clear()
                now = self.clock()
                nap = deadline - now
                if waiters.is_head(waiter):
                    attempt = await self.gate.attempt(self.demand, ticket=waiter.ticket)
                    if isinstance(attempt.outcome, Admitted):
                        self._granted_shared = attempt.outcome.ticket.store != "memory"
                        self._finish("admitted")
                        return attempt.outcome
                    if attempt.answer is None:  # the closed policy's 503, a tenant's 429
                        self._finish(_unanswered_result(attempt.outcome))
                        self.gate.count_reject(attempt.outcome)
                        return attempt.outcome
                    self.answer = attempt.answer
                    now = self.clock()
                    nap = deadline - now
                    if nap > 0 and self.gate.polls_shared:
                        nap = min(nap, self.poll_s)
                    if attempt.answer.behind:
                        # Another replica's waiter heads the fleet-wide queue. Its admission
                        # or withdrawal is announced; its replica's death is not: its ticket
                        # lapses within a lease, so look again by then.
                        nap = min(nap, TICKET_LEASE_S)
                    if nap > 0 and attempt.outcome.reason is Reason.TOKEN_RATE:
                        refill = queued_wait(attempt.demand, attempt.answer)
                        nap = min(nap, max(0.001, refill))
                if now >= deadline:
                    return await self._timed_out(now)
                try:
                    async with asyncio.timeout(nap):
                        await waiter.wake.wait()
                except TimeoutError:
                    pass
        except BaseException:
            # Cancelled (the client left) or failed: out of the queue at once, nothing held.
            self._finish("cancelled")
            raise

    async def _timed_out(self, now: float) -> Reject:
        ahead, ahead_tokens = self.gate.waiters.position(self.waiter)
        if ahead:
            # Not the head: its last answer is stale; the hint needs the compartment now.
            self.answer = await self.gate.peek(self.demand)
        self._finish("timeout")
        outcome = verdict(
            self.demand,
            self.answer,
            self.rng,
            ahead,
            ahead_tokens,
            why=f"waited {now - self.started:.1f}s, its class's max_wait_s",
        )
        assert isinstance(outcome, Reject)  # a peek never grants
        self.gate.count_reject(outcome)
        return outcome


def _unanswered_result(refused: Reject) -> str:
    """How a wait ended whose head attempt no ledger answered (AdmissionGate.attempt): its
    tenant's own limits refused it, else the shared ledger is unreachable under the closed
    policy (the 503)."""
    return "tenant_limit" if refused.reason in TENANT_REASONS else "unavailable"


async def listen_for_releases(
    shared: RedisLedger,
    waiters: Waiters,
    retry_s: float,
    subscribed: asyncio.Event | None = None,
    read_timeout_s: float = 1.0,
) -> None:
    """Turn the shared ledger's release notices into wake-ups, until cancelled.

    Reconnects after ``retry_s`` on any Redis error; a notice missed meanwhile is covered by
    the head's periodic re-check. On Redis Cluster the subscription is classic pub/sub on one
    node: Redis Cluster forwards every PUBLISH to all nodes, so a release on any shard reaches
    it (tests/stream/test_flow.py). A client without pub/sub leaves waiters to the re-check.
    """

    def connect() -> Any:
        # A connection of its own, outside the ledger's pool: a subscription holds its
        # connection for good, and a reconnect during a Redis fault must never take (or
        # leak) a connection that reserves and releases need. Its socket timeout outlasts
        # the read poll below.
        if shared.url is None:
            return shared.client
        return any_client(shared.url, read_timeout_s + shared.timeout_s + 1.0, 2)

    if getattr(shared.client, "pubsub", None) is None:
        log.warning("redis client has no pub/sub: waiters re-check the ledger periodically")
        if subscribed is not None:
            subscribed.set()
        return
    warned = False
    while True:
        client = connect()
        pubsub: Any = None
        try:
            if client is not shared.client and is_cluster_url(shared.url or ""):
                # The cluster client learns the slot map only when initialized; its pub/sub
                # needs it to pick a node (any node: a PUBLISH reaches the whole cluster).
                await client.initialize()
            pubsub = client.pubsub()
            await pubsub.subscribe(shared.freed_channel)
            if subscribed is not None:
                subscribed.set()
            warned = False
            while True:
                msg = await pubsub.get_message(
                    ignore_subscribe_messages=True, timeout=read_timeout_s
                )
                if msg is None:
                    continue
                data = msg.get("data")
                key = data.decode() if isinstance(data, bytes) else str(data)
                found = shared.compartment_of(key)
                if found is not None:
                    waiters.freed(*found)
        except (RedisError, RedisClusterException, OSError) as exc:
            # (The cluster client's RedisClusterException, e.g. no node reachable to build
            # the slot map, is not a RedisError: it would end the listener for good.)
            if not warned:
                warned = True
                log.warning(
                    "release notices unavailable; waiters re-check the ledger periodically",
                    extra={"error": f"{type(exc).__name__}: {exc}"},
                )
        finally:
            if pubsub is not None:
                with contextlib.suppress(RedisError, OSError):
                    await asyncio.shield(pubsub.aclose())
            if client is not shared.client:
                with contextlib.suppress(RedisError, OSError):
                    await asyncio.shield(client.aclose())
        await asyncio.sleep(retry_s)
