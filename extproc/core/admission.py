"""Admission control: per-class, per-cluster budgets (bulkheads) and the retry hints of a 429.

The split, so that check-and-reserve is one atomic step and every decision stays pure:

1. :func:`plan` turns (facts, route) into a :class:`Demand`: the cluster charged (the primary),
   the cost in tokens and the limits to enforce. A request larger than its class's whole budget
   is answered here with a 413 — no ledger state could ever admit it. A class with no enforced
   budget yields ``None``: the shell skips the ledger entirely.
2. A ledger (``extproc.ledger``) checks and reserves atomically and reports a
   :class:`LedgerAnswer`: granted or not, the usage it saw, its release statistics, its clock.
3. :func:`verdict` turns that answer into :class:`Admitted` or a 429 :class:`Reject` whose
   ``retry-after`` is computed from the answer (token-bucket refill time, or the observed
   completion rate of the class on that cluster) plus seeded jitter.
4. ``extproc.core.ratelimit_headers`` renders a reject as the response headers clients and SDKs
   read.

Budget semantics, per (cluster, class), 0 meaning "no cap" throughout:

- ``max_inflight_tokens``: the estimated input tokens of all admitted, unfinished requests — the
  prefill work and prompt KV a class may hold on a cluster at once (classes are input-size bands,
  so the budget is counted in the same unit; a request's output cap does not count);
- ``max_concurrent``: admitted, unfinished requests;
- ``tokens_per_second`` with ``burst_tokens``: a token bucket of capacity ``burst_tokens``
  refilled at ``tokens_per_second`` (``burst_tokens`` 0 means one second's worth).

No clock reads here: time comes from the ledger's answer (for Redis, the Redis server's own
clock, so the refill math of many replicas never mixes skewed local clocks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from random import Random

from extproc.core.decide import Route
from extproc.core.facts import RequestFacts
from extproc.core.fleet import Budget
from extproc.core.flow import TenantLimit

# Time constant of the exponentially weighted release-rate estimate: long enough to smooth
# bursts of completions, short enough to follow a class whose request lengths change.
RELEASE_RATE_TAU_S = 10.0
# With no completion observed yet the wait is unknowable; a short first retry is the cheapest
# probe (jitter spreads the herd, the next 429 carries a measured hint).
NO_SIGNAL_WAIT_S = 1.0
# Hints beyond a few minutes are noise (the fleet changes faster than that) and some clients
# treat a huge Retry-After as "give up".
MAX_RETRY_AFTER_S = 300
# Jitter adds up to this fraction of the wait (at least one second), so the clients rejected
# together do not all come back in the same second.
RETRY_JITTER = 0.5
# The rate estimate divides by the time observed so far; below one second that is noise.
_MIN_OBSERVATION_S = 1.0


def bounded_wait(wait: float) -> float:
    """A wait clamped to [0, MAX_RETRY_AFTER_S], total over every float.

    A decayed rate can be denormal (a compartment idle for ~2 hours: exp(-7000/tau) is about
    1e-305), and a deficit divided by it is inf; a NaN from a broken ledger reply would pass
    every comparison. ``math.ceil`` raises on both, which would fail the stream. inf is a wait
    longer than any hint, NaN an unknown one (the shortest probe, like no signal at all).
    """
    if math.isnan(wait):
        return NO_SIGNAL_WAIT_S
    return min(float(MAX_RETRY_AFTER_S), max(0.0, wait))


def _whole_seconds(wait: float) -> int:
    """A wait as whole seconds in [1, MAX_RETRY_AFTER_S]."""
    return min(MAX_RETRY_AFTER_S, max(1, math.ceil(bounded_wait(wait))))


# The bucket's window (time to refill a full burst) is information, not a hint: not capped at
# MAX_RETRY_AFTER_S, only kept a finite sf-integer (RFC 8941 allows 15 digits).
_MAX_WINDOW_S = 10**15 - 1


def seconds_for(amount: float, per_second: float) -> float:
    """``amount / per_second``, inf when the rate is 0 (a denormal rate split between
    replicas underflows to 0.0, and float division by it would raise)."""
    return amount / per_second if per_second > 0 else math.inf


def _window_seconds(burst_tokens: int, tokens_per_second: float) -> int:
    window = seconds_for(burst_tokens, tokens_per_second)
    if math.isnan(window) or window >= _MAX_WINDOW_S:
        return _MAX_WINDOW_S
    return max(1, math.ceil(window))


def _floor_count(value: float) -> int:
    """A non-negative token count reported by a ledger, floored (NaN counts as empty)."""
    if math.isnan(value) or value <= 0:
        return 0
    return math.floor(min(value, float(2**62)))


class Reason(StrEnum):
    INFLIGHT_TOKENS = "inflight_tokens"
    CONCURRENCY = "concurrency"
    TOKEN_RATE = "token_rate"
    EXCEEDS_BUDGET = "exceeds_budget"
    # Fits the fleet-wide budget but not this replica's share while the shared ledger is down.
    LOCAL_SHARE = "local_share"
    LEDGER_UNAVAILABLE = "ledger_unavailable"
    # The tenant's own limits (flow.tenant_limit / flow.tenants), not the class's budget.
    TENANT_CONCURRENCY = "tenant_concurrency"
    TENANT_TOKEN_RATE = "tenant_token_rate"


# Refusals by the tenant's own limits: answered at once, never placed elsewhere or queued.
TENANT_REASONS = frozenset({Reason.TENANT_CONCURRENCY, Reason.TENANT_TOKEN_RATE})


@dataclass(frozen=True, slots=True)
class TenantClaim:
    """The tenant a demand is counted against in the shared ledger, with its limits as
    enforced (an unset limit: counted, never refused)."""

    key: str  # the tenant's identity in shared state (an unkeyed digest)
    limit: TenantLimit = field(default_factory=TenantLimit)

    def shared(self, replicas: int) -> TenantClaim:
        """One replica's part of the limits when each replica counts alone (limit / replicas,
        at least 1)."""
        if replicas <= 1:
            return self

        def part(value: int | None) -> int | None:
            return None if value is None else max(1, value // replicas)

        own = self.limit
        limit = TenantLimit(part(own.max_concurrent), part(own.tokens_per_minute))
        return TenantClaim(self.key, limit)


@dataclass(frozen=True, slots=True)
class Demand:
    """One request's claim on its class's budget on its primary cluster."""

    cluster: str
    class_name: str
    tokens: int
    budget: Budget  # as configured
    limits: Budget  # as enforced: resolved (Budget.resolved), a replica's share when alone
    # The tenant counted with it in the shared ledger (its own limits checked in the same
    # atomic step); None: the tenant's limits are counted elsewhere, or there are none.
    tenant: TenantClaim | None = None
    # Its tenant in the compartment's fair order (FairClaim.tenant): a ledger keeping the
    # fleet-wide queue answers with the waiters a request of it would follow there
    # (LedgerAnswer.queued_ahead); None: every waiter.
    queue_tenant: str | None = None

    def shared(self, replicas: int) -> Demand:
        if replicas <= 1:
            return self
        tenant = self.tenant.shared(replicas) if self.tenant is not None else None
        return Demand(
            self.cluster,
            self.class_name,
            self.tokens,
            self.budget,
            self.limits.share(replicas),
            tenant,
            self.queue_tenant,
        )


@dataclass(frozen=True, slots=True)
class Ticket:
    """A held reservation. ``store`` names the ledger that holds it ("redis", "memory")."""

    cluster: str
    class_name: str
    tokens: int
    lease: str
    store: str
    # The tenant whose count it holds in the same ledger (given back with it), if any.
    tenant: str | None = None


@dataclass(frozen=True, slots=True)
class CompartmentUsage:
    """One (cluster, class) compartment as a ledger saw it."""

    inflight_tokens: int = 0
    concurrent: int = 0
    # Tokens available in the bucket after refill (0 when the class has no rate limit).
    bucket_tokens: float = 0.0


@dataclass(frozen=True, slots=True)
class ReleaseStats:
    """Exponentially decayed completion counters, as of ``at`` (ledger clock).

    On each release at time t: ``count = count * exp(-(t - at) / tau) + 1`` (tokens likewise)
    and ``at = t``; ``since`` is when counting started, for the start-up bias correction.
    """

    count: float = 0.0
    tokens: float = 0.0
    at: float = 0.0
    since: float = 0.0

    def rates(self, now: float, tau: float = RELEASE_RATE_TAU_S) -> tuple[float, float]:
        """(requests/s, tokens/s) completing on this compartment, estimated at ``now``.

        For a steady rate r the decayed count converges to r·tau·(1 - exp(-elapsed/tau));
        dividing by that factor removes the under-estimate of a freshly started counter.
        """
        if self.count <= 0:
            return 0.0, 0.0
        decay = math.exp(-max(0.0, now - self.at) / tau)
        elapsed = max(_MIN_OBSERVATION_S, now - self.since)
        horizon = tau * -math.expm1(-elapsed / tau)
        return self.count * decay / horizon, self.tokens * decay / horizon


@dataclass(frozen=True, slots=True)
class LedgerAnswer:
    """A ledger's reply to one atomic check-and-reserve.

    ``usage`` is the state after the call: including this demand when granted, unchanged when
    refused. ``now`` is the ledger's clock, the time base of ``released``.
    """

    granted: bool
    ticket: Ticket | None
    usage: CompartmentUsage
    released: ReleaseStats
    now: float
    # Requests (and their tokens) in the compartment's fleet-wide queue (the Redis ledger's
    # flow-control queue); 0 from a ledger that keeps no queue of its own.
    queued: int = 0
    queued_tokens: int = 0
    # Refused because another request heads that queue (its budget may have had room).
    behind: bool = False
    # The demand's tenant as the ledger counted it (Demand.tenant): refused by its own limits
    # (then nothing was reserved), its requests in flight and the tokens in its bucket.
    tenant_refused: bool = False
    tenant_inflight: int = 0
    tenant_bucket: float = 0.0
    # Of the queued requests, those a new request of the demand's queue tenant
    # (Demand.queue_tenant) would be served after in that queue's order, and their tokens
    # (every one without a queue tenant, or under FIFO).
    queued_ahead: int = 0
    queued_ahead_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Quota:
    """One quota policy and its current service limit (IETF RateLimit-Policy / RateLimit)."""

    name: str
    quota: int
    unit: str  # "tokens" (not in the draft's registry: sent as a vendor parameter) or a qu value
    remaining: int
    window_s: int | None = None
    reset_s: int | None = None  # set on the policies that refused this request


@dataclass(frozen=True, slots=True)
class Admitted:
    demand: Demand
    ticket: Ticket
    usage: CompartmentUsage


@dataclass(frozen=True, slots=True)
class Reject:
    status: int  # 429 over budget, 413 never admissible, 503 ledger unavailable (closed policy)
    class_name: str
    cluster: str
    message: str
    reason: Reason
    retry_after_s: int | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_s: float | None = None  # until enough tokens free up for this request (unjittered)
    quotas: tuple[Quota, ...] = ()

    @property
    def code(self) -> str:
        """The ``code`` of the JSON error body (extproc.protocol.errors)."""
        if self.status == 429:
            return "rate_limit_exceeded"
        if self.status == 413:
            return "request_too_large"
        return "service_unavailable"


@dataclass(frozen=True, slots=True)
class Attempt:
    """One check-and-reserve: the outcome, the demand as enforced (a replica's share while
    the shared ledger is down) and the ledger's answer (None: no ledger answered, the
    ``closed`` policy's 503)."""

    outcome: Admitted | Reject
    demand: Demand
    answer: LedgerAnswer | None


