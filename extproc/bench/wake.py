"""``extproc bench wake``: how fast a waiting request learns that budget was released.

Flow control (extproc/core/flow.py) queues an over-budget request until a release frees room.
This measures, per wake-up mechanism, the time from one replica's release to the admission of
a request waiting on another replica (with the memory ledger: the same replica):

- ``memory``: the in-memory ledger, the release sets the head waiter's event;
- ``redis pub/sub``: release.lua publishes on ``P:freed``; the re-check is set to 30 s, so
  every admission is a notice's doing;
- ``redis poll N ms``: notices off (``flow.redis_notices: false``), the head re-checks every
  N ms (what is left when notices are lost, or on a client without pub/sub).

Two pipelines share one ledger, one class with a budget of ONE request on one cluster: A
admits, B's request queues, A releases, B is admitted. It starts its own ``redis-server`` on a
free 127.0.0.1 port unless ``--redis-url`` names one. Prints p50/p90/max per mechanism.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import time
from collections.abc import Iterator
from typing import Any

import orjson
from prometheus_client import CollectorRegistry

from extproc.bench.admission import _redis_server
from extproc.config.load import parse_config
from extproc.config.runtime import Overrides, compile_runtime
from extproc.ledger.gate import AdmissionGate, build_gate
from extproc.pipeline.metrics import Metrics
from extproc.pipeline.outcomes import Routed
from extproc.pipeline.pipeline import Pipeline, RuntimeHolder

CHAT = "/v1/chat/completions"
BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "wake"}]})
HEADERS = {
    ":method": "POST",
    ":path": CHAT,
    "content-type": "application/json",
    "x-session-id": "one-session",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=50, help="releases per mechanism")
    parser.add_argument(
        "--poll-ms", type=int, nargs="*", default=[50, 250], help="polling periods to compare"
    )
    parser.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    parser.add_argument("--redis-server", default="redis-server", help="redis-server binary")


def _doc(poll_ms: int, notices: bool) -> dict[str, Any]:
    return {
        "version": 1,
        "clusters": [{"name": "c1", "endpoints": ["127.0.0.1:8001"]}],
        "classes": [
            {
                "name": "long",
                "budget": {"max_concurrent": 1},
                "wait": {"max_wait_s": 30, "max_queue": 8},
            }
        ],
        "redis": {"timeout_ms": 1000},
        "flow": {"redis_poll_ms": poll_ms, "redis_notices": notices},
    }


async def _pipelines(
    doc: dict[str, Any], redis_url: str | None
) -> tuple[list[Pipeline], list[AdmissionGate]]:
    runtime = compile_runtime(parse_config(doc), overrides=Overrides(redis_url=redis_url))
    pipelines: list[Pipeline] = []
    gates: list[AdmissionGate] = []
    for seed in range(2 if redis_url else 1):
        registry = CollectorRegistry()
        gate = build_gate(runtime, registry, time.monotonic, random.Random(seed))
        await gate.start()
        gates.append(gate)
        pipelines.append(Pipeline(RuntimeHolder(runtime), Metrics(registry), gate))
    return pipelines, gates


async def measure(doc: dict[str, Any], redis_url: str | None, rounds: int) -> list[float]:
    """Seconds from A's release to B's admission, per round."""
    pipelines, gates = await _pipelines(doc, redis_url)
    a, b = pipelines[0], pipelines[-1]
    waiting_gate = gates[-1]
    out: list[float] = []
    try:
        for _ in range(rounds):
            first = await a.decide(HEADERS, BODY, 0.0)
            assert isinstance(first, Routed), first
            waiter = asyncio.create_task(b.decide(HEADERS, BODY, 0.0))
            async with asyncio.timeout(10):
                while True:  # until B's request is queued
                    if waiting_gate.waiters.depth("c1", "long"):
                        break
                    await asyncio.sleep(0.001)
            released = time.perf_counter()
            await a.release(first.hold)
            second = await asyncio.wait_for(waiter, timeout=60)
            out.append(time.perf_counter() - released)
            assert isinstance(second, Routed), second
            await b.release(second.hold)
    finally:
        for gate in gates:
            await gate.close()
    return out


@contextlib.contextmanager
def _redis(args: argparse.Namespace) -> Iterator[str]:
    if args.redis_url:
        yield args.redis_url
    else:
        with _redis_server(args.redis_server) as url:
            yield url


def _row(name: str, samples: list[float]) -> str:
    ms = sorted(s * 1000 for s in samples)
    p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
    return f"{name:<22} {statistics.median(ms):>9.2f} {p90:>9.2f} {ms[-1]:>9.2f}"


async def _run(args: argparse.Namespace, url: str) -> list[str]:
    rows = [f"{'mechanism':<22} {'p50 ms':>9} {'p90 ms':>9} {'max ms':>9}"]
    rows.append(_row("memory", await measure(_doc(500, True), None, args.rounds)))
    rows.append(_row("redis pub/sub", await measure(_doc(30_000, True), url, args.rounds)))
    for poll in args.poll_ms:
        samples = await measure(_doc(poll, False), url, args.rounds)
        rows.append(_row(f"redis poll {poll} ms", samples))
    return rows


def run(args: argparse.Namespace) -> int:
    with _redis(args) as url:
        rows = asyncio.run(_run(args, url))
    print(f"wake-up latency, release on one replica -> admission on another ({args.rounds} rounds)")
    print("\n".join(rows))
    return 0
