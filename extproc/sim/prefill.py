"""The prefill leg of a disaggregated request in the simulator (extproc.sim.pd).

The prefiller is the one the processor would name (``PdPlan.choose``, with the prefills in
flight per prefill endpoint and the endpoints the prober finds ready), its prefill pool's
budget is the processor's prefill step (extproc/pipeline/step.py ``prefill_step``), and the
prefill runs on that cluster's model; when its KV is ready the decode cluster decodes.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import TYPE_CHECKING

from extproc.core.admission import Reject, Ticket
from extproc.core.decide import Route
from extproc.core.placement import Placement
from extproc.pipeline import step as steps
from extproc.sim.engine import NO_CLUSTER
from extproc.sim.pd import PdSim

if TYPE_CHECKING:
    from extproc.sim.run import Simulation

# A prefill under way: (KV ready at, seq, request, decode cluster, tier, endpoint, keys,
# prefill-cached tokens, decode ticket, prefill ticket).
Prefill = tuple[float, int, int, int, int, str, Sequence[int], int, object, object]


class PrefillLeg:
    """Prefills of one run: started by :meth:`start`, finished by :meth:`done` (the run pops
    them from its ``prefills`` heap in time order)."""

    __slots__ = ("_inflight", "_pd", "_sim")

    def __init__(self, sim: Simulation, pd: PdSim) -> None:
        self._sim, self._pd = sim, pd
        # Prefills in flight per prefill endpoint: the load the processor counts.
        self._inflight: dict[str, int] = {}

    def start(
        self,
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
        sim, pd = self._sim, self._pd
        points = sim.points
        assert points is not None
        klass = sim.classes[sim.t_class[tp]]
        point = points[sim.sessions[i]]
        choice = pd.plan.choose(
            klass.name, sim.names[decode_c], point, self._inflight, sim.fleet.ready
        )
        if choice is None or choice.endpoint is None:
            sim.out.prefill_tier[i] = -1
            return False
        endpoint = choice.endpoint
        pticket = None
        budget = pd.plan.prefill_classes[klass.name]
        if sim.policy.bulkheads and budget.budget.enforced:
            prefill_route = Route(Placement(endpoint.cluster, None), budget)
            held = ticket if isinstance(ticket, Ticket) else None
            step = steps.prefill_step(sim.t_in[tp], prefill_route, held)
            outcome = sim.admit(step, i, attempt, now)
            if isinstance(outcome, Reject):
                # As the processor: the decode reservation went back (the step's GiveBack)
                # and the 429 is the prefill pool's.
                sim.refuse(i, outcome, attempt, now)
                return True
            pticket = outcome
        address = endpoint.address
        self._inflight[address] = self._inflight.get(address, 0) + 1
        # The prefill leg: one token out, its KV ready when that token is.
        state = sim.fleet.states[sim.fleet.index[endpoint.cluster]]
        pcached, ready_at, _ = state.serve(keys, sim.t_in[tp], 1, now, point)
        entry = (ready_at, next(sim.seq), i, decode_c, choice.tier, address, keys, pcached)
        heapq.heappush(sim.prefills, (*entry, ticket, pticket))
        return True

    def done(self, entry: Prefill) -> None:
        """The prefill is done: the KV moves to the decode cluster, which decodes."""
        at, _, i, decode_c, tier, address, keys, pcached, ticket, pticket = entry
        sim, plan = self._sim, self._pd.plan
        points = sim.points
        assert points is not None
        sim.clock = at
        self._inflight[address] -= 1
        tickets = [t for t in (ticket, pticket) if t is not None]
        if not sim.fleet.alive[decode_c]:
            sim.out.status[i] = NO_CLUSTER
            for t in tickets:
                sim.give_back(t, at)
            return
        tp = sim.templates[i]
        t_in = sim.t_in[tp]
        per_token = plan.kv_bytes_per_token / plan.topology.bandwidth(tier)
        got, first, finish = sim.fleet.states[decode_c].serve_remote(
            keys, t_in, sim.t_out[tp], at, per_token, points[sim.sessions[i]]
        )
        sim.served(i, decode_c, pcached, first, finish, tickets)
        sim.out.transfer_s[i] = (t_in - got) * per_token
        sim.out.prefill_tier[i] = tier
