"""The in-memory ledger: the embedded default, and the fallback while Redis is unreachable.

Atomicity comes from asyncio itself: :meth:`MemoryLedger.reserve` is a coroutine with no
``await`` inside, so nothing can interleave between the check and the reservation. It holds
no leases with a TTL: its reservations die with the process that holds them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

from extproc.core.admission import (
    RELEASE_RATE_TAU_S,
    CompartmentUsage,
    Demand,
    LedgerAnswer,
    ReleaseStats,
    Ticket,
)
from extproc.core.fleet import Budget


class _Compartment:
    """Budget state of one (cluster, class)."""

    __slots__ = (
        "count",
        "leases",
        "level",
        "level_at",
        "rel_at",
        "rel_n",
        "rel_since",
        "rel_tokens",
        "tokens",
    )

    def __init__(self) -> None:
        self.tokens = 0
        self.count = 0
        self.level: float | None = None  # None: the bucket has never been drawn from (full)
        self.level_at = 0.0
        self.rel_n = 0.0
        self.rel_tokens = 0.0
        self.rel_at = 0.0
        self.rel_since = 0.0
        self.leases: dict[str, int] = {}

    def refill(self, limits: Budget, now: float) -> float:
        if not limits.burst_tokens:
            return 0.0
        if self.level is None:
            return float(limits.burst_tokens)
        gained = max(0.0, now - self.level_at) * limits.tokens_per_second
        return min(float(limits.burst_tokens), self.level + gained)

    def answer(
        self,
        granted: bool,
        ticket: Ticket | None,
        level: float,
        now: float,
        also: CompartmentUsage | None = None,
    ) -> LedgerAnswer:
        extra_tokens, extra_count = (also.inflight_tokens, also.concurrent) if also else (0, 0)
        return LedgerAnswer(
            granted,
            ticket,
            CompartmentUsage(self.tokens + extra_tokens, self.count + extra_count, level),
            ReleaseStats(self.rel_n, self.rel_tokens, self.rel_at, self.rel_since),
            now,
        )


class MemoryLedger:
    store = "memory"

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._compartments: dict[tuple[str, str], _Compartment] = {}
        self._ids = itertools.count(1)

    def _compartment(self, cluster: str, class_name: str) -> _Compartment:
        key = (cluster, class_name)
        comp = self._compartments.get(key)
        if comp is None:
            comp = self._compartments[key] = _Compartment()
        return comp

    def reserve_now(self, demand: Demand, also: CompartmentUsage | None = None) -> LedgerAnswer:
        """The atomic step itself, synchronous: check every dimension, then take them all.

        ``also``: usage held elsewhere that counts against the same limits (the gate's own
        Redis leases of this compartment while it admits locally); it is reported in the
        answer's usage but never taken or released here.
        """
        now = self._clock()
        comp = self._compartment(demand.cluster, demand.class_name)
        lim, need = demand.limits, demand.tokens
        level = comp.refill(lim, now)
        tokens = comp.tokens + (also.inflight_tokens if also else 0)
        count = comp.count + (also.concurrent if also else 0)
        fits = (
            (not lim.max_inflight_tokens or tokens + need <= lim.max_inflight_tokens)
            and (not lim.max_concurrent or count + 1 <= lim.max_concurrent)
            and (not lim.burst_tokens or level >= need)
        )
        if not fits:
            return comp.answer(False, None, level, now, also)
        if lim.burst_tokens:
            level -= need
            comp.level, comp.level_at = level, now
        comp.tokens += need
        comp.count += 1
        lease = f"m{next(self._ids)}"
        comp.leases[lease] = need
        ticket = Ticket(demand.cluster, demand.class_name, need, lease, self.store)
        return comp.answer(True, ticket, level, now, also)

    async def reserve(self, demand: Demand) -> LedgerAnswer:
        return self.reserve_now(demand)

    def release_now(self, ticket: Ticket) -> bool:
        comp = self._compartments.get((ticket.cluster, ticket.class_name))
        if comp is None:
            return False
        tokens = comp.leases.pop(ticket.lease, None)
        if tokens is None:
            return False
        now = self._clock()
        comp.tokens = max(0, comp.tokens - tokens)
        comp.count = max(0, comp.count - 1)
        decay = math.exp(-max(0.0, now - comp.rel_at) / RELEASE_RATE_TAU_S) if comp.rel_n else 0.0
        if not comp.rel_n:
            comp.rel_since = now
        comp.rel_n = comp.rel_n * decay + 1.0
        comp.rel_tokens = comp.rel_tokens * decay + tokens
        comp.rel_at = now
        return True

    async def release(self, ticket: Ticket) -> bool:
        return self.release_now(ticket)

    async def renew(self, tickets: Sequence[Ticket]) -> list[str]:
        # Leases here live exactly as long as the process; there is nothing to extend.
        return []

    async def usage(self, cluster: str, class_name: str, limits: Budget) -> LedgerAnswer:
        return self.usage_now(cluster, class_name, limits)

    def usage_now(self, cluster: str, class_name: str, limits: Budget) -> LedgerAnswer:
        """The compartment as it is (reserves nothing), synchronously."""
        now = self._clock()
        comp = self._compartment(cluster, class_name)
        return comp.answer(False, None, comp.refill(limits, now), now)

    def held(self) -> int:
        """Reservations currently held, over all compartments."""
        return sum(len(c.leases) for c in self._compartments.values())

    async def close(self) -> None:
        return None
