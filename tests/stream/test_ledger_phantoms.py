"""No phantom reservations: a reserve whose caller gave up (timeout, cancellation) is settled
against a real redis-server long before its lease TTL, whatever Redis did with it.

Each stall sends the reserve into a Redis that cannot answer within the 50 ms timeout but
will run (or drop) the queued command later: ``DEBUG SLEEP`` (Redis busy), ``CLIENT PAUSE``
(Redis holding clients back) and SIGSTOP (a hung process). Before reconciliation such a
reserve held budget for its whole lease TTL; here the compartment must settle before any lease
taken after the stall began could have lapsed (on Redis's own clock): an order of two events,
reconciliation first, not a bound on how fast the machine is.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from prometheus_client import CollectorRegistry

from extproc.core.admission import Admitted, Demand
from extproc.core.decide import Route
from extproc.core.facts import RequestFacts
from extproc.core.fleet import Budget
from extproc.ledger.gate import AdmissionGate
from extproc.ledger.redis import RedisLedger, compartment_keys
from tests.stream.test_ledger_redis import compartment, gate_for, request, runtime, sample
from tests.support.redis_server import RedisServer

LEASE_TTL_S = 30.0
# Against a hang only, past the lease TTL: a reserve that reconciliation missed lapses by then,
# and before_a_lapse names the failure.
SETTLE_TIMEOUT_S = 120.0


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


def stall(server: RedisServer, how: str, seconds: float) -> Callable[[], None]:
    """Make Redis unable to answer for ``seconds``; returns a join() that waits for the end."""
    if how == "sigstop":
        server.pause()
        timer = threading.Timer(seconds, server.resume)
        timer.start()
        return timer.join
    client = redis.Redis.from_url(server.url, socket_timeout=seconds + 10)
    client.ping()
    if how == "client-pause":
        client.execute_command("CLIENT", "PAUSE", int(seconds * 1000), "ALL")
        client.close()
        return lambda: time.sleep(seconds)
    assert how == "debug-sleep"
    errors: list[Exception] = []

    def sleep() -> None:
        try:
            client.execute_command("DEBUG", "SLEEP", seconds)
        except redis.RedisError as exc:
            errors.append(exc)

    thread = threading.Thread(target=sleep)
    thread.start()
    deadline = time.monotonic() + 5
    probe = redis.Redis.from_url(server.url, socket_timeout=0.05)
    try:
        while True:  # until Redis is asleep (a PING goes unanswered)
            assert not errors, errors
            assert time.monotonic() < deadline, "DEBUG SLEEP never took hold"
            try:
                probe.ping()
            except redis.TimeoutError:
                break
            time.sleep(0.005)
    finally:
        probe.close()

    def join() -> None:
        thread.join()
        client.close()
        assert not errors, errors

    return join


async def settled(
    server: RedisServer,
    cluster: str,
    limits: Budget,
    gate_unsettled: Callable[[], int],
    expected: tuple[int, int] = (0, 0),
) -> None:
    """Until the compartment holds ``expected`` (tokens, requests) in Redis, by default
    nothing, and the gate has nothing unsettled."""
    try:
        async with asyncio.timeout(SETTLE_TIMEOUT_S):
            while True:
                if await compartment(server, cluster, limits) == expected and not gate_unsettled():
                    return
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError("a phantom reservation outlived reconciliation") from None


def redis_time(server: RedisServer) -> float:
    with redis.Redis.from_url(server.url, socket_timeout=30) as probe:
        seconds, micros = probe.time()
    return seconds + micros / 1e6


def before_a_lapse(server: RedisServer, stalled_at: float) -> None:
    """The compartment settled before a lease reserved after ``stalled_at`` (Redis time)
    could have lapsed: reconciliation settled it, not the lease TTL."""
    now = redis_time(server)
    assert now < stalled_at + LEASE_TTL_S, "settled by a lease's lapse, not by reconciliation"


def unread_by_redis(port: int) -> int:
    """Bytes clients sent that redis-server has not read yet (its sockets' receive queues)."""
    unread = 0
    with open("/proc/net/tcp") as table:
        for row in table.readlines()[1:]:
            fields = row.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":  # ESTABLISHED
                unread += int(fields[4].split(":")[1], 16)
    return unread


async def warm_up(gate: AdmissionGate, facts: RequestFacts, route: Route) -> None:
    """One admission through Redis, so the pooled connection is open before the stall (on a
    busy machine the very first call can miss a 50 ms timeout and go local: try again)."""
    deadline = time.monotonic() + 10
    while True:
        out = await gate.admit(facts, route)
        assert isinstance(out, Admitted)
        await gate.release(out.ticket)
        if out.ticket.store == "redis":
            break
        assert time.monotonic() < deadline, "redis never answered within the timeout"
        await asyncio.sleep(0.25)  # past the probe interval
    while gate.unsettled:  # a missed first call is being reconciled: let it finish
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("how", ["debug-sleep", "client-pause", "sigstop"])
async def test_a_reserve_that_times_out_leaves_no_phantom(server: RedisServer, how: str) -> None:
    budget = {"max_inflight_tokens": 100_000, "max_concurrent": 4}
    rt = runtime(server.url, budget=budget, lease_ttl_s=LEASE_TTL_S, timeout_ms=50)
    registry = CollectorRegistry()
    gate = await gate_for(rt, registry, probe_interval_s=0.2)
    facts = request(rt)
    route = rt.policy.route(facts)
    cluster = route.placement.primary
    limits = route.request_class.budget.resolved()
    await warm_up(gate, facts, route)

    # Long enough that the admission below surely meets the stall on a busy machine.
    stalled_at = redis_time(server)
    join = stall(server, how, 1.5)
    try:
        out = await gate.admit(facts, route)
        assert isinstance(out, Admitted) and out.ticket.store == "memory"
    finally:
        await asyncio.to_thread(join)

    # The request admitted locally during the stall still runs: once Redis answers it is
    # adopted into Redis (counted once, under a lease of its own), and nothing else is held.
    running = (out.ticket.tokens, 1)
    await settled(server, cluster, limits, lambda: gate.unsettled or gate.held_locally, running)
    before_a_lapse(server, stalled_at)
    assert sample(registry, "fleet_ledger_adopted_total") == 1
    reconciled = sum(
        sample(registry, "fleet_ledger_reconciled_total", result=r)
        for r in ("phantom_removed", "not_reserved")
    )
    assert reconciled >= 1  # the stalled reserve (and any warm-up call that missed)
    # Redis holds no lease of this compartment but the adopted request's, and (at most) the
    # tombstone of the cancel.
    keys = compartment_keys("fleet", cluster, "short")
    with redis.Redis.from_url(server.url) as probe:
        held = {k: int(v) for k, v in probe.hgetall(keys[2]).items()}
    assert sorted(v for v in held.values() if v >= 0) == [out.ticket.tokens], held

    await gate.release(out.ticket)
    await settled(server, cluster, limits, lambda: gate.unsettled)
    labels = {"cluster": cluster, "request_class": "short"}
    assert sample(registry, "fleet_budget_inflight_requests", **labels) == 0
    assert gate.held == 0
    await gate.close()


async def test_a_long_lease_does_not_delay_reconciliation(server: RedisServer) -> None:
    """With an hour's lease the renewal is 20 minutes away; the reserve that timed out in a
    hung Redis is still settled (and the locally admitted request adopted) within probe
    intervals of Redis answering, before any renewal ran: the failure itself wakes the
    background loop."""
    rt = runtime(server.url, budget={"max_concurrent": 4}, lease_ttl_s=3600.0, timeout_ms=50)
    registry = CollectorRegistry()
    gate = await gate_for(rt, registry, probe_interval_s=0.2)
    facts = request(rt)
    route = rt.policy.route(facts)
    cluster = route.placement.primary
    limits = route.request_class.budget.resolved()
    await warm_up(gate, facts, route)
    renewals = sample(registry, "fleet_ledger_redis_seconds_count", op="renew")

    join = stall(server, "sigstop", 1.5)
    try:
        out = await gate.admit(facts, route)
        assert isinstance(out, Admitted) and out.ticket.store == "memory"
    finally:
        await asyncio.to_thread(join)

    running = (out.ticket.tokens, 1)
    await settled(server, cluster, limits, lambda: gate.unsettled or gate.held_locally, running)
    assert sample(registry, "fleet_ledger_redis_seconds_count", op="renew") == renewals
    assert sample(registry, "fleet_ledger_adopted_total") == 1
    await gate.release(out.ticket)
    await settled(server, cluster, limits, lambda: gate.unsettled)
    await gate.close()


async def test_a_cancelled_admission_leaves_no_phantom(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt = runtime(server.url, budget={"max_concurrent": 4}, lease_ttl_s=LEASE_TTL_S, timeout_ms=3000)
    registry = CollectorRegistry()
    gate = await gate_for(rt, registry, probe_interval_s=0.2)
    facts = request(rt)
    route = rt.policy.route(facts)
    cluster = route.placement.primary
    await warm_up(gate, facts, route)

    reserving = asyncio.Event()
    reserve = RedisLedger.reserve

    async def reserve_seen(self: RedisLedger, *args: Any, **kwargs: Any) -> Any:
        reserving.set()
        return await reserve(self, *args, **kwargs)

    monkeypatch.setattr(RedisLedger, "reserve", reserve_seen)
    stalled_at = redis_time(server)
    server.pause()
    try:
        task = asyncio.create_task(gate.admit(facts, route))
        # The reserve is sent and waits for its reply: written to the stopped Redis's socket.
        async with asyncio.timeout(30):
            await reserving.wait()
            while True:
                if unread_by_redis(server.port):
                    break
                await asyncio.sleep(0.005)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        server.resume()
    await settled(server, cluster, Budget(max_concurrent=4), lambda: gate.unsettled)
    before_a_lapse(server, stalled_at)
    assert gate.held == 0
    assert (
        sample(registry, "fleet_ledger_reconciled_total", result="phantom_removed")
        + sample(registry, "fleet_ledger_reconciled_total", result="not_reserved")
        >= 1
    )
    await gate.close()


async def test_cancel_refuses_a_late_reserve_and_the_tombstone_lapses(server: RedisServer) -> None:
    ledger = RedisLedger.from_url(server.url, lease_ttl_s=1.0, timeout_s=2.0)
    await ledger.load()
    demand = Demand("c1", "short", 10, Budget(max_concurrent=2), Budget(0, 2))
    keys = compartment_keys("fleet", "c1", "short")

    # Cancel first (the reserve is still queued somewhere), then the late reserve arrives.
    assert await ledger.cancel("c1", "short", "late") is False
    late = await ledger.reserve(demand, "late")
    assert not late.granted and late.usage.concurrent == 0

    # Reserve first, then the cancel: the reservation is taken back.
    early = await ledger.reserve(demand, "early")
    assert early.granted and early.usage.concurrent == 1
    assert await ledger.cancel("c1", "short", "early") is True
    assert await ledger.cancel("c1", "short", "early") is False  # idempotent
    # Resending a reserve under a live lease id charges nothing twice.
    again = await ledger.reserve(demand, "twice")
    assert (await ledger.reserve(demand, "twice")).usage.concurrent == again.usage.concurrent == 1
    assert await ledger.cancel("c1", "short", "twice") is True

    await asyncio.sleep(1.2)  # past the tombstones' TTL: the next reserve reaps them
    fresh = await ledger.reserve(demand, "fresh")
    assert fresh.granted and fresh.usage.concurrent == 1
    with redis.Redis.from_url(server.url) as probe:
        assert probe.hkeys(keys[2]) == [b"fresh"]
        assert probe.zrange(keys[1], 0, -1) == [b"fresh"]
    await ledger.close()
