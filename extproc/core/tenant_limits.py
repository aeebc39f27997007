"""A tenant's own limits inside every class: when a request is over them, and the 429 it gets.

Pure: the counting is the ledger's (extproc/ledger/tenant_limits.py in memory, reserve.lua in
Redis, fleet-wide). The 429 names the tenant's
limit, not the class's: its IETF ``RateLimit-Policy`` items are ``tenant-concurrency`` and
``tenant-rate``, its OpenAI ``x-ratelimit-*-tokens`` and Anthropic ``anthropic-ratelimit-*``
headers carry the tenant's bucket, and its message says it is the tenant's own limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from random import Random

from extproc.core.admission import (
    NO_SIGNAL_WAIT_S,
    Quota,
    Reason,
    Reject,
    bounded_wait,
    jittered_seconds,
    seconds_for,
)
from extproc.core.flow import TenantLimit


@dataclass(frozen=True, slots=True)
class TenantUse:
    """A tenant's use as its limits are enforced: requests in flight, tokens in its bucket."""

    inflight: int
    bucket_tokens: float


def share(limit: TenantLimit, replicas: int) -> TenantLimit:
    """One replica's part of a tenant's limits when each replica counts alone."""
    if replicas <= 1:
        return limit

    def part(value: int | None) -> int | None:
        return None if value is None else max(1, value // replicas)

    return TenantLimit(part(limit.max_concurrent), part(limit.tokens_per_minute))


def refusal(
    limit: TenantLimit,
    use: TenantUse,
    tokens: int,
    class_name: str,
    cluster: str,
    rng: Random,
) -> Reject:
    """The 429 of a request of ``tokens`` that its tenant's ``limit`` (as enforced) refused."""
    waits: dict[Reason, float] = {}
    if limit.max_concurrent is not None and use.inflight >= limit.max_concurrent:
        # No release rate is kept per tenant: a short probe, as a ledger without signal.
        waits[Reason.TENANT_CONCURRENCY] = NO_SIGNAL_WAIT_S
    rate = limit.tokens_per_minute
    if rate is not None:
        need = min(tokens, rate)
        if use.bucket_tokens < need:
            waits[Reason.TENANT_TOKEN_RATE] = seconds_for(need - use.bucket_tokens, rate / 60.0)
    if not waits:  # refused at the same instant another request took the room
        waits[Reason.TENANT_CONCURRENCY] = NO_SIGNAL_WAIT_S
    reason, wait = max(waits.items(), key=lambda kv: kv[1])
    retry_after = jittered_seconds(wait, rng)
    what = "concurrent requests" if reason is Reason.TENANT_CONCURRENCY else "tokens per minute"
    quotas: list[Quota] = []
    if limit.max_concurrent is not None:
        quotas.append(
            Quota(
                "tenant-concurrency",
                limit.max_concurrent,
                "concurrent-requests",
                max(0, limit.max_concurrent - use.inflight),
                reset_s=_whole(waits.get(Reason.TENANT_CONCURRENCY)),
            )
        )
    if rate is not None:
        quotas.append(
            Quota(
                "tenant-rate",
                rate,
                "tokens",
                max(0, math.floor(use.bucket_tokens)),
                window_s=60,
                reset_s=_whole(waits.get(Reason.TENANT_TOKEN_RATE)),
            )
        )
    rate_wait = waits.get(Reason.TENANT_TOKEN_RATE)
    return Reject(
        429,
        class_name,
        cluster,
        f"this tenant is over its own limit of {what} (not the class's budget); "
        f"retry after {retry_after}s",
        reason,
        retry_after_s=retry_after,
        limit_tokens=rate,
        remaining_tokens=None if rate is None else max(0, math.floor(use.bucket_tokens)),
        reset_s=bounded_wait(rate_wait) if rate_wait is not None else None,
        quotas=tuple(quotas),
    )


def _whole(wait: float | None) -> int | None:
    return None if wait is None else max(1, math.ceil(bounded_wait(wait)))
