"""Event-loop health gauges for the processor: scheduling lag and live asyncio tasks.

A leak of streams, watchers or Redis calls shows up as a task count that only grows; a blocked
loop (a slow synchronous call on the serving path) shows up as lag. Both are cheap: one sleep
per interval and a count at scrape time. The soak command (extproc/reliability/soak.py) reads
them from /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge


class LoopMonitor:
    def __init__(
        self,
        registry: CollectorRegistry,
        interval_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._interval = interval_s
        self._clock = clock
        self._worst = 0.0
        self._task: asyncio.Task[None] | None = None
        self.lag = Gauge(
            "fleet_event_loop_lag_seconds",
            "Worst lateness of a timer on the processor's event loop since the last scrape.",
            registry=registry,
        )
        # Read at scrape time, which runs on the loop itself (the admin server shares it).
        self.lag.set_function(self._take_worst)
        self.tasks = Gauge(
            "fleet_asyncio_tasks",
            "asyncio tasks alive on the processor's event loop.",
            registry=registry,
        )
        self.tasks.set_function(_task_count)

    def _take_worst(self) -> float:
        worst, self._worst = self._worst, 0.0
        return worst

    async def _run(self) -> None:
        while True:
            before = self._clock()
            await asyncio.sleep(self._interval)
            late = self._clock() - before - self._interval
            self._worst = max(self._worst, late)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _task_count() -> float:
    try:
        return float(len(asyncio.all_tasks()))
    except RuntimeError:  # scraped off the loop (not how the admin server runs): unknown
        return float("nan")
