"""The Redis ledger: one budget shared by every gateway replica.

One round trip per admission (``EVALSHA reserve.lua``), one per release (``EVALSHA
release.lua``) and, per renewal tick, one pipeline of ``EVALSHA renew.lua`` calls of at most
``RENEW_CHUNK`` leases of one compartment each (several pipelines of ``RENEW_BATCH`` leases at
most for a replica holding more). Reservations are leases with a TTL that the holder renews,
so a replica killed with SIGKILL leaks nothing for longer than the TTL: the next reservation
on the same compartment reaps expired leases before it checks the budget.

The lease id is chosen before the reserve is sent (:meth:`RedisLedger.new_lease`), so a
caller that gave up on a reserve (timeout, cancellation) still knows what Redis may have
reserved and cancels it (:meth:`RedisLedger.cancel`): a release that, for an id Redis has not
seen yet, leaves a tombstone that refuses the late reserve.

Key layout (``P`` = ``redis.key_prefix``, default ``fleet``; one compartment per cluster and
request class, its three keys sharing one hash tag ``{cluster:class}``)::

    P:{cluster:class}:state         HASH  tokens     admitted, unreleased tokens
                                          count      admitted, unreleased requests
                                          level      token-bucket level (tokens)   } only with a
                                          level_at   time of ``level`` (Redis TIME) } rate limit
                                          rel_n      decayed count of releases
                                          rel_tokens decayed tokens released
                                          rel_at     time of the last release
                                          rel_since  time of the first counted release
    P:{cluster:class}:leases        ZSET  member lease id, score = expiry (Redis TIME, s)
    P:{cluster:class}:lease_tokens  HASH  lease id -> tokens it holds
    P:{cluster:class}:queue         ZSET  flow control's fleet-wide queue: ticket -> fair tag
    P:{cluster:class}:queue_expiry  ZSET  ticket -> lease expiry (Redis TIME, s)
    P:{cluster:class}:queue_meta    HASH  vt (the tag last admitted), seq (arrivals),
                                          t:<tenant> (its counter), k:<ticket> (its tokens)
    P:tenant:{T}:leases             ZSET  a limited tenant's requests in flight, fleet-wide:
                                          lease id -> expiry (the compartment lease's twin)
    P:tenant:{T}:state              HASH  level, level_at: its tokens-per-minute bucket

A tenant's keys (``T``: its unkeyed digest) are written by the same reserve.lua call that
admits the request, renewed by renew.lua and released by release.lua with the compartment's
lease; a lease that lapses stops counting for its tenant as for its compartment.
tenant_use.lua reads them (for ``explain``) and writes nothing.

Lease ids are ``<replica id>:<sequence>``; the replica id is random per process. Queue tickets
(queue.lua) are ``<arrival number>/<replica id>:q<sequence>``, leased for ``TICKET_LEASE_S``
and renewed by their waiting replica, so a dead replica's waiters stop blocking the queue
soon. Times come from the Redis server clock (``TIME`` inside the scripts), never from a
replica's. All keys of a compartment expire together after an idle period longer than the
lease TTL, so compartments of removed classes or clusters clean themselves up. Every script
call touches the keys of one compartment only, all in the hash slot of ``{cluster:class}``, so
the same layout runs on a single Redis or a primary with replicas. On Redis Cluster
(``redis+cluster://`` URLs, see extproc.ledger.redis_client) a tenant's count spans every
compartment, so one script cannot reach both in different slots: there every ledger key
carries the one hash tag ``{P}`` (``P:{P}:cluster:class:state``, ``P:{P}:tenant:T:leases``,
...), all on one shard, and each admission is still one script call.

Every call is bounded by ``redis.timeout_ms`` and redis-py's own retries are disabled: a
retried reserve could wait several timeouts, and the policy for an unreachable Redis belongs
to the gate, not to the client. A timed-out or cancelled call makes redis-py drop that
connection, so a failure never leaves a half-read reply on a pooled connection; the next call
reconnects.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import secrets
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from redis.exceptions import NoScriptError, RedisClusterException, RedisError, ResponseError

from extproc.core.admission import (
    RELEASE_RATE_TAU_S,
    CompartmentUsage,
    Demand,
    LedgerAnswer,
    ReleaseStats,
    TenantClaim,
    Ticket,
)
from extproc.core.fleet import Budget
from extproc.core.tenant_limits import TenantUse
from extproc.ledger.base import LedgerUnavailable
from extproc.ledger.redis_client import AnyRedis, any_client, is_cluster_url

log = logging.getLogger("extproc.ledger")

# An idle compartment is dropped after this long (and never sooner than a few lease TTLs).
IDLE_TTL_S = 3600.0
# Leases per renew.lua call: Redis runs one script at a time, so this bounds how long one
# renewal call holds every other client back (~1 ms on a laptop; BENCHMARKS.md "Lease renewal").
RENEW_CHUNK = 1000
# Leases per renewal round trip (one pipeline); a replica holding more sends several, each
# bounded by the Redis timeout on its own. One script call per trip: 5,000 per trip took 77 ms
# on a loaded 2-core machine, over the default 50 ms timeout (BENCHMARKS.md "Lease renewal").
RENEW_BATCH = 1_000


# A queue ticket lapses this long after its replica last renewed it (a waiter renews its own
# every third of it): a dead replica's waiters hold up the queue at most this long.
TICKET_LEASE_S = 3.0


# Scripts that need the fleet-wide queue's ticket helpers: a Redis script cannot load
# another, so tickets.lua goes in front of them (one EVALSHA each, as before).
_WITH_TICKETS = frozenset({"queue.lua", "reserve.lua"})


def _script(name: str) -> str:
    ledger = resources.files("extproc.ledger")
    text = ledger.joinpath(name).read_text(encoding="utf-8")
    if name in _WITH_TICKETS:
        return ledger.joinpath("tickets.lua").read_text(encoding="utf-8") + "\n" + text
    return text


def _compartment(prefix: str, cluster: str, class_name: str, one_slot: bool) -> str:
    if one_slot:
        return f"{prefix}:{{{prefix}}}:{cluster}:{class_name}"
    return f"{prefix}:{{{cluster}:{class_name}}}"


def compartment_keys(
    prefix: str, cluster: str, class_name: str, one_slot: bool = False
) -> tuple[str, str, str]:
    """A compartment's keys (``one_slot``: the Redis Cluster layout, every ledger key in the
    slot of ``{prefix}``)."""
    base = _compartment(prefix, cluster, class_name, one_slot)
    return f"{base}:state", f"{base}:leases", f"{base}:lease_tokens"


def queue_keys(
    prefix: str, cluster: str, class_name: str, one_slot: bool = False
) -> tuple[str, str, str]:
    """The keys of a compartment's fleet-wide flow-control queue (same hash slot)."""
    base = _compartment(prefix, cluster, class_name, one_slot)
    return f"{base}:queue", f"{base}:queue_expiry", f"{base}:queue_meta"