def request_tokens(facts: RequestFacts) -> int:
    """Cost of a request against its class budget: its estimated input tokens."""
    return facts.input_tokens


def plan(
    tokens: int,
    route: Route,
    tenant: TenantClaim | None = None,
    queue_tenant: str | None = None,
) -> Demand | Reject | None:
    """The demand to reserve, a 413 when no budget state could admit it, or None (unbudgeted).

    ``tokens``: the request's cost against its class budget (:func:`request_tokens`);
    ``tenant``: the tenant counted with it in the same reservation. A class without a budget
    still yields a demand (with no caps) when its tenant has limits to count there.
    ``queue_tenant``: its tenant in the fair order of the compartment's queue
    (:attr:`Demand.queue_tenant`).
    """
    cls = route.request_class
    budget = cls.budget
    primary = route.placement.primary
    if not budget.enforced:
        if tenant is None or not tenant.limit.enabled:
            return None
        return Demand(primary, cls.name, tokens, budget, Budget(), tenant, queue_tenant)
    limits = budget.resolved()
    demand = Demand(primary, cls.name, tokens, budget, limits, tenant, queue_tenant)
    cap = limits.largest_admissible
    if cap is not None and demand.tokens > cap:
        what = (
            "in flight per cluster"
            if cap == limits.max_inflight_tokens
            else "per burst (its token-rate limit)"
        )
        message = (
            f"this request needs {tokens} estimated input tokens, but request class '{cls.name}' "
            f"allows at most {cap} tokens {what}, so it can never be admitted; shorten the "
            "input"
        )
        return Reject(
            413,
            cls.name,
            demand.cluster,
            message,
            Reason.EXCEEDS_BUDGET,
            limit_tokens=cap,
            quotas=_quotas(demand, None, {}),
        )
    return demand


