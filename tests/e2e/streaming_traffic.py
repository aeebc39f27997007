"""Steady streaming traffic through the gateway with the real OpenAI SDK, every response checked.

Each worker thread sends streamed chat completions back to back. A response counts as complete
only when every token arrived (the simulated cluster writes four characters per token), the
finish reason says the token cap was reached and the usage chunk counts the same tokens: a stream
cut anywhere, by a reset or by an early end, is ``truncated``. A 429 is the gateway's budget
answer (``rejected``, the worker backs off briefly); anything else is ``failed``.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field

import openai

# Characters per output token in the simulated cluster's text.
CHARS_PER_TOKEN = 4


@dataclass
class StreamingTraffic:
    base_url: str
    workers: int = 8
    max_tokens: int = 48
    backoff_s: float = 0.2
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter, init=False)
    problems: list[str] = field(default_factory=list, init=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _threads: list[threading.Thread] = field(default_factory=list, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def start(self) -> StreamingTraffic:
        for w in range(self.workers):
            thread = threading.Thread(target=self._worker, args=(w,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self, timeout: float = 60) -> None:
        """Let every worker finish the request it is in, then return."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t for t in self._threads if t.is_alive()]
        if alive:
            raise TimeoutError(f"{len(alive)} traffic workers still busy after {timeout:g}s")

    def count(self, kind: str) -> int:
        with self._lock:
            return self.outcomes[kind]

    def _record(self, kind: str, problem: str | None = None) -> None:
        with self._lock:
            self.outcomes[kind] += 1
            if problem is not None:
                self.problems.append(problem)

    def _worker(self, w: int) -> None:
        client = openai.OpenAI(
            base_url=f"{self.base_url}/v1",
            api_key="test",
            max_retries=0,  # a failure must show, not be hidden by a retry
            timeout=60.0,
        )
        i = 0
        try:
            while not self._stop.is_set():
                i += 1
                kind = self._one(client, f"worker {w} request {i}")
                if kind == "rejected":
                    time.sleep(self.backoff_s)
        finally:
            client.close()

    def _one(self, client: openai.OpenAI, label: str) -> str:
        text: list[str] = []
        finish: str | None = None
        usage_tokens: int | None = None
        try:
            stream = client.chat.completions.create(
                model="sim",
                messages=[{"role": "user", "content": f"stream through a deploy: {label}"}],
                max_tokens=self.max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers={"x-session-id": label},
            )
            for chunk in stream:
                if chunk.choices:
                    choice = chunk.choices[0]
                    text.append(choice.delta.content or "")
                    finish = choice.finish_reason or finish
                if chunk.usage is not None:
                    usage_tokens = chunk.usage.completion_tokens
        except openai.RateLimitError:
            self._record("rejected")
            return "rejected"
        except openai.APIStatusError as exc:
            self._record("failed", f"{label}: HTTP {exc.status_code} {exc.message[:200]}")
            return "failed"
        except Exception as exc:  # noqa: BLE001 - every other way a stream can break is recorded
            kind = "truncated" if text else "failed"
            self._record(kind, f"{label}: {type(exc).__name__}: {exc} after {len(text)} chunks")
            return kind
        got = len("".join(text))
        want = self.max_tokens * CHARS_PER_TOKEN
        if got != want or finish != "length" or usage_tokens != self.max_tokens:
            self._record(
                "truncated",
                f"{label}: {got}/{want} chars, finish={finish}, usage={usage_tokens}",
            )
            return "truncated"
        self._record("complete")
        return "complete"
