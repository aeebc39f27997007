"""One policy's run of the discrete-event loop (extproc/sim/engine.py describes the model).

The run's state is explicit, in four small objects:

- :class:`Fleet`: the simulated clusters, their membership and health, the view the policy
  reads, and the fleet events applied in time order;
- :class:`FailureLog`: each failure's lost requests and the re-prefill its sessions cost, by
  the cluster that absorbed them;
- :class:`Outcomes`: the figures of every request;
- :class:`Simulation`: the loop itself (arrivals, 429 retries, releases, waiters' deadlines),
  with one method per kind of event, and admission through the processor's admission steps
  (extproc/pipeline/step.py) driven by :class:`extproc.sim.admission.SimAdmission`.

Disaggregated requests take their prefill leg in :class:`extproc.sim.prefill.PrefillLeg`.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from random import Random

import numpy as np

from extproc.core.admission import Admitted, Demand, Reject, Ticket, plan, verdict
from extproc.core.decide import Route
from extproc.core.fleet import RequestClass
from extproc.core.flow import FairClaim, WaitPolicy
from extproc.core.placement import Placement
from extproc.ledger.memory import MemoryLedger
from extproc.pipeline import step as steps
from extproc.pipeline.step import Placed
from extproc.sim.admission import QUEUED, Compartment, SimAdmission
from extproc.sim.engine import (
    GAVE_UP_429,
    NO_CLUSTER,
    NO_WAIT,
    PROGRESS_EVERY,
    SERVED,
    TOO_LARGE_413,
    FailureRecord,
    PolicyRun,
    Scenario,
    SimConfig,
)
from extproc.sim.engines import EngineCluster, cluster_state
from extproc.sim.events import Kind
from extproc.sim.policies import Candidates, FleetView, Policy, make_policy
from extproc.sim.prefill import Prefill, PrefillLeg
from extproc.sim.tenants import claims_for


class FailureLog:
    """Failures, and the re-prefill of the sessions each displaced (``FailureRecord``)."""

    __slots__ = ("_crash_at", "_crash_ix", "_displaced", "_ideal", "_last_on", "_last_t", "records")

    def __init__(self, n_clusters: int, n_sessions: int, ideal: Sequence[int]) -> None:
        self.records: list[FailureRecord] = []
        self._crash_at = [-math.inf] * n_clusters
        self._crash_ix = [-1] * n_clusters
        self._last_on = [-1] * n_sessions
        self._last_t = [-math.inf] * n_sessions
        # Session -> the failure that displaced it, until it is back on its own cluster.
        self._displaced: dict[int, int] = {}
        self._ideal = ideal

    def failed(self, cluster: int, now: float, lost: int, survivors: list[int]) -> None:
        record = FailureRecord(cluster, now, lost_inflight=lost)
        record.survivors = survivors
        self._crash_at[cluster] = now
        self._crash_ix[cluster] = len(self.records)
        self.records.append(record)

    def recovered(self, cluster: int, now: float) -> None:
        if self._crash_ix[cluster] >= 0:
            self.records[self._crash_ix[cluster]].recovered_at = now

    def served(self, i: int, session: int, cluster: int, cached: int, now: float) -> None:
        """Request ``i`` of ``session`` ran on ``cluster`` with ``cached`` tokens hit."""
        j = self._displaced.get(session)
        if j is None:
            was = self._last_on[session]
            if was >= 0 and self._crash_at[was] > self._last_t[session]:
                j = self._displaced[session] = self._crash_ix[was]
        if j is not None:
            record = self.records[j]
            refill = max(0, self._ideal[i] - cached)
            if now < record.recovered_at:
                record.spread[cluster] = record.spread.get(cluster, 0) + refill
                record.by_session[session] = record.by_session.get(session, 0) + refill
            else:
                record.failback_tokens += refill
                del self._displaced[session]
        self._last_on[session] = cluster
        self._last_t[session] = now


class Fleet:
    """The clusters, their membership and health, and the view the policy reads, kept current
    by the fleet events (fail, recover, add, remove) in time order."""

    __slots__ = (
        "_bound",
        "_ev_i",
        "_pd_endpoints",
        "_policy",
        "_scenario",
        "alive",
        "index",
        "log",
        "member",
        "placeable",
        "ready",
        "states",
        "view",
    )

    def __init__(
        self, scenario: Scenario, config: SimConfig, policy: Policy, rng: Random, log: FailureLog
    ) -> None:
        specs = scenario.clusters
        n = len(specs)
        self._scenario, self._policy, self.log = scenario, policy, log
        block = scenario.traffic.base.block_tokens
        # cluster_state's engine arguments: sticky, spill, balance, floor.
        sticky, spill = config.sticky_engines, config.engine_spill
        self._bound = (sticky, spill, config.engine_balance, config.engine_min_inflight)
        self.states = [cluster_state(spec, block, -math.inf, *self._bound) for spec in specs]
        self.member = [i < scenario.n_base for i in range(n)]
        self.alive = list(self.member)
        self.index = {name: i for i, name in enumerate(scenario.names)}
        pd = config.pd
        # Clusters a policy may send a whole request to (P/D: prefill-role clusters only prefill).
        self.placeable = pd.placeable if pd is not None else (True,) * n
        table = scenario.tables.tables[0]
        self.view = FleetView(
            states=self.states,
            alive=self.alive,
            alive_ix=self._alive_ix(),
            table=table,
            primary=table[:, 0].tolist(),
            secondary=table[:, 1].tolist() if table.shape[1] > 1 else [-1] * len(table),
            rng=rng,
            member=self.member,
            names=scenario.names,
            points=scenario.traffic.points,
            weights=tuple(spec.weight for spec in specs),
            placeable=tuple(self.placeable),
        )
        # P/D: the prefill endpoints, and those the prober would find ready (of live clusters).
        self._pd_endpoints = (
            {ep for pool in pd.plan.pools.values() for ep in pool} if pd is not None else set()
        )
        self.ready = self._ready()
        self._ev_i = 0

    def _alive_ix(self) -> list[int]:
        alive, placeable = self.alive, self.placeable
        return [i for i in range(len(alive)) if alive[i] and placeable[i]]

    def _ready(self) -> frozenset[str]:
        alive, index = self.alive, self.index
        return frozenset(ep.address for ep in self._pd_endpoints if alive[index[ep.cluster]])

    def apply_until(self, now: float) -> None:
        """Apply every event due by ``now``, each at its own time."""
        events = self._scenario.events
        while self._ev_i < len(events) and events[self._ev_i].time_s <= now:
            self.apply(self._ev_i, events[self._ev_i].time_s)
            self._ev_i += 1

    def apply(self, ev_no: int, now: float) -> None:
        scenario = self._scenario
        ev = scenario.events[ev_no]
        c = self.index[ev.cluster]
        alive, states = self.alive, self.states
        if ev.kind is Kind.FAIL:
            lost = states[c].inflight(now)
            states[c].crash()
            alive[c] = False
            self.log.failed(c, now, lost, [i for i in range(len(alive)) if alive[i]])
        elif ev.kind is Kind.RECOVER:
            states[c].restart(now)
            alive[c] = True
            self.log.recovered(c, now)
        else:
            if ev.kind is Kind.ADD:
                block = scenario.traffic.base.block_tokens
                states[c] = cluster_state(scenario.clusters[c], block, now, *self._bound)
            self.member[c] = alive[c] = ev.kind is Kind.ADD
            tab = scenario.tables.tables[scenario.epoch_after[ev_no]]
            view = self.view
            view.table = tab
            view.primary = tab[:, 0].tolist()
            view.secondary = tab[:, 1].tolist() if tab.shape[1] > 1 else [-1] * len(tab)
        self.view.alive_ix = self._alive_ix()
        self.ready = self._ready()
        self._policy.refresh(self.view)


class Outcomes:
    """Per request: its figures, filled in as it is served or refused."""

    __slots__ = (
        "cached",
        "done_at",
        "prefill_tier",
        "rejections",
        "served_on",
        "status",
        "transfer_s",
        "ttft",
    )

    def __init__(self, n: int) -> None:
        self.ttft: list[float] = [math.nan] * n
        self.cached: list[int] = [-1] * n
        self.served_on: list[int] = [-1] * n
        self.rejections: list[int] = [0] * n
        self.status: list[int] = [SERVED] * n
        self.done_at: list[float] = [math.nan] * n
        self.transfer_s: list[float] = [math.nan] * n
        self.prefill_tier: list[int] = [-2] * n


class Simulation:
    """One policy over one scenario: build, :meth:`run`, read the :class:`PolicyRun`."""

    def __init__(self, scenario: Scenario, config: SimConfig, policy_name: str) -> None:
        traffic = scenario.traffic
        self.config, self.policy_name = config, policy_name
        self.policy = policy = make_policy(policy_name, config.spill_wait_s)
        self.names = scenario.names
        self.log = FailureLog(len(scenario.clusters), traffic.n_sessions, traffic.ideal_cached)
        rng = Random(f"sim:{config.seed}:{policy_name}")
        self.fleet = Fleet(scenario, config, policy, rng, self.log)
        self.track = any(e.kind is Kind.FAIL for e in scenario.events)
        self.clock = 0.0
        self.ledger = MemoryLedger(lambda: self.clock)
        self.classes: tuple[RequestClass, ...] = config.classes
        self.bulkheads = policy.bulkheads and any(c.budget.enforced for c in self.classes)
        # Flow control (policy.waits): each waiter's deadline, and per waiting request
        # (compartment, queue id, attempt).
        self.waits = policy.waits and self.bulkheads
        self.deadlines: list[tuple[float, int, int]] = []
        self.queued: dict[int, tuple[Compartment, int, int]] = {}
        self.releases: list[tuple[float, int, object]] = []
        self.retries: list[tuple[float, int, int, int]] = []
        self.prefills: list[Prefill] = []
        # Heap tie-breaks, in push order.
        self.seq = itertools.count(1)
        self.times, self.templates = traffic.times, traffic.templates
        self.offsets, self.sessions = traffic.offsets, traffic.sessions
        self.t_keys, self.t_in = traffic.t_keys, traffic.t_input
        self.t_out, self.t_class = traffic.t_output, traffic.t_class
        specs = scenario.clusters
        # The processor's placement point per session: only clusters of several engines use it.
        self.points: list[int] | None = (
            traffic.points.tolist()
            if config.pd is not None or any(sp.engines > 1 for sp in specs)
            else None
        )
        self.leaves = config.engine_spill == "leave" and config.sticky_engines
        self.seen = bytearray(traffic.n_sessions)
        self.out = Outcomes(len(self.times))
        retry_rng = Random(f"retry:{config.seed}:{policy_name}")
        self.retry_rng = retry_rng
        # The request being decided, for the needs its steps yield.
        self._attempt, self._now = 0, 0.0
        # Traffic naming tenants under a fair order (config.flow): each template's claim, and
        # per ticket of a request served through its queue, the output its tenant is charged
        # when it ends (the processor charges only requests that waited).
        self.claims: list[FairClaim] | None = claims_for(traffic, config.flow)
        self.charges: dict[Ticket, tuple[Compartment, FairClaim, float]] = {}
        claim_of = self._claim_of if self.claims is not None else None
        self.driver = SimAdmission(
            self.ledger, retry_rng, self._on_queued, self._on_give_back, claim_of
        )
        self.queues = self.driver.queues
        self.pd = PrefillLeg(self, config.pd) if config.pd is not None else None
        self.pd_classes = config.pd.disaggregated if config.pd is not None else frozenset()

    # -- admission and its answers ----------------------------------------------------------

    def admit(self, step: steps.Step, i: int, attempt: int, now: float) -> object:
        """Request ``i``'s admission step, run by the simulator's driver."""
        self._attempt, self._now = attempt, now
        return self.driver.admit(step, i)

    def _on_queued(self, i: int, key: Compartment, qid: int, wait: WaitPolicy) -> None:
        self.queued[i] = (key, qid, self._attempt)
        heapq.heappush(self.deadlines, (self._now + wait.max_wait_s, next(self.seq), i))

    def _on_give_back(self, ticket: Ticket) -> None:
        self.give_back(ticket, self._now)

    def _claim_of(self, i: int) -> FairClaim:
        assert self.claims is not None
        return self.claims[self.templates[i]]

    def _charge(self, ticket: Ticket) -> None:
        """A request served through its queue ended: its tenant is charged its output there."""
        found = self.charges.pop(ticket, None)
        if found is not None:
            key, claim, service = found
            q = self.queues.get(key)
            if q is not None:
                q.charge(claim.tenant, service, claim.weight)

    def refuse(self, i: int, refusal: Reject, attempt: int, now: float) -> None:
        """A 429 the client retries after its hint (up to ``max_retries``), else the answer."""
        out = self.out
        if refusal.status == 429 and attempt < self.config.max_retries:
            out.rejections[i] += 1
            wait = float(refusal.retry_after_s or 1)
            heapq.heappush(self.retries, (now + wait, next(self.seq), i, attempt + 1))
        else:
            if refusal.status == 429:
                out.rejections[i] += 1
            out.status[i] = GAVE_UP_429 if refusal.status == 429 else TOO_LARGE_413

    def demand_of(self, i: int, cluster: str) -> Demand | Reject | None:
        tp = self.templates[i]
        klass = self.classes[self.t_class[tp]]
        return plan(self.t_in[tp], Route(Placement(cluster, None), klass))

    # -- budget coming back -----------------------------------------------------------------

    def drain(self, key: Compartment, now: float) -> None:
        """Budget freed on ``key``: queue heads take it, in order, while it admits them."""
        q = self.queues.get(key)
        while q is not None:
            head = q.head()
            if head is None:
                return
            demand = self.demand_of(head, key[0])
            assert isinstance(demand, Demand)  # only budgeted requests are queued
            answer = self.ledger.reserve_now(demand)
            if not answer.granted or answer.ticket is None:
                return
            q.pop()
            attempt = self.queued.pop(head)[2]
            serve_c = self.fleet.index[key[0]]
            if not self.fleet.alive[serve_c]:
                self.out.status[head] = NO_CLUSTER
                self.ledger.release_now(answer.ticket)
                continue
            if self.claims is not None and self.config.flow is not None:
                claim = self.claims[self.templates[head]]
                out_tokens = self.t_out[self.templates[head]]
                service = self.config.flow.output_service(out_tokens)
                self.charges[answer.ticket] = (key, claim, service)
            self.start(head, serve_c, answer.ticket, now, attempt)

    def release_until(self, t: float) -> None:
        """Every release and finished prefill due by ``t``, in time order."""
        releases, prefills = self.releases, self.prefills
        while True:
            next_release = releases[0][0] if releases else math.inf
            if prefills and prefills[0][0] <= t and prefills[0][0] <= next_release:
                assert self.pd is not None
                self.pd.done(heapq.heappop(prefills))
                continue
            if next_release > t:
                return
            rel_t, _, ticket = heapq.heappop(releases)
            self.clock = rel_t
            assert isinstance(ticket, Ticket)
            self.ledger.release_now(ticket)
            if self.charges:
                self._charge(ticket)
            if self.queued:
                self.drain((ticket.cluster, ticket.class_name), rel_t)

    def give_back(self, ticket: object, now: float) -> None:
        """A ticket returned before its request ran (its prefill refused, its decode target
        gone): free at once, and waiters may take it."""
        assert isinstance(ticket, Ticket)
        self.clock = now
        self.ledger.release_now(ticket)
        self.charges.pop(ticket, None)  # it never ran: nothing served, nothing charged
        if self.queued:
            self.drain((ticket.cluster, ticket.class_name), now)

    def expire_next(self) -> None:
        """The earliest waiter's deadline: past it, a 429 with the hint for its position."""
        now, _, i = heapq.heappop(self.deadlines)
        self.release_until(now)
        self.clock = now
        found = self.queued.pop(i, None)
        if found is None:
            return  # admitted before its deadline
        key, qid, attempt = found
        q = self.queues[key]
        ahead, ahead_tokens = q.ahead_of(qid)
        q.remove(qid)
        demand = self.demand_of(i, key[0])
        assert demand is not None and not isinstance(demand, Reject)
        answer = self.ledger.usage_now(key[0], key[1], demand.limits)
        timed_out = verdict(demand, answer, self.retry_rng, ahead, ahead_tokens)
        assert isinstance(timed_out, Reject)
        self.refuse(i, timed_out, attempt, now)
        self.drain(key, now)  # the head may have changed

    # -- a request ----------------------------------------------------------------------------

    def decide(self, i: int, now: float, attempt: int) -> None:
        """Place request ``i`` by the policy, admit it where budgets apply, and start it."""
        s = self.sessions[i]
        new = not self.seen[s]
        cands = self.policy.route(self.fleet.view, s, new, now)
        if not cands:
            self.out.status[i] = NO_CLUSTER
            return
        serve_c, ticket = cands[0][0], None
        if self.bulkheads:
            klass = self.classes[self.t_class[self.templates[i]]]
            if klass.budget.enforced:
                admitted = self._admit(i, klass, cands, new, now, attempt)
                if admitted is None:
                    return
                serve_c, ticket = admitted
        self.start(i, serve_c, ticket, now, attempt)

    def _admit(
        self,
        i: int,
        klass: RequestClass,
        cands: Candidates,
        new: bool,
        now: float,
        attempt: int,
    ) -> tuple[int, object] | None:
        """The admission step on the charged primary (later candidates for a spilling policy's
        new session): where the request runs and its ticket, or None (queued, or refused)."""
        names = self.names
        primary = Route(Placement(names[cands[0][1]], None), klass)
        later = cands[1:] if self.policy.spill(new) else []
        elsewhere: Callable[[], Iterator[Route]] | None = None
        if later:

            def elsewhere() -> Iterator[Route]:
                return (Route(Placement(names[c], None), klass) for _s, c in later)

        wait = self.config.waits.get(klass.name, NO_WAIT) if self.waits else NO_WAIT
        step = steps.admission_step(self.t_in[self.templates[i]], primary, elsewhere, wait)
        outcome = self.admit(step, i, attempt, now)
        if outcome is QUEUED:
            return None
        if isinstance(outcome, Reject):
            self.refuse(i, outcome, attempt, now)
            return None
        if isinstance(outcome, Placed):
            placed_on = outcome.route.placement.primary
            serve_c = next(sc for sc, c in later if names[c] == placed_on)
            return serve_c, outcome.admitted.ticket
        if isinstance(outcome, Admitted):
            return cands[0][0], outcome.ticket
        return cands[0][0], None

    def start(self, i: int, serve_c: int, ticket: object, now: float, attempt: int = 0) -> None:
        """Request ``i`` runs on ``serve_c`` (or its prefill leg starts, P/D)."""
        s = self.sessions[i]
        tp = self.templates[i]
        if not self.seen[s]:
            self.seen[s] = 1
            if self.policy.spill(True):
                self.policy.placed(self.fleet.view, s, serve_c)
        off = self.offsets[i]
        # A list, not a tuple: serve() only indexes and slices it, and building a tuple
        # would cost a second pass.
        keys: Sequence[int] = [k + off for k in self.t_keys[tp]] if off else self.t_keys[tp]
        points = self.points
        if self.leaves and points is not None:
            serve_c = self._engine_leave(s, serve_c, points[s], now)
        if self.t_class[tp] in self.pd_classes:
            assert self.pd is not None
            if self.pd.start(i, tp, keys, serve_c, ticket, now, attempt):
                return
        got, first, done = self.fleet.states[serve_c].serve(
            keys, self.t_in[tp], self.t_out[tp], now, points[s] if points is not None else 0
        )
        self.served(i, serve_c, got, first, done, [ticket] if ticket is not None else [])
        if self.track:
            self.log.served(i, s, serve_c, got, now)

    def _engine_leave(self, s: int, serve_c: int, point: int, now: float) -> int:
        """engine_spill "leave": a session whose engine is full runs on its other hash cluster
        (the charge stays where admission put it)."""
        fleet = self.fleet
        view, state = fleet.view, fleet.states[serve_c]
        other = view.secondary[s] if serve_c == view.primary[s] else view.primary[s]
        if (
            isinstance(state, EngineCluster)
            and other >= 0
            and fleet.alive[other]
            and state.home_full(point, now)
        ):
            return other
        return serve_c

    def served(
        self, i: int, c: int, cached: int, first: float, done: float, tickets: Sequence[object]
    ) -> None:
        """Request ``i`` runs on cluster ``c``: its figures, and its tickets back at its end."""
        for t in tickets:
            heapq.heappush(self.releases, (done, next(self.seq), t))
        out = self.out
        out.ttft[i] = first - self.times[i]
        out.cached[i] = cached
        out.served_on[i] = c
        out.done_at[i] = done

    # -- the loop -------------------------------------------------------------------------------

    def run(self, progress: Callable[[int], None] | None = None) -> PolicyRun:
        count = self._arrivals(progress)
        self._after_arrivals()
        if progress is not None:
            progress(count)
        return self.result()

    def _arrivals(self, progress: Callable[[int], None] | None) -> int:
        """Arrivals, retries and deadlines in time order, until the last arrival."""
        times, retries, deadlines = self.times, self.retries, self.deadlines
        n, inf = len(times), math.inf
        ai = 0
        while True:
            next_retry = retries[0][0] if retries else inf
            next_arrival = times[ai] if ai < n else inf
            next_deadline = deadlines[0][0] if deadlines else inf
            if next_deadline < inf and next_deadline <= min(next_retry, next_arrival):
                self.expire_next()
                continue
            if next_retry < inf and next_retry < next_arrival:
                now, _, i, attempt = heapq.heappop(retries)
            elif ai < n:
                i, now, attempt = ai, times[ai], 0
                ai += 1
                if progress is not None and not ai % PROGRESS_EVERY:
                    progress(ai)
            else:
                return ai
            self.release_until(now)
            self.clock = now
            self.fleet.apply_until(now)
            self.decide(i, now, attempt)

    def _after_arrivals(self) -> None:
        """Releases still pending at the end are requests that finish after the last arrival;
        they admit waiters, and waiters time out (a retry after the last arrival still runs)."""
        releases, deadlines, retries, prefills = (
            self.releases,
            self.deadlines,
            self.retries,
            self.prefills,
        )
        inf = math.inf
        while releases or deadlines or retries or prefills:
            next_release = min(
                releases[0][0] if releases else inf, prefills[0][0] if prefills else inf
            )
            next_deadline = deadlines[0][0] if deadlines else inf
            next_retry = retries[0][0] if retries else inf
            if next_deadline <= min(next_release, next_retry):
                self.expire_next()
            elif next_retry <= next_release:
                now, _, i, attempt = heapq.heappop(retries)
                self.release_until(now)
                self.clock = now
                self.decide(i, now, attempt)
            else:
                self.release_until(next_release)

    def result(self) -> PolicyRun:
        out, policy, pd = self.out, self.policy, self.config.pd
        return PolicyRun(
            policy=self.policy_name,
            ttft=np.asarray(out.ttft, dtype=np.float64),
            cached=np.asarray(out.cached, dtype=np.int64),
            served_on=np.asarray(out.served_on, dtype=np.int16),
            rejections=np.asarray(out.rejections, dtype=np.int16),
            status=np.asarray(out.status, dtype=np.int16),
            failures=self.log.records,
            evictions=[s.evictions for s in self.fleet.states],
            spilled_sessions=int(getattr(policy, "spilled", 0)),
            leaked_tickets=self.ledger.held(),
            decisions=dict(getattr(policy, "kinds", {})),
            done_at=np.asarray(out.done_at, dtype=np.float64),
            transfer_s=np.asarray(out.transfer_s, dtype=np.float64) if pd is not None else None,
            prefill_tier=np.asarray(out.prefill_tier, dtype=np.int8) if pd is not None else None,
        )
