"""Cluster models for the fleet simulator: hardware specs, fleet sizing, and per-cluster state.

One cluster = a prefix KV cache shared by ``lanes`` prefill instances, a concurrency cap, and
decode. The arithmetic is ``extproc.harness.kvmodel.ClusterModel``'s, request by request:

- cache: block-granular LRU, a block counts only if its whole prefix is resident, a request
  refreshes its blocks tail-first (so eviction takes tails before heads);
- a request waits for a concurrency slot (``max_concurrency`` requests hold one until done);
- prefill is FIFO: it starts when a slot is free and its lane is done with earlier prefills,
  and takes ``uncached / lane_tps``; the first token comes out of the prefill step and the
  other ``output - 1`` tokens at ``decode_tps``.

The one addition is lanes. A cluster is several prefill instances behind one name (Mooncake's
prefill pool); a request joins the lane that frees first. With ``lanes=1`` this is exactly
ClusterModel (``tests/unit/test_sim_model.py`` compares them request by request). Lanes are
what makes a per-cluster concurrency budget matter for TTFT: a class capped at one in flight
can occupy at most one lane, and short requests use the others. With a single FIFO, any long
prefill would delay every later short one whatever the budget.

Speed: the cache is one ``OrderedDict`` per cluster, as in ``kvmodel.PrefixCache``, but the
lookup is a binary search. That is exact, not an approximation: a request touches a block's
ancestors after the block itself, so an ancestor is always more recent than its descendants
and LRU eviction always takes descendants first. The resident set is therefore closed under
prefixes, and "key i is resident" is monotone along a request's keys.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from random import Random


@dataclass(frozen=True, slots=True)
class Profile:
    """A hardware shape, as multipliers of the fleet's base figures."""

    name: str
    prefill: float
    kv: float
    decode: float


# Prefill is compute-bound and decode memory-bandwidth-bound, so the shapes trade one for the
# other (at fleet level, per-class eligible clusters express it). Immutable: a tuple of frozen
# dataclasses.
PROFILES: tuple[Profile, ...] = (
    Profile("balanced", 1.0, 1.0, 1.0),
    Profile("prefill-heavy", 1.5, 0.75, 0.7),
    Profile("decode-heavy", 0.7, 1.25, 1.5),
)


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    name: str
    profile: str
    prefill_tps: float  # whole cluster, all lanes together
    kv_capacity_tokens: int
    decode_tps: float  # per request stream
    lanes: int
    max_concurrency: int
    weight: float
    # Engines (replicas) the cluster is made of, each with its own KV cache and its share of
    # the figures above (extproc.sim.engines); 1: one cache shared by every lane.
    engines: int = 1

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ValueError(f"cluster {self.name}: engines must be >= 1")
        if not (self.prefill_tps > 0 and self.decode_tps > 0 and self.weight > 0):
            raise ValueError(f"cluster {self.name}: rates and weight must be > 0")
        if self.kv_capacity_tokens < 1 or self.lanes < 1 or self.max_concurrency < 1:
            raise ValueError(f"cluster {self.name}: capacity, lanes, concurrency must be >= 1")


@dataclass(frozen=True, slots=True)
class FleetShape:
    """How to build a fleet; absolute figures are derived from the offered traffic."""

    clusters: int
    spares: int = 0  # extra clusters that scripted "add" events bring in
    heterogeneous: bool = True
    # Fleet prefill capacity = offered prefill work (at the ideal hit ratio) / utilisation.
    utilisation: float = 0.5
    # Per-cluster KV = kv_share x (distinct prefix tokens of the run / clusters), unless
    # kv_tokens is given.
    kv_share: float = 0.25
    kv_tokens: int | None = None
    prefill_tps: float | None = None  # override of the derived base prefill rate
    decode_tps: float = 50.0
    lanes: int = 8
    max_concurrency: int = 512
    weights: str = "equal"  # or "capacity": weight = prefill multiplier
    seed: int = 0
    engines: int = 1  # per cluster (ClusterSpec.engines)

    def __post_init__(self) -> None:
        if self.clusters < 1 or self.spares < 0:
            raise ValueError("clusters must be >= 1 and spares >= 0")
        if not self.utilisation > 0:
            raise ValueError("utilisation must be > 0")
        if not self.kv_share > 0:
            raise ValueError("kv_share must be > 0")
        if self.weights not in ("equal", "capacity"):
            raise ValueError(f"weights must be 'equal' or 'capacity', got {self.weights!r}")


def build_fleet(
    shape: FleetShape, prefill_tokens_per_s: float, distinct_tokens: int
) -> tuple[ClusterSpec, ...]:
    """``clusters + spares`` specs named c1..cN (names seed the hash, as in fleet.yaml)."""
    rng = Random(f"fleet:{shape.seed}")
    total = shape.clusters + shape.spares
    profiles = [rng.choice(PROFILES) if shape.heterogeneous else PROFILES[0] for _ in range(total)]
    mean_prefill = sum(p.prefill for p in profiles[: shape.clusters]) / shape.clusters
    base_prefill = shape.prefill_tps or max(
        1.0, prefill_tokens_per_s / (shape.clusters * mean_prefill * shape.utilisation)
    )
    base_kv = shape.kv_tokens or max(1, int(shape.kv_share * distinct_tokens / shape.clusters))
    return tuple(
        ClusterSpec(
            name=f"c{i + 1}",
            profile=p.name,
            prefill_tps=base_prefill * p.prefill,
            kv_capacity_tokens=max(1, int(base_kv * p.kv)),
            decode_tps=shape.decode_tps * p.decode,
            lanes=shape.lanes,
            max_concurrency=shape.max_concurrency,
            weight=p.prefill if shape.weights == "capacity" else 1.0,
            engines=shape.engines,
        )
        for i, p in enumerate(profiles)
    )


