"""Per-tenant limits: requests in flight and tokens per minute, on top of the class budgets.

This replica's own counts (in memory), used without Redis (by the pipeline) and while Redis is
unreachable (by the gate); with Redis up a tenant is counted fleet-wide by the reserve itself
(extproc/ledger/reserve.lua). With ``redis.replicas`` > 1 the caller passes each replica's share
of every limit (limit / replicas, at least 1), as budgets are shared while Redis is unreachable.
The decision of what an over-limit request gets (a 429 naming the tenant's limit) is the
core's (:func:`extproc.core.tenant_limits.refusal`); this module only counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from extproc.core.flow import TenantLimit
from extproc.core.tenant_limits import TenantUse

# Tenants remembered before idle ones are swept out.
SWEEP_ABOVE = 1024


@dataclass(slots=True)
class _Tenant:
    inflight: int = 0
    level: float = 0.0  # tokens in the bucket
    at: float = 0.0  # when ``level`` was computed


@dataclass(frozen=True, slots=True)
class TenantSlot:
    """What an admitted request holds of its tenant's limits, given back at release."""

    tenant: str
    tokens: int


class TenantLimits:
    """Counts per tenant key; idle tenants are forgotten (their bucket is full again)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._tenants: dict[str, _Tenant] = {}

    def use(self, tenant: str, own: TenantLimit) -> TenantUse:
        """The tenant's use now (bucket refilled) against ``own``, its limits as enforced here."""
        state = self._tenants.get(tenant)
        if state is None:
            return TenantUse(0, float(own.tokens_per_minute or 0))
        return TenantUse(state.inflight, self._level(state, own))

    def _level(self, state: _Tenant, own: TenantLimit) -> float:
        if not own.tokens_per_minute:
            return 0.0
        now = self._clock()
        refill = (now - state.at) * own.tokens_per_minute / 60.0
        state.level = min(float(own.tokens_per_minute), state.level + max(0.0, refill))
        state.at = now
        return state.level

    def take(self, tenant: str, tokens: int, own: TenantLimit) -> TenantSlot | TenantUse:
        """A slot when ``tokens`` fit ``own`` (the tenant's limits as enforced here) now, else
        its use (for the 429)."""
        state = self._tenants.get(tenant)
        if state is None:
            if len(self._tenants) >= SWEEP_ABOVE:
                self._sweep()
            state = self._tenants[tenant] = _Tenant(
                level=float(own.tokens_per_minute or 0), at=self._clock()
            )
        level = self._level(state, own)
        if own.max_concurrent is not None and state.inflight >= own.max_concurrent:
            return TenantUse(state.inflight, level)
        if own.tokens_per_minute is not None and level < min(tokens, own.tokens_per_minute):
            # A request larger than the whole bucket waits for a full one, not forever.
            return TenantUse(state.inflight, level)
        state.inflight += 1
        if own.tokens_per_minute is not None:
            state.level = level - tokens
        return TenantSlot(tenant, tokens)

    def give(self, slot: TenantSlot) -> None:
        state = self._tenants.get(slot.tenant)
        if state is not None:
            state.inflight = max(0, state.inflight - 1)

    def refund(self, slot: TenantSlot, own: TenantLimit) -> None:
        """Undo the :meth:`take` of ``slot`` (with ``own``, the limits it was taken under)
        whose request was then not served (refused by its class budget, timed out in the
        queue, or its client left while it waited): the slot and its tokens go back, as if it
        had never been taken. A served request's slot goes back with :meth:`give` instead."""
        state = self._tenants.get(slot.tenant)
        if state is None:
            return
        state.inflight = max(0, state.inflight - 1)
        if own.tokens_per_minute is not None:
            state.level = min(float(own.tokens_per_minute), state.level + slot.tokens)

    def _sweep(self) -> None:
        # A tenant with nothing in flight whose bucket has had a minute to refill is in the
        # state a new one starts in: forget it, so memory follows the active tenants only.
        now = self._clock()
        idle = [k for k, s in self._tenants.items() if not s.inflight and now - s.at >= 60.0]
        for key in idle:
            del self._tenants[key]

    def __len__(self) -> int:
        return len(self._tenants)
