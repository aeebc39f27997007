"""Flow control's wait-or-refuse policy: what happens to a request its budget just refused.

Pure. The shell (extproc/ledger/gate.py for the live processor, extproc/sim/admission.py for
the simulator) asks the ledger, counts the waiters ahead, and then follows these answers; it
decides nothing itself (ARCHITECTURE.md, "Flow control"):

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
) -> QueueVerdict:
    """Whether a request whose ``demand`` the ledger refused (``refused``, from ``answer``;
    None: no ledger answered) waits behind ``ahead`` queued requests holding ``ahead_tokens``.
    ``NO_WAIT``: the refusal stands as it is."""
    if answer is None or refused.status != 429 or refused.reason is Reason.LOCAL_SHARE:
        return QueueVerdict.NO_WAIT
    return queue_decision(policy, ahead, queued_wait(demand, answer, ahead, ahead_tokens))


def queue_refusal(
    decision: QueueVerdict,
    refused: Reject,
    demand: Demand,
    answer: LedgerAnswer | None,
    policy: WaitPolicy,
    ahead: int,
    ahead_tokens: int,
    rng: Random,
) -> Reject:
    """The answer to a request flow control does not queue (``decision`` is not WAIT): the
    ledger's refusal when the class does not wait, else a 429 whose hint counts the requests
    ahead and whose message says why it was not queued."""
    if decision is QueueVerdict.NO_WAIT or decision is QueueVerdict.WAIT or answer is None:
        return refused
    why = (
        f"{ahead} requests already wait for it"
        if decision is QueueVerdict.OVERFLOW
        else f"the estimated wait exceeds its class's max_wait_s of {policy.max_wait_s:g}s"
    )
    out = verdict(demand, answer, rng, ahead, ahead_tokens, why=why)
    assert isinstance(out, Reject)  # answer is a refusal: verdict keeps it one
    return out


def flow_outlook(
    demand: Demand, answer: LedgerAnswer, policy: WaitPolicy, queued: int, queued_tokens: int
) -> tuple[str, float]:
    """(``admit`` | ``wait`` | ``too_long`` | ``overflow`` | ``no_wait``, the estimated wait
    in seconds) for ``demand`` on a compartment the ledger sees as ``answer`` with ``queued``
    waiters holding ``queued_tokens``."""
    estimate = queued_wait(demand, answer, queued, queued_tokens)
    if not queued and queued_wait(demand, answer) == 0:
        would = "admit"
    else:
        would = queue_decision(policy, queued, estimate).value
    return would, bounded_wait(estimate)
