"""A rolling restart of two processor replicas under steady streaming traffic loses nothing.

Two replicas behind Envoy's extproc cluster (gRPC health checks), a shared Redis ledger, two
simulated clusters counting requests in flight per class, and eight OpenAI-SDK workers streaming
~3 s responses back to back against a budget smaller than the demand (so the budget is always
full and any budget released too early would show at the upstreams). Each replica in turn gets
SIGTERM, drains, exits, comes back, and is seen healthy by Envoy before the next one goes.

With failure_mode closed and open: no response is truncated or fails, no request reaches an
upstream without the processor's class (nothing failed open), Envoy saw no failed ext_proc
stream, each upstream never ran more requests of the class at once than its budget, and the
ledger is empty at the end.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
import redis

from extproc.harness.launch import FleetStack, http_get, wait_until
from tests.e2e.streaming_traffic import StreamingTraffic
from tests.support.flow import NO_PLACEMENT, refused_at_once
from tests.support.redis_server import RedisServer

# Generous: on a starved machine a processor takes tens of seconds to start (seen at load 25).
pytestmark = pytest.mark.timeout(300)

BUDGET = 3  # max_concurrent per cluster for the one class
WORKERS = 8  # more streams wanted than 2 clusters x BUDGET admit


def _concurrency(stack: FleetStack, name: str) -> dict[str, Any]:
    status, body = http_get(stack.sim_specs[name].port, "/admin/concurrency")
    assert status == 200
    doc: dict[str, Any] = orjson.loads(body)
    return doc


def _warnings(stack: FleetStack) -> list[str]:
    """The processors' warnings (e.g. the ledger falling back to local shares), for messages."""
    lines = []
    for path in sorted(stack.workdir.glob("extproc-*.log")):
        lines += [ln[:300] for ln in path.read_text().splitlines() if '"level":"warning"' in ln]
    return lines


def _drain_lines(log: str) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in log.splitlines() if '"msg":"draining"' in line]


@pytest.mark.parametrize("failure_mode", ["closed", "open"])
def test_rolling_restart_under_streaming_traffic(
    failure_mode: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    classes = [{"name": "chat", "budget": {"max_concurrent": BUDGET}}]
    with RedisServer() as redis_server:
        stack = FleetStack(
            tmp_path_factory.mktemp(f"roll-{failure_mode}"),
            clusters=2,
            processors=2,
            # 48 tokens at 16 tokens/s: each stream runs ~3 s, sent in ~60 ms chunks.
            sim_args=("--time-scale", "1", "--decode-tps", "16", "--max-output", "64"),
            fleet_overrides={
                "classes": refused_at_once(classes),
                "flow": NO_PLACEMENT,
                # A loaded test machine can take more than the default 50 ms to answer; a replica
                # that fell back to local budget shares would not enforce the fleet-wide one.
                "redis": {"url": redis_server.url, "timeout_ms": 3000, "replicas": 2},
                "processor": {"failure_mode": failure_mode},
            },
        )
        with stack:
            traffic = StreamingTraffic(stack.url, workers=WORKERS, max_tokens=48).start()
            try:
                # Streams in flight on both clusters before the first replica goes.
                wait_until(
                    lambda: all(
                        _concurrency(stack, n)["inflight"].get("chat") for n in stack.sim_specs
                    ),
                    30,
                    "streams in flight",
                    0.1,
                )
                codes = []
                for index in range(len(stack.procs)):
                    old_log = stack.procs[index].log_path
                    codes.append(stack.roll_processor(index))
                    drains = _drain_lines(old_log.read_text())
                    assert drains and drains[-1]["streams"] > 0, drains
                # Traffic goes on through the two new replicas.
                done = traffic.count("complete")
                wait_until(
                    lambda: traffic.count("complete") >= done + 2, 30, "traffic after roll", 0.1
                )
            finally:
                traffic.stop()
            problems = "\n".join(traffic.problems[:20])
            assert codes == [0, 0]
            assert traffic.count("truncated") == 0, problems
            assert traffic.count("failed") == 0, problems
            assert traffic.count("complete") >= 12, traffic.outcomes
            assert traffic.count("rejected") > 0, traffic.outcomes  # the budget was full
            # Nothing failed open or closed at Envoy's ext_proc filter.
            for stat in ("streams_failed", "failure_mode_allowed", "message_timeouts"):
                assert stack.envoy_stat(f"http.ingress.ext_proc.{stat}") == 0, stat
            peaks = {name: _concurrency(stack, name) for name in stack.sim_specs}
            for name, doc in peaks.items():
                assert set(doc["total"]) == {"chat"}, (name, doc)  # never unclassified
                assert doc["peak"]["chat"] <= BUDGET, (name, doc, _warnings(stack))
            # The budget was reached: a check that it is never exceeded means something.
            assert max(doc["peak"]["chat"] for doc in peaks.values()) == BUDGET, peaks
        # Every reservation was released when its request ended.
        r = redis.Redis.from_url(redis_server.url)
        try:
            states = [r.hgetall(key) for key in r.scan_iter("fleet:*:state")]
            assert states
            for state in states:
                assert int(state.get(b"count", b"0")) == 0, state
        finally:
            r.close()
