"""Routing policies compared by the simulator, registered by name in one table (``POLICIES``).

A policy answers, per request, an ordered list of ``(serve, charge)`` cluster candidates:
``serve`` runs the request; ``charge`` is the cluster whose class budget admission charges —
what the gateway calls the primary. They differ on failover: the gateway does not know a
cluster is down (Envoy's health checks move the request to the secondary), so it still charges
the hash primary. The engine tries candidates in order only when ``spill`` says so; otherwise
the first one is the answer.

The hash policies read the core's rendezvous placement for the current membership epoch
(``vector.EpochTables``: column 0 = ``Rendezvous.top2().primary``, column 1 = secondary).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from random import Random
from types import MappingProxyType

import numpy as np
import numpy.typing as npt

from extproc.config.runtime import DEFAULT_BALANCE_FACTOR, Runtime, affinity_params
from extproc.config.schema import AffinityConfig
from extproc.core.affinity import (
    AffinityParams,
    Override,
    SessionView,
    place,
)
from extproc.core.keys import KeySource
from extproc.core.load import ClusterLoad, FleetSnapshot
from extproc.core.placement import Placement
from extproc.core.relief import ReliefParams
from extproc.pipeline.fleet_state import LoadTable, SessionMemory, kv_relief
from extproc.pipeline.placement_step import (
    BoundedInputs,
    BoundedPlacement,
    LookUpSession,
    NotePlacement,
    PlacementNeed,
    balance_half_life,
    bounded_step,
)
from extproc.pipeline.relief import ReliefTable, relief_view
from extproc.pipeline.step import drive
from extproc.sim.model import ClusterState
from extproc.sim.vector import scores, seeds_of

Candidates = list[tuple[int, int]]


@dataclass(slots=True)
class FleetView:
    """What policies may read: the engine owns and updates it."""

    states: list[ClusterState]
    alive: list[bool]  # in the fleet and not failed
    alive_ix: list[int]
    table: npt.NDArray[np.int32]  # (sessions, depth): the current epoch's preference order
    primary: list[int]
    secondary: list[int]
    rng: Random
    member: list[bool] = field(default_factory=list)
    names: tuple[str, ...] = ()
    # Per session: the processor's placement point (what the hash tables were ranked from).
    points: npt.NDArray[np.uint64] | None = None
    weights: tuple[float, ...] = ()
    # Clusters the session placer may choose at all (P/D: not prefill-role ones).
    placeable: tuple[bool, ...] = ()


class Policy:
    """Base: subclasses set the class attributes and implement ``route``."""

    name = ""
    description = ""
    bulkheads = False
    uses_hash = False
    # Over-budget requests wait in a queue (extproc.core.flow) before their 429.
    waits = False

    def __init__(self, spill_wait_s: float = 2.0) -> None:
        self.spill_wait_s = spill_wait_s

    def route(self, view: FleetView, session: int, new: bool, now: float) -> Candidates:
        raise NotImplementedError

    def spill(self, new: bool) -> bool:
        """Whether the engine should try further candidates when one refuses admission."""
        return False

    def placed(self, view: FleetView, session: int, cluster: int) -> None:
        """Told where a spilled new session finally went."""

    def refresh(self, view: FleetView) -> None:
        """Called after every fleet change (failure, recovery, membership)."""


def _random_alive(view: FleetView, charge: int) -> Candidates:
    # Envoy's fallback route (an aggregate of every cluster) lands anywhere healthy.
    if not view.alive_ix:
        return []
    return [(view.alive_ix[view.rng.randrange(len(view.alive_ix))], charge)]


class RoundRobin(Policy):
    name = "round-robin"
    description = "Envoy ROUND_ROBIN over healthy clusters"

    def __init__(self, spill_wait_s: float = 2.0) -> None:
        super().__init__(spill_wait_s)
        self._next = 0

    def route(self, view: FleetView, session: int, new: bool, now: float) -> Candidates:
        alive = view.alive_ix
        if not alive:
            return []
        self._next = (self._next + 1) % len(alive)
        c = alive[self._next]
        return [(c, c)]


class LeastLoaded(Policy):
    name = "least-loaded"
    description = "Envoy LEAST_REQUEST: fewer active requests of two random healthy clusters"

    def route(self, view: FleetView, session: int, new: bool, now: float) -> Candidates:
        alive = view.alive_ix
        if not alive:
            return []
        # Power of two choices, Envoy's default choice_count: as good as a full scan in
        # balance, and what a stock proxy does.
        a = alive[view.rng.randrange(len(alive))]
        b = alive[view.rng.randrange(len(alive))]
        states = view.states
        c = b if states[b].inflight(now) < states[a].inflight(now) else a
        return [(c, c)]


class PrimaryOnly(Policy):
    name = "hash-primary"
    description = "rendezvous primary only; a dead primary falls back to any healthy cluster"
    uses_hash = True

    def route(self, view: FleetView, session: int, new: bool, now: float) -> Candidates:
        p = view.primary[session]
        if view.alive[p]:
            return [(p, p)]
        return _random_alive(view, p)


class PrimarySecondary(Policy):
    name = "hash-2"
    description = "rendezvous primary + pre-assigned secondary (Envoy aggregate cluster)"
    uses_hash = True

    def route(self, view: FleetView, session: int, new: bool, now: float) -> Candidates:
        p = view.primary[session]
        alive = view.alive
        if alive[p]:
            return [(p, p)]
        s = view.secondary[session]
        if s >= 0 and alive[s]:
            return [(s, p)]
        for c in view.table[session].tolist()[2:]:
            if c >= 0 and alive[c]:
                return [(c, p)]
        return _random_alive(view, p)


class Bulkheads(PrimarySecondary):
    name = "hash-2+bulkheads"
    description = "hash-2 with per-class budgets per cluster (429 + retry-after)"
    bulkheads = True


class Spill(Bulkheads):
    name = "hash-2+bulkheads+spill"
    description = (
        "bulkheads; a new session whose primary is saturated (queue wait over the spill "
        "threshold, or its class budget full) starts on the next candidate in hash order"
    )

    def __init__(self, spill_wait_s: float = 2.0) -> None:
        super().__init__(spill_wait_s)
        # Sessions placed off their primary: the gateway would keep this table in its ledger.
        self._moved: dict[int, int] = {}

    def spill(self, new: bool) -> bool:
        return new

    def route(self, view: FleetView, session: int, new: bool, now: float) -> Candidates:
        if not new:
            home = self._moved.get(session)
            if home is not None and view.alive[home]:
                return [(home, home)]
            return super().route(view, session, new, now)
        alive, states = view.alive, view.states
        ranked = [c for c in view.table[session].tolist() if c >= 0 and alive[c]]
        if not ranked:
            return super().route(view, session, new, now)
        ok = [c for c in ranked if states[c].queue_wait(now) <= self.spill_wait_s]
        busy = sorted((c for c in ranked if c not in ok), key=lambda c: states[c].queue_wait(now))
        return [(c, c) for c in ok + busy]

    def placed(self, view: FleetView, session: int, cluster: int) -> None:
        if cluster != view.primary[session]:
            self._moved[session] = cluster

    def refresh(self, view: FleetView) -> None:
        # A removed cluster's spilled sessions go back to hash placement.
        self._moved = {s: c for s, c in self._moved.items() if view.member[c]}

    @property
    def spilled(self) -> int:
        return len(self._moved)


class Flow(Spill):
    """The gateway's flow control (extproc.core.flow, ARCHITECTURE.md "Flow control"): a new
    session is tried on its candidates in hash order and starts on the first whose class
    budget has room (remembered, as the gateway's override); an existing session stays on its
    cluster; a request refused everywhere waits in its primary's (cluster, class) queue if the
    estimated wait fits its class's max wait (``SimConfig.waits``), else gets its 429. Unlike
    ``Spill`` it does not read queue waits: only the budget moves a new session."""

    name = "hash-2+bulkheads+flow"
    description = (
        "bulkheads + flow control: new sessions placed on the next hash candidate with budget, "
        "then a bounded wait in a fair queue, then a 429"
    )
    waits = True

    def route(self, view: FleetView, session: int, new: bool, now: float) -> Candidates:
        if not new:
            return super().route(view, session, new, now)
        alive = view.alive
        ranked = [c for c in view.table[session].tolist() if c >= 0 and alive[c]]
        if not ranked:
            return PrimarySecondary.route(self, view, session, new, now)
        return [(c, c) for c in ranked]


class CoreAffinity(Bulkheads):
    """The gateway's own load-aware affinity, ``extproc.core.affinity.place``, called per request.

    Fed as the shell feeds it: the session's candidates in hash order (the first ``depth`` of
    ``Rendezvous.ranked``, from the epoch table), a snapshot of each candidate's in-flight
    requests (what this gateway routed there and has not seen finish) and health, whether the
    session was seen within ``new_session_ttl_s``, and its override. No load reports (the
    simulated clusters send none), so KV pressure never triggers; saturation and health do.
    """

    name = "hash-2+bulkheads+affinity"
    description = (
        "bulkheads + extproc.core.affinity.place: new sessions spill off saturated primaries, "
        "sessions migrate off failed clusters, overrides with TTL"
    )

    def __init__(self, spill_wait_s: float = 2.0) -> None:
        super().__init__(spill_wait_s)
        self.params = AffinityParams(enabled=True)
        self._seen_at: dict[int, float] = {}
        self._overrides: dict[int, Override] = {}
        self._index: dict[str, int] = {}
        self.kinds: dict[str, int] = {}

    def route(self, view: FleetView, session: int, new: bool, now: float) -> Candidates:
        if not self._index:
            self._index = {n: i for i, n in enumerate(view.names)}
        alive, states, names = view.alive, view.states, view.names
        ranked_ix = [c for c in view.table[session].tolist() if c >= 0]
        if not ranked_ix:
            return super().route(view, session, new, now)
        snapshot = FleetSnapshot(
            {
                names[c]: ClusterLoad(inflight=states[c].inflight(now), healthy=alive[c])
                for c in ranked_ix
            }
        )
        seen_at = self._seen_at.get(session)
        seen = seen_at is not None and now - seen_at <= self.params.new_session_ttl_s
        decision = place(
            # Simulated sessions carry explicit ids: a header key, never hot-spread.
            KeySource.HEADER,
            [names[c] for c in ranked_ix],
            snapshot,
            SessionView(seen, self._overrides.get(session)),
            now,
            self.params,
        )
        self._seen_at[session] = now
        if decision.override_to_write is not None:
            self._overrides[session] = decision.override_to_write
        self.kinds[decision.kind] = self.kinds.get(decision.kind, 0) + 1
        chosen = self._index[decision.placement.primary]
        if alive[chosen]:
            return [(chosen, chosen)]
        # Every candidate is down: Envoy's failover, then its catch-all route.
        secondary = decision.placement.secondary
        if secondary is not None and alive[self._index[secondary]]:
            return [(self._index[secondary], chosen)]
        return _random_alive(view, chosen)

    @property
    def spilled(self) -> int:
        return self.kinds.get("spilled", 0)


class ProductDefault(PrimarySecondary):
    """The processor's default placement (fleet.yaml with no ``affinity:`` section, one replica
    or Redis): pure hashing, plus bounded-load placement of new sessions without load-aware
    affinity: the processor's own bounded placement step
    (extproc/pipeline/placement_step.py, ``bounded_step``), driven here synchronously as
    ``Pipeline._follow_override`` drives it live.

    - The session memory and the load signal are the pipeline's own objects
      (``extproc.pipeline.fleet_state``): ``SessionMemory`` marks each request's session seen
      (new = not seen within ``new_session_ttl_s``) and holds overrides with their TTL;
      ``LoadTable.placed`` counts every placed request on the cluster it was placed on, decayed
      with ``balance_half_life_s``. Parameters: the config's defaults, ``balance_factor``
      ``DEFAULT_BALANCE_FACTOR``.
    - Hot clusters (``relief``: the compiled relief pace, ``Runtime.relief``; None in the
      simulator's runs, as in the default config): the load table's GPU verdicts and KV
      reports, and the pipeline's relief table, so a hot cluster takes no new session and its
      least active sessions leave.
    - Candidates: every cluster in the fleet, in hash order (the core's rendezvous, as the
      simulator's tables rank them), ranked only when a new session is judged.
    - Health: with load-aware affinity off the processor asks for no response phase, so it never
      learns of a failover, and in route mode it probes no endpoint: every candidate looks
      healthy to it. Envoy then fails a request on a dead cluster over to the decision's
      secondary, else to its catch-all route.
    - No class budgets (``bulkheads`` False): the product enforces them only where configured.
    """

    name = "product-default"
    description = (
        "the processor's default: hash-2, a new session over balance_factor (1.1) x the mean "
        "recent placements starts on the next candidate in hash order and its turns follow "
        "(extproc.core.affinity.place_bounded; load-aware affinity off)"
    )

    def __init__(self, spill_wait_s: float = 2.0, relief: ReliefParams | None = None) -> None:
        super().__init__(spill_wait_s)
        config = AffinityConfig()
        self.params = affinity_params(config, DEFAULT_BALANCE_FACTOR)
        self.load = LoadTable()
        self.memory = SessionMemory(config.max_sessions)
        # GPU health's (or KV relief's) pace, as the processor compiles it; None: no cluster is
        # ever hot (fleet.yaml without gpus or engine metrics, as the simulator's runs).
        self.relief_params = relief
        self.relief = ReliefTable(config.max_sessions)
        self.kinds: dict[str, int] = {}
        self._index: dict[str, int] = {}
        self._members: tuple[bool, ...] = ()
        self._candidates: frozenset[str] = frozenset()
        self._seeds: npt.NDArray[np.uint64] | None = None
        self._weights: npt.NDArray[np.float64] | None = None

    @classmethod
    def of_runtime(cls, runtime: Runtime, spill_wait_s: float = 2.0) -> ProductDefault:
        """This policy with a compiled fleet.yaml's placement settings instead of the defaults
        (load-aware affinity off): its affinity parameters and session bound, GPU health's pace
        and KV relief."""
        if runtime.affinity.enabled:
            raise ValueError("product-default places with load-aware affinity off")
        policy = cls(spill_wait_s, runtime.relief)
        policy.params = runtime.affinity
        policy.memory = SessionMemory(runtime.max_sessions)
        policy.relief = ReliefTable(runtime.max_sessions)
        policy.load.kv_relief = kv_relief(runtime)
        return policy

    def refresh(self, view: FleetView) -> None:
        placeable = view.placeable or (True,) * len(view.names)
        members = tuple(m and p for m, p in zip(view.member, placeable, strict=True))
        if members != self._members:
            self._members = members
            self._candidates = frozenset(n for n, m in zip(view.names, members, strict=True) if m)

    def _ranked(self, view: FleetView, session: int) -> list[str]:
        """The session's candidates in hash order: every member, as ``Rendezvous.ranked``."""
        assert view.points is not None, "product-default needs the sessions' points"
        if self._seeds is None:
            self._seeds = seeds_of(view.names)
            weights = view.weights or (1.0,) * len(view.names)
            # Same rule as vector.ranking: equal weights take the logarithm-free path.
            self._weights = None if len(set(weights)) == 1 else np.asarray(weights)
        row = scores(view.points[session : session + 1], self._seeds, self._weights)[0]
        members = self._members
        names = view.names
        return [names[c] for c in np.argsort(-row, kind="stable").tolist() if members[c]]

    def decide(self, view: FleetView, session: int, now: float) -> BoundedPlacement:
        """The processor's decision for this request, (primary, secondary) and its kind: the
        bounded placement step (extproc/pipeline/placement_step.py) driven over this policy's
        session memory, load table and relief table."""
        if not self._index:
            self._index = {n: i for i, n in enumerate(view.names)}
            self.refresh(view)
        names = view.names
        p, s = view.primary[session], view.secondary[session]
        half_life = balance_half_life(self.params)
        hot = self.load.hot(now) if self.relief_params is not None else frozenset()

        def loads(ranked: Sequence[str]) -> FleetSnapshot:
            return self.load.snapshot(ranked, now, None, half_life)

        inputs = BoundedInputs(
            Placement(names[p], names[s] if s >= 0 else None),
            self._candidates,
            lambda: self._ranked(view, session),
            loads,
            hot,
        )
        # The session's 16-byte digest in the processor; any injective key does here.
        key = session.to_bytes(8, "little")

        def perform(need: PlacementNeed) -> SessionView | None:
            if isinstance(need, LookUpSession):
                return self._look_up(key, need.hash_primary, now)
            self._note(key, need, now)
            return None

        outcome: BoundedPlacement = drive(
            bounded_step(inputs, inputs.hashed, now, self.params), perform
        )
        self.kinds[outcome.decision.kind] = self.kinds.get(outcome.decision.kind, 0) + 1
        return outcome

    def _look_up(self, key: bytes, hash_primary: str, now: float) -> SessionView:
        ttl = self.params.new_session_ttl_s
        view = SessionView(self.memory.touch(key, now, ttl), self.memory.override(key, now))
        if self.relief_params is None:
            return view
        return relief_view(
            self.relief, self.load, self.relief_params, key, view, hash_primary, now, ttl
        )

    def _note(self, key: bytes, need: NotePlacement, now: float) -> None:
        half_life = balance_half_life(self.params)
        if half_life is not None:
            self.load.placed(need.cluster, now, half_life)
        if self.relief_params is not None:
            ttl = self.params.new_session_ttl_s
            self.relief.seen(need.cluster, key, now, ttl, self.relief_params)
        override = need.decision.override_to_write
        if override is not None:
            self.memory.write(key, override, now)

    def route(self, view: FleetView, session: int, new: bool, now: float) -> Candidates:
        placement = self.decide(view, session, now).placement
        chosen = self._index[placement.primary]
        if view.alive[chosen]:
            return [(chosen, chosen)]
        # Envoy's failover: the decision's secondary, then the catch-all route.
        secondary = placement.secondary
        if secondary is not None and view.alive[self._index[secondary]]:
            return [(self._index[secondary], chosen)]
        return _random_alive(view, chosen)

    @property
    def spilled(self) -> int:
        return self.kinds.get("spilled", 0)


# name -> policy class. The whole policy surface, in one visible, read-only table.
POLICIES: Mapping[str, type[Policy]] = MappingProxyType(
    {
        cls.name: cls
        for cls in (
            RoundRobin,
            LeastLoaded,
            PrimaryOnly,
            PrimarySecondary,
            ProductDefault,
            Bulkheads,
            Spill,
            CoreAffinity,
            Flow,
        )
    }
)


def make_policy(name: str, spill_wait_s: float) -> Policy:
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return cls(spill_wait_s)
