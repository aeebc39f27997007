"""`extproc bench handler`: the processor's own CPU per request, in process, beside the bare one.

No Envoy and no network: the ext_proc messages Envoy would send (request headers with a
session header, then the whole body) are serialised once; each request parses them as gRPC
would (``FromString``), runs them through the stream handler and serialises the answers. The
same is done for the bare processor's handler (extproc/bench/bare.py: constant answers), so
the difference is the processor's own work per request, without gRPC's transport, which both
pay alike. `bench overhead` measures the whole stack through Envoy; this isolates the part
the code can change, and ``--profile SIZE`` shows where it goes (cProfile).

It also times body decoding alone: ``orjson.loads`` against ``json_body.loads`` (what the
processor uses: msgspec, with orjson's answers), on the bench's chat body (one long ASCII
message) and on an agent-like body (many messages of code and non-ASCII text).

Figures are process CPU time (``time.process_time``), best of ``--repeat`` rounds.

``--cold-bytes N`` writes N bytes of other memory before every request (not timed), as Envoy,
gRPC's C core and the kernel do between two requests of a processor sharing 2 cores with them:
the handler then runs from cold caches, as it does through Envoy, where its Python costs about
twice what the warm loop shows (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import pstats
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson

SIZES = {"1KB": 1024, "64KB": 64 * 1024, "4MiB": 4 << 20, "16MiB": 16 << 20}
# Requests per round by size: enough to take ~0.2-1 s of CPU each on an idle machine.
REQUESTS = {"1KB": 4000, "64KB": 2000, "4MiB": 60, "16MiB": 15}


def agent_body(size: int) -> bytes:
    """An agent's turn: a system prompt, then alternating messages of code and non-ASCII
    prose (tool results), ~4 KB each, up to ``size`` bytes."""
    piece = "def f(x):\n    return {'a': x}  # é ✓ — naïve café\n" * 80
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are a coding agent."}]
    total = 0
    while total < size:
        messages.append({"role": "user" if len(messages) % 2 else "assistant", "content": piece})
        total += len(piece) + 32
    return orjson.dumps({"model": "m", "messages": messages, "max_tokens": 16})


def _best(fn: Callable[[], object], n: int, repeat: int) -> float:
    """Best CPU µs per call over ``repeat`` rounds of ``n`` calls."""
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        for _ in range(n):
            fn()
        best = min(best, (time.process_time() - start) / n)
    return best * 1e6


def decode_rows(sizes: list[str], repeat: int) -> list[dict[str, Any]]:
    from extproc.bench.overhead import chat_body
    from extproc.core import json_body

    rows = []
    for size in sizes:
        for shape, body in (("chat", chat_body(SIZES[size])), ("agent", agent_body(SIZES[size]))):
            n = max(3, REQUESTS[size] // 2)
            ref = _best(functools.partial(orjson.loads, body), n, repeat)
            ours = _best(functools.partial(json_body.loads, body), n, repeat)
            rows.append(
                {
                    "size": size,
                    "body": shape,
                    "bytes": len(body),
                    "orjson_us": round(ref, 1),
                    "json_body_us": round(ours, 1),
                    "ratio": round(ours / ref, 2),
                }
            )
    return rows


class _Requests:
    """The messages of one request, parsed from their wire form as gRPC's deserializer does."""

    def __init__(self, wire: list[bytes], parse: Callable[[bytes], Any]) -> None:
        self._wire = iter(wire)
        self._parse = parse

    def __aiter__(self) -> _Requests:
        return self

    async def __anext__(self) -> Any:
        for raw in self._wire:
            return self._parse(raw)
        raise StopAsyncIteration


def _processor(read_body: str) -> Any:
    from prometheus_client import CollectorRegistry

    from extproc.config import compile_runtime, parse_config
    from extproc.ledger.gate import build_gate
    from extproc.pipeline.metrics import Metrics
    from extproc.pipeline.pipeline import Pipeline, RuntimeHolder
    from extproc.protocol.server import FleetProcessor

    # The fleet of `bench overhead` (two clusters, default classes, no budgets).
    fleet = {
        "version": 1,
        "processor": {"read_body": read_body},
        "clusters": [{"name": f"c{i}", "endpoints": [f"127.0.0.1:{9000 + i}"]} for i in (1, 2)],
    }
    runtime = compile_runtime(parse_config(fleet, "bench"))
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    gate = build_gate(runtime, registry, time.monotonic, random.Random(0))
    return FleetProcessor(Pipeline(RuntimeHolder(runtime), metrics, gate))


