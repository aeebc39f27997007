"""``extproc bench admission``: the cost of one admission decision, memory vs Redis ledger.

Both ledgers run side by side in one process on the same requests: the gate's full path
(plan → atomic reserve → verdict → metrics) per admission and per release, reported as
p50/p99; ``redis+tenant`` is the Redis ledger with the request's tenant counted against its own
limits (max_concurrent and tokens_per_minute, never reached) in the same reserve. For Redis it
also counts round trips per admission and per release with
``INFO commandstats`` before and after each phase (commands the Lua scripts run inside Redis
are counted there too, but cost no round trip, so they are left out). It starts its own
``redis-server`` on a free 127.0.0.1 port unless ``--redis-url`` names one.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from random import Random

from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from extproc.bench.fair_queue_cost import QueueRow, memory_rows, redis_rows, tenant_us
from extproc.config.load import parse_config
from extproc.config.runtime import Runtime, compile_runtime
from extproc.core.admission import (
    Admitted,
    Demand,
    Reject,
    TenantClaim,
    Ticket,
    plan,
    request_tokens,
)
from extproc.core.decide import Route
from extproc.core.facts import RequestFacts, parse_request
from extproc.core.flow import TenantLimit
from extproc.ledger.gate import AdmissionGate, build_gate
from extproc.ledger.redis import _script


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=5000, help="admissions per ledger")
    parser.add_argument("--warmup", type=int, default=200, help="untimed admissions first")
    parser.add_argument(
        "--redis-url", default=None, help="use this Redis instead of starting redis-server"
    )
    parser.add_argument("--redis-server", default="redis-server", help="redis-server binary")
    parser.add_argument("--seed", type=int, default=1)


@dataclass(frozen=True, slots=True)
class Row:
    ledger: str
    admit_us: list[float]
    release_us: list[float]
    trips_admit: float | None
    trips_release: float | None
    # Mean time Redis spent running the reserve / release script (INFO commandstats usec).
    server_us: tuple[float, float]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def _redis_server(binary: str) -> Iterator[str]:
    path = shutil.which(binary)
    if path is None:
        raise SystemExit(f"extproc bench admission: {binary} not found (or pass --redis-url)")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as tmp:
        cmd = [path, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        cmd += ["--appendonly", "no", "--dir", tmp]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                        s.sendall(b"*1\r\n$4\r\nPING\r\n")
                        if s.recv(16).startswith(b"+PONG"):
                            break
                except OSError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("extproc bench admission: redis-server did not start")
                time.sleep(0.02)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def _script_commands() -> frozenset[str]:
    names: set[str] = set()
    for name in ("reserve.lua", "release.lua", "renew.lua"):
        text = _script(name)  # as loaded: with the ticket helpers in front of reserve.lua
        names.update(m.lower() for m in re.findall(r"redis\.call\('(\w+)'", text))
    return frozenset(names)


async def _client_calls(probe: Redis, internal: frozenset[str]) -> Counter[str]:
    """Calls per client-sent command; ``usec:evalsha`` carries the scripts' server time."""
    stats = await probe.info("commandstats")
    out: Counter[str] = Counter()
    for key, value in stats.items():
        name = str(key).removeprefix("cmdstat_")
        if name not in internal and name != "info":
            out[name] = int(value["calls"])
        if name == "evalsha":
            out["usec:evalsha"] = int(value["usec"])
    return out


def _trips(delta: Counter[str], n: int) -> tuple[float, float]:
    """(round trips per operation, Redis-side microseconds per script call)."""
    calls = sum(v for k, v in delta.items() if not k.startswith("usec:"))
    scripts = delta["evalsha"]
    return calls / n, (delta["usec:evalsha"] / scripts if scripts else 0.0)


def _runtime(requests: int) -> Runtime:
    # A budget the run never exhausts: every admission takes the granted path.
    return compile_runtime(
        parse_config(
            {
                "version": 1,
                "clusters": [
                    {"name": f"c{i}", "endpoints": [f"127.0.0.1:{8000 + i}"]} for i in range(4)
                ],
                "classes": [
                    {
                        "name": "short",
                        "max_input_tokens": 4096,
                        "budget": {
                            "max_inflight_tokens": 10_000 * (requests + 1),
                            "max_concurrent": requests + 1,
                        },
                    },
                    {"name": "long"},
                ],
                # A long lease: no renewal tick lands inside a timed phase. Own key prefix:
                # --redis-url may point at a Redis that also holds real budgets.
                "redis": {"lease_ttl_s": 600, "timeout_ms": 1000, "key_prefix": "fleet-bench"},
            }
        )
    )


def _facts(rt: Runtime, i: int) -> RequestFacts:
    body = (
        b'{"model":"m","max_tokens":256,"messages":[{"role":"user","content":"question %d"}]}' % i
    )
    headers = {"content-type": "application/json", "x-session-id": f"bench-{i}"}
    facts = parse_request("/v1/chat/completions", headers, body, rt.key_rules, rt.parse_limits)
    if not isinstance(facts, RequestFacts):
        raise RuntimeError(f"bench request rejected by the parser: {facts}")
    return facts


async def _admit(
    gate: AdmissionGate, facts: RequestFacts, route: Route, tenant: TenantClaim | None
) -> Admitted | Reject | None:
    """The gate's admission; with ``tenant``, the demand carries it (the pipeline's path when
    the tenant has limits and the ledger is Redis)."""
    if tenant is None:
        return await gate.admit(facts, route)
    demand = plan(request_tokens(facts), route, tenant)
    if not isinstance(demand, Demand):
        raise RuntimeError(f"bench request not budgeted: {demand}")
    return (await gate.attempt(demand)).outcome


