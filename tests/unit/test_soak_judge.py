"""The soak verdict and the probes it relies on: each bound can fail."""

from __future__ import annotations

import asyncio
import math
import time

from prometheus_client import CollectorRegistry

from extproc.reliability.probes import interval_quantile
from extproc.reliability.soak import Sample, judge
from extproc.serve.loop_monitor import LoopMonitor


def _samples(rss: list[float], fds: list[int]) -> list[Sample]:
    return [
        Sample(
            t_s=60.0 * i,
            rss_mb=r,
            fds=f,
            tasks=10,
            loop_lag_ms=1,
            decision_p99_ms=0.5,
            requests=100 * i,
            streams_active=0,
        )
        for i, (r, f) in enumerate(zip(rss, fds, strict=True))
    ]


def test_steady_run_passes() -> None:
    v = judge(_samples([50, 80, 80, 81, 80, 81, 81], [20] * 7), 60, 5.0, 8, 0, 0)
    assert v.ok, v.problems
    assert v.rss_warm_mb == 80
    assert 0 < v.rss_growth_pct < 5


def test_warmup_growth_is_not_judged_but_later_growth_is() -> None:
    v = judge(_samples([50, 80, 80, 80, 84, 86, 88], [20] * 7), 60, 5.0, 8, 0, 0)
    assert not v.ok
    assert v.rss_growth_pct == 100 * (86 - 80) / 80
    assert "RSS grew" in v.problems[0]


def test_fd_growth_fails() -> None:
    v = judge(_samples([80] * 6, [20, 20, 21, 25, 29, 40]), 60, 5.0, 8, 0, 0)
    assert [p for p in v.problems if "FDs grew from 20 to 40" in p]


def test_held_budget_and_open_streams_fail() -> None:
    v = judge(_samples([80] * 5, [20] * 5), 60, 5.0, 8, held=2, streams=1)
    assert len(v.problems) == 2


def test_too_few_samples_fail() -> None:
    assert not judge(_samples([80, 80], [20, 20]), 600, 5.0, 8, 0, 0).ok


def test_interval_quantile_uses_only_the_interval() -> None:
    before = {0.001: 100.0, 0.01: 100.0, math.inf: 100.0}
    # 100 new observations, 98 under 1 ms, 2 between 1 and 10 ms: p99 is in the 10 ms bucket.
    after = {0.001: 198.0, 0.01: 200.0, math.inf: 200.0}
    assert interval_quantile(before, after, 0.99) == 0.01
    assert interval_quantile(before, after, 0.5) == 0.001
    assert interval_quantile(after, after, 0.99) is None


async def test_loop_monitor_sees_a_blocked_loop_and_counts_tasks() -> None:
    registry = CollectorRegistry()
    monitor = LoopMonitor(registry, interval_s=0.01)
    monitor.start()
    await asyncio.sleep(0.05)
    registry.get_sample_value("fleet_event_loop_lag_seconds")  # reset the window
    time.sleep(0.2)  # noqa: ASYNC251 — block the loop, as a slow synchronous call on the serving path would
    await asyncio.sleep(0.05)
    lag = registry.get_sample_value("fleet_event_loop_lag_seconds")
    assert lag is not None and lag >= 0.1
    tasks = registry.get_sample_value("fleet_asyncio_tasks")
    assert tasks is not None and tasks >= 2  # this test and the monitor
    await monitor.stop()