def request_wire(size: str, with_body: bool = True) -> list[bytes]:
    """Envoy's two messages for a chat request of ``size`` with a session header (the headers
    alone for the header path: Envoy never sends the body it was told to skip)."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    from extproc.bench.overhead import chat_body

    body = chat_body(SIZES[size])
    pairs = [
        (":authority", b"127.0.0.1:10000"),
        (":path", b"/v1/chat/completions"),
        (":method", b"POST"),
        (":scheme", b"http"),
        ("content-length", str(len(body)).encode()),
        ("content-type", b"application/json"),
        ("x-session-id", b"bench-agent-1"),
        ("x-forwarded-proto", b"http"),
        ("x-request-id", b"0b7f1b3e-4a63-4e8b-9b38-6f1c0d2e9a11"),
    ]
    headers = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in pairs]
    )
    wire = [
        ep.ProcessingRequest(
            request_headers=ep.HttpHeaders(headers=headers, end_of_stream=False)
        ).SerializeToString()
    ]
    if with_body:
        body_message = ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))
        wire.append(body_message.SerializeToString())
    return wire


class _Evictor:
    """Writes ``size`` bytes of its own memory, one byte per cache line: what runs between two
    requests through Envoy evicts the handler's code and data from the CPU's caches."""

    def __init__(self, size: int) -> None:
        self._buffer = bytearray(size)
        self._zeros = bytes(len(range(0, size, 64)))

    def __call__(self) -> None:
        self._buffer[::64] = self._zeros


async def _handler_rows(
    sizes: list[str], repeat: int, profile: str | None, read_body: str, cold_bytes: int = 0
) -> list[dict[str, Any]]:
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    from extproc.bench.bare import bare_process

    parse = ep.ProcessingRequest.FromString
    real = _processor(read_body).Process
    bare = bare_process("c1__c2")

    def one(process: Callable[..., AsyncIterator[Any]], wire: list[bytes]) -> Awaitable[None]:
        async def run() -> None:
            async for answer in process(_Requests(wire, parse), None):
                answer.SerializeToString()

        return run()

    evict = _Evictor(cold_bytes) if cold_bytes > 0 else None

    async def best(process: Callable[..., AsyncIterator[Any]], wire: list[bytes], n: int) -> float:
        for _ in range(min(n, 20)):  # warm-up: caches, first-use paths
            await one(process, wire)
        result = float("inf")
        for _ in range(repeat):
            if evict is None:
                start = time.process_time()
                for _ in range(n):
                    await one(process, wire)
                spent = time.process_time() - start
            else:
                spent = 0.0
                for _ in range(n):
                    evict()  # not timed: only the request's own CPU counts
                    start = time.process_time()
                    await one(process, wire)
                    spent += time.process_time() - start
            result = min(result, spent / n)
        return result * 1e6

    rows = []
    for size in sizes:
        wire = request_wire(size, with_body=read_body == "always")
        n = REQUESTS[size]
        bare_us = await best(bare, wire, n)
        real_us = await best(real, wire, n)
        rows.append(
            {
                "size": size,
                "bare_us": round(bare_us, 1),
                "extproc_us": round(real_us, 1),
                "added_us": round(real_us - bare_us, 1),
            }
        )
        if profile == size:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(n):
                await one(real, wire)
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="1KB,64KB,4MiB,16MiB")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; the best is reported")
    parser.add_argument("--profile", metavar="SIZE", default=None, help="cProfile this size")
    parser.add_argument(
        "--read-body",
        default="always",
        choices=("always", "when_needed"),
        help="always: the body path; when_needed: the header path (decided at the headers)",
    )
    parser.add_argument("--no-decode", dest="decode", action="store_false")
    parser.add_argument(
        "--cold-bytes",
        type=int,
        default=0,
        metavar="N",
        help="write N bytes of other memory before every request (untimed): the handler runs"
        " from cold caches, as through Envoy (e.g. 16000000); 0: a warm loop",
    )


def run(args: argparse.Namespace) -> int:
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise SystemExit(f"unknown sizes {unknown}; choose from {', '.join(SIZES)}")
    # As `extproc serve` does at start (FLEET_MALLOC): large bodies reuse the heap's memory.
    from extproc.serve import allocator

    allocator.tune(allocator.choice_from_env())
    rows = asyncio.run(
        _handler_rows(sizes, args.repeat, args.profile, args.read_body, args.cold_bytes)
    )
    cold = f", caches evicted: {args.cold_bytes} B before each" if args.cold_bytes else ""
    print(f"handler CPU per request (read_body: {args.read_body}{cold}), µs:")
    print(f"{'size':>6} {'bare':>9} {'extproc':>9} {'added':>9}")
    for row in rows:
        print(f"{row['size']:>6} {row['bare_us']:>9} {row['extproc_us']:>9} {row['added_us']:>9}")
    if args.decode:
        print("body decoding CPU, µs:")
        print(f"{'size':>6} {'body':>6} {'bytes':>9} {'orjson':>9} {'json_body':>9} {'ratio':>6}")
        for d in decode_rows(sizes, args.repeat):
            print(
                f"{d['size']:>6} {d['body']:>6} {d['bytes']:>9} {d['orjson_us']:>9} "
                f"{d['json_body_us']:>9} {d['ratio']:>6}"
            )
    return 0


if __name__ == "__main__":
    # Run as a script against another tree (the code before a change), the decode table off:
    #   PYTHONPATH=<old tree> python extproc/bench/handler.py --no-decode
    _parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(_parser)
    raise SystemExit(run(_parser.parse_args()))
