"""AdmissionGate: the async facade the ext_proc servicer calls.

    gate = build_gate(runtime, registry, clock=time.monotonic, rng=random.Random(seed))
    await gate.start()                      # loads scripts, starts lease renewal
    outcome = await gate.admit(facts, route)
    #   None      -> the class has no budget: route it, hold nothing
    #   Reject    -> answer with reject.status, rate_limit_headers(reject), reject.message
    #   Admitted  -> route it; keep outcome.ticket until the HTTP exchange ends, then:
    await gate.release(ticket)              # in `finally:`; idempotent, never raises
    await gate.close()

The gate owns the policy for an unreachable Redis: ``local`` admits against this replica's
share of each budget (budget / replicas) in memory, ``closed`` rejects with 503. Every Redis
call is bounded by ``redis.timeout_ms``; after a failure the gate stays local for
``probe_interval_s`` and then tries Redis again (admissions or the background tick), so it
goes back to the shared budget as soon as Redis answers. Reservations taken locally are then
adopted: written into Redis under a Redis lease of their own (unconditionally: the requests
are running), renewed and released there, so the other replicas see them. Until adoption ends
(one round trip per local reservation, started when Redis is seen up again) a compartment can
exceed its budget by at most what the local shares admitted (RELIABILITY.md states and
measures the bound).

No phantoms: a reserve's lease id is chosen before the call. When the call times out, fails
or its caller is cancelled, the gate does not know whether Redis ran it (a timed-out call can
still be sitting in Redis's input buffer), so it cancels that lease id: released if Redis had
reserved it, refused in advance otherwise (extproc/ledger/release.lua). A cancel Redis does
not answer is kept and retried every probe interval until Redis acknowledges it; the lease
lapses with its TTL in any case, since nobody renews it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from random import Random
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge

from extproc.config.runtime import Runtime
from extproc.core.admission import (
    Admitted,
    Attempt,
    CompartmentUsage,
    Demand,
    LedgerAnswer,
    Reject,
    TenantClaim,
    Ticket,
    plan,
    request_tokens,
    unavailable,
    verdict,
)
from extproc.core.decide import Route
from extproc.core.facts import RequestFacts
from extproc.core.fleet import Budget, RequestClass
from extproc.core.flow import FairCharge, FairClaim, QueueVerdict, WaitPolicy
from extproc.core.queue_policy import flow_outlook, queue_refusal, queue_verdict
from extproc.core.tenant_limits import TenantUse
from extproc.core.tenant_limits import refusal as tenant_refusal
from extproc.ledger.base import LedgerUnavailable
from extproc.ledger.memory import MemoryLedger
from extproc.ledger.metrics import LedgerMetrics
from extproc.ledger.redis import TICKET_LEASE_S, Joined, RedisLedger, lease_ttl_tick
from extproc.ledger.redis_health import RedisHealth
from extproc.ledger.tenant_limits import TenantLimits, TenantSlot
from extproc.ledger.waiters import Queued, Waiters, listen_for_releases

log = logging.getLogger("extproc.ledger")

OnUnavailable = Literal["local", "closed"]

# Cancels and releases kept for retry while Redis does not answer; beyond this the leases
# are left to lapse with their TTL (memory stays bounded through a long outage).
MAX_UNSETTLED = 100_000

# Rejections by reason are counted, not logged; what is logged (Redis trouble) is throttled
# so an outage under load writes a few lines, not one per request.
LOG_INTERVAL_S = 10.0


class _LogThrottle:
    def __init__(self, clock: Callable[[], float], interval_s: float) -> None:
        self._clock = clock
        self._interval = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def allow(self, key: str) -> int | None:
        """None while throttled; otherwise how many lines were suppressed since the last one."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._interval:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._suppressed.pop(key, 0)


@dataclass(frozen=True, slots=True)
class _Series:
    """The metric children one (cluster, class, ledger) touches on every admit and release."""

    tokens: Gauge
    requests: Gauge
    leases: Gauge
    admitted: Counter


