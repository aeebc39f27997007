"""Ledger keys all carry a TTL, so an eviction policy other than noeviction can drop them under
memory pressure (freeing budget that is in use): the gate checks ``maxmemory-policy`` at start
and reports a warning, which readiness shows."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from tests.stream.test_ledger_redis import gate_for, runtime
from tests.support.redis_server import RedisServer


@pytest.mark.parametrize(
    ("policy", "warned"),
    [("noeviction", False), ("volatile-lru", True), ("allkeys-lru", True)],
)
async def test_an_evicting_redis_is_reported(policy: str, warned: bool) -> None:
    with RedisServer(extra_args=("--maxmemory-policy", policy)) as server:
        gate = await gate_for(
            runtime(server.url, budget={"max_concurrent": 4}, timeout_ms=2000), CollectorRegistry()
        )
        try:
            assert bool(gate.warnings) is warned
            if warned:
                assert policy in gate.warnings[0] and "noeviction" in gate.warnings[0]
        finally:
            await gate.close()
