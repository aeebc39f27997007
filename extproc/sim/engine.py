"""The discrete-event loop: requests, 429 retries, budget releases and fleet events in time order.

Every policy runs over the same prepared :class:`Scenario` (same requests, same fleet, same
events), each with its own seeded RNG, so results do not depend on which policies ran or in
which process.

Admission is the gateway's own code path, not a copy: the simulator drives the processor's
admission steps (extproc/pipeline/step.py, ``admission_step`` and ``prefill_step``) with a
synchronous driver (extproc/sim/admission.py) over the in-memory ledger on the simulated
clock. A step answers with a ticket, a 413, or a 429 whose ``retry-after`` the simulated
client honours (up to ``max_retries`` times). Tickets are released when the request finishes
(its decode ends), as the ext_proc stream would end then.

A policy that waits (``Policy.waits``, the gateway's flow control) answers the step's
JoinQueue with the processor's wait-or-refuse policy (extproc/core/queue_policy.py) over its
own (cluster, class) ``FairQueue``s, with its class's ``SimConfig.waits``; a release lets the
queue's heads in, in order, while the ledger admits them; a waiter still queued at its
deadline gets the 429 with the hint for its position (and retries like any 429).

Events are exact, not time-stepped: each request's whole timeline is fixed when it is admitted
(``model.ClusterState.serve``), so there is nothing to advance between arrivals.

This module holds a run's inputs and outputs; the loop itself is extproc/sim/run.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np
import numpy.typing as npt

from extproc.core.endpoints import DEFAULT_BALANCE, DEFAULT_MIN_INFLIGHT
from extproc.core.fleet import RequestClass
from extproc.core.flow import FlowParams, WaitPolicy
from extproc.sim.engines import EngineSpill
from extproc.sim.events import Event, Kind, validate
from extproc.sim.model import ClusterSpec
from extproc.sim.pd import PdSim
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
    # The processor's fair order among tenants (fleet.yaml flow:, its tenant header and
    # fairness), for traffic that names tenants (Traffic.t_tenant); None: every waiter is one
    # shared tenant at unit cost.
    flow: FlowParams | None = None


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
    """One policy's run (extproc/sim/run.py): ``progress`` is told the arrivals so far."""
    from extproc.sim.run import Simulation  # it builds on this module's types

    return Simulation(scenario, config, policy_name).run(progress)


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
