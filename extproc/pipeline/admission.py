"""Admission against an in-process ledger, synchronously: the fleet simulator's admission step.

The same three steps the live gate takes with its in-memory ledger
(extproc/ledger/gate.py, ``AdmissionGate.admit``): :func:`~extproc.core.admission.plan` (the
demand, or a 413 no budget state could ever admit), the ledger's atomic check-and-reserve
(``MemoryLedger.reserve_now``, on the caller's clock), and
:func:`~extproc.core.admission.verdict` (a refusal becomes a 429 with its jittered
retry-after). No event loop: a simulator admits millions of requests, and the in-memory ledger
never waits.

``charges`` generalises the live path's single charged cluster (the primary) to a list tried
in order, for the simulator's spill policy: the first cluster with room admits; when none has,
the answer is the refusal of the first one — the one a client of the live gateway would get.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from random import Random

from extproc.core.admission import Reject, Ticket, plan, verdict
from extproc.core.decide import Route
from extproc.core.fleet import RequestClass
from extproc.core.placement import Placement
from extproc.ledger.memory import MemoryLedger


@dataclass(frozen=True, slots=True)
class Admission:
    """``index``: the position in ``charges`` that admitted (-1: none did, see ``refusal``)."""

    index: int
    ticket: Ticket | None = None  # None also when the class has no budget (nothing held)
    refusal: Reject | None = None


def admit_first_fit(
    ledger: MemoryLedger,
    tokens: int,
    request_class: RequestClass,
    charges: Sequence[str],
    rng: Random,
) -> Admission:
    """Admit ``tokens`` of ``request_class`` on the first of ``charges`` with room."""
    refusal: Reject | None = None
    for index, cluster in enumerate(charges):
        planned = plan(tokens, Route(Placement(cluster, None), request_class))
        if planned is None:
            return Admission(index)
        if isinstance(planned, Reject):
            # Never admissible anywhere: the class's whole budget is smaller than the request.
            return Admission(-1, refusal=planned)
        answer = ledger.reserve_now(planned)
        if answer.granted:
            return Admission(index, answer.ticket)
        if refusal is None:
            # Drawn once per request (its jitter is the one the client sees), so that trying
            # more candidates does not change the random stream of later requests.
            outcome = verdict(planned, answer, rng)
            if isinstance(outcome, Reject):
                refusal = outcome
    return Admission(-1, refusal=refusal)