def _token_limit(limits: Budget) -> int | None:
    return limits.max_inflight_tokens or limits.burst_tokens or None


def _token_remaining(limits: Budget, usage: CompartmentUsage) -> int | None:
    left: list[int] = []
    if limits.max_inflight_tokens:
        left.append(max(0, limits.max_inflight_tokens - usage.inflight_tokens))
    if limits.burst_tokens:
        left.append(_floor_count(usage.bucket_tokens))
    return min(left) if left else None


def _quotas(
    demand: Demand, usage: CompartmentUsage | None, waits: dict[Reason, float]
) -> tuple[Quota, ...]:
    lim = demand.limits
    name = demand.class_name
    out: list[Quota] = []

    def reset(reason: Reason) -> int | None:
        if reason not in waits:
            return None
        return _whole_seconds(waits[reason])

    caps = (
        (
            "inflight",
            lim.max_inflight_tokens,
            usage.inflight_tokens if usage else 0,
            "tokens",
            Reason.INFLIGHT_TOKENS,
        ),
        (
            "concurrency",
            lim.max_concurrent,
            usage.concurrent if usage else 0,
            "concurrent-requests",
            Reason.CONCURRENCY,
        ),
    )
    for suffix, cap, used, unit, reason in caps:
        if cap:
            out.append(
                Quota(f"{name}-{suffix}", cap, unit, max(0, cap - used), reset_s=reset(reason))
            )
    if lim.burst_tokens:
        level = usage.bucket_tokens if usage else float(lim.burst_tokens)
        out.append(
            Quota(
                f"{name}-rate",
                lim.burst_tokens,
                "tokens",
                _floor_count(level),
                window_s=_window_seconds(lim.burst_tokens, lim.tokens_per_second),
                reset_s=reset(Reason.TOKEN_RATE),
            )
        )
    return tuple(out)


