"""The budget ledger contract: one atomic check-and-reserve per admission.

The decision core computes the cost and the limits (:class:`~extproc.core.admission.Demand`);
a ledger reserves atomically and answers with what it saw
(:class:`~extproc.core.admission.LedgerAnswer`); the core turns that into Admit or Reject. A
ledger never decides policy and never computes retry hints. The answer types live in the core
(it consumes them and may import nothing else); they are re-exported here for implementers.

What a ledger offers (MemoryLedger, RedisLedger; the gate calls them by their own types):
``reserve(demand) -> LedgerAnswer`` (check and reserve as one atomic step), ``release(ticket)``
(idempotent), ``renew(tickets) -> lost lease ids``, ``usage(cluster, class, limits)`` (reserves
nothing) and ``close()``; ``store`` is the tag written into every ticket it issues.
"""

from __future__ import annotations

from extproc.core.admission import (
    CompartmentUsage,
    Demand,
    LedgerAnswer,
    ReleaseStats,
    Ticket,
)
from extproc.core.fleet import Budget


class LedgerUnavailable(Exception):
    """The ledger could not be reached or did not answer in time; nothing was reserved."""


__all__ = [
    "Budget",
    "CompartmentUsage",
    "Demand",
    "LedgerAnswer",
    "LedgerUnavailable",
    "ReleaseStats",
    "Ticket",
]
