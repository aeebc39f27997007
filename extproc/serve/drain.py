"""Draining on SIGTERM: new ext_proc streams move to other replicas, running requests finish.

Envoy keeps a request's ext_proc stream open for the whole HTTP exchange and the budget is
released when that stream ends, so cancelling a stream early is what broke deploys: with
``failure_mode: closed`` Envoy resets the client's request (a truncated response), with
``open`` the request runs on with its budget already released (over-admission). The drain:

1. (the caller) reports NOT_SERVING on the gRPC health service;
2. keeps taking new streams for ``delay_s``: Envoy's active health checks of the extproc
   cluster (1 s apart, two failures: within 3 s) see NOT_SERVING and send new streams to the
   other replicas. A stream refused before Envoy knows would fail (closed) or pass
   unbudgeted (open);
3. stops taking new streams and serves the open ones until they end, at most ``limit_s``
   longer (None: until they all end); only streams still open at that limit are cancelled,
   and their budgets are released as they end.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from extproc.config.drain import DrainTimes

log = logging.getLogger("extproc.serve")

# grpc.aio's stop() cancels every call at once when given None: an unbounded drain passes a
# grace no deploy reaches instead.
FOREVER_S = 10 * 365 * 86400.0


class StoppableServer(Protocol):
    async def stop(self, grace: float | None) -> None: ...


@dataclass(frozen=True, slots=True)
class DrainReport:
    streams_at_signal: int
    streams_at_refuse: int  # open when new streams stopped being taken
    cut: int  # still open at the limit: cancelled
    seconds: float


async def drain(
    server: StoppableServer,
    active: Callable[[], int],
    times: DrainTimes,
    clock: Callable[[], float],
    poll_s: float = 0.05,
) -> DrainReport:
    started = clock()
    at_signal = active()
    log.info(
        "draining",
        extra={"streams": at_signal, "delay_s": times.delay_s, "limit_s": times.limit_s},
    )
    if times.delay_s > 0:
        await asyncio.sleep(times.delay_s)
    at_refuse = active()
    log.info("refusing new streams", extra={"streams": at_refuse})
    grace = FOREVER_S if times.limit_s is None else times.limit_s
    stopping = asyncio.ensure_future(server.stop(grace))
    idle = await _wait_idle(active, times.limit_s, clock, poll_s)
    cut = 0 if idle else active()
    if cut:
        log.warning(
            "drain limit reached: cancelling the streams still open",
            extra={"streams": cut, "limit_s": times.limit_s},
        )
    await stopping
    return DrainReport(at_signal, at_refuse, cut, clock() - started)


async def _wait_idle(
    active: Callable[[], int], limit_s: float | None, clock: Callable[[], float], poll_s: float
) -> bool:
    """True when no stream is open before the limit. Polled: a draining replica has nothing
    better to do, and the servicer stays free of drain bookkeeping."""
    deadline = None if limit_s is None else clock() + limit_s
    while active() > 0:
        if deadline is not None and clock() >= deadline:
            return False
        await asyncio.sleep(poll_s)
    return True