def _observed_wait(missing: float, completion_rate: float) -> float:
    """Time for ``missing`` units to complete at the observed rate (no signal: a short probe)."""
    return seconds_for(missing, completion_rate) if completion_rate > 0 else NO_SIGNAL_WAIT_S


def _waits(
    demand: Demand, answer: LedgerAnswer, ahead: int = 0, ahead_tokens: int = 0
) -> dict[Reason, float]:
    """Seconds until each violated dimension could admit this demand, behind ``ahead``
    queued requests holding ``ahead_tokens`` (extproc.core.flow: they are served first)."""
    lim, usage = demand.limits, answer.usage
    need = demand.tokens + ahead_tokens
    req_rate, tok_rate = answer.released.rates(answer.now)
    waits: dict[Reason, float] = {}
    if lim.max_inflight_tokens and usage.inflight_tokens + need > lim.max_inflight_tokens:
        deficit = usage.inflight_tokens + need - lim.max_inflight_tokens
        waits[Reason.INFLIGHT_TOKENS] = _observed_wait(deficit, tok_rate)
    if lim.max_concurrent and usage.concurrent + 1 + ahead > lim.max_concurrent:
        missing = usage.concurrent + 1 + ahead - lim.max_concurrent
        waits[Reason.CONCURRENCY] = _observed_wait(missing, req_rate)
    if lim.burst_tokens and usage.bucket_tokens < need:
        waits[Reason.TOKEN_RATE] = seconds_for(need - usage.bucket_tokens, lim.tokens_per_second)
    return waits


