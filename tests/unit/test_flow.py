"""Flow control's pure parts (extproc/core/flow.py): who may be placed elsewhere, who waits, in
what order; and the queued wait estimate (extproc/core/admission.py).

The property tests run the fair queue against the real in-memory ledger on a simulated clock:
nothing is admitted past the budget, nothing waits past its class's maximum, and while tenants
are all backlogged their service follows their weights within one request each.
"""

from __future__ import annotations

import dataclasses
import math
from random import Random

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.admission import (
    CompartmentUsage,
    Demand,
    LedgerAnswer,
    Reason,
    Reject,
    ReleaseStats,
    queued_wait,
    verdict,
)
from extproc.core.fleet import Budget
from extproc.core.flow import (
    FairQueue,
    QueueVerdict,
    WaitPolicy,
    placement_candidates,
    queue_decision,
    secondary_for,
)
from extproc.core.queue_policy import flow_outlook, queue_refusal, queue_verdict
from extproc.ledger.memory import MemoryLedger

RANKED = ("c3", "c1", "c4", "c2")


def test_only_new_sessions_are_placed_elsewhere_in_hash_order() -> None:
    assert placement_candidates(RANKED, "c3", seen=False, has_override=False) == ("c1", "c4", "c2")
    # The refused primary need not be the hash primary (affinity may have chosen another).
    assert placement_candidates(RANKED, "c1", seen=False, has_override=False) == ("c3", "c4", "c2")
    assert placement_candidates(RANKED, "c3", seen=True, has_override=False) == ()
    assert placement_candidates(RANKED, "c3", seen=False, has_override=True) == ()


def test_secondary_is_the_first_other_candidate() -> None:
    assert secondary_for(RANKED, "c3") == "c1"
    assert secondary_for(RANKED, "c1") == "c3"
    assert secondary_for(("c1",), "c1") is None


def test_queue_decision() -> None:
    policy = WaitPolicy(max_wait_s=30.0, max_queue=2)
    assert queue_decision(policy, 0, 29.9) is QueueVerdict.WAIT
    assert queue_decision(policy, 1, 30.0) is QueueVerdict.WAIT
    assert queue_decision(policy, 1, 30.1) is QueueVerdict.TOO_LONG
    assert queue_decision(policy, 2, 0.1) is QueueVerdict.OVERFLOW
    assert queue_decision(WaitPolicy(), 0, 0.0) is QueueVerdict.NO_WAIT
    assert queue_decision(WaitPolicy(0.0, 8), 0, 0.0) is QueueVerdict.NO_WAIT


def _answer(concurrent: int, releases_per_s: float, now: float = 100.0) -> LedgerAnswer:
    # A steady rate r observed since long ago: decayed count r * tau (tau = 10 s).
    stats = ReleaseStats(releases_per_s * 10.0, 0.0, now, 0.0)
    return LedgerAnswer(False, None, CompartmentUsage(0, concurrent, 0.0), stats, now)


def test_queued_wait_counts_the_requests_ahead() -> None:
    demand = Demand("c1", "long", 10, Budget(max_concurrent=2), Budget(max_concurrent=2))
    answer = _answer(concurrent=2, releases_per_s=0.5)
    alone = queued_wait(demand, answer)
    behind_three = queued_wait(demand, answer, ahead=3)
    assert math.isclose(alone, 2.0, rel_tol=0.01)  # one release needed at 0.5/s
    assert math.isclose(behind_three, 8.0, rel_tol=0.01)  # four releases needed
    # The 429 for a request behind three carries that longer hint, and says why.
    reject = verdict(demand, answer, Random(1), ahead=3, why="queue full")
    assert isinstance(reject, Reject)
    assert reject.retry_after_s is not None and 8 <= reject.retry_after_s <= 12
    assert "queue full" in reject.message
    # Room now: no wait at all.
    assert queued_wait(demand, _answer(concurrent=1, releases_per_s=0.5)) == 0.0


def test_fair_queue_is_fifo_per_tenant_and_weighted_across() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(4):
        q.push(f"a{i}", "a", weight=1.0)
    for i in range(4):
        q.push(f"b{i}", "b", weight=3.0)
    served = [q.pop() for _ in range(8)]
    assert [x for x in served if x and x.startswith("a")] == ["a0", "a1", "a2", "a3"]
    assert [x for x in served if x and x.startswith("b")] == ["b0", "b1", "b2", "b3"]
    # b (weight 3) gets three of the first four turns.
    assert sum(1 for x in served[:4] if x and x.startswith("b")) == 3
    assert q.pop() is None and len(q) == 0


def test_fair_queue_removal_and_position() -> None:
    q: FairQueue[str] = FairQueue()
    ids = [q.push(f"x{i}", "t", cost=10) for i in range(3)]
    assert q.ahead_of(ids[2]) == (2, 20)
    assert q.remove(ids[0]) and not q.remove(ids[0])
    assert q.head() == "x1" and q.head_id() == ids[1]
    assert q.ahead_of(ids[2]) == (1, 10) and q.tokens == 20
    assert list(q) == ["x1", "x2"]


