"""Flow control before a 429: place a new session elsewhere, then wait (bounded), then refuse.

Pure decisions and one pure data structure; the shell (extproc/ledger/waiters.py,
extproc/pipeline/pipeline.py) does the reserving, the waiting and the remembering. See
ARCHITECTURE.md, "Flow control".

1. **Place before refusing** (:func:`placement_candidates`): a request of a *new* session (no
   seen mark, no override: no cache anywhere) whose primary's class budget is full may run on
   the next hash candidate with room, tried in hash order. The shell remembers the choice as an
   override (like a spill), so the session's later turns follow it. An existing session never
   moves by this rule: its cache is on its primary, so it waits or gets its 429.
2. **Wait, bounded** (:func:`queue_decision`): an over-budget request waits in its (cluster,
   class) queue when the class allows waiting, the queue has room and the wait estimated from the
   observed release rate (:func:`extproc.core.admission.queued_wait`) fits the class's maximum;
   otherwise it is refused at once with that estimate as its retry hint.
3. **Fair order** (:class:`FairQueue`): within a (cluster, class) queue, FIFO within a tenant and
   weighted fair across tenants: self-clocked fair queueing whose cost is, by default, the
   tokens a tenant is served (:class:`Fairness`), so a tenant of million-token requests gets
   the same share of a contended class as one of twenty-thousand-token requests, not fifty
   times it. Weights by tenant or tier. See docs/fairness.md.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, TypeVar

# The shipped waits: short requests barely wait; long and agentic requests may wait tens of
# seconds. A class bounded at or below SHORT_CLASS_TOKENS serves requests whose whole
# answer is expected within a second or two: a wait longer than that is worse than a prompt
# 429 that sends the client elsewhere. Larger classes (and the catch-all, where long
# agentic contexts land) take tens of seconds of prefill anyway, so waiting for budget costs
# proportionally little and saves a blind retry whose hint may be minutes.
SHORT_CLASS_TOKENS = 8192
SHORT_MAX_WAIT_S = 0.5
LONG_MAX_WAIT_S = 30.0


def default_max_wait_s(max_input_tokens: int | None) -> float:
    """The wait a class gets when fleet.yaml does not set ``wait.max_wait_s``, by its size
    bound (None: the catch-all class, unbounded input)."""
    if max_input_tokens is not None and max_input_tokens <= SHORT_CLASS_TOKENS:
        return SHORT_MAX_WAIT_S
    return LONG_MAX_WAIT_S


@dataclass(frozen=True, slots=True)
class WaitPolicy:
    """How long and how many requests of one class may wait for budget on one cluster.

    ``max_wait_s`` 0 means "never wait" (the 429 is immediate; fleet.yaml's default is
    :func:`default_max_wait_s`); ``max_queue`` bounds the waiters per (cluster, class)
    (fleet-wide with Redis, extproc/ledger/queue.lua).
    """

    max_wait_s: float = 0.0
    max_queue: int = 0

    @property
    def enabled(self) -> bool:
        return self.max_wait_s > 0 and self.max_queue > 0


class Fairness(StrEnum):
    """What a contended queue shares out equally (per weight) among its tenants."""

    TOKENS = "tokens"  # the input and output tokens each tenant is served (the default)
    REQUESTS = "requests"  # one unit per request, whatever its size
    FIFO = "fifo"  # no fairness: arrival order


class TenantFallback(StrEnum):
    """The tenant of a request without the trusted tenant header."""

    TIER = "tier"  # its tier (no tier: one shared tenant)
    API_KEY = "api_key"  # the keyed hash of its API key (Authorization bearer or x-api-key)
    NONE = "none"  # one shared tenant


@dataclass(frozen=True, slots=True)
class TenantLimit:
    """One tenant's own limits inside every class, on top of the class budgets (None: none)."""

    max_concurrent: int | None = None
    tokens_per_minute: int | None = None

    @property
    def enabled(self) -> bool:
        return self.max_concurrent is not None or self.tokens_per_minute is not None


