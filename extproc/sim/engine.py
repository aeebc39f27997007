"""The discrete-event loop: requests, 429 retries, budget releases and fleet events in time order.

Every policy runs over the same prepared :class:`Scenario` (same requests, same fleet, same
events), each with its own seeded RNG, so results do not depend on which policies ran or in
which process.

Admission is the gateway's own code path, not a copy: the simulator drives the processor's
admission steps (extproc/pipeline/step.py, ``admission_step`` and ``prefill_step``) with a
synchronous driver (``perform``) over the in-memory ledger on the simulated clock. A step
answers with a ticket, a 413, or a 429 whose ``retry-after`` the simulated client honours (up
to ``max_retries`` times). Tickets are released when the request finishes (its decode ends),
as the ext_proc stream would end then.

A policy that waits (``Policy.waits``, the gateway's flow control) answers the step's
JoinQueue with the processor's wait-or-refuse policy (extproc/core/queue_policy.py) over its
own (cluster, class) ``FairQueue``s, with its class's ``SimConfig.waits``; a release lets the
queue's heads in, in order, while the ledger admits them; a waiter still queued at its
deadline gets the 429 with the hint for its position (and retries like any 429).

Events are exact, not time-stepped: each request's whole timeline is fixed when it is admitted
(``model.ClusterState.serve``), so there is nothing to advance between arrivals.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from random import Random
from types import MappingProxyType

import numpy as np
import numpy.typing as npt

from extproc.core.admission import Admitted, Demand, Reject, Ticket, plan, verdict
from extproc.core.decide import Route
from extproc.core.endpoints import DEFAULT_BALANCE, DEFAULT_MIN_INFLIGHT
from extproc.core.fleet import RequestClass
from extproc.core.flow import WaitPolicy
from extproc.core.placement import Placement
from extproc.ledger.memory import MemoryLedger
from extproc.pipeline import step as steps
from extproc.pipeline.step import Placed
from extproc.sim.admission import QUEUED, SimAdmission
from extproc.sim.engines import EngineCluster, EngineSpill, cluster_state
from extproc.sim.events import Event, Kind, validate
from extproc.sim.model import ClusterSpec
from extproc.sim.pd import PdSim
from extproc.sim.policies import FleetView, make_policy
from extproc.sim.traffic import Traffic
from extproc.sim.vector import EpochTables

# Progress is reported every this many requests: often enough for a smooth bar, rarely
# enough to cost nothing.
PROGRESS_EVERY = 1 << 16
# Final outcomes of a request.
SERVED, GAVE_UP_429, TOO_LARGE_413, NO_CLUSTER = 0, 429, 413, 503
NO_WAIT = WaitPolicy()


@dataclass(frozen=True, slots=True)
class Scenario:
    """Everything a run needs, shared read-only by every policy."""

    traffic: Traffic
    clusters: tuple[ClusterSpec, ...]  # base clusters first, then spares
    n_base: int
    events: tuple[Event, ...]  # sorted by time
    tables: EpochTables
    epoch_after: tuple[int, ...]  # per event: the membership epoch in force after it

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.clusters)

    def remapped(self) -> list[dict[str, object]]:
        """Per add/remove: the share of all sessions whose primary moved."""
        out: list[dict[str, object]] = []
        for ev, epoch in zip(self.events, self.epoch_after, strict=True):
            if ev.kind in (Kind.ADD, Kind.REMOVE):
                before_members = self.tables.members[epoch - 1]
                after_members = self.tables.members[epoch]
                n_before, n_after = int(before_members.sum()), int(after_members.sum())
                weights = np.array([c.weight for c in self.clusters])
                # The share rendezvous should move: the weight of the cluster that came or went.
                moved_cluster = self.names.index(ev.cluster)
                denom = weights[after_members].sum() if ev.kind is Kind.ADD else None
                if denom is None:
                    denom = weights[before_members].sum()
                out.append(
                    {
                        "event": str(ev),
                        "clusters_before": n_before,
                        "clusters_after": n_after,
                        "moved_share": self.tables.moved(epoch - 1, epoch),
                        "expected_share": float(weights[moved_cluster] / denom),
                        "one_over_n": 1.0 / (n_after if ev.kind is Kind.ADD else n_before),
                    }
                )
        return out


def memberships(
    names: Sequence[str],
    n_base: int,
    events: Sequence[Event],
    placeable: Sequence[bool] | None = None,
) -> tuple[list[npt.NDArray[np.bool_]], tuple[int, ...]]:
    """Membership per epoch (a new epoch at each add/remove) and the epoch after each event.
    ``placeable``: clusters the session placer may choose at all (P/D: not prefill-role ones)."""
    current = np.zeros(len(names), dtype=bool)
    current[:n_base] = True
    if placeable is not None:
        current &= np.asarray(placeable, dtype=bool)
    epochs = [current.copy()]
    after: list[int] = []
    index = {n: i for i, n in enumerate(names)}
    for ev in events:
        if ev.kind in (Kind.ADD, Kind.REMOVE):
            current[index[ev.cluster]] = ev.kind is Kind.ADD
            epochs.append(current.copy())
        after.append(len(epochs) - 1)
    return epochs, tuple(after)


def prepare(
    traffic: Traffic,
    clusters: tuple[ClusterSpec, ...],
    n_base: int,
    events: Sequence[Event],
    depth: int = 8,
    placeable: Sequence[bool] | None = None,
) -> Scenario:
    names = [c.name for c in clusters]
    ordered = tuple(sorted(events, key=lambda e: e.time_s))
    validate(ordered, names[:n_base], names[n_base:])
    members, after = memberships(names, n_base, ordered, placeable)
    tables = EpochTables(traffic.points, names, [c.weight for c in clusters], members, depth)
    return Scenario(traffic, clusters, n_base, ordered, tables, after)


def default_waits() -> Mapping[str, WaitPolicy]:
    """Flow control's waits in the simulator: short requests barely wait, longer ones may
    wait tens of seconds (the values ARCHITECTURE.md recommends)."""
    return MappingProxyType(
        {
            "short": WaitPolicy(0.5, 64),
            "medium": WaitPolicy(30.0, 64),
            "long": WaitPolicy(30.0, 64),
        }
    )


@dataclass(frozen=True, slots=True)
class SimConfig:
    classes: tuple[RequestClass, ...]  # budgets apply only to the bulkhead policies
    max_retries: int = 3
    spill_wait_s: float = 2.0
    seed: int = 0
    # Clusters of several engines: each session sticks to one (the processor's choice), or
    # requests go round robin over them (Envoy's default inside a cluster).
    sticky_engines: bool = True
    # A sticky session whose engine is over its bounded-load cap (sim/engines.py EngineSpill).
    engine_spill: EngineSpill = "within"
    # Its bound: core.endpoints.engine_cap's balance factor and floor (fleet.yaml engines).
    engine_balance: float = DEFAULT_BALANCE
    engine_min_inflight: int = DEFAULT_MIN_INFLIGHT
    # Per class, for the policies that wait (Policy.waits): how long and how many may wait.
    waits: Mapping[str, WaitPolicy] = field(default_factory=default_waits)
    # Disaggregated prefill/decode (extproc.sim.pd): roles, and the processor's compiled plan.
    pd: PdSim | None = None


@dataclass(slots=True)
class FailureRecord:
    cluster: int
    failed_at: float
    recovered_at: float = math.inf
    survivors: list[int] = field(default_factory=list)
    # Re-prefill tokens during the outage by the cluster that did them, and by session.
    spread: dict[int, int] = field(default_factory=dict)
    by_session: dict[int, int] = field(default_factory=dict)
    failback_tokens: int = 0
    lost_inflight: int = 0


@dataclass(slots=True)
class PolicyRun:
    """Raw per-request outcomes of one policy; ``report`` turns them into figures."""

    policy: str
    ttft: npt.NDArray[np.float64]  # NaN where not served; measured from the first attempt
    cached: npt.NDArray[np.int64]  # -1 where not served
    served_on: npt.NDArray[np.int16]  # -1 where not served
    rejections: npt.NDArray[np.int16]  # 429s this request received
    status: npt.NDArray[np.int16]
    failures: list[FailureRecord]
    evictions: list[int]
    spilled_sessions: int
    leaked_tickets: int
    # Decision kinds of extproc.core.affinity.place (primary, spilled, migrated, override, ...).
    decisions: dict[str, int] = field(default_factory=dict)
    # When each served request's decode ended (NaN where not served): throughput.
    done_at: npt.NDArray[np.float64] | None = None
    # P/D runs: the KV transfer of each disaggregated request (NaN otherwise: colocated, or not
    # served) and the topology relation of its pair (core.pd tier; -1 colocated prefill, -2
    # not a disaggregated class).
    transfer_s: npt.NDArray[np.float64] | None = None
    prefill_tier: npt.NDArray[np.int8] | None = None


def run_policy(
    scenario: Scenario,
    config: SimConfig,
    policy_name: str,
    progress: Callable[[int], None] | None = None,
) -> PolicyRun:
    traffic = scenario.traffic
    specs = scenario.clusters
    names = scenario.names
    block = traffic.base.block_tokens
    policy = make_policy(policy_name, config.spill_wait_s)
    rng = Random(f"sim:{config.seed}:{policy_name}")
    retry_rng = Random(f"retry:{config.seed}:{policy_name}")

    n_clusters = len(specs)
    sticky = config.sticky_engines
    engine_spill = config.engine_spill
    bound = (config.engine_balance, config.engine_min_inflight)
    states = [
        cluster_state(
            spec, block, sticky=sticky, spill=engine_spill, balance=bound[0], floor=bound[1]
        )
        for spec in specs
    ]
    leaves = engine_spill == "leave" and sticky
    member = [i < scenario.n_base for i in range(n_clusters)]
    alive = list(member)
    pd = config.pd
    # Clusters a policy may send a whole request to (P/D: prefill-role clusters only prefill).
    placeable = pd.placeable if pd is not None else (True,) * n_clusters
    table = scenario.tables.tables[0]
    view = FleetView(
        states=states,
        alive=alive,
        alive_ix=[i for i in range(n_clusters) if alive[i] and placeable[i]],
        table=table,
        primary=table[:, 0].tolist(),
        secondary=table[:, 1].tolist() if table.shape[1] > 1 else [-1] * len(table),
        rng=rng,
        member=member,
        names=names,
        points=traffic.points,
        weights=tuple(spec.weight for spec in specs),
        placeable=tuple(placeable),
    )

    clock = [0.0]
    ledger = MemoryLedger(lambda: clock[0])
    classes = config.classes
    bulkheads = policy.bulkheads and any(c.budget.enforced for c in classes)

    times = traffic.times
    templates = traffic.templates
    offsets = traffic.offsets
    sessions = traffic.sessions
    # The processor's placement point per session: only clusters of several engines use it.
    points = (
        traffic.points.tolist() if pd is not None or any(sp.engines > 1 for sp in specs) else None
    )
    ideal = traffic.ideal_cached
    t_keys, t_in, t_out, t_class = (
        traffic.t_keys,
        traffic.t_input,
        traffic.t_output,
        traffic.t_class,
    )
    n = len(times)

    ttft: list[float] = [math.nan] * n
    cached_out: list[int] = [-1] * n
    served_on: list[int] = [-1] * n
    rejections: list[int] = [0] * n
    status: list[int] = [SERVED] * n
    done_at: list[float] = [math.nan] * n
    transfer_s: list[float] = [math.nan] * n
    prefill_tier: list[int] = [-2] * n

    seen = bytearray(traffic.n_sessions)
    last_on: list[int] = [-1] * traffic.n_sessions
    last_t: list[float] = [-math.inf] * traffic.n_sessions
    crash_at: list[float] = [-math.inf] * n_clusters
    crash_ix: list[int] = [-1] * n_clusters
    failures: list[FailureRecord] = []
    displaced: dict[int, int] = {}
    track = any(e.kind is Kind.FAIL for e in scenario.events)

    events = scenario.events
    ev_times = [e.time_s for e in events]
    ev_i = 0
    n_ev = len(events)
    index = {name: i for i, name in enumerate(names)}

    # P/D (extproc.sim.pd): prefills in flight per prefill endpoint (the load the processor
    # counts), the endpoints the prober would find ready (those of live clusters), and the
    # prefills under way: (KV ready at, seq, request, decode cluster, tier, endpoint, keys,
    # prefill-cached tokens, decode ticket, prefill ticket).
    pd_classes = pd.disaggregated if pd is not None else frozenset()
    pd_endpoints = (
        {ep for pool in pd.plan.pools.values() for ep in pool} if pd is not None else set()
    )
    pd_inflight: dict[str, int] = {}
    pd_ready = [frozenset(ep.address for ep in pd_endpoints if alive[index[ep.cluster]])]
    prefills: list[tuple[float, int, int, int, int, str, Sequence[int], int, object, object]] = []

    def apply(ev_no: int, now: float) -> None:
        ev = events[ev_no]
        c = index[ev.cluster]
        if ev.kind is Kind.FAIL:
            record = FailureRecord(c, now, lost_inflight=states[c].inflight(now))
            states[c].crash()
            alive[c] = False
            record.survivors = [i for i in range(n_clusters) if alive[i]]
            crash_at[c] = now
            crash_ix[c] = len(failures)
            failures.append(record)
        elif ev.kind is Kind.RECOVER:
            states[c].restart(now)
            alive[c] = True
            if crash_ix[c] >= 0:
                failures[crash_ix[c]].recovered_at = now
        else:
            if ev.kind is Kind.ADD:
                states[c] = cluster_state(specs[c], block, now, sticky, engine_spill, *bound)
            member[c] = alive[c] = ev.kind is Kind.ADD
            tab = scenario.tables.tables[scenario.epoch_after[ev_no]]
            view.table = tab
            view.primary = tab[:, 0].tolist()
            view.secondary = tab[:, 1].tolist() if tab.shape[1] > 1 else [-1] * len(tab)
        view.alive_ix = [i for i in range(n_clusters) if alive[i] and placeable[i]]
        pd_ready[0] = frozenset(ep.address for ep in pd_endpoints if alive[index[ep.cluster]])
        policy.refresh(view)

    releases: list[tuple[float, int, object]] = []
    retries: list[tuple[float, int, int, int]] = []
    # Flow control (policy.waits): per (cluster, class) queues of request indices, and each
    # waiter's deadline; queued[i] = (compartment, queue id, attempt).
    waits = policy.waits and bulkheads
    deadlines: list[tuple[float, int, int]] = []
    queued: dict[int, tuple[tuple[str, str], int, int]] = {}
    seq = 0
    ai = 0
    done_count = 0
    route = policy.route
    spill = policy.spill

    def refuse(i: int, refusal: Reject, attempt: int, now: float) -> None:
        nonlocal seq
        if refusal.status == 429 and attempt < config.max_retries:
            rejections[i] += 1
            seq += 1
            wait = float(refusal.retry_after_s or 1)
            heapq.heappush(retries, (now + wait, seq, i, attempt + 1))
        else:
            if refusal.status == 429:
                rejections[i] += 1
            status[i] = GAVE_UP_429 if refusal.status == 429 else TOO_LARGE_413

    def demand_of(i: int, cluster: str) -> Demand | Reject | None:
        klass = classes[t_class[templates[i]]]
        return plan(t_in[templates[i]], Route(Placement(cluster, None), klass))

    # The request being decided, for the needs its steps yield: (attempt, now).
    current: list[float] = [0, 0.0]

    def on_queued(i: int, key: tuple[str, str], qid: int, wait: WaitPolicy) -> None:
        nonlocal seq
        queued[i] = (key, qid, int(current[0]))
        seq += 1
        heapq.heappush(deadlines, (current[1] + wait.max_wait_s, seq, i))

    def on_give_back(ticket: Ticket) -> None:
        give_back(ticket, current[1])

    driver = SimAdmission(ledger, retry_rng, on_queued, on_give_back)
    queues = driver.queues

    def drain(key: tuple[str, str], now: float) -> None:
        """Budget freed on ``key``: queue heads take it, in order, while it admits them."""
        q = queues.get(key)
        while q is not None:
            head = q.head()
            if head is None:
                return
            demand = demand_of(head, key[0])
            assert isinstance(demand, Demand)  # only budgeted requests are queued
            answer = ledger.reserve_now(demand)
            if not answer.granted or answer.ticket is None:
                return
            q.pop()
            attempt = queued.pop(head)[2]
            serve_c = index[key[0]]
            if not alive[serve_c]:
                status[head] = NO_CLUSTER
                ledger.release_now(answer.ticket)
                continue
            start(head, serve_c, answer.ticket, now, attempt)

    def release_until(t: float) -> None:
        while True:
            next_release = releases[0][0] if releases else math.inf
            if prefills and prefills[0][0] <= t and prefills[0][0] <= next_release:
                prefilled(heapq.heappop(prefills))
                continue
            if next_release > t:
                return
            rel_t, _, ticket = heapq.heappop(releases)
            clock[0] = rel_t
            assert isinstance(ticket, Ticket)
            ledger.release_now(ticket)
            if queued:
                drain((ticket.cluster, ticket.class_name), rel_t)

    def give_back(ticket: object, now: float) -> None:
        """A ticket returned before its request ran (its prefill refused, its decode target
        gone): free at once, and waiters may take it."""
        assert isinstance(ticket, Ticket)
        clock[0] = now
        ledger.release_now(ticket)
        if queued:
            drain((ticket.cluster, ticket.class_name), now)

    def start_pd(
        i: int,
        tp: int,
        keys: Sequence[int],
        decode_c: int,
        ticket: object,
        now: float,
        attempt: int,
    ) -> bool:
        """A disaggregated request: the prefiller the processor would name, its prefill pool's
        budget, then the prefill on it; False when the decode target prefills it itself."""
        nonlocal seq
        assert pd is not None and points is not None
        klass = classes[t_class[tp]]
        point = points[sessions[i]]
        choice = pd.plan.choose(klass.name, names[decode_c], point, pd_inflight, pd_ready[0])
        if choice is None or choice.endpoint is None:
            prefill_tier[i] = -1
            return False
        endpoint = choice.endpoint
        pticket = None
        budget = pd.plan.prefill_classes[klass.name]
        if policy.bulkheads and budget.budget.enforced:
            prefill_route = Route(Placement(endpoint.cluster, None), budget)
            held = ticket if isinstance(ticket, Ticket) else None
            current[:] = (attempt, now)
            outcome = driver.admit(steps.prefill_step(t_in[tp], prefill_route, held), i)
            if isinstance(outcome, Reject):
                # As the processor: the decode reservation went back (the step's GiveBack)
                # and the 429 is the prefill pool's.
                refuse(i, outcome, attempt, now)
                return True
            pticket = outcome
        pd_inflight[endpoint.address] = pd_inflight.get(endpoint.address, 0) + 1
        # The prefill leg: one token out, its KV ready when that token is.
        pcached, ready_at, _ = states[index[endpoint.cluster]].serve(keys, t_in[tp], 1, now, point)
        seq += 1
        heapq.heappush(
            prefills,
            (
                ready_at,
                seq,
                i,
                decode_c,
                choice.tier,
                endpoint.address,
                keys,
                pcached,
                ticket,
                pticket,
            ),
        )
        return True

    def prefilled(
        entry: tuple[float, int, int, int, int, str, Sequence[int], int, object, object],
    ) -> None:
        """The prefill is done: the KV moves to the decode cluster, which decodes."""
        at, _, i, decode_c, tier, address, keys, pcached, ticket, pticket = entry
        assert pd is not None and points is not None
        clock[0] = at
        pd_inflight[address] -= 1
        tickets = [t for t in (ticket, pticket) if t is not None]
        if not alive[decode_c]:
            status[i] = NO_CLUSTER
            for t in tickets:
                give_back(t, at)
            return
        tp = templates[i]
        per_token = pd.plan.kv_bytes_per_token / pd.plan.topology.bandwidth(tier)
        got, first, done = states[decode_c].serve_remote(
            keys, t_in[tp], t_out[tp], at, per_token, points[sessions[i]]
        )
        served(i, decode_c, pcached, first, done, tickets)
        transfer_s[i] = (t_in[tp] - got) * per_token
        prefill_tier[i] = tier

    def served(
        i: int, c: int, cached: int, first: float, done: float, tickets: Sequence[object]
    ) -> None:
        """Request ``i`` runs on cluster ``c``: its figures, and its tickets back at its end."""
        nonlocal seq
        for t in tickets:
            seq += 1
            heapq.heappush(releases, (done, seq, t))
        ttft[i] = first - times[i]
        cached_out[i] = cached
        served_on[i] = c
        done_at[i] = done

    def start(i: int, serve_c: int, ticket: object, now: float, attempt: int = 0) -> None:
        s = sessions[i]
        tp = templates[i]
        if not seen[s]:
            seen[s] = 1
            if spill(True):
                policy.placed(view, s, serve_c)
        off = offsets[i]
        # A list, not a tuple: serve() only indexes and slices it, and building a tuple
        # would cost a second pass.
        keys: Sequence[int] = [k + off for k in t_keys[tp]] if off else t_keys[tp]
        if leaves and points is not None:
            state = states[serve_c]
            other = view.secondary[s] if serve_c == view.primary[s] else view.primary[s]
            if (
                isinstance(state, EngineCluster)
                and other >= 0
                and alive[other]
                and state.home_full(points[s], now)
            ):
                serve_c = other  # the charge stays where admission put it
        if t_class[tp] in pd_classes and start_pd(i, tp, keys, serve_c, ticket, now, attempt):
            return
        got, first, done = states[serve_c].serve(
            keys, t_in[tp], t_out[tp], now, points[s] if points is not None else 0
        )
        served(i, serve_c, got, first, done, [ticket] if ticket is not None else [])
        if track:
            j = displaced.get(s)
            if j is None:
                was = last_on[s]
                if was >= 0 and crash_at[was] > last_t[s]:
                    j = displaced[s] = crash_ix[was]
            if j is not None:
                record = failures[j]
                refill = max(0, ideal[i] - got)
                if now < record.recovered_at:
                    record.spread[serve_c] = record.spread.get(serve_c, 0) + refill
                    record.by_session[s] = record.by_session.get(s, 0) + refill
                else:
                    record.failback_tokens += refill
                    del displaced[s]
            last_on[s] = serve_c
            last_t[s] = now

    def expire_next() -> None:
        """The earliest waiter's deadline: past it, a 429 with the hint for its position."""
        now, _, i = heapq.heappop(deadlines)
        release_until(now)
        clock[0] = now
        found = queued.pop(i, None)
        if found is None:
            return  # admitted before its deadline
        key, qid, attempt = found
        q = queues[key]
        ahead, ahead_tokens = q.ahead_of(qid)
        q.remove(qid)
        demand = demand_of(i, key[0])
        assert demand is not None and not isinstance(demand, Reject)
        answer = ledger.usage_now(key[0], key[1], demand.limits)
        timed_out = verdict(demand, answer, retry_rng, ahead, ahead_tokens)
        assert isinstance(timed_out, Reject)
        refuse(i, timed_out, attempt, now)
        drain(key, now)  # the head may have changed

    def decide(i: int, now: float, attempt: int) -> None:
        s = sessions[i]
        tp = templates[i]
        new = not seen[s]
        cands = route(view, s, new, now)
        if not cands:
            status[i] = NO_CLUSTER
            return
        serve_c = cands[0][0]
        ticket = None
        if bulkheads:
            klass = classes[t_class[tp]]
            if klass.budget.enforced:
                primary = Route(Placement(names[cands[0][1]], None), klass)
                later = cands[1:] if spill(new) else []
                elsewhere = None
                if later:

                    def elsewhere() -> Iterator[Route]:
                        return (Route(Placement(names[c], None), klass) for _s, c in later)

                wait = config.waits.get(klass.name, NO_WAIT) if waits else NO_WAIT
                current[:] = (attempt, now)
                outcome = driver.admit(steps.admission_step(t_in[tp], primary, elsewhere, wait), i)
                if outcome is QUEUED:
                    return
                if isinstance(outcome, Reject):
                    refuse(i, outcome, attempt, now)
                    return
                if isinstance(outcome, Placed):
                    placed_on = outcome.route.placement.primary
                    serve_c = next(sc for sc, c in later if names[c] == placed_on)
                    ticket = outcome.admitted.ticket
                elif isinstance(outcome, Admitted):
                    ticket = outcome.ticket
        start(i, serve_c, ticket, now, attempt)

    inf = math.inf
    while True:
        next_retry = retries[0][0] if retries else inf
        next_arrival = times[ai] if ai < n else inf
        next_deadline = deadlines[0][0] if deadlines else inf
        if next_deadline < inf and next_deadline <= min(next_retry, next_arrival):
            expire_next()
            continue
        if next_retry < inf and next_retry < next_arrival:
            now, _, i, attempt = heapq.heappop(retries)
        elif ai < n:
            i = ai
            now = times[ai]
            attempt = 0
            ai += 1
            done_count += 1
            if progress is not None and not done_count % PROGRESS_EVERY:
                progress(done_count)
        else:
            break
        release_until(now)
        clock[0] = now
        while ev_i < n_ev and ev_times[ev_i] <= now:
            apply(ev_i, ev_times[ev_i])
            ev_i += 1
        decide(i, now, attempt)

    # Releases still pending at the end are requests that finish after the last arrival;
    # they admit waiters, and waiters time out (a retry after the last arrival still runs).
    while releases or deadlines or retries or prefills:
        next_release = min(releases[0][0] if releases else inf, prefills[0][0] if prefills else inf)
        next_deadline = deadlines[0][0] if deadlines else inf
        next_retry = retries[0][0] if retries else inf
        if next_deadline <= min(next_release, next_retry):
            expire_next()
        elif next_retry <= next_release:
            now, _, i, attempt = heapq.heappop(retries)
            release_until(now)
            clock[0] = now
            decide(i, now, attempt)
        else:
            release_until(next_release)
    if progress is not None:
        progress(done_count)
    spilled = getattr(policy, "spilled", 0)
    return PolicyRun(
        policy=policy_name,
        ttft=np.asarray(ttft, dtype=np.float64),
        cached=np.asarray(cached_out, dtype=np.int64),
        served_on=np.asarray(served_on, dtype=np.int16),
        rejections=np.asarray(rejections, dtype=np.int16),
        status=np.asarray(status, dtype=np.int16),
        failures=failures,
        evictions=[s.evictions for s in states],
        spilled_sessions=int(spilled),
        leaked_tickets=ledger.held(),
        decisions=dict(getattr(policy, "kinds", {})),
        done_at=np.asarray(done_at, dtype=np.float64),
        transfer_s=np.asarray(transfer_s, dtype=np.float64) if pd is not None else None,
        prefill_tier=np.asarray(prefill_tier, dtype=np.int8) if pd is not None else None,
    )


def run_all(
    scenario: Scenario,
    config: SimConfig,
    policies: Sequence[str],
    jobs: int = 1,
    progress: Callable[[Mapping[str, int]], None] | None = None,
) -> dict[str, PolicyRun]:
    """Run each policy; with ``jobs > 1`` in forked worker processes (one policy each)."""
    if jobs <= 1 or len(policies) <= 1:
        done: dict[str, int] = dict.fromkeys(policies, 0)
        out: dict[str, PolicyRun] = {}
        for name in policies:

            def tick(count: int, name: str = name) -> None:
                done[name] = count
                if progress is not None:
                    progress(done)

            out[name] = run_policy(scenario, config, name, tick)
        return out
    from extproc.sim.parallel import run_forked

    return run_forked(scenario, config, policies, jobs, progress)
