"""Client aborts through a real Envoy, two processor replicas and a shared Redis ledger.

Clients give up at every stage of an LLM request, and each stage ends the processor's work
differently: during the **upload** (Envoy is still buffering the body; the processor has seen
only the headers, nothing is reserved yet), during the **prefill** (the budget is reserved and
the engine is computing; no response byte yet) and **mid-stream** (tokens are flowing). A
fourth share of the requests runs to completion, so the budgets are pressed while the storm
goes on.

What the run shows, for the ledger:

- no budget is leaked: once the storm ends, every replica's in-flight gauges and every Redis
  compartment (``count``, ``tokens`` and the lease set) return to 0, and how long that took;
- no over-admission beyond the stated bound: the peak number of concurrent requests of each
  class seen *at the upstreams* (the simulated engines count what actually reached them, and
  end a request when its client goes away, as real engines do) minus the class's
  ``max_concurrent``. The bound is 0 while Redis answers every ledger call, and one budget
  (the documented local fallback) once a call failed or timed out; ``redis_errors`` says which;
- no lost request: every completed request ends in a 2xx or a 429 (backpressure), never a 5xx
  or a broken connection.

Raw sockets, because an upload abort means sending half a body and closing, which HTTP client
libraries do not do.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson

from extproc.harness.launch import LOOPBACK, FleetStack
from extproc.ledger.redis import compartment_keys
from extproc.reliability import probes
from extproc.reliability.redis_proc import RedisProc

Kind = Literal["complete", "upload", "prefill", "stream"]
KINDS: tuple[Kind, ...] = ("complete", "upload", "prefill", "stream")

# Tight budgets per cluster, so the storm presses against them and over-admission would show.
# Refused at once (no flow-control wait, no placement elsewhere), so the storm meets the
# budget's own accounting and nothing else.
NO_WAIT: dict[str, Any] = {"max_wait_s": 0}
CLASSES: list[dict[str, Any]] = [
    {"name": "short", "max_input_tokens": 2048, "budget": {"max_concurrent": 4}, "wait": NO_WAIT},
    {"name": "medium", "budget": {"max_concurrent": 2}, "wait": NO_WAIT},
]
LIMITS = {c["name"]: int(c["budget"]["max_concurrent"]) for c in CLASSES}
KEY_PREFIX = "fleet"
GAUGES = ("fleet_budget_inflight_requests", "fleet_budget_inflight_tokens")


@dataclass(frozen=True, slots=True)
class StormOptions:
    requests: int = 1200
    concurrency: int = 48
    clusters: int = 3
    replicas: int = 2
    lease_ttl_s: float = 10.0
    # Simulated engines: 2,000 prompt tokens prefill in 0.2 s, then 10 tokens/s of decode, so
    # a prefill abort (0.01-0.15 s after the upload) lands before the first byte.
    prefill_tps: float = 10_000.0
    decode_tps: float = 10.0
    max_tokens: int = 8
    settle_cap_s: float = 60.0
    redis_timeout_ms: int = 1000
    seed: int = 13
    out: str = "out/abort-storm"


@dataclass
class StormResult:
    requests: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    lost: int = 0  # completed requests that got a 5xx or a broken connection
    upstream_peak: dict[str, int] = field(default_factory=dict)  # class -> max over clusters
    max_over_admission: dict[str, int] = field(default_factory=dict)
    leaked_gauges: float = 0.0
    leaked_redis: dict[str, float] = field(default_factory=dict)
    upstream_inflight_after: int = 0
    # Redis ledger calls that failed or timed out during the run (each admits on the local
    # fallback, whose documented bound is one budget over: the over-admission is then theirs).
    redis_errors: float = 0.0
    settled_after_s: float | None = None
    lease_ttl_s: float = 0.0
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return (
            self.lost == 0
            and self.leaked_gauges == 0
            and not any(self.leaked_redis.values())
            and self.upstream_inflight_after == 0
            and self.settled_after_s is not None
            and self.settled_after_s <= self.lease_ttl_s
            and all(v <= self.bound(k) for k, v in self.max_over_admission.items())
        )

    def bound(self, klass: str) -> int:
        """The stated over-admission bound: none while Redis answers every call; one budget
        (the documented ``on_unavailable: local`` fallback) once a call failed."""
        return 0 if self.redis_errors == 0 else LIMITS[klass]


def _body(rng: random.Random, i: int, stream: bool, opts: StormOptions) -> tuple[str, bytes]:
    medium = rng.random() < 0.2
    words = 3000 if medium else rng.randint(20, 400)
    text = f"storm {i} " + "lorem ipsum " * (words // 2)
    payload = {
        "model": "sim",
        "max_tokens": opts.max_tokens,
        "stream": stream,
        "messages": [{"role": "user", "content": text}],
    }
    # The same body is valid for both APIs: half go to each.
    path = "/v1/messages" if rng.random() < 0.5 else "/v1/chat/completions"
    return path, orjson.dumps(payload)


def _head(path: str, body_len: int, session: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
        f"anthropic-version: 2023-06-01\r\nx-session-id: {session}\r\n"
        f"content-length: {body_len}\r\nconnection: close\r\n\r\n"
    ).encode()


async def _one(port: int, kind: Kind, rng: random.Random, i: int, opts: StormOptions) -> str:
    """Send one request and end it the ``kind`` way; returns its outcome."""
    path, body = _body(rng, i, stream=kind == "stream", opts=opts)
    head = _head(path, len(body), f"storm-{rng.randrange(64)}")
    delay = rng.uniform(0.01, 0.15)
    try:
        reader, writer = await asyncio.open_connection(LOOPBACK, port)
    except OSError:
        return "connect_error"
    try:
        if kind == "upload":
            writer.write(head + body[: len(body) // 2])
            await writer.drain()
            await asyncio.sleep(delay)
            return "aborted_upload"
        writer.write(head + body)
        await writer.drain()
        if kind == "prefill":
            try:
                first = await asyncio.wait_for(reader.read(1), delay)
            except TimeoutError:
                return "aborted_prefill"
            return "answered_before_abort" if first else "closed"
        status_line = await reader.readline()
        parts = status_line.split()
        status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
        if kind == "stream" and status == 200:
            await reader.readuntil(b"\r\n\r\n")  # the response headers
            await reader.read(1)  # the first token is out
            return "aborted_stream"
        await reader.read()  # to the end: connection: close
        if status == 200:
            return "ok"
        if status == 429:
            return "rejected"
        return f"status_{status}"
    except (ConnectionError, OSError, asyncio.IncompleteReadError):
        return "broken"
    finally:
        writer.close()
        # The peer may have reset first: the socket is closed either way.
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()


async def _storm(port: int, opts: StormOptions) -> tuple[Counter[str], Counter[str]]:
    rng = random.Random(opts.seed)
    kinds: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    sem = asyncio.Semaphore(opts.concurrency)

    async def run(i: int) -> None:
        kind = KINDS[i % len(KINDS)]
        kinds[kind] += 1
        async with sem:
            outcomes[await _one(port, kind, random.Random(rng.random()), i, opts)] += 1

    await asyncio.gather(*(run(i) for i in range(opts.requests)))
    return kinds, outcomes


def _upstreams(stack: FleetStack, reset: bool = False) -> list[dict[str, Any]]:
    import http.client

    docs = []
    for spec in stack.sim_specs.values():
        conn = http.client.HTTPConnection(LOOPBACK, spec.port, timeout=5)
        try:
            conn.request("DELETE" if reset else "GET", "/admin/concurrency")
            docs.append(orjson.loads(conn.getresponse().read()))
        finally:
            conn.close()
    return docs


def _gauges(stack: FleetStack) -> float:
    out = 0.0
    for port in stack.metrics_ports:
        samples = probes.scrape(port)
        out += sum(probes.total(samples, name) for name in GAUGES)
        out += probes.total(samples, "fleet_extproc_streams_active")
    return out


def _redis_held(url: str, clusters: list[str]) -> dict[str, float]:
    """What the compartments still hold. A tombstone (tokens -1: a reserve given up on before
    Redis answered, see release.lua) holds no budget and expires by itself: not counted."""
    import redis

    client = redis.Redis.from_url(url)
    held = {"count": 0.0, "tokens": 0.0, "leases": 0.0}
    try:
        for cluster in clusters:
            for klass in LIMITS:
                state, _leases, lease_tokens = compartment_keys(KEY_PREFIX, cluster, klass)
                count, tokens = client.hmget(state, "count", "tokens")
                held["count"] += float(count or 0)
                held["tokens"] += float(tokens or 0)
                values = client.hvals(lease_tokens)
                held["leases"] += float(sum(1 for v in values if float(v) >= 0))
    finally:
        client.close()
    return held


def run_storm(opts: StormOptions) -> StormResult:
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    redis_proc = RedisProc(out / "redis.log")
    redis_proc.start()
    result = StormResult(requests=opts.requests, lease_ttl_s=opts.lease_ttl_s)
    try:
        stack = FleetStack(
            out / "fleet",
            clusters=opts.clusters,
            processors=opts.replicas,
            sim_args=(
                "--time-scale",
                "1",
                "--prefill-tps",
                str(opts.prefill_tps),
                "--decode-tps",
                str(opts.decode_tps),
            ),
            fleet_overrides={
                "classes": CLASSES,
                "flow": {"place_new_sessions": False},
                "redis": {
                    "url": redis_proc.url,
                    "key_prefix": KEY_PREFIX,
                    "lease_ttl_s": opts.lease_ttl_s,
                    "replicas": opts.replicas,
                    # This run is about aborts, not a slow Redis (the chaos run injects that):
                    # a timeout generous enough for a loaded machine keeps the local fallback
                    # out of the figures; redis_errors shows whether it still fired.
                    "timeout_ms": opts.redis_timeout_ms,
                },
            },
            access_log=False,
        )
        with stack:
            _upstreams(stack, reset=True)
            started = time.monotonic()
            kinds, outcomes = asyncio.run(_storm(stack.listener_port, opts))
            ended = time.monotonic()
            clusters = list(stack.sim_specs)

            def settled() -> bool:
                idle = all(sum(doc.get("inflight", {}).values()) == 0 for doc in _upstreams(stack))
                return (
                    idle
                    and _gauges(stack) == 0
                    and not any(_redis_held(redis_proc.url, clusters).values())
                )

            while not settled() and time.monotonic() - ended < opts.settle_cap_s:
                time.sleep(0.1)
            if settled():
                result.settled_after_s = round(time.monotonic() - ended, 2)
            docs = _upstreams(stack)
            result.kinds = dict(kinds)
            result.outcomes = dict(outcomes)
            result.lost = sum(
                n
                for k, n in outcomes.items()
                if k.startswith("status_5") or k in ("broken", "connect_error", "closed")
            )
            for klass, limit in LIMITS.items():
                peak = max((int(d.get("peak", {}).get(klass, 0)) for d in docs), default=0)
                result.upstream_peak[klass] = peak
                result.max_over_admission[klass] = max(0, peak - limit)
            result.upstream_inflight_after = sum(sum(d.get("inflight", {}).values()) for d in docs)
            result.redis_errors = sum(
                probes.total(probes.scrape(port), "fleet_ledger_redis_errors_total")
                for port in stack.metrics_ports
            )
            result.leaked_gauges = _gauges(stack)
            result.leaked_redis = _redis_held(redis_proc.url, clusters)
            result.seconds = round(ended - started, 1)
    finally:
        redis_proc.stop()
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = StormOptions()
    parser.add_argument("--requests", type=int, default=defaults.requests)
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency)
    parser.add_argument("--lease-ttl-s", type=float, default=defaults.lease_ttl_s)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--out", default=defaults.out)


def run(args: argparse.Namespace) -> int:
    opts = StormOptions(
        requests=args.requests,
        concurrency=args.concurrency,
        lease_ttl_s=args.lease_ttl_s,
        seed=args.seed,
        out=args.out,
    )
    result = run_storm(opts)
    doc = {
        "command": (
            f"extproc abort-storm --requests {opts.requests} --concurrency {opts.concurrency}"
            f" --seed {opts.seed}"
        ),
        "limits_max_concurrent": LIMITS,
        "passed": result.passed,
        **asdict(result),
    }
    path = Path(opts.out) / "abort-storm.json"
    path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    print(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())
    print(f"abort-storm: {'PASS' if result.passed else 'FAIL'}; JSON in {path}")
    return 0 if result.passed else 1
