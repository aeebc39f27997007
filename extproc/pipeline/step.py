"""Admission as one sans-I/O step that the processor, ``explain`` and the simulator all drive.

A step is a generator: it takes the request's facts that admission reads (its cost in tokens,
its route, where else a new session may start, its class's wait policy), **yields what it needs
from the outside** (a :class:`Reserve`, the depth of a queue, a placement to remember, a queue
to join, a ticket to give back), receives each answer, and **returns the outcome**. It reads
no clock, opens no socket, touches no Redis, counts no metric: the driver does all of that.

    step = admission_step(tokens, route, elsewhere, wait)
    outcome = drive(step, perform)   # perform(need) -> answer; see below

Three drivers run the same steps:

- the live driver (``Pipeline._drive``, extproc/pipeline/pipeline.py, async): a reservation
  is the gate's atomic check-and-reserve on Redis or in memory, with its timeouts and outage
  policy (extproc/ledger/gate.py), a queue is the gate's queue (extproc/ledger/waiters.py);
- ``explain``'s preview (:func:`preview`), which decides on the live state without changing
  it: every reservation is assumed to have room, nothing is written, nobody waits, so
  admission is previewed as far as it is pure (a 413 no budget could admit, a policy's own
  refusal);
- the simulator's synchronous driver (extproc/sim/admission.py, run by extproc/sim/run.py)
  over the in-memory ledger on the simulated clock and its own fair queues.

So a change to the order of admission (what is tried, when a request waits) is made once,
here, and all three follow; the policies themselves are pure functions of the core
(extproc/core/admission.py, extproc/core/flow.py, extproc/core/queue_policy.py).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from extproc.core.admission import (
    TENANT_REASONS,
    Admitted,
    Attempt,
    CompartmentUsage,
    Demand,
    Reject,
    TenantClaim,
    Ticket,
    plan,
)
from extproc.core.decide import Route
from extproc.core.flow import WaitPolicy


@dataclass(frozen=True, slots=True)
class Reserve:
    """Check-and-reserve ``demand`` atomically. Answer: an :class:`Attempt`. ``look``: only
    look (others already wait on the compartment: the request joins behind them rather than
    take the budget a release just handed to the queue's head)."""

    demand: Demand
    look: bool = False


@dataclass(frozen=True, slots=True)
class QueueDepth:
    """How many requests wait on (cluster, class) here. Answer: an int."""

    cluster: str
    class_name: str


@dataclass(frozen=True, slots=True)
class RememberPlacement:
    """A new session was admitted off its primary, on ``route``: its later turns follow it
    (an override in the session memory). Answer: None."""

    route: Route


@dataclass(frozen=True, slots=True)
class JoinQueue:
    """Wait for budget behind the compartment's queue, or be refused now (the wait-or-refuse
    policy of extproc/core/queue_policy.py). Answer: a driver's queued-request value, or the
    :class:`Reject` to answer."""

    demand: Demand
    attempt: Attempt
    wait: WaitPolicy


@dataclass(frozen=True, slots=True)
class GiveBack:
    """Release ``ticket`` (taken earlier by this request, no longer needed). Answer: None."""

    ticket: Ticket


Need = Reserve | QueueDepth | RememberPlacement | JoinQueue | GiveBack

# A step's needs and its outcome (for :func:`drive`).
N = TypeVar("N")
R = TypeVar("R")

# The ledger named by the preview's tickets: none was asked.
PREVIEW_STORE = "preview"


@dataclass(frozen=True, slots=True)
class Placed:
    """Admitted on a later candidate than the primary (flow control's placement)."""

    route: Route
    admitted: Admitted


# The outcome of an admission step: None (the class has no budget: route, hold nothing),
# Admitted, Placed, a Reject to answer, or the driver's value for a request that waits.
Step = Generator[Need, Any, Any]


def admission_step(
    tokens: int,
    route: Route,
    elsewhere: Callable[[], Iterable[Route]] | None,
    wait: WaitPolicy,
    tenant: TenantClaim | None = None,
    queue_tenant: str | None = None,
) -> Step:
    """Admit ``tokens`` on ``route``'s primary; else, when ``elsewhere`` is given (a new
    session, flow control placing), on the first of its routes with room and nobody waiting
    (remembered); else wait or refuse (``wait``: the class's wait policy). ``tenant``: counted
    (and its own limits checked) in the same reservations; a refusal by those limits is
    answered at once. ``queue_tenant``: the request's tenant in the fair order of the queues
    (each reservation's answer counts the waiters it would follow: :attr:`Demand.queue_tenant`).

    A compartment with waiters is only looked at on the primary (the request joins behind
    them) and skipped as a placement: the budget a release frees there is its queue's head's,
    not a newcomer's from another cluster."""
    planned = plan(tokens, route, tenant, queue_tenant)
    if planned is None or isinstance(planned, Reject):
        return planned  # unbudgeted, or a 413 no budget could ever admit
    look = yield from _has_waiters(planned, wait)
    attempt: Attempt = yield Reserve(planned, look)
    if isinstance(attempt.outcome, Admitted) or attempt.outcome.reason in TENANT_REASONS:
        return attempt.outcome
    if elsewhere is not None and attempt.outcome.status == 429:
        for candidate in elsewhere():
            demand = plan(tokens, candidate, tenant, queue_tenant)
            if not isinstance(demand, Demand) or (yield from _has_waiters(demand, wait)):
                continue
            tried: Attempt = yield Reserve(demand)
            if isinstance(tried.outcome, Admitted):
                yield RememberPlacement(candidate)
                return Placed(candidate, tried.outcome)
            if tried.outcome.reason in TENANT_REASONS:
                return tried.outcome
    return (yield JoinQueue(planned, attempt, wait))


def _has_waiters(demand: Demand, wait: WaitPolicy) -> Generator[Need, Any, bool]:
    """Whether requests wait on ``demand``'s compartment (never, when its class does not
    wait)."""
    if not wait.enabled:
        return False
    depth: int = yield QueueDepth(demand.cluster, demand.class_name)
    return depth > 0


def prefill_step(tokens: int, route: Route, held: Ticket | None) -> Step:
    """Disaggregated requests: the prefill pool's budget (``route``: the prefill cluster and
    its prefill class), reserved apart from the decode pool's, after it. The prefill ticket,
    None (no prefill budget), or the Reject to answer, the decode reservation ``held`` then
    given back: a prefill burst is refused there and leaves decode budgets alone."""
    planned = plan(tokens, route)
    if planned is None:
        return None
    refused = planned
    if isinstance(planned, Demand):
        attempt: Attempt = yield Reserve(planned)
        if isinstance(attempt.outcome, Admitted):
            return attempt.outcome.ticket
        refused = attempt.outcome
    if held is not None:
        yield GiveBack(held)
    return refused


def _assume_room(need: Need) -> Any:
    """The preview's answers: every reservation has room (whether the ledger has room right
    now is the next instant's question, which ``explain`` answers with the compartment's
    usage), nobody waits, and nothing is written or given back."""
    if isinstance(need, Reserve):
        demand = need.demand
        ticket = Ticket(demand.cluster, demand.class_name, demand.tokens, "", PREVIEW_STORE)
        return Attempt(Admitted(demand, ticket, CompartmentUsage()), demand, None)
    if isinstance(need, QueueDepth):
        return 0
    return None


def preview(step: Step) -> Any:
    """``explain``'s driver: the step's outcome on the live state, changing nothing."""
    return drive(step, _assume_room)


def drive(step: Generator[N, Any, R], perform: Callable[[N], Any]) -> R:
    """Run ``step`` to its outcome, answering each need with ``perform`` (synchronous): an
    admission step here, or the bounded placement step (extproc/pipeline/placement_step.py)."""
    answer = None
    while True:
        try:
            need = step.send(answer)
        except StopIteration as done:
            outcome: R = done.value
            return outcome
        answer = perform(need)
