"""Immutable descriptions of the fleet that the decision core works on.

The config layer compiles fleet.yaml into these; the core never sees YAML or pydantic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from extproc.core.flow import WaitPolicy


@dataclass(frozen=True, slots=True)
class Cluster:
    name: str
    endpoints: tuple[str, ...]
    weight: float = 1.0
    health_path: str = "/health"


@dataclass(frozen=True, slots=True)
class Budget:
    """Per-cluster capacity granted to one request class (a bulkhead compartment).

    0 means "no cap" for every field: a class without a budget is only routed.
    """

    max_inflight_tokens: int = 0
    max_concurrent: int = 0
    tokens_per_second: float = 0.0
    burst_tokens: int = 0

    @property
    def enforced(self) -> bool:
        return bool(self.max_inflight_tokens or self.max_concurrent or self.tokens_per_second)

    def resolved(self) -> Budget:
        """The budget as a ledger enforces it: ``burst_tokens`` is the token bucket's actual
        capacity (:func:`effective_burst`), so in a resolved budget a burst of 0 means "no
        bucket". A demand's limits are always resolved (extproc.core.admission.plan)."""
        burst = effective_burst(self)
        if burst == self.burst_tokens:
            return self
        return Budget(self.max_inflight_tokens, self.max_concurrent, self.tokens_per_second, burst)

    @property
    def largest_admissible(self) -> int | None:
        """The largest single demand a resolved budget can ever admit (None = unbounded)."""
        caps = [c for c in (self.max_inflight_tokens, self.burst_tokens) if c]
        return min(caps) if caps else None

    def share(self, parts: int) -> Budget:
        """One of ``parts`` equal shares, for a replica or worker that enforces its part alone
        (rate divided; caps by :func:`share_of`)."""
        if parts <= 1:
            return self
        return Budget(
            share_of(self.max_inflight_tokens, parts),
            share_of(self.max_concurrent, parts),
            self.tokens_per_second / parts,
            share_of(self.burst_tokens, parts),
        )


def effective_burst(budget: Budget) -> int:
    """Token-bucket capacity: the configured burst, or one second of refill when it is 0."""
    if not budget.tokens_per_second:
        return 0
    # Capped so an absurd (or infinite) rate still gives an integer a ledger can store.
    return budget.burst_tokens or max(1, math.ceil(min(budget.tokens_per_second, 2.0**53)))


def share_of(cap: int, parts: int) -> int:
    """One of ``parts`` shares of a cap: rounded down, so the parts together never exceed the
    whole, but never below 1, so a capped dimension stays capped (0 means "no cap")."""
    return max(1, cap // parts) if cap else 0


@dataclass(frozen=True, slots=True)
class RequestClass:
    """A request class: an input-token band, optionally limited to some tenant tiers.

    Classes are matched in order, first match wins; ``max_input_tokens`` is exclusive and
    ``None`` means unbounded. ``eligible`` restricts placement to a subset of clusters.
    """

    name: str
    max_input_tokens: int | None = None
    tiers: frozenset[str] = field(default_factory=frozenset)
    eligible: tuple[str, ...] = ()
    budget: Budget = field(default_factory=Budget)
    wait: WaitPolicy = field(default_factory=WaitPolicy)

    def matches(self, input_tokens: int, tier: str | None) -> bool:
        if self.tiers and (tier is None or tier not in self.tiers):
            return False
        return self.max_input_tokens is None or input_tokens < self.max_input_tokens


def classify(
    classes: tuple[RequestClass, ...], input_tokens: int, tier: str | None
) -> RequestClass:
    """First class whose tier set and token band admit the request.

    Config validation guarantees the last class is a catch-all, so this always finds one.
    """
    for cls in classes:
        if cls.matches(input_tokens, tier):
            return cls
    return classes[-1]
