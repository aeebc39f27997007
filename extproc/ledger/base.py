"""The budget ledger contract: one atomic check-and-reserve per admission.

The decision core computes the cost and the limits (:class:`~extproc.core.admission.Demand`);
a ledger reserves atomically and answers with what it saw
(:class:`~extproc.core.admission.LedgerAnswer`); the core turns that into Admit or Reject. A
ledger never decides policy and never computes retry hints. The answer types live in the core
(it consumes them and may import nothing else); they are re-exported here for implementers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from extproc.core.admission import (
    Demand,
    LedgerAnswer,
    Limits,
    ReleaseStats,
    Ticket,
    Usage,
)


class LedgerUnavailable(Exception):
    """The ledger could not be reached or did not answer in time; nothing was reserved."""


class Ledger(Protocol):
    #: Tag written into every ticket this ledger issues (Ticket.store).
    store: str

    async def reserve(self, demand: Demand) -> LedgerAnswer:
        """Check ``demand`` against ``demand.limits`` and reserve it, as one atomic step."""
        ...

    async def release(self, ticket: Ticket) -> bool:
        """Return a reservation. Idempotent: False when it was not (or no longer) held."""
        ...

    async def renew(self, tickets: Sequence[Ticket]) -> list[str]:
        """Extend the leases of ``tickets``; returns the lease ids the ledger no longer had."""
        ...

    async def usage(self, cluster: str, class_name: str, limits: Limits) -> LedgerAnswer:
        """The compartment's current state (after expiring dead leases); reserves nothing."""
        ...

    async def close(self) -> None: ...


__all__ = [
    "Demand",
    "Ledger",
    "LedgerAnswer",
    "LedgerUnavailable",
    "Limits",
    "ReleaseStats",
    "Ticket",
    "Usage",
]