@settings(max_examples=200, deadline=None)
@given(
    weights=st.lists(st.sampled_from([1.0, 2.0, 4.0]), min_size=2, max_size=4),
    backlog=st.integers(min_value=5, max_value=40),
    served=st.integers(min_value=1, max_value=60),
)
def test_fairness_bound_while_backlogged(weights: list[float], backlog: int, served: int) -> None:
    """Tenants with a backlog each get service proportional to their weight, within one
    request of it: |n_a / w_a - n_b / w_b| <= 1 / w_a + 1 / w_b."""
    q: FairQueue[int] = FairQueue()
    # Arrivals interleaved, as they come in.
    for _ in range(backlog):
        for t in range(len(weights)):
            q.push(t, f"t{t}", weights[t])
    counts = [0] * len(weights)
    for _ in range(min(served, backlog)):  # every tenant still has a backlog
        item = q.pop()
        assert item is not None
        counts[item] += 1
    for a in range(len(weights)):
        for b in range(len(weights)):
            gap = abs(counts[a] / weights[a] - counts[b] / weights[b])
            assert gap <= 1 / weights[a] + 1 / weights[b] + 1e-9


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@settings(max_examples=100, deadline=None)
@given(
    events=st.lists(
        st.tuples(
            st.sampled_from(["arrive", "finish", "tick"]),
            st.integers(min_value=0, max_value=2),  # tenant
            st.floats(min_value=0.0, max_value=3.0),  # time step
        ),
        min_size=1,
        max_size=120,
    ),
    cap=st.integers(min_value=1, max_value=3),
    max_wait=st.floats(min_value=0.5, max_value=5.0),
)
def test_queue_over_the_real_ledger_never_exceeds_budget_or_max_wait(
    events: list[tuple[str, int, float]], cap: int, max_wait: float
) -> None:
    """The waiting discipline of extproc/ledger/waiters.py on a simulated clock: only the head
    reserves; a release lets heads in until one is refused; a waiter past its deadline leaves."""
    clock = _Clock()
    ledger = MemoryLedger(clock)
    limits = Budget(max_concurrent=cap)
    demand = Demand("c1", "long", 1, Budget(max_concurrent=cap), limits)
    q: FairQueue[tuple[int, float]] = FairQueue()  # (id, arrived at)
    held: list[object] = []
    waited: list[float] = []
    serial = 0

    def drain_heads() -> None:
        while (head := q.head()) is not None:
            if clock.now - head[1] > max_wait:
                q.pop()  # timed out: leaves with a 429
                continue
            answer = ledger.reserve_now(demand)
            if not answer.granted:
                return
            q.pop()
            held.append(answer.ticket)
            waited.append(clock.now - head[1])

    for kind, tenant, step in events:
        clock.now += step
        drain_heads()  # deadlines and bucket refills are checked as time passes
        if kind == "arrive":
            serial += 1
            if len(q) == 0:
                answer = ledger.reserve_now(demand)
                if answer.granted:
                    held.append(answer.ticket)
                    continue
            q.push((serial, clock.now), f"t{tenant}", 1.0 + tenant)
        elif kind == "finish" and held:
            ticket = held.pop(0)
            assert ticket is not None
            ledger.release_now(ticket)  # type: ignore[arg-type]
            drain_heads()
        assert ledger.held() == len(held) <= cap
        assert all(w <= max_wait + 1e-9 for w in waited)


def test_the_wait_or_refuse_policy_is_the_cores() -> None:
    """queue_verdict waits only on a ledger's 429 that a wait can cure; queue_refusal says
    why it did not wait and counts the requests ahead; flow_outlook is explain's view."""
    budget = Budget(max_concurrent=2)
    demand = Demand("c1", "long", 10, budget, budget)
    answer = _answer(concurrent=2, releases_per_s=0.5)  # one release every 2 s
    refused = verdict(demand, answer, Random(1))
    assert isinstance(refused, Reject)
    policy = WaitPolicy(max_wait_s=5.0, max_queue=3)
    assert queue_verdict(refused, demand, answer, policy, 0, 0) is QueueVerdict.WAIT
    assert queue_verdict(refused, demand, answer, policy, 2, 20) is QueueVerdict.TOO_LONG
    assert queue_verdict(refused, demand, answer, policy, 3, 30) is QueueVerdict.OVERFLOW
    assert queue_verdict(refused, demand, answer, WaitPolicy(), 0, 0) is QueueVerdict.NO_WAIT
    # No ledger answered (the closed policy's 503), or a refusal no wait cures: as it is.
    assert queue_verdict(refused, demand, None, policy, 0, 0) is QueueVerdict.NO_WAIT
    share = dataclasses.replace(refused, reason=Reason.LOCAL_SHARE)
    assert queue_verdict(share, demand, answer, policy, 0, 0) is QueueVerdict.NO_WAIT
    too_large = dataclasses.replace(refused, status=413)
    assert queue_verdict(too_large, demand, answer, policy, 0, 0) is QueueVerdict.NO_WAIT

    rng = Random(3)
    args = (refused, demand, answer, policy, 3, 30, rng)
    assert queue_refusal(QueueVerdict.NO_WAIT, *args) is refused
    full = queue_refusal(QueueVerdict.OVERFLOW, *args)
    assert "3 requests already wait for it" in full.message
    assert full.retry_after_s is not None and full.retry_after_s >= 8  # four releases ahead
    slow = queue_refusal(QueueVerdict.TOO_LONG, *args)
    assert "exceeds its class's max_wait_s of 5s" in slow.message

    would, estimate = flow_outlook(demand, answer, policy, 0, 0)
    assert would == "wait" and math.isclose(estimate, 2.0, rel_tol=0.01)
    assert flow_outlook(demand, answer, policy, 3, 30)[0] == "overflow"
    roomy = _answer(concurrent=0, releases_per_s=0.5)
    assert flow_outlook(demand, roomy, policy, 0, 0) == ("admit", 0.0)
