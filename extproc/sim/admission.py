"""The simulator's driver of the processor's admission steps (extproc/pipeline/step.py).

Synchronous, over the in-memory ledger on the caller's clock, with its own (cluster, class)
fair queues: the same needs the live driver answers against the gate, answered the way the
gate answers them with its in-memory ledger. No event loop: a simulator admits millions of
requests, and the in-memory ledger never waits.

    driver = SimAdmission(ledger, rng, on_queued, on_give_back)
    outcome = driver.admit(admission_step(tokens, route, elsewhere, wait), request)
    # None | Admitted | Placed | Reject | QUEUED (then ``on_queued(request, key, qid, wait)``)
"""

from __future__ import annotations

from collections.abc import Callable
from random import Random

from extproc.core.admission import Attempt, Reject, Ticket, verdict
from extproc.core.flow import FairClaim, FairQueue, QueueVerdict, WaitPolicy
from extproc.core.queue_policy import queue_refusal, queue_verdict
from extproc.ledger.memory import MemoryLedger
from extproc.pipeline.step import GiveBack, JoinQueue, Need, QueueDepth, Reserve, Step

# A refused request that joined its queue (the driver's answer to a JoinQueue need).
QUEUED = object()

Compartment = tuple[str, str]


class SimAdmission:
    """Answers an admission step's needs: a reservation is the in-memory ledger's atomic
    check-and-reserve (or a look), a queue is a :class:`FairQueue` of request numbers, a
    placement is remembered by the caller's policy when the request starts."""

    __slots__ = (
        "_claim_of",
        "_ledger",
        "_on_give_back",
        "_on_queued",
        "_request",
        "_rng",
        "queues",
    )

    def __init__(
        self,
        ledger: MemoryLedger,
        rng: Random,
        on_queued: Callable[[int, Compartment, int, WaitPolicy], None],
        on_give_back: Callable[[Ticket], None],
        claim_of: Callable[[int], FairClaim] | None = None,
    ) -> None:
        self._ledger = ledger
        self._rng = rng
        self._on_queued = on_queued
        self._on_give_back = on_give_back
        # A request's claim on the fair order (its tenant, weight and cost, as the processor's
        # FlowParams.claim makes it); None: one shared tenant at unit cost.
        self._claim_of = claim_of
        self._request = 0
        self.queues: dict[Compartment, FairQueue[int]] = {}

    def admit(self, step: Step, request: int) -> object:
        """Run ``step`` for request number ``request`` to its outcome."""
        self._request = request
        answer: object = None
        while True:
            try:
                need = step.send(answer)
            except StopIteration as done:
                return done.value
            answer = self.perform(need)

    def perform(self, need: Need) -> object:
        if isinstance(need, Reserve):
            demand, ledger = need.demand, self._ledger
            if need.look:
                seen = ledger.usage_now(demand.cluster, demand.class_name, demand.limits)
            else:
                seen = ledger.reserve_now(demand)
            return Attempt(verdict(demand, seen, self._rng), demand, seen)
        if isinstance(need, QueueDepth):
            q = self.queues.get((need.cluster, need.class_name))
            return len(q) if q is not None else 0
        if isinstance(need, JoinQueue):
            return self._join(need)
        if isinstance(need, GiveBack):
            self._on_give_back(need.ticket)
        # RememberPlacement: the caller's policy is told where a new session started.
        return None

    def _join(self, need: JoinQueue) -> object:
        """Wait in the primary's queue (QUEUED), or the 429 to answer: the processor's
        wait-or-refuse policy (extproc/core/queue_policy.py), as its gate applies it."""
        demand, refused, answer = need.demand, need.attempt.outcome, need.attempt.answer
        assert isinstance(refused, Reject)
        key = (demand.cluster, demand.class_name)
        q = self.queues.get(key)
        claim = FairClaim("") if self._claim_of is None else self._claim_of(self._request)
        queued = len(q) if q is not None else 0
        ahead, ahead_tokens = q.ahead_for(claim.tenant) if q is not None else (0, 0)
        decision = queue_verdict(
            refused, demand, answer, need.wait, ahead, ahead_tokens, queued=queued
        )
        if decision is QueueVerdict.WAIT:
            if q is None:
                q = self.queues[key] = FairQueue()
            qid = q.push(
                self._request, claim.tenant, claim.weight, demand.tokens, service=claim.service
            )
            self._on_queued(self._request, key, qid, need.wait)
            return QUEUED
        return queue_refusal(
            decision,
            refused,
            demand,
            answer,
            need.wait,
            ahead,
            ahead_tokens,
            self._rng,
            queued=queued,
        )
