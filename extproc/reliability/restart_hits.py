"""Multi-turn conversations keyed by their prompt, and the prefix-cache hit ratio they see.

The chaos row "processor restart: prefix-cache hit ratio" runs these beside the steady load:
conversations with no session header (the processor keys them by the chain key, so placement
depends on the common chains its sketch learnt), all behind one shared opening, each turn
resending its whole history. New conversations keep starting (each ends after ``turns``), so
the keying of conversations nobody has seen yet is measured too, which is what a replica with
an empty sketch would get wrong. The hit ratio is the engines' own figure: cached prompt
tokens over prompt tokens, from each answer's ``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import orjson

OPENING = "You are the support assistant of a large shop. " + "Policy clause. " * 300
CHAT = "/v1/chat/completions"


@dataclass
class Answer:
    finished: float
    prompt_tokens: int
    cached_tokens: int


@dataclass
class Conversations:
    url: str
    conversations: int = 24
    turns: int = 6
    rate_per_s: float = 4.0
    seed: int = 1
    clock: Callable[[], float] = time.monotonic
    answers: list[Answer] = field(default_factory=list)
    failed: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._next_id = 0
        self._active: list[tuple[int, list[dict[str, str]]]] = [
            self._new() for _ in range(self.conversations)
        ]
        self._busy: set[int] = set()  # slots with a turn in flight: one turn at a time

    def _new(self) -> tuple[int, list[dict[str, str]]]:
        self._next_id += 1
        return self._next_id, [{"role": "system", "content": OPENING}]

    def ratio(self, start: float, end: float) -> tuple[float | None, int]:
        """Cached over prompt tokens of the answers finished in [start, end), and their count."""
        window = [a for a in self.answers if start <= a.finished < end]
        prompt = sum(a.prompt_tokens for a in window)
        if not prompt:
            return None, len(window)
        return sum(a.cached_tokens for a in window) / prompt, len(window)

    async def run(self, stop: asyncio.Event) -> None:
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            tasks: set[asyncio.Task[None]] = set()
            while not stop.is_set():
                free = [i for i in range(len(self._active)) if i not in self._busy]
                if free:
                    slot = self._rng.choice(free)
                    self._busy.add(slot)
                    task = asyncio.create_task(self._turn(session, slot))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0 / self.rate_per_s)
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _turn(self, session: aiohttp.ClientSession, slot: int) -> None:
        try:
            await self._send(session, slot)
        finally:
            self._busy.discard(slot)

    async def _send(self, session: aiohttp.ClientSession, slot: int) -> None:
        conversation, history = self._active[slot]
        turn = sum(1 for m in history if m["role"] == "user")
        messages = [*history, {"role": "user", "content": f"conversation {conversation}: q{turn}"}]
        body = {"model": "sim", "max_tokens": 8, "messages": messages, "stream": False}
        try:
            async with session.post(
                self.url + CHAT,
                data=orjson.dumps(body),
                headers={"content-type": "application/json"},
            ) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError):
            self.failed += 1
            return
        if status != 200:
            self.failed += 1
            return
        doc = orjson.loads(raw)
        usage = doc.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        self.answers.append(
            Answer(
                self.clock(),
                int(usage.get("prompt_tokens", 0)),
                int(details.get("cached_tokens", 0)),
            )
        )
        reply = doc["choices"][0]["message"]["content"]
        history[:] = [*messages, {"role": "assistant", "content": reply}]
        if turn + 1 >= self.turns:
            self._active[slot] = self._new()