async def _measure(
    name: str,
    rt: Runtime,
    url: str | None,
    args: argparse.Namespace,
    probe: Redis | None,
    tenant: TenantClaim | None = None,
) -> Row:
    gate = build_gate(rt, CollectorRegistry(), time.monotonic, Random(args.seed), url)
    await gate.start()
    requests = [_facts(rt, i) for i in range(args.requests)]
    routes = [rt.policy.route(f) for f in requests]
    internal = _script_commands()
    try:
        for i in range(args.warmup):
            out = await _admit(gate, requests[i % len(requests)], routes[i % len(routes)], tenant)
            if isinstance(out, Admitted):
                await gate.release(out.ticket)

        admit_ns: list[int] = []
        tickets: list[Ticket] = []
        before = await _client_calls(probe, internal) if probe else None
        clock = time.perf_counter_ns
        for facts, route in zip(requests, routes, strict=True):
            t0 = clock()
            out = await _admit(gate, facts, route, tenant)
            admit_ns.append(clock() - t0)
            if not isinstance(out, Admitted):
                raise RuntimeError(f"{name}: admission refused during the benchmark: {out}")
            tickets.append(out.ticket)
        middle = await _client_calls(probe, internal) if probe else None
        release_ns: list[int] = []
        for ticket in tickets:
            t0 = clock()
            await gate.release(ticket)
            release_ns.append(clock() - t0)
        after = await _client_calls(probe, internal) if probe else None
    finally:
        await gate.close()
    n = len(requests)
    trips_admit = trips_release = None
    server_us = (0.0, 0.0)
    if before is not None and middle is not None and after is not None:
        trips_admit, admit_server_us = _trips(middle - before, n)
        trips_release, release_server_us = _trips(after - middle, n)
        server_us = (admit_server_us, release_server_us)
    return Row(
        name,
        [x / 1000 for x in admit_ns],
        [x / 1000 for x in release_ns],
        trips_admit,
        trips_release,
        server_us,
    )


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def _table(rows: list[Row]) -> str:
    head = (
        "ledger",
        "admit p50",
        "admit p99",
        "release p50",
        "release p99",
        "trips/admit",
        "trips/release",
    )
    lines = ["{:<13} {:>11} {:>11} {:>12} {:>12} {:>12} {:>14}".format(*head)]
    for r in rows:
        trips = ["0" if r.trips_admit is None else f"{r.trips_admit:.2f}"]
        trips.append("0" if r.trips_release is None else f"{r.trips_release:.2f}")
        lines.append(
            "{:<13} {:>11} {:>11} {:>12} {:>12} {:>12} {:>14}".format(
                r.ledger,
                f"{_pct(r.admit_us, 0.50):.1f} µs",
                f"{_pct(r.admit_us, 0.99):.1f} µs",
                f"{_pct(r.release_us, 0.50):.1f} µs",
                f"{_pct(r.release_us, 0.99):.1f} µs",
                *trips,
            )
        )
    return "\n".join(lines)


async def _bench(args: argparse.Namespace, url: str) -> tuple[list[Row], list[QueueRow]]:
    rt = _runtime(args.requests + args.warmup)
    probe = Redis.from_url(url)
    try:
        await probe.ping()  # connected before the first snapshot, so its handshake is not counted
        server = await probe.info("server")
        print(
            f"admission decision cost: {args.requests} admissions + releases per ledger, "
            f"sequential; redis-server {server.get('redis_version')} at {url}"
        )
        memory = await _measure("memory", rt, None, args, None)
        shared = await _measure("redis", rt, url, args, probe)
        room = args.requests + args.warmup + 1
        limit = TenantLimit(max_concurrent=room, tokens_per_minute=10_000 * room)
        claim = TenantClaim("bench-tenant", limit)
        tenant = await _measure("redis+tenant", rt, url, args, probe, claim)
        queued = [*memory_rows(args.requests), *await redis_rows(url, args.requests)]
    finally:
        await probe.aclose()
    return [memory, shared, tenant], queued


def run(args: argparse.Namespace) -> int:
    if args.requests <= 0:
        raise SystemExit("extproc bench admission: --requests must be > 0")
    if args.redis_url:
        rows, queued = asyncio.run(_bench(args, args.redis_url))
    else:
        with _redis_server(args.redis_server) as url:
            rows, queued = asyncio.run(_bench(args, url))
    print(_table(rows))
    for r in rows:
        if r.trips_admit is not None:
            print(
                f"{r.ledger}: of which inside Redis (script run time, INFO commandstats): "
                f"reserve {r.server_us[0]:.1f} µs, release {r.server_us[1]:.1f} µs per call; "
                "the rest is the loopback round trip and the client"
            )
    print(_queue_table(queued, tenant_us(args.requests)))
    return 0


def _queue_table(rows: list[QueueRow], naming_us: list[float]) -> str:
    lines = [
        "fair admission, per waiting request: its place in a contended queue (join + leave), "
        "FIFO vs token-weighted",
        "{:<8} {:<9} {:>10} {:>10}".format("ledger", "order", "p50", "p99"),
    ]
    for r in rows:
        p50, p99 = _pct(r.join_leave_us, 0.50), _pct(r.join_leave_us, 0.99)
        lines.append(f"{r.where:<8} {r.fairness:<9} {p50:>7.1f} µs {p99:>7.1f} µs")
    p50, p99 = _pct(naming_us, 0.50), _pct(naming_us, 0.99)
    lines.append(f"naming the tenant (API key digest, cached): p50 {p50:.2f} µs, p99 {p99:.2f} µs")
    return "\n".join(lines)
