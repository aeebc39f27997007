"""The request type every generator produces, and the built-in synthetic workload.

The synthetic mix exercises what the processor is for:

- multi-turn chat sessions behind a few shared system prompts (turn k+1 resends turn k's
  messages plus the reply and a new user message, so its prompt extends turn k's);
- RAG requests over a few shared long documents (same system prompt and document => same
  prefix, which prefix affinity should route to the same cluster);
- agentic sessions whose context grows step by step up to a cap (1M tokens by default);
- long-context bursts (start, duration, rate, size) that must not starve short requests.

Everything is drawn from ``random.Random`` seeded by the config, so a config always yields the
same requests. The first user message of every session starts with its session id, which makes
the processor's prefix key (system prompt + first 1024 characters of the first user message)
distinct per session.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from extproc.harness.prompts import API_PATHS, CHARS_PER_TOKEN, ApiKind, TextSynth

BodySource = Mapping[str, Any] | Callable[[], Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """One request of an open-loop replay.

    ``body`` is either the JSON body or a zero-argument callable that builds it at send time
    (trace prompts are synthesised lazily to keep memory flat). ``input_tokens`` is the
    generator's estimate, used only to put the request in a reporting class.
    """

    arrival_s: float
    api: ApiKind
    path: str
    body: BodySource
    session_id: str | None
    send_session_header: bool
    kind: str
    input_tokens: int
    stream: bool
    max_tokens: int
    # Headers of this request alone (e.g. its API key), on top of ReplayOptions.headers.
    headers: tuple[tuple[str, str], ...] = ()

    def materialize(self) -> Mapping[str, Any]:
        return self.body() if callable(self.body) else self.body


@dataclass(frozen=True, slots=True)
class BurstSpec:
    """Long-context requests arriving as a Poisson stream inside one window."""

    start_s: float
    duration_s: float
    rate_per_s: float
    input_tokens: int

    def __post_init__(self) -> None:
        if self.start_s < 0 or self.duration_s <= 0 or self.rate_per_s <= 0:
            raise ValueError(f"burst needs start >= 0, duration > 0 and rate > 0: {self}")
        if self.input_tokens <= 0:
            raise ValueError(f"burst input_tokens must be > 0: {self}")

    @property
    def window(self) -> tuple[float, float]:
        return (self.start_s, self.start_s + self.duration_s)

    @classmethod
    def parse(cls, text: str) -> BurstSpec:
        """``START,DURATION,RATE,TOKENS``, e.g. ``20,10,2,150000``."""
        parts = text.split(",")
        if len(parts) != 4:
            raise ValueError(f"burst must be START,DURATION,RATE,TOKENS, got {text!r}")
        start, duration, rate, tokens = parts
        return cls(float(start), float(duration), float(rate), int(tokens))


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    seed: int = 0
    duration_s: float = 60.0
    model: str = "sim"
    # chat
    chat_sessions_per_s: float = 1.0
    chat_turns: tuple[int, int] = (2, 6)
    chat_think_s: float = 4.0
    chat_user_tokens: tuple[int, int] = (30, 300)
    system_prompts: int = 3
    system_prompt_tokens: int = 1000
    # RAG
    rag_per_s: float = 0.5
    rag_documents: int = 4
    rag_document_tokens: int = 6000
    # agentic
    agent_sessions_per_s: float = 0.02
    agent_step_s: float = 3.0
    agent_step_tokens: int = 4000
    agent_max_context_tokens: int = 1_000_000
    # all
    output_tokens: tuple[int, int] = (16, 256)
    stream_share: float = 1.0
    session_header_share: float = 0.5
    bursts: tuple[BurstSpec, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        rates = (self.chat_sessions_per_s, self.rag_per_s, self.agent_sessions_per_s)
        if self.duration_s <= 0 or any(rate < 0 for rate in rates):
            raise ValueError("duration must be > 0 and rates >= 0")
        for name in ("chat_turns", "chat_user_tokens", "output_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be (low, high) with 1 <= low <= high")
        for name in ("stream_share", "session_header_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be within [0, 1]")
        if self.system_prompts < 1 or self.rag_documents < 1:
            raise ValueError("system_prompts and rag_documents must be >= 1")
        if self.agent_step_tokens < 1 or self.agent_max_context_tokens < 1:
            raise ValueError("agent_step_tokens and agent_max_context_tokens must be >= 1")

    @property
    def burst_windows(self) -> tuple[tuple[float, float], ...]:
        return tuple(burst.window for burst in self.bursts)


def _message(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def _message_chars(role: str, content: str) -> int:
    # Mirrors prompts.canonical_prompt's "<|role|>content\n" framing without building the text
    # (an agent context of 1M tokens would otherwise be rebuilt at every step).
    return len(role) + 5 + len(content)


def _tokens(chars: int) -> int:
    return -(-chars // CHARS_PER_TOKEN)


class _Generator:
    def __init__(self, config: WorkloadConfig) -> None:
        self.config = config
        self.rng = random.Random(f"workload:{config.seed}")
        self.synth = TextSynth(config.seed)
        self.out: list[ReplayRequest] = []

    def tokens_text(self, key: str, tokens: int) -> str:
        return self.synth.text(key, tokens * CHARS_PER_TOKEN)

    def poisson(self, rate: float, start: float, end: float) -> list[float]:
        times: list[float] = []
        if rate <= 0:
            return times
        t = start + self.rng.expovariate(rate)
        while t < end:
            times.append(t)
            t += self.rng.expovariate(rate)
        return times

    def emit(
        self,
        arrival: float,
        messages: list[dict[str, str]],
        prompt_chars: int,
        kind: str,
        session_id: str,
        send_header: bool,
    ) -> int:
        config = self.config
        max_tokens = self.rng.randint(*config.output_tokens)
        stream = self.rng.random() < config.stream_share
        body: dict[str, Any] = {
            "model": config.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        api: ApiKind = "openai-chat"
        self.out.append(
            ReplayRequest(
                arrival_s=arrival,
                api=api,
                path=API_PATHS[api],
                body=body,
                session_id=session_id,
                send_session_header=send_header,
                kind=kind,
                input_tokens=_tokens(prompt_chars),
                stream=stream,
                max_tokens=max_tokens,
            )
        )
        return max_tokens

    def chat(self) -> None:
        config = self.config
        systems = [
            self.tokens_text(f"system:{i}", config.system_prompt_tokens)
            for i in range(config.system_prompts)
        ]
        for n, start in enumerate(self.poisson(config.chat_sessions_per_s, 0.0, config.duration_s)):
            session = f"chat-{n}"
            send_header = self.rng.random() < config.session_header_share
            system = systems[self.rng.randrange(len(systems))]
            messages = [_message("system", system)]
            chars = _message_chars("system", system)
            arrival = start
            for turn in range(self.rng.randint(*config.chat_turns)):
                if arrival >= config.duration_s:
                    break
                user_tokens = self.rng.randint(*config.chat_user_tokens)
                text = self.tokens_text(f"{session}:user:{turn}", user_tokens)
                # The session id leads the first user message so that sessions sharing a system
                # prompt still differ within the first ~200 characters (the prefix-affinity key).
                content = f"[{session}] {text}" if turn == 0 else text
                messages = [*messages, _message("user", content)]
                chars += _message_chars("user", content)
                max_tokens = self.emit(arrival, messages, chars, "chat", session, send_header)
                reply = self.tokens_text(f"{session}:assistant:{turn}", max_tokens)
                messages = [*messages, _message("assistant", reply)]
                chars += _message_chars("assistant", reply)
                arrival += self.rng.expovariate(1.0 / config.chat_think_s)

    def rag(self) -> None:
        config = self.config
        system = "You answer questions using only the document provided. " + self.tokens_text(
            "rag:system", 200
        )
        documents = [
            self.tokens_text(f"rag:doc:{d}", config.rag_document_tokens)
            for d in range(config.rag_documents)
        ]
        for n, arrival in enumerate(self.poisson(config.rag_per_s, 0.0, config.duration_s)):
            d = self.rng.randrange(len(documents))
            question = self.tokens_text(f"rag:q:{n}", self.rng.randint(20, 80))
            content = f"Document {d}:\n{documents[d]}\n\nQuestion {n}: {question}"
            messages = [_message("system", system), _message("user", content)]
            chars = _message_chars("system", system) + _message_chars("user", content)
            # One-shot requests: no session header, so routing relies on the shared prefix.
            self.emit(arrival, messages, chars, "rag", f"rag-{n}", False)

    def agent(self) -> None:
        config = self.config
        system = "You are an autonomous coding agent with tools. " + self.tokens_text(
            "agent:system", 1500
        )
        for n, start in enumerate(
            self.poisson(config.agent_sessions_per_s, 0.0, config.duration_s)
        ):
            session = f"agent-{n}"
            send_header = self.rng.random() < config.session_header_share
            task = f"[{session}] " + self.tokens_text(f"{session}:task", 300)
            messages = [_message("system", system), _message("user", task)]
            chars = _message_chars("system", system) + _message_chars("user", task)
            arrival = start
            step = 0
            while arrival < config.duration_s and _tokens(chars) <= config.agent_max_context_tokens:
                max_tokens = self.emit(arrival, messages, chars, "agent", session, send_header)
                call = self.tokens_text(f"{session}:call:{step}", max_tokens)
                result = "Tool result: " + self.tokens_text(
                    f"{session}:result:{step}", config.agent_step_tokens
                )
                messages = [*messages, _message("assistant", call), _message("user", result)]
                chars += _message_chars("assistant", call) + _message_chars("user", result)
                arrival += config.agent_step_s
                step += 1

    def bursts(self) -> None:
        for b, burst in enumerate(self.config.bursts):
            end = min(burst.start_s + burst.duration_s, self.config.duration_s)
            for n, arrival in enumerate(self.poisson(burst.rate_per_s, burst.start_s, end)):
                session = f"burst-{b}-{n}"
                content = f"[{session}] " + self.tokens_text(session, burst.input_tokens)
                chars = _message_chars("user", content)
                self.emit(arrival, [_message("user", content)], chars, "burst", session, False)


def generate_workload(config: WorkloadConfig) -> list[ReplayRequest]:
    """All requests of the synthetic workload, sorted by arrival time."""
    generator = _Generator(config)
    generator.chat()
    generator.rag()
    generator.agent()
    generator.bursts()
    return sorted(generator.out, key=lambda r: r.arrival_s)
