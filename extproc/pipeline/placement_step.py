"""Bounded placement as one sans-I/O step that the processor and the simulator both drive.

With load-aware affinity off, a request's placement is pure hashing's (primary, secondary),
unless the session memory says otherwise: a session placed before follows its override, a new
session over the load bound or on a hot cluster starts on the next candidate in hash order
(extproc.core.affinity.place_bounded), and a session relief picked leaves a hot cluster. The
step takes what that decision reads of the fleet (:class:`BoundedInputs`: the hash placement,
the candidates in hash order, their loads, the hot set, the bound's tier), **yields what it needs
from the outside** (look the session up, note where the request was placed), and **returns the
placement**. It reads no clock, opens no socket, touches no Redis, counts no metric.

    step = bounded_step(inputs, current, now, params)
    outcome = drive(step, perform)   # extproc.pipeline.step.drive; perform(need) -> answer

Two drivers run the same step:

- the live driver (``Pipeline._follow_override``, extproc/pipeline/pipeline.py, async): the
  session lookup is the session memory's and Redis's, with relief's verdict on a hot cluster
  (extproc.pipeline.relief.relief_view); a placement is counted in the load table, noted in the
  relief table and its override written to the memory and Redis (none of it in a preview);
- the simulator's ``ProductDefault`` (extproc/sim/policies.py, synchronous): the same session
  memory, load table and relief table objects, in memory, on the simulated clock.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Generator, Sequence
from dataclasses import dataclass
from typing import Any

from extproc.core.affinity import AffinityParams, Decision, SessionView, Shortcut, place_bounded
from extproc.core.load import FleetSnapshot
from extproc.core.placement import Placement


@dataclass(slots=True)
class BoundedInputs:
    """What bounded placement reads of the fleet, lazily where it costs.

    ``hashed``: pure hashing's top two. ``candidates``: every candidate (an override is followed
    only onto one). ``ranked``: the candidates in hash order, and ``loads``: those candidates'
    health and recent placements; each asked for at most once, and only when a new session is
    judged, a session moves or a secondary is hot. ``hot``: the clusters that take no new
    sessions now. ``within``: a LoRA adapter's loaded tier (the first ``within`` of ``ranked``).
    ``shortcut``: cheaper views of the same inputs (place_bounded's :class:`Shortcut`), built
    only for a session not seen before. (Not frozen: built on every request, and a frozen
    dataclass costs five times as much to build.)"""

    hashed: Placement
    candidates: Collection[str]
    ranked: Callable[[], Sequence[str]]
    loads: Callable[[Sequence[str]], FleetSnapshot]
    hot: Collection[str] = ()
    within: int | None = None
    shortcut: Callable[[], Shortcut] | None = None


@dataclass(frozen=True, slots=True)
class LookUpSession:
    """Look the session up (and mark it seen), with relief's verdict on the cluster it is on
    (its override's, else ``hash_primary``). Answer: a :class:`SessionView`."""

    hash_primary: str


@dataclass(frozen=True, slots=True)
class NotePlacement:
    """The request is placed on ``cluster``: count it toward the bound's recent placements,
    note the session there for relief, and remember ``decision``'s override (if any).
    Answer: None."""

    decision: Decision
    cluster: str


@dataclass(frozen=True, slots=True)
class BoundedPlacement:
    """The step's outcome: where the request goes, the policy's decision, the session view."""

    placement: Placement
    decision: Decision
    session: SessionView


PlacementNeed = LookUpSession | NotePlacement
PlacementStep = Generator[PlacementNeed, Any, BoundedPlacement]


def balance_half_life(params: AffinityParams) -> float | None:
    """The half-life recent placements decay with, or None when no bound is kept."""
    return params.balance_half_life_s if params.balance_factor > 0 else None


class _Asked:
    """``inputs.ranked`` and ``inputs.loads`` of that ranking, each computed at most once."""

    __slots__ = ("_inputs", "_ranked", "_snapshot")

    def __init__(self, inputs: BoundedInputs) -> None:
        self._inputs = inputs
        self._ranked: Sequence[str] | None = None
        self._snapshot: FleetSnapshot | None = None

    def ranked(self) -> Sequence[str]:
        if self._ranked is None:
            self._ranked = self._inputs.ranked()
        return self._ranked

    def loads(self) -> FleetSnapshot:
        if self._snapshot is None:
            self._snapshot = self._inputs.loads(self.ranked())
        return self._snapshot


def placed_on(current: Placement, hashed: Placement, decision: Decision) -> Placement:
    """Where the request goes: the decision's placement, except that a "primary" decision
    leaves ``current`` (the hash placement, or already moved off an unready primary) alone
    unless it only replaced a hot secondary of the hash placement itself."""
    if decision.kind != "primary" or (decision.placement != hashed and current == hashed):
        return decision.placement
    return current


def bounded_step(
    inputs: BoundedInputs, current: Placement, now: float, params: AffinityParams
) -> PlacementStep:
    """Place one request with load-aware affinity off (extproc.core.affinity.place_bounded):
    look its session up, decide, note the placement, return it. ``current``: the request's
    placement so far (``inputs.hashed``, or moved off an unready primary)."""
    session: SessionView = yield LookUpSession(inputs.hashed.primary)
    asked = _Asked(inputs)
    shortcut = inputs.shortcut() if inputs.shortcut is not None and not session.seen else None
    decision = place_bounded(
        inputs.hashed,
        inputs.candidates,
        asked.ranked,
        asked.loads,
        session,
        now,
        params,
        inputs.within,
        shortcut,
        inputs.hot,
    )
    placement = placed_on(current, inputs.hashed, decision)
    yield NotePlacement(decision, placement.primary)
    return BoundedPlacement(placement, decision, session)