@dataclass(frozen=True, slots=True)
class FairClaim:
    """A waiter's claim on its queue's fair order: its tenant (a keyed label), the tenant's
    weight, and the service admitting it costs (:meth:`FlowParams.service`)."""

    tenant: str
    weight: float = 1.0
    service: float = 1.0

    @property
    def increment(self) -> float:
        """How far its tag lies past the tenant's counter."""
        return self.service / max(self.weight, 1e-9)


@dataclass(frozen=True, slots=True)
class FairCharge:
    """Where a request served through a contended queue charges its output, once known."""

    cluster: str
    class_name: str
    tenant: str
    weight: float


@dataclass(frozen=True, slots=True)
class FlowParams:
    """Compiled from fleet.yaml's ``flow:`` section."""

    # Place a new session on its next hash candidate with room when its primary is full
    # (fleet.yaml's default is on: the rule, not an option).
    place_new_sessions: bool = False
    # The trusted header naming the tenant for fair queueing (None: the tier is the tenant).
    tenant_header: str | None = None
    # A tenant's share of a contended queue is proportional to its tier's weight (default 1).
    tier_weights: Mapping[str, float] = field(default_factory=dict)
    fairness: Fairness = Fairness.TOKENS
    # Tokens fairness: an output token costs this many input tokens (decode holds the engine
    # for each one; llm-d's router counts them double too).
    output_weight: float = 2.0
    tenant_fallback: TenantFallback = TenantFallback.TIER
    # By tenant label (keyed hash of the tenant's name, as every tenant is known here): its
    # weight, replacing its tier's, and its own limits, replacing ``tenant_limit``.
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    tenant_limit: TenantLimit = TenantLimit()
    tenant_limits: Mapping[str, TenantLimit] = field(default_factory=dict)
    # Per-tenant metrics: the N tenants with the most served tokens get a label, the rest
    # are "other" (0: no per-tenant metrics).
    tenant_metrics_top: int = 0

    def weight(self, tier: str | None, tenant: str | None = None) -> float:
        if tenant is not None:
            own = self.tenant_weights.get(tenant)
            if own is not None:
                return own
        return self.tier_weights.get(tier or "", 1.0)

    def service(self, input_tokens: int) -> float:
        """What admitting a request of ``input_tokens`` costs its tenant in a contended queue,
        before weighting (its output is charged when it is known: :meth:`output_service`)."""
        if self.fairness is Fairness.TOKENS:
            return float(max(1, input_tokens))
        if self.fairness is Fairness.REQUESTS:
            return 1.0
        return 0.0

    def output_service(self, output_tokens: int) -> float:
        """What ``output_tokens`` served cost the tenant, under tokens fairness (else 0)."""
        if self.fairness is Fairness.TOKENS and output_tokens > 0:
            return output_tokens * self.output_weight
        return 0.0

    def claim(self, tenant: str, tier: str | None, input_tokens: int) -> FairClaim:
        return FairClaim(tenant, self.weight(tier, tenant), self.service(input_tokens))

    def limit_for(self, tenant: str) -> TenantLimit:
        return self.tenant_limits.get(tenant, self.tenant_limit)

    @property
    def limits_tenants(self) -> bool:
        return self.tenant_limit.enabled or any(x.enabled for x in self.tenant_limits.values())


def placement_candidates(
    ranked: Sequence[str], refused: str, seen: bool, has_override: bool
) -> tuple[str, ...]:
    """The clusters to try, in order, after ``refused`` (the chosen primary) had no budget.

    Empty for an existing session (seen recently, or already placed by an override): its
    cache is where it runs, so it is never moved by admission. A new session gets the other
    candidates in hash order (its rendezvous ranking), so the choice is deterministic and the
    next-best cluster by the same hash that picked the primary.
    """
    if seen or has_override:
        return ()
    return tuple(name for name in ranked if name != refused)


