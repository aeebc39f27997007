"""The pure model of one inference cluster: prefix KV cache, FIFO prefill queue, decode.

No sockets and no clock reads: every call takes ``now`` (seconds on any monotonic clock) and
returns the full timeline of the request as a ``Plan``. The HTTP shell (``sim_cluster``) then
sleeps until the planned instants. Because the whole future of each admitted request is fixed at
admission, the prefill queue is a single "prefill busy until" instant: a long prefill pushes every
later prefill on the same cluster back (the convoy effect that makes short-request TTFT suffer
behind long-context bursts).

Times in a ``Plan`` are in the caller's clock; durations are simulated durations multiplied by
``time_scale`` (0.01 runs 100x faster than real) and by the current slowdown factor.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ClusterParams:
    kv_capacity_tokens: int = 2_000_000
    prefill_tps: float = 20_000.0
    decode_tps: float = 50.0
    max_concurrency: int = 64
    time_scale: float = 1.0
    block_tokens: int = 512

    def __post_init__(self) -> None:
        for name in ("kv_capacity_tokens", "prefill_tps", "decode_tps", "max_concurrency"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not self.time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale!r}")
        if self.block_tokens <= 0:
            raise ValueError(f"block_tokens must be > 0, got {self.block_tokens!r}")


@dataclass(frozen=True, slots=True)
class ModelRequest:
    """What the model needs to know about a request.

    ``block_hashes`` are the chained hashes of the prompt's full blocks (see
    ``prompts.block_hashes``): a hash identifies the whole prefix that ends with its block.
    """

    block_hashes: tuple[int, ...]
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class Plan:
    arrival: float
    cached_tokens: int
    uncached_tokens: int
    slot_at: float  # when a concurrency slot became free (== arrival unless the cluster was full)
    prefill_start: float
    first_token_at: float
    done_at: float
    time_scale: float

    @property
    def ttft(self) -> float:
        """Time to first token on the caller's clock."""
        return self.first_token_at - self.arrival

    @property
    def sim_ttft_s(self) -> float:
        """Time to first token in simulated seconds (undoing ``time_scale``)."""
        return self.ttft / self.time_scale


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    inflight: int  # arrived and not finished (queued or running)
    queued: int  # arrived, prefill not started yet
    kv_usage: float  # KV held by running requests / capacity, capped at 1
    cache_fill: float  # prefix-cache blocks resident / capacity


class PrefixCache:
    """A block-granular prefix cache with LRU eviction.

    Lookups walk the request's chained hashes from the start and stop at the first miss, so a
    block counts only when its whole prefix is resident. When a request touches its blocks they
    are refreshed tail-first, leaving the prefix the most recently used: under pressure a
    request loses its tail before its head (vLLM frees a request's blocks in reverse order for
    the same reason), and the chain of the remaining blocks stays usable.
    """

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be > 0")
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._lru

    def match(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks resident (no side effects)."""
        matched = 0
        for block_hash in hashes:
            if block_hash not in self._lru:
                break
            matched += 1
        return matched

    def touch(self, hashes: Sequence[int]) -> None:
        """Insert or refresh the blocks, then evict least recently used ones over capacity."""
        for block_hash in reversed(hashes):
            self._lru[block_hash] = None
            self._lru.move_to_end(block_hash)
        while len(self._lru) > self.capacity_blocks:
            self._lru.popitem(last=False)
            self.evictions += 1


@dataclass(frozen=True, slots=True)
class _Inflight:
    arrival: float
    prefill_start: float
    done_at: float
    tokens: int


class ClusterModel:
    """One cluster's cache and timeline. Call ``admit`` with non-decreasing ``now``."""

    def __init__(self, params: ClusterParams) -> None:
        self.params = params
        self.cache = PrefixCache(max(1, params.kv_capacity_tokens // params.block_tokens))
        self._slowdown = 1.0
        self._prefill_busy_until = -math.inf
        # done_at of every request holding a concurrency slot; the smallest frees first.
        self._slots: list[float] = []
        self._inflight: deque[_Inflight] = deque()

    @property
    def slowdown(self) -> float:
        return self._slowdown

    def set_slowdown(self, factor: float) -> None:
        """Multiply the durations of requests admitted from now on (fault injection)."""
        if not factor > 0:
            raise ValueError(f"slowdown factor must be > 0, got {factor!r}")
        self._slowdown = factor

    def admit(self, request: ModelRequest, now: float) -> Plan:
        return self._admit(request, now, None)

    def admit_remote(self, request: ModelRequest, now: float, transfer_s_per_token: float) -> Plan:
        """Decode of a request prefilled elsewhere (disaggregated P/D).

        The prompt's KV arrives over the link, ``transfer_s_per_token`` simulated seconds per
        token, instead of being computed: the prefill queue is not touched, which is what P/D
        buys the decode pool. Only the blocks this cluster lacks travel (vLLM's NIXL connector
        pulls the prompt minus the local prefix-cache hit), so decode affinity still pays.
        """
        return self._admit(request, now, transfer_s_per_token)

    def _admit(self, request: ModelRequest, now: float, transfer_s_per_token: float | None) -> Plan:
        params = self.params
        scale = params.time_scale * self._slowdown

        matched = self.cache.match(request.block_hashes)
        cached = min(matched * params.block_tokens, request.prompt_tokens)
        uncached = request.prompt_tokens - cached
        # The prefill will compute (and cache) every block; later requests queue behind this
        # prefill, so by the time they run the blocks exist.
        self.cache.touch(request.block_hashes)

        while self._slots and self._slots[0] <= now:
            heapq.heappop(self._slots)
        slot_at = heapq.heappop(self._slots) if len(self._slots) >= params.max_concurrency else now

        if transfer_s_per_token is None:
            prefill_start = max(slot_at, self._prefill_busy_until)
            first_token_at = prefill_start + uncached / params.prefill_tps * scale
            self._prefill_busy_until = first_token_at
        else:
            prefill_start = slot_at
            first_token_at = slot_at + uncached * transfer_s_per_token * scale
        # The prefill step emits the first token; decode produces the rest.
        decode_tokens = max(0, request.output_tokens - 1)
        done_at = first_token_at + decode_tokens / params.decode_tps * scale
        heapq.heappush(self._slots, done_at)

        self._prune(now)
        self._inflight.append(
            _Inflight(now, prefill_start, done_at, request.prompt_tokens + request.output_tokens)
        )
        return Plan(
            arrival=now,
            cached_tokens=cached,
            uncached_tokens=uncached,
            slot_at=slot_at,
            prefill_start=prefill_start,
            first_token_at=first_token_at,
            done_at=done_at,
            time_scale=params.time_scale,
        )

    def _prune(self, now: float) -> None:
        if any(item.done_at <= now for item in self._inflight):
            self._inflight = deque(item for item in self._inflight if item.done_at > now)

    def load(self, now: float) -> LoadSnapshot:
        self._prune(now)
        held = 0
        queued = 0
        inflight = 0
        for item in self._inflight:
            if item.arrival > now:
                continue
            inflight += 1
            if item.prefill_start > now:
                queued += 1
            else:
                # Like vLLM, a waiting request holds no KV blocks until it is scheduled.
                held += item.tokens
        capacity = self.params.kv_capacity_tokens
        cache_tokens = len(self.cache) * self.params.block_tokens
        return LoadSnapshot(
            inflight=inflight,
            queued=queued,
            kv_usage=min(1.0, held / capacity),
            cache_fill=min(1.0, cache_tokens / capacity),
        )
