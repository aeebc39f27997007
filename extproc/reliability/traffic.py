"""Steady synthetic traffic for the chaos and soak runs, with every outcome classified.

Open loop at a fixed rate (a slow gateway must not slow its own load down), capped by a
concurrency limit; each request ends in exactly one outcome:

- ``ok``: a 2xx whose body is complete — a JSON object, or an SSE stream that reached its
  API's terminal event (``data: [DONE]`` / ``message_stop``);
- ``truncated``: a 2xx whose stream or body ended early (the worst failure: the client got
  half an answer);
- ``rejected``: a 429 (budget backpressure, with retry hints — not a failure);
- ``client_error``: any other 4xx; ``server_error``: a 5xx; ``transport``: a connection error;
  ``timeout``: no complete answer within the per-request timeout;
- ``aborted``: the generator itself abandoned the request (the abort storm).

Outcomes carry their finish time so the chaos runner can attribute them to a fault window.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import aiohttp
import orjson

OutcomeKind = Literal[
    "ok", "truncated", "rejected", "client_error", "server_error", "transport", "timeout", "aborted"
]
FAILURES: tuple[OutcomeKind, ...] = ("client_error", "server_error", "transport", "timeout")

PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "messages": "/v1/messages",
}


@dataclass(frozen=True, slots=True)
class Outcome:
    kind: OutcomeKind
    started: float
    finished: float
    api: str
    status: int = 0


@dataclass(frozen=True, slots=True)
class TrafficOptions:
    rate_per_s: float = 20.0
    concurrency: int = 256
    sessions: int = 200
    stream_share: float = 0.5
    # Share of requests sized into the medium class (the rest are short).
    medium_share: float = 0.1
    max_tokens: int = 16
    timeout_s: float = 60.0
    seed: int = 1


@dataclass
class SteadyLoad:
    """Drive ``url`` until ``stop`` is set; outcomes accumulate in ``outcomes``."""

    url: str
    options: TrafficOptions = field(default_factory=TrafficOptions)
    clock: Callable[[], float] = time.monotonic
    outcomes: list[Outcome] = field(default_factory=list)
    in_flight: int = 0
    skipped: int = 0  # sends the concurrency cap held back (the generator was the bottleneck)
    # While above 0, this share of requests is abandoned mid-flight by the client.
    abort_share: float = 0.0
    # While set, no new request is sent (the chaos run settles the fleet between faults).
    paused: bool = False

    def __post_init__(self) -> None:
        self._rng = random.Random(self.options.seed)
        self._seq = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def counts(self, start: float = float("-inf"), end: float = float("inf")) -> Counter[str]:
        return Counter(o.kind for o in self.outcomes if start <= o.finished < end)

    def body(self) -> tuple[str, bytes, dict[str, str]]:
        rng, opts = self._rng, self.options
        self._seq += 1
        api = rng.choice(tuple(PATHS))
        session = f"soak-{rng.randrange(opts.sessions)}"
        stream = rng.random() < opts.stream_share
        words = 6000 if rng.random() < opts.medium_share else rng.randint(5, 200)
        text = f"request {self._seq} " + "lorem ipsum " * (words // 2)
        headers = {"content-type": "application/json", "x-session-id": session}
        payload: dict[str, object]
        if api == "messages":
            headers["anthropic-version"] = "2023-06-01"
            payload = {
                "model": "sim",
                "max_tokens": opts.max_tokens,
                "messages": [{"role": "user", "content": text}],
                "stream": stream,
            }
        elif api == "chat":
            payload = {
                "model": "sim",
                "max_tokens": opts.max_tokens,
                "messages": [{"role": "user", "content": text}],
                "stream": stream,
            }
        else:
            payload = {"model": "sim", "max_tokens": opts.max_tokens, "prompt": text}
            payload["stream"] = stream
        return api, orjson.dumps(payload), headers

    async def run(self, stop: asyncio.Event) -> None:
        timeout = aiohttp.ClientTimeout(total=self.options.timeout_s)
        connector = aiohttp.TCPConnector(limit=self.options.concurrency, force_close=False)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            interval = 1.0 / self.options.rate_per_s
            next_at = self.clock()
            while not stop.is_set():
                now = self.clock()
                if now < next_at:
                    with contextlib.suppress(TimeoutError):  # the next send is due
                        await asyncio.wait_for(stop.wait(), next_at - now)
                    continue
                next_at += interval
                if self.paused:
                    continue
                if self.in_flight >= self.options.concurrency:
                    self.skipped += 1
                    continue
                task = asyncio.create_task(self._one(session))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            # Let what is in flight finish: its outcome belongs to the run.
            if self._tasks:
                await asyncio.wait(set(self._tasks), timeout=self.options.timeout_s + 5)

    async def _one(self, session: aiohttp.ClientSession) -> None:
        api, payload, headers = self.body()
        started = self.clock()
        self.in_flight += 1
        abort = self.abort_share > 0 and self._rng.random() < self.abort_share
        try:
            if abort:
                # Give up after a moment: mid-prefill or mid-stream, as impatient clients do.
                kind, status = await self._abandon(session, api, payload, headers)
            else:
                kind, status = await self._send(session, api, payload, headers)
        finally:
            self.in_flight -= 1
        self.outcomes.append(Outcome(kind, started, self.clock(), api, status))

    async def _abandon(
        self, session: aiohttp.ClientSession, api: str, payload: bytes, headers: dict[str, str]
    ) -> tuple[OutcomeKind, int]:
        try:
            await asyncio.wait_for(
                self._send(session, api, payload, headers), self._rng.uniform(0.01, 0.3)
            )
        except TimeoutError:
            return "aborted", 0
        return "aborted", 0

    async def _send(
        self, session: aiohttp.ClientSession, api: str, payload: bytes, headers: dict[str, str]
    ) -> tuple[OutcomeKind, int]:
        try:
            async with session.post(self.url + PATHS[api], data=payload, headers=headers) as resp:
                status = resp.status
                raw = await resp.read()
                if status == 429:
                    return "rejected", status
                if 400 <= status < 500:
                    return "client_error", status
                if status >= 500:
                    return "server_error", status
                stream = resp.headers.get("content-type", "").startswith("text/event-stream")
                return ("ok" if complete(api, raw, stream) else "truncated"), status
        except aiohttp.ClientPayloadError:
            # The body broke off after a 2xx status line: a truncated answer.
            return "truncated", 200
        except TimeoutError:
            return "timeout", 0
        except (aiohttp.ClientError, OSError):
            return "transport", 0


def complete(api: str, raw: bytes, stream: bool) -> bool:
    """Whether a 2xx body is a whole answer in its API's format."""
    if stream:
        text = raw.rstrip()
        if api == "messages":
            return b"event: message_stop" in text[-200:]
        return text.endswith(b"data: [DONE]")
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False
    return isinstance(parsed, dict) and ("choices" in parsed or "content" in parsed)