def secondary_for(ranked: Sequence[str], chosen: str) -> str | None:
    """Envoy's failover target for a request placed on ``chosen``: the first other candidate
    in hash order (pure hashing's own rule)."""
    for name in ranked:
        if name != chosen:
            return name
    return None


class QueueVerdict(StrEnum):
    WAIT = "wait"
    OVERFLOW = "overflow"  # the queue is at max_queue
    TOO_LONG = "too_long"  # the estimated wait exceeds max_wait_s
    NO_WAIT = "no_wait"  # the class does not wait


def queue_decision(policy: WaitPolicy, queued: int, estimate_s: float) -> QueueVerdict:
    """Whether an over-budget request joins a queue holding ``queued`` waiters, given the
    estimated wait for its position (``estimate_s``, from the observed release rate)."""
    if not policy.enabled:
        return QueueVerdict.NO_WAIT
    if queued >= policy.max_queue:
        return QueueVerdict.OVERFLOW
    if estimate_s > policy.max_wait_s:
        return QueueVerdict.TOO_LONG
    return QueueVerdict.WAIT


T = TypeVar("T")


@dataclass(order=True, slots=True)
class _Entry(Generic[T]):
    tag: float
    order: int  # ties of tags: arrival order (this queue's, or the fleet-wide queue's)
    seq: int
    tenant: str = field(compare=False)
    item: T = field(compare=False)
    cost: int = field(compare=False, default=0)
    removed: bool = field(compare=False, default=False)
    # How far it moved its tenant's counter; given back if it leaves unserved (0: its tag
    # was decided elsewhere, and so is the refund).
    increment: float = field(compare=False, default=0.0)


