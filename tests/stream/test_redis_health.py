"""One Redis health tracker: what the affinity session store learns, the ledger and readiness see,
and the other way round. Redis here is a loopback port nothing listens on (connection refused at
once), so each failure is immediate and real."""

from __future__ import annotations

import socket
from random import Random

from prometheus_client import CollectorRegistry

from extproc.config import compile_runtime, parse_config
from extproc.core.affinity import AffinityParams
from extproc.core.api import Api
from extproc.core.facts import RequestFacts
from extproc.core.keys import KeySource, hash_key
from extproc.ledger.gate import build_gate
from extproc.ledger.redis_health import RedisHealth
from extproc.pipeline.fleet_state import FleetState, RedisSessions
from extproc.pipeline.metrics import Metrics

PARAMS = AffinityParams(enabled=True)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"  # bound, then closed: nothing listens


def facts() -> RequestFacts:
    session = hash_key(KeySource.HEADER, b"s")
    return RequestFacts(Api.OPENAI_CHAT, "m", session, 10, 4, None, False, 40)


def test_the_tracker_reports_changes_once_and_waits_the_probe_interval() -> None:
    health = RedisHealth(probe_interval_s=2.0)
    seen: list[bool] = []
    health.subscribe(seen.append)
    assert health.up and health.due(0.0)
    assert health.failed(10.0) is True
    assert health.failed(10.5) is False  # already down: no second change
    assert not health.up and not health.due(12.0) and health.due(12.5)
    assert health.succeeded() is True and health.succeeded() is False
    assert seen == [False, True]


async def test_a_session_store_failure_moves_the_ledger_to_local_and_back() -> None:
    url = dead_url()
    clock = Clock()
    health = RedisHealth(probe_interval_s=1.0)
    runtime = compile_runtime(parse_config({
        "version": 1,
        "clusters": [{"name": "c1", "endpoints": ["127.0.0.1:8001"]}],
        "redis": {"url": url, "timeout_ms": 200},
    }))  # fmt: skip
    gate = build_gate(runtime, CollectorRegistry(), clock, Random(1), health=health)
    store = RedisSessions.from_url(url, timeout_s=0.2)
    fleet = FleetState(Metrics(CollectorRegistry()), shared=store, health=health)
    try:
        assert gate.mode == "redis"
        view = await fleet.view(facts(), "c1", clock(), PARAMS)
        assert view.seen is False  # memory answered
        assert not health.up
        # The ledger sees the same outage: new reservations go to the local fallback.
        assert gate.mode == "local"
        # Within the probe interval neither calls Redis; after it, the next call probes.
        assert not health.due(clock() + 0.5) and health.due(clock() + 1.0)
        health.succeeded()  # e.g. the ledger's renewal ping got through
        assert gate.mode == "redis"
    finally:
        await fleet.close()
        await gate.close()
