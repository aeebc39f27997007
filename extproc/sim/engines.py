"""Engines inside a simulated cluster: each with its own KV cache.

A ``ClusterState`` alone is one prefix cache shared by all of a cluster's prefill lanes: a
cluster that is really several vLLM / SGLang replicas has one cache per replica, and a session
sent to another replica re-prefills there. ``EngineCluster`` models that: the cluster's KV,
prefill lanes and concurrency are divided among ``spec.engines`` engine states, and each request
goes to one engine, chosen as the processor chooses (``core.endpoints.pick_engine``: rendezvous
of the session over the engines, with bounded load), or round robin (one request after another
over the engines, what Envoy's default ROUND_ROBIN does inside a cluster).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal

from extproc.core.endpoints import (
    DEFAULT_BALANCE,
    DEFAULT_MIN_INFLIGHT,
    endpoint_order,
    engine_cap,
    pick_engine,
)
from extproc.sim.model import ClusterSpec, ClusterState

# Where a session goes when its engine is over the bounded-load cap (the engine-level
# load rule, compared side by side by `extproc simulate --engine-spill`):
# - within: to its runner-up engine of the same cluster (core.endpoints.pick_engine; the rule);
# - leave: to its secondary cluster (its engine there by the same rendezvous), as if another
#   cluster were the better place for a request its own engine cannot take now;
# - none: it stays on its engine and queues there (sticky, no bound).
EngineSpill = Literal["within", "leave", "none"]
ENGINE_SPILLS: tuple[EngineSpill, ...] = ("within", "leave", "none")


def engine_spec(spec: ClusterSpec, index: int) -> ClusterSpec:
    """One of the cluster's engines: its share of KV, prefill, lanes and concurrency."""
    n = spec.engines
    return dataclasses.replace(
        spec,
        name=f"{spec.name}-e{index + 1}",
        prefill_tps=spec.prefill_tps / n,
        kv_capacity_tokens=max(1, spec.kv_capacity_tokens // n),
        lanes=max(1, spec.lanes // n),
        max_concurrency=max(1, spec.max_concurrency // n),
        engines=1,
    )


class EngineCluster(ClusterState):
    """A cluster of ``spec.engines`` engines; the ClusterState interface over all of them."""

    __slots__ = ("balance", "bound", "engine_names", "engines", "floor", "sticky", "turn")

    def __init__(
        self,
        spec: ClusterSpec,
        block_tokens: int,
        now: float = -math.inf,
        sticky: bool = True,
        balance: float | None = DEFAULT_BALANCE,
        floor: int = DEFAULT_MIN_INFLIGHT,
        bound: float = DEFAULT_BALANCE,
    ) -> None:
        super().__init__(spec, block_tokens, now)
        self.engines = [
            ClusterState(engine_spec(spec, i), block_tokens, now) for i in range(spec.engines)
        ]
        self.engine_names = [e.spec.name for e in self.engines]
        self.sticky = sticky
        self.balance = balance  # the engine choice's own bound (None: none)
        self.floor = floor
        self.bound = bound  # home_full's (the leave rule)
        self.turn = 0

    def choose(self, point: int, now: float) -> int:
        if not self.sticky:
            self.turn += 1
            return self.turn % len(self.engines)
        load = {
            name: e.inflight(now) for name, e in zip(self.engine_names, self.engines, strict=True)
        }
        chosen = pick_engine(
            point, self.engine_names, self.engine_names, load, self.balance, self.floor
        )
        assert chosen is not None
        return self.engine_names.index(chosen)

    def home_full(self, point: int, now: float) -> bool:
        """Whether the session's own engine (its rendezvous first) is at the bounded-load cap
        the ``within`` rule would spill at (core.endpoints.engine_cap)."""
        if not self.sticky:
            return False
        home = endpoint_order(point, self.engine_names)[0]
        loads = [e.inflight(now) for e in self.engines]
        mine = loads[self.engine_names.index(home)]
        return mine >= engine_cap(sum(loads), len(loads), self.bound, self.floor)

    def serve(
        self,
        keys: Sequence[int],
        prompt_tokens: int,
        output_tokens: int,
        now: float,
        point: int = 0,
    ) -> tuple[int, float, float]:
        engine = self.engines[self.choose(point, now)]
        return self._counted(engine.serve(keys, prompt_tokens, output_tokens, now))

    def serve_remote(
        self,
        keys: Sequence[int],
        prompt_tokens: int,
        output_tokens: int,
        now: float,
        transfer_s_per_token: float,
        point: int = 0,
    ) -> tuple[int, float, float]:
        engine = self.engines[self.choose(point, now)]
        return self._counted(
            engine.serve_remote(keys, prompt_tokens, output_tokens, now, transfer_s_per_token)
        )

    def _counted(self, served: tuple[int, float, float]) -> tuple[int, float, float]:
        """The cluster's evictions are its engines' (a few engines: summed per request)."""
        self.evictions = sum(e.evictions for e in self.engines)
        return served

    def queue_wait(self, now: float) -> float:
        return min(e.queue_wait(now) for e in self.engines)

    def inflight(self, now: float) -> int:
        return sum(e.inflight(now) for e in self.engines)

    def crash(self) -> None:
        for e in self.engines:
            e.crash()

    def restart(self, now: float) -> None:
        for e in self.engines:
            e.restart(now)

    @property
    def cached_blocks(self) -> int:
        return sum(e.cached_blocks for e in self.engines)


def cluster_state(
    spec: ClusterSpec,
    block_tokens: int,
    now: float = -math.inf,
    sticky: bool = True,
    spill: EngineSpill = "within",
    balance: float = DEFAULT_BALANCE,
    floor: int = DEFAULT_MIN_INFLIGHT,
) -> ClusterState:
    """The model of one cluster: a single cache, or one per engine when it has several. Only
    ``within`` bounds the engine choice itself; ``leave`` is the engine loop's (home_full)."""
    if spec.engines <= 1:
        return ClusterState(spec, block_tokens, now)
    own = balance if spill == "within" else None
    return EngineCluster(spec, block_tokens, now, sticky, own, floor, balance)