def tenant_keys(prefix: str, tenant: str, one_slot: bool = False) -> tuple[str, str]:
    """A tenant's keys: its leases in flight (zset) and its tokens-per-minute bucket."""
    base = f"{prefix}:{{{prefix}}}:tenant:{tenant}" if one_slot else f"{prefix}:tenant:{{{tenant}}}"
    return f"{base}:leases", f"{base}:state"


@dataclass(frozen=True, slots=True)
class Joined:
    """queue.lua's answer to a join: ``joined`` False when the queue was full; ``ahead`` and
    ``ahead_tokens`` are the tickets served before it (all of them when it did not join)."""

    joined: bool
    ahead: int
    ahead_tokens: int
    tag: float
    ticket: str  # its member in the queue (arrival number / the caller's ticket id)
    order: int  # its arrival number: ties of tags go in this order


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _num(value: Any) -> float:
    return float(_text(value))


class RedisLedger:
    store = "redis"

    def __init__(
        self,
        client: AnyRedis,
        *,
        prefix: str = "fleet",
        lease_ttl_s: float = 30.0,
        timeout_s: float = 0.05,
        replica_id: str | None = None,
        max_connections: int = 16,
        one_slot: bool = False,
    ) -> None:
        self.client = client
        # Redis Cluster: every ledger key in one slot, so a tenant's keys and any compartment's
        # can be in one script call (see the module docstring).
        self.one_slot = one_slot
        # Where the release listener opens its own connection (extproc/ledger/waiters.py);
        # None for a ledger built on a given client (then it subscribes through that one).
        self.url: str | None = None
        # Calls in flight at once. The single-node pool blocks by itself; the cluster client's
        # per-node pools raise instead, so a burst waits here (within the same timeout).
        self._slots = asyncio.Semaphore(max_connections)
        self.prefix = prefix
        self.lease_ttl_s = lease_ttl_s
        self.timeout_s = timeout_s
        self.replica_id = replica_id or secrets.token_hex(6)
        self._idle_ttl_ms = int(max(IDLE_TTL_S, 4 * lease_ttl_s) * 1000)
        self._ids = itertools.count(1)
        self._tickets = itertools.count(1)
        self._reserve = client.register_script(_script("reserve.lua"))
        self._release = client.register_script(_script("release.lua"))
        self._renew = client.register_script(_script("renew.lua"))
        self._queue = client.register_script(_script("queue.lua"))
        self._tenant_use = client.register_script(_script("tenant_use.lua"))

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = "fleet",
        lease_ttl_s: float = 30.0,
        timeout_s: float = 0.05,
        replica_id: str | None = None,
        max_connections: int = 16,
    ) -> RedisLedger:
        """A ledger with its own bounded connection pool (see extproc.ledger.redis_client)."""
        client = any_client(url, timeout_s, max_connections)
        ledger = cls(
            client,
            prefix=prefix,
            lease_ttl_s=lease_ttl_s,
            timeout_s=timeout_s,
            replica_id=replica_id,
            max_connections=max_connections,
            one_slot=is_cluster_url(url),
        )
        ledger.url = url
        return ledger

    async def _bounded(self, what: str, call: Awaitable[Any]) -> Any:
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self._slots:
                    return await call
        except (RedisError, RedisClusterException, OSError) as exc:  # TimeoutError: OSError
            # RedisClusterException is not a RedisError: the cluster client raises it when it
            # cannot (re)build its slot map, e.g. at start on a loaded machine, where it
            # crashed the gate's start instead of leaving it on local budgets.
            raise LedgerUnavailable(f"redis {what}: {type(exc).__name__}: {exc}") from exc
        finally:
            if inspect.iscoroutine(call):
                call.close()  # no-op once it ran; a call that never got a slot is discarded

    async def load(self) -> None:
        """Load the scripts so the first admission is already a single EVALSHA."""
        scripts = (self._reserve, self._release, self._renew, self._queue, self._tenant_use)
        for script in scripts:
            await self._bounded("script load", self.client.script_load(script.script))

    async def eviction_policy(self) -> str | None:
        """Redis's ``maxmemory-policy`` (on a cluster: the first node's answer), or None when
        the server does not say (managed services often refuse CONFIG)."""
        try:
            raw = await self._bounded("config get", self.client.config_get("maxmemory-policy"))
        except LedgerUnavailable as exc:
            if isinstance(exc.__cause__, ResponseError):
                return None
            raise
        found: list[str] = []

        def collect(node: Any) -> None:
            if isinstance(node, dict):
                for key, value in node.items():
                    if _text(key) == "maxmemory-policy":
                        found.append(_text(value))
                    else:
                        collect(value)

        collect(raw)
        return found[0] if found else None

    async def ping(self) -> None:
        await self._bounded("ping", self.client.ping())

    def _answer(self, raw: Sequence[Any], ticket: Ticket | None) -> LedgerAnswer:
        granted = int(raw[0]) == 1
        return LedgerAnswer(
            granted,
            ticket if granted else None,
            CompartmentUsage(int(raw[1]), int(raw[2]), _num(raw[3])),
            ReleaseStats(_num(raw[4]), _num(raw[5]), _num(raw[6]), _num(raw[7])),
            _num(raw[8]),
            int(raw[9]),
            int(raw[10]),
            int(raw[11]) == 1,
            int(raw[12]) == 1,
            int(raw[13]),
            _num(raw[14]),
            int(raw[15]),
            int(raw[16]),
        )

    def compartment(self, cluster: str, class_name: str) -> tuple[str, str, str]:
        return compartment_keys(self.prefix, cluster, class_name, self.one_slot)

    def _queue_keys(self, cluster: str, class_name: str) -> tuple[str, str, str]:
        return queue_keys(self.prefix, cluster, class_name, self.one_slot)

    def tenant_keys(self, tenant: str) -> tuple[str, str]:
        return tenant_keys(self.prefix, tenant, self.one_slot)

    def _keys(
        self, cluster: str, class_name: str, tenant: TenantClaim | None = None
    ) -> tuple[str, ...]:
        keys = (*self.compartment(cluster, class_name), *self._queue_keys(cluster, class_name))
        return keys if tenant is None else (*keys, *self.tenant_keys(tenant.key))

    def _with_tenant(self, cluster: str, class_name: str, tenant: str | None) -> tuple[str, ...]:
        """The keys of release.lua and renew.lua for a lease held by ``tenant`` (or none)."""
        keys = self.compartment(cluster, class_name)
        return keys if tenant is None else (*keys, self.tenant_keys(tenant)[0])

    def _args(
        self,
        lease: str,
        tokens: int,
        limits: Budget,
        peek: bool,
        queue: str = "",
        tenant: TenantClaim | None = None,
        queue_tenant: str | None = None,
    ) -> list[str | int]:
        own = tenant.limit if tenant is not None else None
        return [
            lease,
            tokens,
            limits.max_inflight_tokens,
            limits.max_concurrent,
            repr(float(limits.tokens_per_second)),
            limits.burst_tokens,
            repr(float(self.lease_ttl_s)),
            self._idle_ttl_ms,
            1 if peek else 0,
            queue,
            repr(TICKET_LEASE_S),
            self.freed_channel,
            (own.max_concurrent or 0) if own is not None else 0,
            (own.tokens_per_minute or 0) if own is not None else 0,
            queue_tenant or "",
        ]

    def new_lease(self) -> str:
        """A lease id no other call of any replica uses (replica id, sequence)."""
        return f"{self.replica_id}:{next(self._ids)}"

    async def reserve(
        self, demand: Demand, lease: str | None = None, queue: str = ""
    ) -> LedgerAnswer:
        """Reserve under ``lease`` (from :meth:`new_lease`; a fresh one when omitted).

        Resending the same lease id never reserves twice; after :meth:`cancel` of that id it
        is refused. ``queue``: "" ignores the compartment's flow-control queue (a charge that
        follows a failover), "-" is a new request (refused while anyone is queued: it does not
        pass them), a ticket (:meth:`join`) is granted only at the head of the queue.
        """
        lease = lease or self.new_lease()
        tenant = demand.tenant
        keys = self._keys(demand.cluster, demand.class_name, tenant)
        args = self._args(
            lease, demand.tokens, demand.limits, False, queue, tenant, demand.queue_tenant
        )
        raw = await self._bounded("reserve", self._reserve(keys=keys, args=args))
        held = tenant.key if tenant is not None else None
        ticket = Ticket(demand.cluster, demand.class_name, demand.tokens, lease, self.store, held)
        return self._answer(raw, ticket)

    async def release(self, ticket: Ticket) -> bool:
        keys = self._with_tenant(ticket.cluster, ticket.class_name, ticket.tenant)
        args = self._release_args(ticket.lease, 0.0)
        raw = await self._bounded("release", self._release(keys=keys, args=args))
        return int(raw) == 1

    def _release_args(self, lease: str, cancel_ttl_s: float) -> list[str | int]:
        return [
            lease,
            repr(RELEASE_RATE_TAU_S),
            self._idle_ttl_ms,
            repr(float(cancel_ttl_s)),
            self.freed_channel,
        ]

    @property
    def freed_channel(self) -> str:
        """The pub/sub channel release.lua announces every release on (payload: the
        compartment's state key, see :func:`compartment_of`)."""
        return f"{self.prefix}:freed"

    def compartment_of(self, state_key: str) -> tuple[str, str] | None:
        """(cluster, class) of a compartment's state key, None when it is not one of ours."""
        head, tail = f"{self.prefix}:{{", "}:state"
        if self.one_slot:
            head, tail = f"{self.prefix}:{{{self.prefix}}}:", ":state"
        if not state_key.startswith(head) or not state_key.endswith(tail):
            return None
        cluster, sep, class_name = state_key[len(head) : -len(tail)].rpartition(":")
        return (cluster, class_name) if sep else None

    async def cancel(
        self, cluster: str, class_name: str, lease: str, tenant: str | None = None
    ) -> bool:
        """Settle a reserve whose outcome the caller never saw: release ``lease`` if Redis
        holds it, otherwise make sure a reserve of it that arrives later is refused.

        Idempotent. True when the lease was held (the reserve had run: a phantom removed).
        """
        keys = self._with_tenant(cluster, class_name, tenant)
        args = self._release_args(lease, self.lease_ttl_s)
        raw = await self._bounded("cancel", self._release(keys=keys, args=args))
        return int(raw) == 1

    async def cancel_many(
        self,
        leases: Sequence[tuple[str, str, str]],
        tenants: Mapping[str, str] | None = None,
    ) -> int:
        """:meth:`cancel` for many (cluster, class, lease) at once (``tenants``: lease -> the
        tenant its reserve counted): pipelined round trips of at most RENEW_CHUNK calls.
        Returns how many were held (phantoms removed)."""
        removed = 0
        tenants = tenants or {}
        for i in range(0, len(leases), RENEW_CHUNK):
            calls = []
            for cluster, class_name, lease in leases[i : i + RENEW_CHUNK]:
                keys = self._with_tenant(cluster, class_name, tenants.get(lease))
                calls.append((keys, self._release_args(lease, self.lease_ttl_s)))
            raw = await self._pipelined("cancel", self._release.sha, calls)
            removed += sum(1 for x in raw if int(x) == 1)
        return removed

    async def _pipelined(
        self, what: str, sha: str, calls: Sequence[tuple[Sequence[str], Sequence[str | int]]]
    ) -> list[Any]:
        """EVALSHA ``sha`` once per (keys, args), in one pipelined round trip; once more
        after loading the scripts when the server's script cache is empty (a restarted or
        newly promoted Redis)."""
        for attempt in range(2):
            pipe = self.client.pipeline(transaction=False)
            for keys, args in calls:
                pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args)
            try:
                result: list[Any] = await self._bounded(what, pipe.execute())
                return result
            except LedgerUnavailable as exc:
                if attempt or not isinstance(exc.__cause__, NoScriptError):
                    raise
                await self.load()
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def renew(self, tickets: Sequence[Ticket]) -> list[str]:
        """Extend ``tickets``' leases; returns the ids Redis no longer had.

        Chunked per compartment (RENEW_CHUNK leases per script call) and batched (RENEW_BATCH
        leases per pipelined round trip, each under the Redis timeout on its own).
        """
        groups: dict[tuple[str, str, str | None], list[str]] = {}
        for t in tickets:
            groups.setdefault((t.cluster, t.class_name, t.tenant), []).append(t.lease)
        calls: list[tuple[tuple[str, ...], list[str]]] = []
        for (cluster, class_name, tenant), leases in groups.items():
            keys = self._with_tenant(cluster, class_name, tenant)
            for i in range(0, len(leases), RENEW_CHUNK):
                calls.append((keys, leases[i : i + RENEW_CHUNK]))
        lost: list[str] = []
        batch: list[tuple[tuple[str, ...], list[str]]] = []
        size = 0
        for call in calls:
            batch.append(call)
            size += len(call[1])
            if size >= RENEW_BATCH:
                lost.extend(await self._renew_batch(batch))
                batch, size = [], 0
        if batch:
            lost.extend(await self._renew_batch(batch))
        return lost

    async def _renew_batch(self, batch: Sequence[tuple[tuple[str, ...], list[str]]]) -> list[str]:
        head: list[str | int] = [repr(float(self.lease_ttl_s)), self._idle_ttl_ms]
        calls = [(keys, [*head, *leases]) for keys, leases in batch]
        raw = await self._pipelined("renew", self._renew.sha, calls)
        return [_text(x) for reply in raw for x in reply]

    async def usage(
        self,
        cluster: str,
        class_name: str,
        limits: Budget,
        tenant: TenantClaim | None = None,
        tokens: int = 0,
        queue_tenant: str | None = None,
    ) -> LedgerAnswer:
        """The compartment (and ``tenant``, whether ``tokens`` would fit its limits) as it is,
        with the waiters of its queue a new request of ``queue_tenant`` would follow
        (:attr:`LedgerAnswer.queued_ahead`); reserves nothing."""
        keys = self._keys(cluster, class_name, tenant)
        args = self._args("-", tokens, limits, True, "", tenant, queue_tenant)
        raw = await self._bounded("usage", self._reserve(keys=keys, args=args))
        return self._answer(raw, None)

    async def tenant_use(self, tenant: TenantClaim) -> TenantUse:
        """``tenant``'s use fleet-wide as it is (tenant_use.lua): its live leases and its
        bucket's level (against ``tenant.limit``); reads only, reaps nothing."""
        keys = self.tenant_keys(tenant.key)
        args = [tenant.limit.tokens_per_minute or 0]
        raw = await self._bounded("tenant use", self._tenant_use(keys=keys, args=args))
        return TenantUse(int(raw[0]), _num(raw[1]))

    # -- flow control's fleet-wide queue (queue.lua) ------------------------------------------

    def new_ticket(self) -> str:
        """A queue ticket id no other replica uses (queue.lua prefixes its arrival number)."""
        return f"{self.replica_id}:q{next(self._tickets)}"

    async def join(
        self,
        cluster: str,
        class_name: str,
        ticket: str,
        tenant: str,
        increment: float,
        tokens: int,
        max_queue: int,
    ) -> Joined:
        """Queue ``ticket`` in the compartment's fleet-wide fair order (unless it is full);
        its tag lies ``increment`` past its tenant's counter (FairClaim.increment)."""
        keys = self._queue_keys(cluster, class_name)
        args: list[str | int] = ["join", ticket, tenant, repr(float(increment)), tokens]
        args += [repr(TICKET_LEASE_S), max_queue, self._idle_ttl_ms]
        raw = await self._bounded("join", self._queue(keys=keys, args=args))
        return Joined(
            int(raw[0]) == 1, int(raw[1]), int(raw[2]), _num(raw[3]), _text(raw[4]), int(raw[5])
        )

    async def leave(self, cluster: str, class_name: str, ticket: str) -> bool:
        """Withdraw ``ticket`` (idempotent); when it was the head, the next one is told."""
        keys = self._queue_keys(cluster, class_name)
        state = self.compartment(cluster, class_name)[0]
        args = ["leave", ticket, self.freed_channel, state]
        raw = await self._bounded("leave", self._queue(keys=keys, args=args))
        return int(raw) == 1

    async def charge(self, cluster: str, class_name: str, tenant: str, increment: float) -> None:
        """Advance ``tenant``'s counter in the compartment's fleet-wide queue by
        ``increment`` (its output, weighted), while the queue is contended."""
        keys = self._queue_keys(cluster, class_name)
        args = ["charge", tenant, repr(float(increment))]
        await self._bounded("charge", self._queue(keys=keys, args=args))

    async def touch(self, cluster: str, class_name: str, tickets: Sequence[str]) -> list[str]:
        """Renew ``tickets``' leases; returns those no longer queued (lapsed or admitted)."""
        keys = self._queue_keys(cluster, class_name)
        args = ["touch", repr(TICKET_LEASE_S), *tickets]
        raw = await self._bounded("touch", self._queue(keys=keys, args=args))
        return [_text(x) for x in raw]

    async def close(self) -> None:
        try:
            await self.client.aclose()
        except (RedisError, OSError) as exc:
            # A connection that does not close within the socket timeout (a loaded machine:
            # the fault matrix's close raised TimeoutError) is dropped anyway; closing must
            # not fail the shutdown it is part of.
            log.warning("redis ledger connections not closed cleanly: %s", exc)


def lease_ttl_tick(lease_ttl_s: float) -> float:
    """Renewal period: three chances to renew before a lease lapses."""
    return max(0.05, lease_ttl_s / 3)


__all__ = [
    "IDLE_TTL_S",
    "TICKET_LEASE_S",
    "Joined",
    "RedisLedger",
    "compartment_keys",
    "lease_ttl_tick",
    "queue_keys",
    "tenant_keys",
]
