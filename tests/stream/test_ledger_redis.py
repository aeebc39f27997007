"""The Redis ledger against a real redis-server: round trips, a fleet-wide budget shared by
two gates, leases of a SIGKILLed holder, and Redis outages under load."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from random import Random
from typing import Any, Protocol

import pytest
import redis
from prometheus_client import CollectorRegistry

import extproc.ledger
from extproc.config.load import parse_config
from extproc.config.runtime import Runtime, compile_runtime
from extproc.core.admission import Admitted, Reject, Ticket
from extproc.core.facts import RequestFacts, parse_request
from extproc.core.fleet import Budget
from extproc.ledger.gate import AdmissionGate, build_gate
from extproc.ledger.redis import RedisLedger
from tests.support.redis_server import RedisServer

LUA = Path(extproc.ledger.__file__).parent
# How long a step may take before the test calls it hung: generous, for a starved machine.
HANG_S = 60.0
# Admissions in a row through Redis that show a gate recovered after an outage.
RECOVERED_RUN = 5
# Commands the Lua scripts run inside Redis: INFO commandstats counts them too, but they
# cost no round trip. Everything else in commandstats was sent by a client.
SCRIPT_COMMANDS = frozenset(
    name.lower()
    for path in LUA.glob("*.lua")
    for name in re.findall(r"redis\.call\('(\w+)'", path.read_text())
)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


def fleet_doc(
    url: str | None,
    *,
    budget: dict[str, Any],
    on_unavailable: str = "local",
    replicas: int = 1,
    lease_ttl_s: float = 30.0,
    # Generous: a call that should succeed must not time out on a starved machine. A test
    # about timeouts makes Redis stop answering (SIGSTOP), so its timeout fires at any value.
    timeout_ms: int = 2000,
) -> dict[str, Any]:
    return {
        "version": 1,
        "clusters": [
            {"name": "c1", "endpoints": ["127.0.0.1:8001"]},
            {"name": "c2", "endpoints": ["127.0.0.1:8002"]},
        ],
        "classes": [
            {"name": "short", "max_input_tokens": 2048, "budget": budget},
            {"name": "long"},
        ],
        "redis": {
            "url": url,
            "on_unavailable": on_unavailable,
            "replicas": replicas,
            "lease_ttl_s": lease_ttl_s,
            "timeout_ms": timeout_ms,
        },
    }


def runtime(url: str | None, **kwargs: Any) -> Runtime:
    return compile_runtime(parse_config(fleet_doc(url, **kwargs)))


def request(rt: Runtime, session: str = "s1") -> RequestFacts:
    body = b'{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":20}'
    headers = {"content-type": "application/json", "x-session-id": session}
    facts = parse_request("/v1/chat/completions", headers, body, rt.key_rules, rt.parse_limits)
    assert isinstance(facts, RequestFacts)
    return facts


async def gate_for(
    rt: Runtime, registry: CollectorRegistry | None = None, **kw: Any
) -> AdmissionGate:
    gate = build_gate(rt, registry or CollectorRegistry(), time.monotonic, Random(1), **kw)
    await gate.start()
    return gate


def client_calls(probe: redis.Redis) -> Counter[str]:
    """Commands clients sent (round trips), from INFO commandstats, minus script internals.

    ``probe`` must already be connected, so its own handshake is not counted in between.
    """
    stats = probe.info("commandstats")
    out: Counter[str] = Counter()
    for key, value in stats.items():
        name = key.removeprefix("cmdstat_")
        if name not in SCRIPT_COMMANDS and name != "info":
            out[name] = int(value["calls"])
    return out


class Reachable(Protocol):
    """A Redis to read a compartment from: a server, or a cluster (any node as the seed)."""

    @property
    def url(self) -> str: ...


async def compartment(srv: Reachable, cluster: str, limits: Budget) -> tuple[int, int]:
    # The test's own look at Redis: a generous timeout, so a starved machine slows it down
    # rather than failing the test that asked.
    ledger = RedisLedger.from_url(srv.url, timeout_s=30.0)
    try:
        usage = (await ledger.usage(cluster, "short", limits)).usage
    finally:
        await ledger.close()
    return usage.inflight_tokens, usage.concurrent


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_one_round_trip_per_admission_and_one_per_release(server: RedisServer) -> None:
    rt = runtime(server.url, budget={"max_inflight_tokens": 1_000_000, "max_concurrent": 1000})
    gate = await gate_for(rt)
    facts = request(rt)
    route = rt.policy.route(facts)
    warm = await gate.admit(facts, route)  # opens the pooled connection
    assert isinstance(warm, Admitted)
    await gate.release(warm.ticket)

    n = 25
    with redis.Redis.from_url(server.url) as probe:
        probe.ping()
        before = client_calls(probe)
        tickets = []
        for _ in range(n):
            out = await gate.admit(facts, route)
            assert isinstance(out, Admitted) and out.ticket.store == "redis"
            tickets.append(out.ticket)
        middle = client_calls(probe)
        for t in tickets:
            await gate.release(t)
        after = client_calls(probe)
    await gate.close()

    admits = +(middle - before)
    releases = +(after - middle)
    assert admits == Counter({"evalsha": n})
    assert releases == Counter({"evalsha": n})


async def test_two_gates_sharing_redis_enforce_one_fleet_wide_budget(server: RedisServer) -> None:
    budget = {"max_inflight_tokens": 1_000_000, "max_concurrent": 4}
    # The default generous timeout: this test is about the shared budget, not about latency on
    # a busy CI machine (a timeout would send admissions to the local fallback).
    rt = runtime(server.url, budget=budget)
    a, b = await gate_for(rt), await gate_for(rt)
    facts = request(rt)
    route = rt.policy.route(facts)
    limits = route.request_class.budget.resolved()

    alternating = [await (a if i % 2 == 0 else b).admit(facts, route) for i in range(6)]
    assert [type(o).__name__ for o in alternating] == ["Admitted"] * 4 + ["Reject"] * 2
    rejected = alternating[4]
    assert isinstance(rejected, Reject) and rejected.status == 429
    assert a.held == 2 and b.held == 2

    first = alternating[0]
    assert isinstance(first, Admitted)
    await a.release(first.ticket)  # capacity freed on one replica is usable by the other
    again = await b.admit(facts, route)
    assert isinstance(again, Admitted)

    for out in [*alternating[1:4], again]:
        assert isinstance(out, Admitted)
        # Each gate releases only what it issued; the other one ignores the ticket.
        await a.release(out.ticket)
        await b.release(out.ticket)
    assert a.held == 0 and b.held == 0
    assert await compartment(server, route.placement.primary, limits) == (0, 0)

    # Concurrent admissions from both replicas never overshoot the shared budget.
    storm = await asyncio.gather(*(g.admit(facts, route) for _ in range(40) for g in (a, b)))
    winners = [o for o in storm if isinstance(o, Admitted)]
    assert all(w.ticket.store == "redis" for w in winners)
    assert len(winners) == budget["max_concurrent"]
    assert all(o.status == 429 for o in storm if isinstance(o, Reject))
    assert await compartment(server, route.placement.primary, limits) == (
        sum(w.ticket.tokens for w in winners),
        len(winners),
    )
    for w in winners:
        await a.release(w.ticket)
        await b.release(w.ticket)
    assert await compartment(server, route.placement.primary, limits) == (0, 0)
    await a.close()
    await b.close()


CHILD = """
import asyncio, json, random, sys, time
from prometheus_client import CollectorRegistry
from extproc.config.load import parse_config
from extproc.config.runtime import compile_runtime
from extproc.core.admission import Admitted
from extproc.core.facts import parse_request
from extproc.ledger.gate import build_gate