class AdmissionGate:
    def __init__(
        self,
        *,
        local: MemoryLedger,
        shared: RedisLedger | None,
        metrics: LedgerMetrics,
        clock: Callable[[], float],
        rng: Random,
        on_unavailable: OnUnavailable = "local",
        replicas: int = 1,
        probe_interval_s: float = 1.0,
        renew_interval_s: float | None = None,
        health: RedisHealth | None = None,
        release_notices: bool = True,
    ) -> None:
        self._local = local
        self._release_notices = release_notices
        self._shared = shared
        self._m = metrics
        self._clock = clock
        self._rng = rng
        self._on_unavailable = on_unavailable
        self._replicas = max(1, replicas)
        self._renew_interval_s = renew_interval_s or (
            lease_ttl_tick(shared.lease_ttl_s) if shared is not None else 1.0
        )
        # Shared with the affinity session store when the service builds both (one Redis).
        self._health = health or RedisHealth(probe_interval_s)
        self._health.subscribe(self._health_changed)
        self._held: dict[str, Ticket] = {}
        # The "unbudgeted" admission counter by class, resolved once: labels() costs more than
        # the increment, on every request of a class without a budget.
        self._unbudgeted: dict[str, Any] = {}
        # (cluster, class) -> [tokens, requests] this replica holds in Redis.
        self._redis_held: dict[tuple[str, str], list[int]] = {}
        # lease -> (cluster, class, its tenant): reserves to cancel, releases to deliver, once
        # Redis answers.
        self._unsettled: dict[str, tuple[str, str, str | None]] = {}
        # The tenants of demands that carry one (Demand.tenant), counted here while Redis is
        # unreachable (each replica its share of the limits, as budgets); with Redis up they
        # are counted in Redis by the reserve itself.
        self._tenants = TenantLimits(clock)
        self._settling: set[str] = set()
        # Operator-facing problems found at start (shown in readiness), e.g. eviction policy.
        self.warnings: list[str] = []
        self._last_renew: float = clock()
        self._limits_seen: dict[tuple[str, str], Budget] = {}
        self._series_cache: dict[tuple[str, str, str], _Series] = {}
        self._renewer: asyncio.Task[None] | None = None
        # Set when the background loop has work sooner than its current sleep would allow.
        self._nudge = asyncio.Event()
        self._toucher: asyncio.Task[None] | None = None
        self._adopting: asyncio.Task[None] | None = None
        # One adoption at a time: two would write two Redis copies of one reservation.
        self._adopt_lock = asyncio.Lock()
        self._background: set[asyncio.Task[None]] = set()
        self._throttle = _LogThrottle(clock, LOG_INTERVAL_S)
        self._m.set_mode(self.mode)
        # Requests waiting for budget, woken by releases (extproc/ledger/waiters.py).
        self.waiters = Waiters(metrics)
        self._wakeups: asyncio.Task[None] | None = None

    # -- state ------------------------------------------------------------------------------

    @property
    def mode(self) -> Literal["redis", "local"]:
        """Where new reservations go right now."""
        return "redis" if self._shared is not None and self._health.up else "local"

    @property
    def counts_tenants(self) -> bool:
        """Whether demands should carry their tenant (Demand.tenant): with Redis its limits
        are checked fleet-wide in the reserve itself; locally, while Redis is unreachable."""
        return self._shared is not None

    @property
    def held(self) -> int:
        """Reservations this gate holds (both ledgers)."""
        return len(self._held)

    def publish_limits(self, runtime: Runtime) -> None:
        """Export every (cluster, class) budget as gauges; call again after a reload."""
        for cls in runtime.policy.all_classes():
            for cluster in runtime.policy.clusters_of(cls, runtime.cluster_names):
                self._publish(cluster, cls.name, cls.budget.resolved())

    def _publish(self, cluster: str, class_name: str, limits: Budget) -> None:
        key = (cluster, class_name)
        if self._limits_seen.get(key) == limits:
            return
        self._limits_seen[key] = limits
        self._m.limit_tokens.labels(cluster, class_name).set(limits.max_inflight_tokens)
        self._m.limit_requests.labels(cluster, class_name).set(limits.max_concurrent)

    async def usage(self, cluster: str, class_name: str, budget: Budget) -> dict[str, object]:
        """One compartment as the active ledger sees it (for ``explain`` and operators).

        Reserves nothing and never raises: with Redis unreachable it reports the local ledger.
        """
        limits = budget.resolved()
        answer: LedgerAnswer | None = None
        ledger = "local"
        if self._shared is not None and self._redis_due():
            try:
                answer = await self._shared.usage(cluster, class_name, limits)
                ledger = "redis"
                self._redis_ok()
            except LedgerUnavailable as exc:
                self._redis_failed("usage", exc)
        if answer is None:
            limits = limits.share(self._replicas)
            answer = await self._local.usage(cluster, class_name, limits)
        req_rate, tok_rate = answer.released.rates(answer.now)
        return {
            "ledger": ledger,
            "inflight_tokens": answer.usage.inflight_tokens,
            "concurrent": answer.usage.concurrent,
            "bucket_tokens": round(answer.usage.bucket_tokens, 1) if limits.burst_tokens else None,
            "max_inflight_tokens": limits.max_inflight_tokens,
            "max_concurrent": limits.max_concurrent,
            "tokens_per_second": limits.tokens_per_second,
            "burst_tokens": limits.burst_tokens,
            "releases_per_second": round(req_rate, 3),
            "released_tokens_per_second": round(tok_rate, 1),
        }

    async def tenant_use(self, claim: TenantClaim) -> tuple[str, TenantClaim, TenantUse]:
        """Where ``claim``'s tenant is counted now (``redis``: fleet-wide; ``local``: this
        replica, while Redis is unreachable), its limits as enforced there (a replica's share
        locally) and its use of them. Reads only (no lease, no bucket drawn) and never raises
        (for ``explain``)."""
        if self._shared is not None and self._redis_due():
            try:
                use = await self._shared.tenant_use(claim)
            except LedgerUnavailable as exc:
                self._redis_failed("usage", exc)
            else:
                self._redis_ok()
                return "redis", claim, use
        local = claim.shared(self._replicas)
        return "local", local, self._tenants.use(local.key, local.limit)

    # -- admission --------------------------------------------------------------------------

    async def admit(self, facts: RequestFacts, route: Route) -> Admitted | Reject | None:
        """Reserve budget for one request on its primary cluster. Never raises for Redis."""
        planned = plan(request_tokens(facts), route)
        if planned is None:
            self.count_unbudgeted(route.request_class.name)
            return None
        if isinstance(planned, Reject):
            self._count_reject(planned)
            return planned
        attempt = await self.attempt(planned)
        if isinstance(attempt.outcome, Reject):
            self._count_reject(attempt.outcome)
        return attempt.outcome

    async def attempt(
        self, demand: Demand, *, reserve: bool = True, ticket: str | None = None
    ) -> Attempt:
        """One check-and-reserve of ``demand`` on the active ledger, uncounted when refused
        (the caller may still place or queue the request: see :meth:`count_reject`).
        ``reserve=False`` only looks (a refusal computed from the compartment as it is).
        On Redis a new request is refused while others wait in the compartment's fleet-wide
        queue; ``ticket``, a waiter's, is granted only at that queue's head."""
        if not reserve:
            # Judged against the limits the look was made against (a replica's share when
            # it was local), so the 429 names what is enforced.
            seen, demand = await self._peek(demand)
            if seen.tenant_refused and demand.tenant is not None:
                use = TenantUse(seen.tenant_inflight, seen.tenant_bucket)
                return Attempt(self._tenant_refusal(demand, demand.tenant, use), demand, None)
            refused = verdict(demand, dataclasses.replace(seen, granted=False), self._rng)
            return Attempt(refused, demand, seen)
        self._publish(demand.cluster, demand.class_name, demand.limits)
        answer: LedgerAnswer | None = None
        if self._shared is not None and self._redis_due():
            answer = await self._reserve_shared(self._shared, demand, ticket or "-")
        if answer is None:
            if self._shared is not None and self._on_unavailable == "closed":
                reject = unavailable(demand, self._health.probe_interval_s, self._rng)
                return Attempt(reject, demand, None)
            demand = demand.shared(self._replicas)
            local = self._reserve_local(demand)
            if isinstance(local, Reject):
                return Attempt(local, demand, None)
            answer = local
        elif answer.tenant_refused and demand.tenant is not None:
            use = TenantUse(answer.tenant_inflight, answer.tenant_bucket)
            return Attempt(self._tenant_refusal(demand, demand.tenant, use), demand, None)
        outcome = verdict(demand, answer, self._rng)
        if isinstance(outcome, Admitted):
            self._track(outcome.ticket)
        return Attempt(outcome, demand, answer)

    def _reserve_local(self, demand: Demand) -> LedgerAnswer | Reject:
        """The in-memory reserve of ``demand`` (a replica's share already), its tenant counted
        here: the ticket names the tenant, so its release gives the tenant's slot back."""
        claim = demand.tenant
        slot: TenantSlot | None = None
        if claim is not None:
            taken = self._tenants.take(claim.key, demand.tokens, claim.limit)
            if isinstance(taken, TenantUse):
                return self._tenant_refusal(demand, claim, taken)
            slot = taken
        # This replica's own Redis leases of the compartment are requests still running:
        # they count against its local share too, so an outage does not let it admit a
        # whole share on top of what it already holds.
        answer = self._local.reserve_now(demand, self._redis_usage(demand))
        if claim is None or slot is None:
            return answer
        if answer.ticket is None:
            # Refused by the budget: that takes nothing from the tenant (as in reserve.lua).
            self._tenants.refund(slot, claim.limit)
            return answer
        return dataclasses.replace(
            answer, ticket=dataclasses.replace(answer.ticket, tenant=claim.key)
        )

    def _tenant_refusal(self, demand: Demand, claim: TenantClaim, use: TenantUse) -> Reject:
        """The 429 of a demand its tenant's own limits refused (they name the tenant's)."""
        return tenant_refusal(
            claim.limit, use, demand.tokens, demand.class_name, demand.cluster, self._rng
        )

    def _release_local(self, ticket: Ticket) -> None:
        self._local.release_now(ticket)
        if ticket.tenant is not None:
            self._tenants.give(TenantSlot(ticket.tenant, ticket.tokens))

    async def peek(self, demand: Demand) -> LedgerAnswer:
        """The compartment of ``demand`` as the active ledger sees it; reserves nothing."""
        return (await self._peek(demand))[0]

    async def _peek(self, demand: Demand) -> tuple[LedgerAnswer, Demand]:
        """:meth:`peek`, with ``demand`` as the ledger looked at it (a replica's share of its
        limits and its tenant's when the look was local)."""
        if self._shared is not None and self._redis_due():
            try:
                answer = await self._shared.usage(
                    demand.cluster,
                    demand.class_name,
                    demand.limits,
                    demand.tenant,
                    demand.tokens,
                    demand.queue_tenant,
                )
            except LedgerUnavailable as exc:
                self._redis_failed("usage", exc)
            else:
                self._redis_ok()
                return answer, demand
        local = demand.shared(self._replicas)
        answer = await self._local.usage(local.cluster, local.class_name, local.limits)
        claim = local.tenant
        if claim is None:
            return answer, local
        use = self._tenants.use(claim.key, claim.limit)
        own = claim.limit
        over = (own.max_concurrent is not None and use.inflight >= own.max_concurrent) or (
            own.tokens_per_minute is not None
            and use.bucket_tokens < min(local.tokens, own.tokens_per_minute)
        )
        seen = dataclasses.replace(
            answer,
            tenant_refused=over,
            tenant_inflight=use.inflight,
            tenant_bucket=use.bucket_tokens,
        )
        return seen, local

    @property
    def polls_shared(self) -> bool:
        """Whether budget can free without this replica seeing it (another replica's release,
        a lapsed lease): then a waiter re-checks the shared ledger now and then."""
        return self._shared is not None and self._health.up

    def count_reject(self, reject: Reject) -> None:
        self._count_reject(reject)

    def count_unbudgeted(self, class_name: str) -> None:
        """A request of a class without a budget: routed, nothing reserved."""
        counter = self._unbudgeted.get(class_name)
        if counter is None:
            if len(self._unbudgeted) >= 4096:  # class names come from reloads: bound it
                self._unbudgeted.clear()
            counter = self._m.admissions.labels(class_name, "unbudgeted")
            self._unbudgeted[class_name] = counter
        counter.inc()

    async def flow_preview(
        self, cluster: str, request_class: RequestClass, tokens: int, tenant: str
    ) -> dict[str, object]:
        """What flow control would do with a request of ``tenant`` of ``tokens`` on (cluster,
        class) now: ``admit``, ``wait`` (with the wait estimated for the waiters it would
        follow), or refuse (``too_long``, ``overflow``, ``no_wait``: the class does not wait);
        reserves nothing (for ``explain``)."""
        budget = request_class.budget
        policy = request_class.wait
        queued = self.waiters.depth(cluster, request_class.name)
        ahead, ahead_tokens = self.waiters.ahead(cluster, request_class.name, tenant)
        out: dict[str, object] = {
            "queued": queued,
            "ahead": ahead,
            "max_wait_s": policy.max_wait_s,
            "max_queue": policy.max_queue,
        }
        if not budget.enforced:
            return {**out, "would": "admit", "estimated_wait_s": 0.0}
        limits = budget.resolved()
        demand = Demand(cluster, request_class.name, tokens, budget, limits, queue_tenant=tenant)
        answer = await self.peek(demand)
        if self.mode == "redis":  # the fleet-wide queue
            queued, ahead, ahead_tokens = fleet_wide(answer)
            out["queued"], out["ahead"] = queued, ahead
        would, estimate = flow_outlook(demand, answer, policy, ahead, ahead_tokens, queued=queued)
        return {**out, "would": would, "estimated_wait_s": round(estimate, 3)}

    @property
    def metrics(self) -> LedgerMetrics:
        return self._m

    async def queue(
        self,
        demand: Demand,
        attempt: Attempt,
        policy: WaitPolicy,
        claim: FairClaim,
        poll_s: float,
    ) -> Queued | Reject:
        """After a refused ``attempt`` of ``demand``: join its queue, or the 429 to answer now
        (the class does not wait, the queue is full, or the estimated wait is too long: the
        hint is then that estimate), for the caller to count (:meth:`count_reject`) as the
        request's one refusal. The estimate counts the waiters the request would follow in
        the queue's order (under fair order, not another tenant's whole backlog: its tag
        would precede most of it); ``max_queue`` bounds the whole queue.

        With Redis the queue is fleet-wide (queue.lua): its length, its order and the
        requests ahead count every replica's waiters, as the reserve that refused the
        request counted them (reserve.lua, by the fleet-wide tags, for the demand's queue
        tenant, ``claim``'s); this replica's waiters keep that order locally. With Redis
        unreachable it is this replica's own queue."""
        reject = attempt.outcome
        assert isinstance(reject, Reject)
        answer = attempt.answer
        key = (demand.cluster, demand.class_name)
        shared = self._shared if self.mode == "redis" else None  # then the answer is Redis's
        queued = self.waiters.depth(*key)
        ahead, ahead_tokens = self.waiters.ahead(*key, claim.tenant)
        if shared is not None and answer is not None:
            queued, ahead, ahead_tokens = fleet_wide(answer)
        decision = queue_verdict(
            reject, attempt.demand, answer, policy, ahead, ahead_tokens, queued=queued
        )
        joined: Joined | None = None
        if decision is QueueVerdict.WAIT and shared is not None:
            # None when Redis failed: this replica's queue alone.
            joined = await self._join_shared(shared, demand, claim, policy)
            if joined is not None and not joined.joined:
                decision, queued, ahead, ahead_tokens = (
                    QueueVerdict.OVERFLOW,
                    joined.ahead,
                    joined.ahead,
                    joined.ahead_tokens,
                )
        if decision is QueueVerdict.WAIT:
            assert answer is not None  # queue_verdict waits only on a ledger's refusal
            waiter = self.waiters.join(key, claim, demand.tokens, joined)
            return Queued(
                self,
                demand,
                waiter,
                policy,
                poll_s,
                self._clock,
                self._rng,
                self._clock(),
                answer,
                claim,
            )
        if decision is not QueueVerdict.NO_WAIT:
            self._m.waits.labels(demand.class_name, decision.value).inc()
        return queue_refusal(
            decision,
            reject,
            attempt.demand,
            answer,
            policy,
            ahead,
            ahead_tokens,
            self._rng,
            queued=queued,
        )

    async def _join_shared(
        self,
        shared: RedisLedger,
        demand: Demand,
        claim: FairClaim,
        policy: WaitPolicy,
    ) -> Joined | None:
        ticket = shared.new_ticket()
        try:
            joined = await shared.join(
                demand.cluster,
                demand.class_name,
                ticket,
                claim.tenant,
                claim.increment,
                demand.tokens,
                policy.max_queue,
            )
        except LedgerUnavailable as exc:
            # The join may have run; its ticket, unknown here, lapses with its lease.
            self._redis_failed("join", exc)
            return None
        self._redis_ok()
        return joined

    def charge(self, fair: FairCharge, service: float) -> None:
        """A request served through a contended queue was served ``service`` more (its
        output): its tenant's counter advances in this replica's queue and, in the
        background, in the fleet-wide one (lost with Redis: fairness is then a little
        less exact, nothing else)."""
        if service <= 0:
            return
        key = (fair.cluster, fair.class_name)
        self.waiters.charge(key, fair.tenant, service, fair.weight)
        shared = self._shared if self.mode == "redis" else None
        if shared is None:
            return
        increment = service / max(fair.weight, 1e-9)

        async def charge() -> None:
            try:
                await shared.charge(fair.cluster, fair.class_name, fair.tenant, increment)
            except LedgerUnavailable as exc:
                self._redis_failed("charge", exc)

        task = asyncio.ensure_future(charge())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def leave_shared(self, cluster: str, class_name: str, ticket: str) -> None:
        """Withdraw a waiter's ticket from the fleet-wide queue, in the background (the
        waiter is gone already; a withdrawal Redis does not take lapses with its lease)."""
        shared = self._shared
        if shared is None:
            return

        async def leave() -> None:
            try:
                await shared.leave(cluster, class_name, ticket)
            except LedgerUnavailable as exc:
                self._redis_failed("leave", exc)

        task = asyncio.ensure_future(leave())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _touch_loop(self, shared: RedisLedger) -> None:
        """Renew this replica's queue tickets, three times per lease: a dead replica's lapse
        within TICKET_LEASE_S and stop holding up the fleet-wide queue."""
        while True:
            await asyncio.sleep(TICKET_LEASE_S / 3)
            if not self._health.up:
                continue
            for (cluster, class_name), tickets in self.waiters.tickets().items():
                try:
                    await shared.touch(cluster, class_name, tickets)
                except LedgerUnavailable as exc:
                    # Left to the next round: the lease outlasts three of them.
                    self._redis_failed("touch", exc)
                    break
                except Exception:
                    # A bug here must not stop renewal for good: every waiter would lose
                    # its place. Log it and try again next round.
                    log.exception("queue ticket renewal failed")
                    break

    async def move(self, ticket: Ticket, cluster: str, budget: Budget) -> Ticket:
        """Charge a running request to ``cluster`` instead of ``ticket.cluster`` (Envoy failed
        it over): reserve there, then release the old reservation. Returns the ticket to hold.

        The reserve is unconditional: the request is already running on ``cluster``, refusing
        it now would only make the ledger lie. A charge that takes the compartment past its
        budget is counted (``over_budget``); new requests see it and are refused until it
        ends. The token-rate bucket is not charged twice (the admission drew from it).
        """
        held = self._held.get(ticket.lease)
        if ticket.cluster == cluster or held is None:
            return ticket
        # No caps: what is reserved is exactly this request's tokens and one request (and its
        # tenant's count, which moves with it).
        tenant = TenantClaim(held.tenant) if held.tenant is not None else None
        demand = Demand(cluster, ticket.class_name, ticket.tokens, budget, Budget(), tenant)
        answer: LedgerAnswer | None = None
        # The held ticket's ledger (a local one may have been adopted into Redis since).
        if held.store != self._local.store and self._shared is not None and self._redis_due():
            answer = await self._reserve_shared(self._shared, demand)
        if answer is None:
            local = self._reserve_local(demand)
            if isinstance(local, Reject):
                return ticket  # cannot happen without limits; keep the charge where it is
            answer = local
        moved = answer.ticket
        if not answer.granted or moved is None:
            return ticket  # cannot happen without caps; keep the charge where it is
        limits = budget.resolved()
        if held.store == self._local.store or moved.store == self._local.store:
            limits = limits.share(self._replicas)
        usage = answer.usage
        over = (
            limits.max_inflight_tokens and usage.inflight_tokens > limits.max_inflight_tokens
        ) or (limits.max_concurrent and usage.concurrent > limits.max_concurrent)
        self._track(moved)
        self._m.charges_moved.labels(ticket.class_name, "over_budget" if over else "moved").inc()
        await self.release(ticket)
        return moved

    async def _reserve_shared(
        self, shared: RedisLedger, demand: Demand, queue: str = ""
    ) -> LedgerAnswer | None:
        started = self._clock()
        lease = shared.new_lease()
        tenant = demand.tenant.key if demand.tenant is not None else None
        try:
            answer = await shared.reserve(demand, lease, queue)
        except LedgerUnavailable as exc:
            self._settle(shared, demand.cluster, demand.class_name, lease, tenant)
            self._redis_failed("reserve", exc)
            return None
        except asyncio.CancelledError:
            # The stream went away mid-call; Redis may still run (or have run) the reserve.
            self._settle(shared, demand.cluster, demand.class_name, lease, tenant)
            raise
        except Exception as exc:
            # Not a connectivity problem (e.g. a reply this code cannot parse): still never
            # a crashed stream. Treated like an outage, with the traceback in the log.
            log.exception("redis ledger reserve failed unexpectedly")
            self._settle(shared, demand.cluster, demand.class_name, lease, tenant)
            self._redis_failed("reserve", exc)
            return None
        finally:
            self._m.redis_seconds.labels("reserve").observe(self._clock() - started)
        self._redis_ok()
        return answer

    # -- reconciliation ---------------------------------------------------------------------

    @property
    def unsettled(self) -> int:
        """Cancels and releases still waiting for Redis to acknowledge them."""
        return len(self._unsettled)

    def _settle(
        self,
        shared: RedisLedger,
        cluster: str,
        class_name: str,
        lease: str,
        tenant: str | None = None,
    ) -> None:
        """Cancel ``lease`` in the background: now, and again every probe interval until Redis
        answers (shielded from the caller's cancellation, which may be what got us here)."""
        self._keep_unsettled(lease, cluster, class_name, tenant)
        task = asyncio.ensure_future(self._flush_unsettled(shared, [lease]))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _keep_unsettled(
        self, lease: str, cluster: str, class_name: str, tenant: str | None = None
    ) -> None:
        if len(self._unsettled) < MAX_UNSETTLED:
            self._unsettled[lease] = (cluster, class_name, tenant)
            self._m.unsettled.set(len(self._unsettled))
            self._nudge.set()

    async def _flush_unsettled(self, shared: RedisLedger, only: list[str] | None = None) -> None:
        leases = [
            lease
            for lease in (only or list(self._unsettled))
            if lease in self._unsettled and lease not in self._settling
        ]
        if not leases:
            return
        self._settling.update(leases)
        batch = [(*self._unsettled[lease][:2], lease) for lease in leases]
        tenants = {
            lease: tenant for lease in leases if (tenant := self._unsettled[lease][2]) is not None
        }
        started = self._clock()
        try:
            removed = await shared.cancel_many(batch, tenants)
        except LedgerUnavailable as exc:
            self._redis_failed("cancel", exc)
            return
        except Exception:
            # Runs in the background with no one awaiting it: handle everything here.
            log.exception("ledger reconciliation failed")
            return
        finally:
            self._settling.difference_update(leases)
            self._m.redis_seconds.labels("cancel").observe(self._clock() - started)
        for lease in leases:
            self._unsettled.pop(lease, None)
        self._m.unsettled.set(len(self._unsettled))
        self._m.reconciled.labels("phantom_removed").inc(removed)
        self._m.reconciled.labels("not_reserved").inc(len(leases) - removed)
        self._redis_ok()

    def _count_reject(self, reject: Reject) -> None:
        result = {413: "too_large", 503: "unavailable"}.get(reject.status, "rejected")
        self._m.admissions.labels(reject.class_name, result).inc()
        self._m.rejections.labels(reject.class_name, str(reject.status), reject.reason).inc()

    def _series(self, ticket: Ticket) -> _Series:
        # labels() costs more than the whole in-memory reservation: resolve each once.
        key = (ticket.cluster, ticket.class_name, ticket.store)
        series = self._series_cache.get(key)
        if series is None:
            series = self._series_cache[key] = _Series(
                self._m.inflight_tokens.labels(ticket.cluster, ticket.class_name),
                self._m.inflight_requests.labels(ticket.cluster, ticket.class_name),
                self._m.leases_held.labels(ticket.store),
                self._m.admissions.labels(ticket.class_name, "admitted"),
            )
        return series

    def _redis_usage(self, demand: Demand) -> CompartmentUsage | None:
        held = self._redis_held.get((demand.cluster, demand.class_name))
        return CompartmentUsage(held[0], held[1]) if held else None

    def _track(self, ticket: Ticket, key: str | None = None, admitted: bool = True) -> None:
        """Hold ``ticket`` under ``key`` (its own lease id unless it was adopted: then the
        lease id of the local ticket the request still holds)."""
        self._held[key or ticket.lease] = ticket
        if ticket.store != self._local.store:
            held = self._redis_held.setdefault((ticket.cluster, ticket.class_name), [0, 0])
            held[0] += ticket.tokens
            held[1] += 1
        series = self._series(ticket)
        series.tokens.inc(ticket.tokens)
        series.requests.inc()
        series.leases.inc()
        if admitted:
            series.admitted.inc()

    def _untrack(self, ticket: Ticket) -> None:
        if ticket.store != self._local.store:
            key = (ticket.cluster, ticket.class_name)
            held = self._redis_held.get(key)
            if held is not None:
                held[0] -= ticket.tokens
                held[1] -= 1
                if held[1] <= 0:
                    del self._redis_held[key]
        series = self._series(ticket)
        series.tokens.dec(ticket.tokens)
        series.requests.dec()
        series.leases.dec()

    # -- release ----------------------------------------------------------------------------

    def release_if_local(self, ticket: Ticket) -> bool:
        """Give back a ticket of the in-memory ledger at once (no await, so nothing to shield
        and no task: the common case, one per request), or an already released one; False for
        a Redis ticket, which :meth:`release` gives back."""
        held = self._held.get(ticket.lease)
        if held is None:
            return True
        if held.store != self._local.store:
            return False
        del self._held[ticket.lease]
        self._untrack(held)
        self._release_local(held)
        self.waiters.freed(held.cluster, held.class_name)
        return True

    async def release(self, ticket: Ticket) -> None:
        """Give a reservation back. Idempotent; logs and counts failures instead of raising.

        The Redis call is shielded: if the caller is cancelled meanwhile (its stream is torn
        down twice) the release still completes, and only the caller sees CancelledError.
        """
        try:
            if self.release_if_local(ticket):
                return
            held = self._held.pop(ticket.lease, None)
            if held is None:
                return
            self._untrack(held)
            if self._shared is None:
                raise RuntimeError(f"ticket from ledger {held.store!r}, which this gate lacks")
            task = asyncio.ensure_future(self._release_shared(self._shared, held))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            await asyncio.shield(task)
            # This replica's own waiters need no round trip through pub/sub.
            self.waiters.freed(held.cluster, held.class_name)
        except Exception:
            self._m.release_errors.inc()
            log.exception("budget release failed", extra={"request_class": ticket.class_name})

    async def _release_shared(self, shared: RedisLedger, ticket: Ticket) -> None:
        started = self._clock()
        try:
            await shared.release(ticket)
        except LedgerUnavailable as exc:
            # Retried with the reconciliation; in any case the lease is no longer renewed,
            # so Redis frees it within the lease TTL.
            self._m.release_errors.inc()
            self._keep_unsettled(ticket.lease, ticket.cluster, ticket.class_name, ticket.tenant)
            self._redis_failed("release", exc)
            return
        except Exception:
            # This runs shielded, possibly with no one awaiting it: handle everything here.
            self._m.release_errors.inc()
            log.exception("budget release failed", extra={"request_class": ticket.class_name})
            return
        finally:
            self._m.redis_seconds.labels("release").observe(self._clock() - started)
        self._redis_ok()

    # -- Redis health -----------------------------------------------------------------------

    def _health_changed(self, up: bool) -> None:
        self._m.set_mode("redis" if up else "local")
        if up:
            self._adopt_soon()

    # -- adoption of local reservations -----------------------------------------------------

    @property
    def held_locally(self) -> int:
        """Reservations of the local ledger this gate holds (with Redis: admitted during an
        outage and not adopted yet)."""
        return sum(1 for t in self._held.values() if t.store == self._local.store)

    def _adopt_soon(self) -> None:
        """Start adopting the local reservations in the background (Redis answered again)."""
        if self._shared is None or (self._adopting is not None and not self._adopting.done()):
            return
        if not self.held_locally:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a synchronous caller): the next tick adopts
        task = loop.create_task(self._adopt_in_background(), name="ledger-adopt")
        self._adopting = task
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _adopt_in_background(self) -> None:
        try:
            await self.adopt_local()
        except Exception:
            # No one awaits this task: a bug here is logged, and the next tick tries again.
            log.exception("adopting local reservations failed")

    async def adopt_local(self) -> int:
        """Write every reservation admitted on the local share into Redis, each under a Redis
        lease of its own, and give the local one back; the request keeps its ticket (its
        lease id now maps to the Redis one). Stops at the first failure (the rest stay local
        until Redis answers again). Returns how many were adopted.

        Without this, the other replicas would not see requests admitted during an outage
        that are still running, and would admit a whole budget beside them."""
        shared = self._shared
        if shared is None:
            return 0
        async with self._adopt_lock:
            return await self._adopt(shared)

    async def _adopt(self, shared: RedisLedger) -> int:
        adopted = 0
        for key, ticket in list(self._held.items()):
            if ticket.store != self._local.store:
                continue
            if not self._redis_due():
                break
            # No caps: the request is running; the reserve only records it (and its tenant).
            tenant = TenantClaim(ticket.tenant) if ticket.tenant is not None else None
            demand = Demand(
                ticket.cluster, ticket.class_name, ticket.tokens, Budget(), Budget(), tenant
            )
            answer = await self._reserve_shared(shared, demand)
            if answer is None or answer.ticket is None:
                break
            copy = answer.ticket
            if self._held.get(key) is not ticket:
                # Released (or moved) while the reserve was in flight: take the copy back.
                self._settle(shared, copy.cluster, copy.class_name, copy.lease, copy.tenant)
                continue
            self._untrack(ticket)
            self._release_local(ticket)
            self._track(copy, key=key, admitted=False)
            adopted += 1
        if adopted:
            self._m.adopted.inc(adopted)
            log.info("adopted local reservations into redis", extra={"adopted": adopted})
        return adopted

    def _redis_due(self) -> bool:
        return self._health.due(self._clock())

    def _redis_failed(self, op: str, exc: Exception) -> None:
        self._m.redis_errors.labels(op).inc()
        self._health.failed(self._clock())
        self._nudge.set()
        suppressed = self._throttle.allow("redis_down")
        if suppressed is not None:
            log.warning(
                "redis ledger unavailable; %s",
                "admitting against local budget shares"
                if self._on_unavailable == "local"
                else "rejecting budgeted requests with 503",
                extra={"op": op, "error": str(exc), "suppressed": suppressed},
            )

    def _redis_ok(self) -> None:
        if not self._health.succeeded():
            return
        suppressed = self._throttle.allow("redis_up")
        if suppressed is not None:
            log.info("redis ledger reachable again; shared budgets in force")

    async def check_redis(self) -> bool:
        """Ping Redis (one bounded round trip) and update the mode: readiness needs to see an
        outage or a recovery even when no request has touched the ledger lately."""
        shared = self._shared
        if shared is None:
            return False
        try:
            await shared.ping()
        except LedgerUnavailable as exc:
            self._redis_failed("ping", exc)
            return False
        self._redis_ok()
        return True

    # -- lease renewal ----------------------------------------------------------------------

    async def renew_once(self) -> None:
        """One renewal: extend every Redis lease this replica holds (pipelined, chunked per
        compartment, see RedisLedger.renew).

        With nothing to renew while Redis is marked down, it pings instead, so the gate
        returns to Redis even without traffic.
        """
        shared = self._shared
        if shared is None:
            return
        self._last_renew = self._clock()
        tickets = [t for t in self._held.values() if t.store == shared.store]
        started = self._clock()
        try:
            if tickets:
                lost = await shared.renew(tickets)
                self._m.redis_seconds.labels("renew").observe(self._clock() - started)
                if lost:
                    self._m.leases_lost.inc(len(lost))
                    if self._throttle.allow("leases_lost") is not None:
                        log.warning("redis no longer had %d of our leases", len(lost))
            elif not self._health.up and self._redis_due():
                await shared.ping()
            else:
                return
        except LedgerUnavailable as exc:
            self._redis_failed("renew", exc)
            return
        self._redis_ok()

    def _renew_due_in(self) -> float:
        return self._last_renew + self._renew_interval_s - self._clock()

    async def tick(self) -> None:
        """The background step: renew when a renewal period has passed, probe a down Redis
        when its probe interval has, and retry unsettled cancels and releases."""
        shared = self._shared
        if shared is None:
            return
        if self._renew_due_in() <= 0:
            await self.renew_once()
        elif not self._health.up and self._redis_due() and not self._unsettled:
            await self.check_redis()
        if self._unsettled and self._redis_due():
            await self._flush_unsettled(shared)
        if self._health.up:
            self._adopt_soon()  # a run cut short by a failure, or a change seen with no loop

    def _loop_wait(self) -> float:
        """Until the next renewal is due; while Redis is down or something waits to be
        settled, at most one probe interval."""
        wait = self._renew_due_in()
        if self._unsettled or not self._health.up:
            wait = min(wait, self._health.probe_interval_s)
        return max(0.005, wait)

    async def _sleep_until_due(self) -> None:
        """Sleep :meth:`_loop_wait`; a nudge (a cancel left to settle, Redis found down)
        shortens the sleep to what is due now, and never lengthens it: a stream of failures
        cannot keep postponing the tick."""
        deadline = self._clock() + self._loop_wait()
        while (left := deadline - self._clock()) > 0:
            self._nudge.clear()
            try:
                # Not asyncio.wait_for: on Python 3.11 it swallows a cancel (close()) that
                # arrives just as the nudge is set, and the loop would then never end.
                async with asyncio.timeout(left):
                    await self._nudge.wait()
            except TimeoutError:
                return
            deadline = min(deadline, self._clock() + self._loop_wait())

    async def _renew_loop(self) -> None:
        while True:
            await self._sleep_until_due()
            try:
                await self.tick()
            except Exception:
                # A bug here must not stop renewal for good: leases would lapse under
                # long requests. Log it and try again next tick.
                log.exception("lease renewal tick failed")

    async def start(self) -> None:
        if self._shared is not None:
            try:
                await self._shared.load()
                await self._check_eviction(self._shared)
            except LedgerUnavailable as exc:
                self._redis_failed("load", exc)
            self._renewer = asyncio.create_task(self._renew_loop(), name="ledger-renew")
            self._toucher = asyncio.create_task(
                self._touch_loop(self._shared), name="ledger-queue-tickets"
            )
        if self._shared is not None and self._release_notices:
            subscribed = asyncio.Event()
            self._wakeups = asyncio.create_task(
                listen_for_releases(
                    self._shared, self.waiters, self._health.probe_interval_s, subscribed
                ),
                name="ledger-wakeups",
            )
            # Subscribed before the first admission (bounded: Redis may be down at start, and
            # the listener keeps trying on its own).
            try:
                async with asyncio.timeout(max(1.0, 4 * self._shared.timeout_s)):
                    await subscribed.wait()
            except TimeoutError:
                log.warning("release notices not subscribed yet; waiters re-check periodically")

    async def _check_eviction(self, shared: RedisLedger) -> None:
        """Warn (log, readiness) when Redis may evict ledger keys: every ledger key has a TTL,
        so any ``volatile-*`` or ``allkeys-*`` policy can drop leases and in-flight counts
        under memory pressure, which silently frees budget (RELIABILITY.md)."""
        policy = await shared.eviction_policy()
        if policy is None or policy == "noeviction":
            self.warnings = []
            return
        self.warnings = [
            f"redis maxmemory-policy is {policy}: under memory pressure Redis may evict "
            "budget ledger keys and free budget that is in use; use noeviction for the ledger's "
            "Redis (and keep session state in a Redis of its own if it needs eviction)"
        ]
        log.warning(self.warnings[0])

    async def close(self) -> None:
        if self._wakeups is not None:
            self._wakeups.cancel()
            await asyncio.gather(self._wakeups, return_exceptions=True)
            self._wakeups = None
        for task in (self._renewer, self._toucher):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._renewer = self._toucher = None
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self._local.close()
        if self._shared is not None:
            await self._shared.close()


