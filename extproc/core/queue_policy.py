"""Flow control's wait-or-refuse policy: what happens to a request its budget just refused.

Pure. The shell (extproc/ledger/gate.py for the live processor, extproc/sim/admission.py for
the simulator) asks the ledger, counts the waiters a newcomer would follow in the queue's order
(:meth:`extproc.core.flow.FairQueue.ahead_for`: under fair order, not a flooding tenant's whole
backlog), and then follows these answers; it decides nothing itself (ARCHITECTURE.md, "Flow
control"):

- :func:`queue_verdict`: join the (cluster, class) queue, or refuse now: the class does not
  wait, the refusal is one a wait cannot cure (a 413, the ``closed`` policy's 503, a request
  larger than a replica's share), the queue is full, or the wait estimated from the observed
  release rate (counting the requests ahead) is longer than the class allows;
- :func:`queue_refusal`: the 429 for a refusal flow control turned down, its hint counting
  the requests ahead and its message saying why it did not wait;
- :func:`flow_outlook`: what a request of the compartment would get now, for ``explain``.
"""

from __future__ import annotations

from random import Random

from extproc.core.admission import (
    Demand,
    LedgerAnswer,
    Reason,
    Reject,
    bounded_wait,
    queued_wait,
    verdict,
)
from extproc.core.flow import QueueVerdict, WaitPolicy, queue_decision


def queue_verdict(
    refused: Reject,
    demand: Demand,
    answer: LedgerAnswer | None,
    policy: WaitPolicy,
    ahead: int,
    ahead_tokens: int,
    *,
    queued: int | None = None,
) -> QueueVerdict:
    """Whether a request whose ``demand`` the ledger refused (``refused``, from ``answer``;
    None: no ledger answered) waits behind the ``ahead`` queued requests holding
    ``ahead_tokens`` that it would follow in the queue's order, in a queue of ``queued``
    waiters in all (None: ``ahead``, as in a FIFO queue), which ``max_queue`` bounds.
    ``NO_WAIT``: the refusal stands as it is."""
    if answer is None or refused.status != 429 or refused.reason is Reason.LOCAL_SHARE:
        return QueueVerdict.NO_WAIT
    estimate = queued_wait(demand, answer, ahead, ahead_tokens)
    return queue_decision(policy, ahead if queued is None else queued, estimate)


def queue_refusal(
    decision: QueueVerdict,
    refused: Reject,
    demand: Demand,
    answer: LedgerAnswer | None,
    policy: WaitPolicy,
    ahead: int,
    ahead_tokens: int,
    rng: Random,
    *,
    queued: int | None = None,
) -> Reject:
    """The answer to a request flow control does not queue (``decision`` is not WAIT): the
    ledger's refusal when the class does not wait, else a 429 whose hint counts the requests
    it would have followed and whose message says why it was not queued (``queued``: the
    queue's whole length; None: ``ahead``)."""
    if decision is QueueVerdict.NO_WAIT or decision is QueueVerdict.WAIT or answer is None:
        return refused
    why = (
        f"{ahead if queued is None else queued} requests already wait for it"
        if decision is QueueVerdict.OVERFLOW
        else f"the estimated wait exceeds its class's max_wait_s of {policy.max_wait_s:g}s"
    )
    out = verdict(demand, answer, rng, ahead, ahead_tokens, why=why)
    assert isinstance(out, Reject)  # answer is a refusal: verdict keeps it one
    return out


def flow_outlook(
    demand: Demand,
    answer: LedgerAnswer,
    policy: WaitPolicy,
    ahead: int,
    ahead_tokens: int,
    *,
    queued: int | None = None,
) -> tuple[str, float]:
    """(``admit`` | ``wait`` | ``too_long`` | ``overflow`` | ``no_wait``, the estimated wait
    in seconds) for ``demand`` on a compartment the ledger sees as ``answer``, behind the
    ``ahead`` waiters holding ``ahead_tokens`` it would follow, in a queue of ``queued``
    waiters in all (None: ``ahead``)."""
    whole = ahead if queued is None else queued
    estimate = queued_wait(demand, answer, ahead, ahead_tokens)
    if not whole and queued_wait(demand, answer) == 0:
        would = "admit"
    else:
        would = queue_decision(policy, whole, estimate).value
    return would, bounded_wait(estimate)
