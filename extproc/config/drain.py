"""How long a processor replica drains on SIGTERM, derived from fleet.yaml.

A deploy must not cut a running request, nor release its budget early: the replica keeps the
ext_proc stream of every request in flight open until Envoy ends it with the request (the
budget is released then). Envoy keeps that stream open for the whole HTTP exchange, so the
drain lasts as long as the longest request in flight.

The default bound is the longest request the config allows: receiving it
(``request_receive_timeout_s``), the processor's two request phases (headers, then the whole
body), each within Envoy's ext_proc ``message_timeout`` (counted on top, though Envoy's receive
timer may already cover them), then the route timeout, which Envoy starts once the whole request
was received and which covers every retry and the last byte of a streamed response. A request
over its class budget may also wait for budget between its body and its route
(extproc/core/flow.py): the longest wait of a class that has a budget is counted on top. With
``route_timeout_s: 0`` (the default: no timer ends a generation) or no receive timeout nothing
bounds a request, and the default drain waits for every one of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from extproc.config.schema import ClassConfig, FleetConfig

# Beyond the drain itself: closing the ledger, the shared session store and the admin server.
SHUTDOWN_MARGIN_S = 5.0
# Kubernetes needs a number. When the config lets requests run for ever, a terminating pod may
# take up to a day; it exits as soon as its last request ends, so this costs only a pod slot
# while real requests still run. processor.drain_timeout_s sets a real bound.
UNBOUNDED_TERMINATION_GRACE_S = 24 * 3600


@dataclass(frozen=True, slots=True)
class DrainTimes:
    # After NOT_SERVING, new streams are still taken this long (Envoy moves them elsewhere).
    delay_s: float
    # Then in-flight streams are served at most this much longer; None: until they all end.
    limit_s: float | None

    @property
    def total_s(self) -> float | None:
        """The longest a drain can take, from SIGTERM to the last stream; None: unbounded."""
        return None if self.limit_s is None else self.delay_s + self.limit_s


def longest_request_s(config: FleetConfig) -> float | None:
    """The longest an ext_proc stream can stay open under this config; None: no bound."""
    listener = config.listener
    route, receive = listener.route_timeout_s, listener.request_receive_timeout_s
    if route <= 0 or receive <= 0:
        return None
    phases = 2 * config.processor.message_timeout_ms / 1000
    return receive + phases + longest_wait_s(config) + route


def _budgeted(config: FleetConfig, cls: ClassConfig) -> bool:
    budgets = [cls.budget, cls.prefill_budget]
    budgets += [m.budgets[cls.name] for m in config.models if cls.name in m.budgets]
    return any(b.max_inflight_tokens or b.max_concurrent or b.tokens_per_second for b in budgets)


def longest_wait_s(config: FleetConfig) -> float:
    """The longest a request can wait for budget under this config (0: none can wait)."""
    return max((c.max_wait_s for c in config.classes if _budgeted(config, c)), default=0.0)


def drain_times(
    config: FleetConfig, limit_s: float | None = None, delay_s: float | None = None
) -> DrainTimes:
    """Drain times from the config; ``limit_s`` / ``delay_s`` override it (serve's flags)."""
    proc = config.processor
    delay = proc.drain_delay_s if delay_s is None else delay_s
    if limit_s is None:
        limit_s = proc.drain_timeout_s
    if limit_s is None:
        limit_s = longest_request_s(config)
    return DrainTimes(delay, limit_s)


def termination_grace_s(config: FleetConfig) -> int:
    """Kubernetes terminationGracePeriodSeconds that lets the drain run to its end."""
    total = drain_times(config).total_s
    if total is None:
        return UNBOUNDED_TERMINATION_GRACE_S
    return math.ceil(total + SHUTDOWN_MARGIN_S)