def fleet_wide(answer: LedgerAnswer) -> tuple[int, int, int]:
    """(waiters, the waiters a new request of the demand's queue tenant would follow, their
    tokens) in the fleet-wide queue, as the Redis ledger's ``answer`` counted them."""
    return answer.queued, answer.queued_ahead, answer.queued_ahead_tokens


def workers_problem(runtime: Runtime, workers: int) -> str | None:
    """Why ``workers`` processes cannot enforce ``runtime``'s budgets, or None when they can.

    Without a shared ledger each worker would hold its own copy of every budget. Neither a
    full copy (N x the budget) nor a 1/N share is the configured budget: Envoy multiplexes
    every stream on one HTTP/2 connection, which one worker accepts, so a share refuses
    requests that fit (and answers 413 to a request larger than the share).
    """
    if workers <= 1 or runtime.redis.url:  # overrides (--redis-url, $FLEET_REDIS_URL) included
        return None
    budgeted = [cls.name for cls in runtime.policy.all_classes() if cls.budget.enforced]
    if not budgeted:
        return None
    return (
        f"processor.workers is {workers} but no redis.url is set, and classes "
        f"{', '.join(budgeted)} have budgets: separate worker processes cannot enforce one "
        "budget without a shared ledger. Set redis.url (or FLEET_REDIS_URL / --redis-url) so "
        "the workers share it, or run one worker per processor (workers: 1) and add replicas."
    )


def build_gate(
    runtime: Runtime,
    registry: CollectorRegistry,
    clock: Callable[[], float],
    rng: Random,
    redis_url_override: str | None = None,
    *,
    probe_interval_s: float = 1.0,
    health: RedisHealth | None = None,
) -> AdmissionGate:
    """The gate for a runtime's ``redis`` section; in-memory only when no URL is configured.

    The Redis settings are read once here; budgets come from each request's route, so a
    reloaded runtime's budgets apply to the next admission without rebuilding the gate.
    """
    cfg = runtime.redis
    url = redis_url_override or cfg.url
    shared = (
        RedisLedger.from_url(
            url,
            prefix=cfg.key_prefix,
            lease_ttl_s=cfg.lease_ttl_s,
            timeout_s=cfg.timeout_s,
        )
        if url
        else None
    )
    gate = AdmissionGate(
        local=MemoryLedger(clock),
        shared=shared,
        metrics=LedgerMetrics(registry),
        clock=clock,
        rng=rng,
        on_unavailable=cfg.on_unavailable,
        replicas=cfg.replicas,
        probe_interval_s=probe_interval_s,
        health=health,
        release_notices=runtime.flow_redis_notices,
    )
    gate.publish_limits(runtime)
    return gate