class FairQueue(Generic[T]):
    """Waiters of one (cluster, class): FIFO per tenant, weighted fair across tenants.

    Start-time fair queueing (SFQ; the virtual token counter of VTC): each tenant has a
    counter; a waiter of tenant t costing service s (its input tokens under tokens fairness,
    1 under requests fairness, 0 for FIFO) gets the tag ``start = max(V, counter(t))`` and
    moves the counter to ``start + s / weight``; the smallest tag is served first (ties:
    arrival order) and V becomes its tag. The counter also advances by the output a tenant is
    later served (:meth:`charge`). So a tenant's first waiter is not held back by its own size,
    its later ones wait until the others have been served as much; tags of one tenant only
    grow, so each tenant is FIFO. While tenants a and b are backlogged, the service they are
    given (divided by weight) differs by at most one largest request of each
    (``s_max(a) / w_a + s_max(b) / w_b``; ``tests/unit/test_fairness.py`` checks the bound). A
    tenant that becomes active starts at V, the least counter still waiting, so it cannot bank
    credit for the time it was away.
    """

    def __init__(self) -> None:
        self._heap: list[_Entry[T]] = []
        self._ids: dict[int, _Entry[T]] = {}
        self._last: dict[str, float] = {}
        self._virtual = 0.0
        self._seq = itertools.count()
        self._live = 0
        self._tokens = 0

    def __len__(self) -> int:
        return self._live

    @property
    def tokens(self) -> int:
        """The summed cost (estimated input tokens) of the live waiters."""
        return self._tokens

    def tag_for(self, tenant: str) -> float:
        """The tag a waiter of ``tenant`` joining now gets (what :meth:`push` assigns): its
        start, the tenant's counter."""
        return self.counter(tenant)

    def counter(self, tenant: str) -> float:
        """Where ``tenant``'s next waiter starts: its counter, lifted to V when behind it."""
        return max(self._virtual, self._last.get(tenant, self._virtual))

    @property
    def virtual(self) -> float:
        """V: the tag last served."""
        return self._virtual

    def charge(self, tenant: str, service: float, weight: float = 1.0) -> None:
        """``tenant`` was served ``service`` more (its output, known at the end): its counter
        advances while the queue is contended; an idle queue owes nobody anything."""
        if self._live and service > 0:
            self._last[tenant] = self.counter(tenant) + service / max(weight, 1e-9)

    def push(
        self,
        item: T,
        tenant: str,
        weight: float = 1.0,
        cost: int = 0,
        tag: float | None = None,
        order: int | None = None,
        service: float = 1.0,
    ) -> int:
        """Queue ``item`` costing ``service``; returns its id (for :meth:`remove`). ``tag`` and
        ``order`` given: the place was decided elsewhere (the fleet-wide queue in Redis,
        queue.lua, computes the same tags over every replica's waiters), and this queue keeps
        that order."""
        refundable = tag is None
        if tag is None:
            tag = self.tag_for(tenant)
        # The tenant's counter moves past this waiter: its next one starts there.
        increment = service / max(weight, 1e-9)
        finish = tag + increment
        self._last[tenant] = max(finish, self._last.get(tenant, finish))
        seq = next(self._seq)
        entry = _Entry(tag, seq if order is None else order, seq, tenant, item, cost)
        if refundable:
            entry.increment = increment
        heapq.heappush(self._heap, entry)
        self._ids[seq] = entry
        self._live += 1
        self._tokens += cost
        return seq

    def _drop_removed(self) -> None:
        while self._heap and self._heap[0].removed:
            heapq.heappop(self._heap)

    def head(self) -> T | None:
        """The waiter served next, or None when empty."""
        self._drop_removed()
        return self._heap[0].item if self._heap else None

    def head_id(self) -> int | None:
        self._drop_removed()
        return self._heap[0].seq if self._heap else None

    def pop(self) -> T | None:
        """Serve the head."""
        self._drop_removed()
        if not self._heap:
            return None
        entry = heapq.heappop(self._heap)
        self._virtual = max(self._virtual, entry.tag)
        self._forget(entry)
        return entry.item

    def remove(self, seq: int) -> bool:
        """Withdraw a waiter (timed out, or its client went away); True when it was queued.

        It was never served, so its tenant is not charged for it: its counter moves back by
        the waiter's increment (the tags of waiters already queued stay, so every replica's
        copy of the fleet-wide order stays the same). Else a tenant whose requests time out
        under overload would fall ever further behind for service it never got."""
        entry = self._ids.get(seq)
        if entry is None or entry.removed:
            return False
        entry.removed = True
        self._forget(entry)
        if entry.increment and entry.tenant in self._last:
            self._last[entry.tenant] -= entry.increment
        self._drop_removed()
        return True

    def _forget(self, entry: _Entry[T]) -> None:
        self._ids.pop(entry.seq, None)
        self._live -= 1
        self._tokens -= entry.cost
        if not self._live:
            # Idle: nothing is owed to anyone any more.
            self._last.clear()

    def ahead_of(self, seq: int) -> tuple[int, int]:
        """(waiters, their tokens) that would be served before ``seq``."""
        entry = self._ids.get(seq)
        if entry is None:
            return 0, 0
        n = tokens = 0
        for other in self._ids.values():
            if other < entry:
                n += 1
                tokens += other.cost
        return n, tokens

    def ahead_for(self, tenant: str) -> tuple[int, int]:
        """(waiters, their tokens) a waiter of ``tenant`` joining now would be served after:
        those whose tag is at most the tag it would get (ties go to the earlier arrival).
        Under FIFO every tag is V, so that is every waiter; under weighted fairness a tenant
        arriving behind another tenant's backlog follows only the part of it tagged no later
        than its own start, not the whole queue."""
        tag = self.tag_for(tenant)
        n = tokens = 0
        for other in self._ids.values():
            if other.tag <= tag:
                n += 1
                tokens += other.cost
        return n, tokens

    def place_for(self, tenant: str) -> int:
        """How many live waiters a waiter of ``tenant`` joining now would be served after."""
        return self.ahead_for(tenant)[0]

    def __iter__(self) -> Iterator[T]:
        """Live waiters in service order."""
        return iter(e.item for e in sorted(self._ids.values()))