class ClusterState:
    """The mutable model of one cluster during a run. ``serve`` with non-decreasing ``now``."""

    __slots__ = (
        "block",
        "cache",
        "capacity_blocks",
        "decode_tps",
        "evictions",
        "lane_tps",
        "lanes",
        "max_concurrency",
        "slots",
        "spec",
    )

    def __init__(self, spec: ClusterSpec, block_tokens: int, now: float = -math.inf) -> None:
        self.spec = spec
        self.block = block_tokens
        self.capacity_blocks = max(1, spec.kv_capacity_tokens // block_tokens)
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0
        self.lane_tps = spec.prefill_tps / spec.lanes
        self.decode_tps = spec.decode_tps
        self.max_concurrency = spec.max_concurrency
        self.lanes = [now] * spec.lanes
        # done_at of every request holding a concurrency slot (a min-heap).
        self.slots: list[float] = []

    def match(self, keys: Sequence[int]) -> int:
        """Leading keys resident (binary search; exact, see the module note)."""
        cache = self.cache
        lo, hi = 0, len(keys)
        while lo < hi:
            mid = (lo + hi) >> 1
            if keys[mid] in cache:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def serve(
        self,
        keys: Sequence[int],
        prompt_tokens: int,
        output_tokens: int,
        now: float,
        point: int = 0,
    ) -> tuple[int, float, float]:
        """Admit one request: (cached tokens, first-token time, done time). ``point`` (the
        session's) chooses the engine of a cluster of several (extproc.sim.engines)."""
        cached = self._touch(keys, prompt_tokens)
        slot_at = self._slot(now)
        lanes = self.lanes
        free = min(lanes)
        lane = lanes.index(free)
        start = slot_at if slot_at > free else free
        first = start + (prompt_tokens - cached) / self.lane_tps
        lanes[lane] = first
        done = first + max(0, output_tokens - 1) / self.decode_tps
        heapq.heappush(self.slots, done)
        return cached, first, done

    def serve_remote(
        self,
        keys: Sequence[int],
        prompt_tokens: int,
        output_tokens: int,
        now: float,
        transfer_s_per_token: float,
        point: int = 0,
    ) -> tuple[int, float, float]:
        """Decode a request prefilled on another cluster (P/D, extproc.sim.pd): its KV arrives
        over the link, ``transfer_s_per_token`` per token this cluster does not hold (vLLM's
        NIXL connector pulls the prompt minus the local prefix-cache hit), instead of being
        computed, so the prefill lanes are not touched. As ``serve``: (cached tokens,
        first-token time, done time); the transfer is ``first - max(now, slot)``."""
        cached = self._touch(keys, prompt_tokens)
        slot_at = self._slot(now)
        first = slot_at + (prompt_tokens - cached) * transfer_s_per_token
        done = first + max(0, output_tokens - 1) / self.decode_tps
        heapq.heappush(self.slots, done)
        return cached, first, done

    def _slot(self, now: float) -> float:
        """When a concurrency slot is free for a request arriving ``now`` (taken from the heap
        when the cluster is full; the caller pushes the request's own done time)."""
        slots = self.slots
        while slots and slots[0] <= now:
            heapq.heappop(slots)
        return heapq.heappop(slots) if len(slots) >= self.max_concurrency else now

    def _touch(self, keys: Sequence[int], prompt_tokens: int) -> int:
        """The request's cached tokens; its blocks become the most recent, LRU evicts."""
        cache = self.cache
        matched = self.match(keys)
        cached = min(matched * self.block, prompt_tokens)
        # Touch like PrefixCache.touch (reversed order, ancestors last = most recent). The
        # keys past the match are absent (prefix closure), so they are appended in one C call.
        if matched < len(keys):
            cache.update(dict.fromkeys(reversed(keys[matched:])))
        if matched:
            deque(map(cache.move_to_end, reversed(keys[:matched])), maxlen=0)
        over = len(cache) - self.capacity_blocks
        if over > 0:
            self.evictions += over
            # popitem(last=False) ``over`` times, iterated in C.
            deque(map(cache.popitem, repeat(False, over)), maxlen=0)
        return cached

    def queue_wait(self, now: float) -> float:
        """How long a prefill arriving now would wait for a lane (the spill signal)."""
        return max(0.0, min(self.lanes) - now)

    def inflight(self, now: float) -> int:
        """Requests admitted and not finished (Envoy's least-request "active requests")."""
        slots = self.slots
        while slots and slots[0] <= now:
            heapq.heappop(slots)
        return len(slots)

    def crash(self) -> None:
        """A failure loses the KV cache and every request on the cluster."""
        self.cache = OrderedDict()
        self.slots = []

    def restart(self, now: float) -> None:
        self.cache = OrderedDict()
        self.slots = []
        self.lanes = [now] * self.spec.lanes

    @property
    def cached_blocks(self) -> int:
        return len(self.cache)