async def main() -> None:
    rt = compile_runtime(parse_config(json.loads(sys.argv[1])))
    gate = build_gate(rt, CollectorRegistry(), time.monotonic, random.Random(7))
    await gate.start()
    body = b'{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":20}'
    headers = {"content-type": "application/json", "x-session-id": "s1"}
    facts = parse_request("/v1/chat/completions", headers, body, rt.key_rules, rt.parse_limits)
    route = rt.policy.route(facts)
    held = [await gate.admit(facts, route) for _ in range(int(sys.argv[2]))]
    assert all(isinstance(h, Admitted) for h in held), held
    print(route.placement.primary, flush=True)
    await asyncio.sleep(120)

asyncio.run(main())
"""


async def test_reservations_of_a_sigkilled_replica_expire_within_the_lease_ttl(
    server: RedisServer,
) -> None:
    # A TTL long against the holder's renewal interval, and a generous timeout: this test is
    # about leases outliving a killed holder, not about latency; on a starved machine a late or
    # timed-out renewal would let the leases lapse on their own.
    ttl = 6.0
    doc = fleet_doc(server.url, budget={"max_concurrent": 10}, lease_ttl_s=ttl)
    limits = Budget(max_concurrent=10)
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, json.dumps(doc), "3", stdout=asyncio.subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(child.stdout.readline(), timeout=30)
        cluster = line.decode().strip()
        assert cluster in ("c1", "c2")
        inflight, count = await compartment(server, cluster, limits)
        assert count == 3 and inflight > 0

        await asyncio.sleep(ttl * 1.5)  # longer than the TTL: the holder's renewals keep them
        assert (await compartment(server, cluster, limits))[1] == 3

        child.send_signal(signal.SIGKILL)
        await asyncio.wait_for(child.wait(), timeout=10)
        killed = time.monotonic()
        assert (await compartment(server, cluster, limits))[1] == 3  # not freed by magic
        # Lapsed, not held for ever (the hang bound is generous: Redis reaps them at the TTL).
        while (await compartment(server, cluster, limits)) != (0, 0):
            assert time.monotonic() - killed < ttl + HANG_S, "leases outlived their TTL"
            await asyncio.sleep(0.05)
        freed_after = time.monotonic() - killed
        assert freed_after > 0.2  # it was the lease expiry, not the kill itself
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()


@pytest.mark.parametrize(
    ("policy", "how"),
    [("local", signal.SIGKILL), ("closed", signal.SIGTERM)],
    ids=["local-fallback-redis-killed", "closed-policy-redis-stopped"],
)
async def test_redis_outage_under_load_falls_back_and_recovers(
    server: RedisServer, policy: str, how: signal.Signals
) -> None:
    budget = {"max_inflight_tokens": 100_000, "max_concurrent": 6}
    rt = runtime(server.url, budget=budget, on_unavailable=policy, replicas=2)
    registry = CollectorRegistry()
    gate = await gate_for(rt, registry, probe_interval_s=0.2)
    facts = request(rt)
    route = rt.policy.route(facts)
    cluster = route.placement.primary
    share = budget["max_concurrent"] // 2

    held: list[Ticket] = []
    seen: list[tuple[str, str]] = []  # (phase, outcome)
    phase = "before"
    restarted_at = 0.0
    for i in range(10_000):
        if i == 30:
            server.stop(how)
            phase = "down"
        if i == 80:
            server.start()
            phase, restarted_at = "after", time.monotonic()
        # Recovered: the last admissions after the restart all went through Redis again.
        after_so_far = [o for p, o in seen if p == "after"]
        if after_so_far[-RECOVERED_RUN:] == ["redis"] * RECOVERED_RUN:
            break
        if phase == "after":
            assert time.monotonic() - restarted_at < HANG_S, ("never recovered", after_so_far)
        # Bounded by timeout_ms, never hangs (the hang bound is the test's).
        out = await asyncio.wait_for(gate.admit(facts, route), HANG_S)
        if isinstance(out, Admitted):
            seen.append((phase, out.ticket.store))
            held.append(out.ticket)
        else:
            assert isinstance(out, Reject)
            seen.append((phase, str(out.status)))
        if len(held) > 2:  # keep a few in flight, release the oldest (to whichever ledger)
            await gate.release(held.pop(0))
        if phase == "down":
            local_held = sum(1 for t in held if t.store == "memory")
            assert local_held <= share
        await asyncio.sleep(0.005)

    down = Counter(o for p, o in seen if p == "down")
    if policy == "local":
        assert down["memory"] > 0 and "503" not in down
        assert set(down) <= {"memory", "redis", "429"}
    else:
        assert down["503"] > 0 and "memory" not in down
        assert set(down) <= {"503", "redis"}
    after = [o for p, o in seen if p == "after"]
    assert after[-1] == "redis"
    assert gate.mode == "redis"
    assert sample(registry, "fleet_ledger_mode", mode="redis") == 1
    assert sample(registry, "fleet_ledger_redis_errors_total", op="reserve") > 0

    for t in held:
        await gate.release(t)
    assert gate.held == 0
    labels = {"cluster": cluster, "request_class": "short"}
    assert sample(registry, "fleet_budget_inflight_tokens", **labels) == 0
    assert sample(registry, "fleet_budget_inflight_requests", **labels) == 0
    local_usage = await gate._local.usage(cluster, "short", Budget())
    assert (local_usage.usage.inflight_tokens, local_usage.usage.concurrent) == (0, 0)
    assert await compartment(server, cluster, route.request_class.budget.resolved()) == (0, 0)
    await gate.close()


async def test_hung_redis_costs_one_timeout_and_leaks_nothing_beyond_the_ttl(
    server: RedisServer,
) -> None:
    ttl = 2.0
    rt = runtime(server.url, budget={"max_concurrent": 50}, lease_ttl_s=ttl, timeout_ms=50)
    registry = CollectorRegistry()
    gate = await gate_for(rt, registry, probe_interval_s=0.2)
    facts = request(rt)
    route = rt.policy.route(facts)
    held: list[Ticket] = []

    server.pause()  # SIGSTOP: connections stay open, nothing answers
    try:
        # One timeout, then the local budget: answered, not hung on the silent Redis.
        out = await asyncio.wait_for(gate.admit(facts, route), HANG_S)
        assert isinstance(out, Admitted) and out.ticket.store == "memory"
        held.append(out.ticket)
        assert gate.mode == "local"
        assert sample(registry, "fleet_ledger_redis_errors_total", op="reserve") == 1
    finally:
        server.resume()

    # The timed-out connection was dropped, not left with a reply in flight: once the probe
    # interval has passed, admissions go back to Redis and see consistent answers.
    deadline = time.monotonic() + HANG_S
    while True:
        out = await gate.admit(facts, route)
        assert isinstance(out, Admitted)
        held.append(out.ticket)
        if out.ticket.store == "redis":
            break
        assert time.monotonic() < deadline, "never went back to redis"
        await asyncio.sleep(0.05)
    assert out.usage.concurrent >= 1
    for t in held:
        await gate.release(t)
    assert gate.held == 0
    # A reserve that reached the paused server may have run after SIGCONT with nobody
    # listening for the answer; its lease is never renewed, so it lapses within the TTL.
    limits = route.request_class.budget.resolved()
    deadline = time.monotonic() + ttl + HANG_S
    while await compartment(server, route.placement.primary, limits) != (0, 0):
        assert time.monotonic() < deadline, "a lease outlived its TTL"
        await asyncio.sleep(0.05)
    await gate.close()


async def test_release_while_redis_is_down_never_raises_and_the_lease_lapses(
    server: RedisServer,
) -> None:
    ttl = 2.0
    rt = runtime(server.url, budget={"max_concurrent": 5}, lease_ttl_s=ttl)
    registry = CollectorRegistry()
    gate = await gate_for(rt, registry, probe_interval_s=0.2)
    facts = request(rt)
    route = rt.policy.route(facts)
    out = await gate.admit(facts, route)
    assert isinstance(out, Admitted) and out.ticket.store == "redis"
    server.pause()
    try:
        await gate.release(out.ticket)  # times out inside; must not raise
    finally:
        server.resume()
    assert gate.held == 0
    assert sample(registry, "fleet_ledger_release_errors_total") == 1
    labels = {"cluster": route.placement.primary, "request_class": "short"}
    assert sample(registry, "fleet_budget_inflight_requests", **labels) == 0
    limits = route.request_class.budget.resolved()
    deadline = time.monotonic() + ttl + HANG_S
    while await compartment(server, route.placement.primary, limits) != (0, 0):
        assert time.monotonic() < deadline, "the lease outlived its TTL"
        await asyncio.sleep(0.05)
    await gate.close()