def queued_wait(
    demand: Demand, answer: LedgerAnswer, ahead: int = 0, ahead_tokens: int = 0
) -> float:
    """The estimated wait (s) until ``demand`` could be admitted behind ``ahead`` queued
    requests, from the ledger's observed release rate; 0 when it fits now. Unbounded (inf)
    when it can never fit at the observed rates; the no-signal probe when nothing was released
    yet."""
    waits = _waits(demand, answer, ahead, ahead_tokens)
    wait = max(waits.values()) if waits else 0.0
    return NO_SIGNAL_WAIT_S if math.isnan(wait) else wait


def jittered_seconds(wait: float, rng: Random) -> int:
    """Whole seconds for Retry-After: the wait plus seeded jitter, in [1, MAX_RETRY_AFTER_S]."""
    # Whole seconds of jitter, at least one: Retry-After has one-second granularity, so a
    # fractional spread would round every client of a short wait to the same value.
    wait = bounded_wait(wait)
    spread = math.ceil(max(1.0, wait * RETRY_JITTER))
    return min(MAX_RETRY_AFTER_S, max(1, math.ceil(wait) + rng.randint(0, spread)))


_WHY = {
    Reason.INFLIGHT_TOKENS: "too many tokens in flight",
    Reason.CONCURRENCY: "too many concurrent requests",
    Reason.TOKEN_RATE: "token rate limit reached",
    Reason.LOCAL_SHARE: (
        "the shared budget ledger is unreachable and this request is larger than the share "
        "of the budget one gateway replica may admit alone"
    ),
}


def verdict(
    demand: Demand,
    answer: LedgerAnswer,
    rng: Random,
    ahead: int = 0,
    ahead_tokens: int = 0,
    why: str = "",
) -> Admitted | Reject:
    """The ledger's answer as an admission or a 429 with retry hints.

    ``ahead``/``ahead_tokens``: requests queued before this one (its hint counts them);
    ``why``: what flow control did first (e.g. "waited 30s"), said in the message.
    """
    if answer.granted and answer.ticket is not None:
        return Admitted(demand, answer.ticket, answer.usage)
    waits = _waits(demand, answer, ahead, ahead_tokens)
    cap = demand.limits.largest_admissible
    if cap is not None and demand.tokens > cap:
        # Only a replica's share can be this small (plan() 413s against the whole budget):
        # the request has to wait for the shared ledger, whose outage length is unknown.
        reason, wait = Reason.LOCAL_SHARE, NO_SIGNAL_WAIT_S
    elif waits:
        reason, wait = max(waits.items(), key=lambda kv: kv[1])
    else:
        # Refused although the snapshot shows room: another holder won the same instant.
        reason, wait = Reason.CONCURRENCY, NO_SIGNAL_WAIT_S
    retry_after = jittered_seconds(wait, rng)
    token_waits = [waits[r] for r in (Reason.INFLIGHT_TOKENS, Reason.TOKEN_RATE) if r in waits]
    message = (
        f"request class '{demand.class_name}' is over its budget ({_WHY[reason]}"
        f"{'; ' + why if why else ''}); retry after {retry_after}s"
    )
    return Reject(
        429,
        demand.class_name,
        demand.cluster,
        message,
        reason,
        retry_after_s=retry_after,
        limit_tokens=_token_limit(demand.limits),
        remaining_tokens=_token_remaining(demand.limits, answer.usage),
        reset_s=bounded_wait(max(token_waits)) if token_waits else None,
        quotas=_quotas(demand, answer.usage, waits),
    )


def unavailable(demand: Demand, probe_s: float, rng: Random) -> Reject:
    """503 under the "closed" policy: the shared ledger is down and nothing is admitted."""
    retry_after = jittered_seconds(probe_s, rng)
    return Reject(
        503,
        demand.class_name,
        demand.cluster,
        "admission control is temporarily unavailable (budget ledger unreachable); "
        f"retry after {retry_after}s",
        Reason.LEDGER_UNAVAILABLE,
        retry_after_s=retry_after,
        limit_tokens=_token_limit(demand.limits),
    )
