"""A wrong ``redis.replicas`` is detected: replicas announce themselves in a real Redis (single
node and Cluster) and warn, in the log and in /readyz, when the live count differs from the
setting; the replica stays ready."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import orjson
import pytest
import redis
import yaml

from extproc.harness.launch import Proc, http_get, wait_until
from extproc.ledger.census import ReplicaCensus, census_key
from extproc.ledger.redis_client import any_client
from tests.stream.test_ledger_redis import fleet_doc
from tests.support.redis_server import RedisClusterServers, RedisServer

# Long enough that a replica slowed down by a starved machine does not lapse between two
# announcements of the test; the lapse below is waited for, however long it takes.
TTL_S = 3.0


def _census(url: str, configured: int, grace_s: float = 0.0) -> ReplicaCensus:
    # A generous client timeout: on a starved machine a Redis Cluster client whose start-up
    # discovery timed out leaves connections behind (a ResourceWarning the suite treats as an
    # error), which is not what this test is about.
    client = any_client(url, 30.0, 2)
    return ReplicaCensus(client, "fleet", configured, ttl_s=TTL_S, grace_s=grace_s)


async def _count_and_lapse(url: str) -> None:
    one, two = _census(url, 1), _census(url, 1)
    try:
        assert await one.announce(0.0) == 1
        assert one.warnings == []
        assert await two.announce(0.0) == 2
        # Two replicas against redis.replicas 1: the second sees it at once (no grace here),
        # and names the count to set.
        assert two.warnings and "redis.replicas is 1 but 2" in two.warnings[0]
        assert await one.announce(0.0) == 2 and one.warnings
        # Set right: no warning.
        one.configure(2)
        assert await one.announce(0.0) == 2 and one.warnings == []
        # A replica that stops announcing (SIGKILL) lapses after its TTL, on the Redis clock.
        for _ in range(2400):  # up to two minutes of polling: the lapse is on Redis's clock
            if await one.announce(0.0) == 1:
                break
            await asyncio.sleep(0.05)
        assert one.live == 1 and one.warnings and "redis.replicas is 2 but 1" in one.warnings[0]
        # One that withdraws (drain) is gone at once.
        assert await two.announce(0.0) == 2
        await two.withdraw()
        assert await one.announce(0.0) == 1
    finally:
        await one.aclose()
        await two.aclose()


async def test_replicas_are_counted_and_lapse_on_a_single_redis() -> None:
    with RedisServer() as server:
        await _count_and_lapse(server.url)


async def test_replicas_are_counted_on_a_redis_cluster() -> None:
    with RedisClusterServers() as cluster:
        await _count_and_lapse(cluster.url)


async def test_a_short_mismatch_is_not_a_warning_and_a_failure_changes_nothing() -> None:
    with RedisServer() as server:
        one, two = _census(server.url, 1, grace_s=10.0), _census(server.url, 1, grace_s=10.0)
        try:
            await two.announce(100.0)
            assert await one.announce(100.0) == 2
            # Within the grace (a rollout, a restart's lapse): no warning yet.
            assert await one.announce(105.0) == 2 and one.warnings == []
            assert await one.announce(110.0) == 2 and one.warnings
            assert await server_down(server, one) is None
            assert one.warnings  # Redis failing says nothing about the count
        finally:
            await one.aclose()
            await two.aclose()


async def server_down(server: RedisServer, census: ReplicaCensus) -> int | None:
    server.stop()
    return await census.announce(120.0)


def _serve(tmp: Path, name: str, config: Path) -> tuple[Proc, int]:
    argv = [sys.executable, "-m", "extproc", "serve", "--config", str(config)]
    argv += ["--port", "0", "--metrics-port", "0", "--drain-delay", "0"]
    proc = Proc(name, argv, tmp / f"{name}.log", {"FLEET_SESSION_SECRET": "census-test"})
    proc.start()
    ports: dict[str, str] = {}

    def ready() -> bool:
        if not proc.alive:
            raise RuntimeError(proc.log_text()[-3000:])
        for line in proc.log_text().splitlines():
            if line.startswith("READY "):
                ports.update(kv.split("=") for kv in line.split()[1:])
                return True
        return False

    try:
        wait_until(ready, 60, f"{name} READY")
    except BaseException:
        proc.stop()
        raise
    return proc, int(ports["metrics"])


def _readyz(port: int) -> tuple[int, dict[str, object]]:
    status, body = http_get(port, "/readyz", timeout=5.0)
    return status, orjson.loads(body)


@pytest.mark.parametrize("configured", [1, 2])
def test_serve_warns_in_readyz_and_the_log_when_redis_replicas_is_wrong(
    tmp_path: Path, configured: int
) -> None:
    with RedisServer() as server:
        config = tmp_path / "fleet.yaml"
        doc = fleet_doc(server.url, budget={"max_concurrent": 4}, replicas=configured)
        doc["redis"]["timeout_ms"] = 1000
        config.write_text(yaml.safe_dump(doc))
        procs = [_serve(tmp_path, f"extproc-{i}", config) for i in range(2)]
        try:
            port = procs[0][1]
            # Both processors announced: readiness shows the count against the setting.
            wait_until(
                lambda: _readyz(port)[1]["replicas"] == {"configured": configured, "live": 2},
                60,
                "both replicas counted",
                0.2,
            )
            if configured == 1:
                # Two processors, redis.replicas 1: a warning once the grace (10 s) passed.
                wait_until(lambda: bool(_readyz(port)[1]["warnings"]), 60, "the replica warning")
                status, ready = _readyz(port)
                assert status == 200  # still ready: a detail, not a failure
                warnings = ready["warnings"]
                assert isinstance(warnings, list)
                assert "redis.replicas is 1 but 2" in warnings[0]
                assert "redis.replicas is 1 but 2" in procs[0][0].log_text()
            else:
                status, ready = _readyz(port)
                assert (status, ready["warnings"]) == (200, [])
            # A drained replica withdraws at once.
            procs[1][0].signal(signal.SIGTERM)
            assert procs[1][0].popen is not None
            procs[1][0].popen.wait(60)
            wait_until(lambda: _members(server) == 1, 30, "the drained replica to withdraw", 0.1)
        finally:
            for proc, _port in procs:
                proc.stop()


def _members(server: RedisServer) -> int:
    client = redis.Redis.from_url(server.url)
    try:
        return int(client.zcard(census_key("fleet")))
    finally:
        client.close()
