"""The traffic of `extproc bench peers`: the same requests for every set-up.

- ``chat``: multi-turn chat behind two shared 2,000-token system prompts; half of the sessions
  send ``x-session-id`` (clients differ), the rest are recognisable only by their body;
- ``first-user``: no system role: a shared 2,000-token opening at the start of the first user
  message (``extproc.harness.layouts``), a third of the conversations with a shared document,
  no session ids;
- ``agentic``: agent sessions whose context (a shared 8,000-token tool catalogue, then tool
  results) grows step by step beside short interactive chats, no session ids;
- ``trace``: the public Mooncake trace vendored under ``third_party/`` (block ids rebuilt into
  text, no session ids), replayed closed-loop: ``concurrency`` requests in flight at all times;
- ``ramp``: chat sessions arriving at a stepped rate, for the highest sustained rate.

All but ``trace`` are open-loop (each request sent at its arrival time). Every request streams.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extproc.bench.routing import blocks_ideal, prompt_blocks
from extproc.harness.layouts import LayoutConfig, generate_layout
from extproc.harness.prompts import API_PATHS, CHARS_PER_TOKEN, TextSynth
from extproc.harness.replay import ClassBounds
from extproc.harness.trace import read_trace, trace_to_requests
from extproc.harness.workload import ReplayRequest, WorkloadConfig, generate_workload

TRACE = Path(__file__).resolve().parents[2] / "third_party/mooncake/mooncake_synthetic_trace.jsonl"
# short (interactive) < 8,192 input tokens <= long: one bound, so the medium class is empty.
BOUNDS = ClassBounds(8192, 8192)
WORKLOADS: tuple[str, ...] = ("chat", "first-user", "agentic", "trace")


@dataclass(frozen=True, slots=True)
class PeerWorkload:
    name: str
    description: str
    requests: tuple[ReplayRequest, ...]
    # None: open loop; N: closed loop, N requests in flight (every arrival at 0).
    closed_loop: int | None = None
    # Start of each rate step (s) for ``ramp``, else empty.
    steps: tuple[float, ...] = ()

    @property
    def ideal(self) -> float:
        """Hit ratio of one infinite prefix cache serving every request in order."""
        return blocks_ideal(prompt_blocks(self.requests))

    @property
    def working_set_tokens(self) -> int:
        blocks = {h for hashes, _ in prompt_blocks(self.requests) for h in hashes}
        return len(blocks) * 512


def streamed(requests: Sequence[ReplayRequest]) -> list[ReplayRequest]:
    out = []
    for r in requests:
        body = {**r.materialize(), "stream": True, "stream_options": {"include_usage": True}}
        out.append(dataclasses.replace(r, body=body, stream=True))
    return out


def chat(seed: int, duration_s: float, sessions_per_s: float) -> PeerWorkload:
    """Sessions start within ``duration_s``; each plays all its turns (up to ~8 s later)."""
    config = WorkloadConfig(
        seed=seed,
        duration_s=duration_s + 8.0,
        chat_sessions_per_s=sessions_per_s,
        chat_turns=(3, 5),
        chat_think_s=1.5,
        chat_user_tokens=(100, 600),
        system_prompts=2,
        system_prompt_tokens=2000,
        rag_per_s=0.0,
        agent_sessions_per_s=0.0,
        output_tokens=(16, 48),
        session_header_share=0.5,
    )
    first: dict[str | None, float] = {}
    for r in generate_workload(config):
        first.setdefault(r.session_id, r.arrival_s)
    requests = [r for r in generate_workload(config) if first[r.session_id] < duration_s]
    return PeerWorkload(
        "chat",
        f"multi-turn chat, {sessions_per_s:g} sessions/s for {duration_s:g} s, 3-5 turns, two "
        f"shared 2,000-token system prompts, half the sessions with x-session-id: "
        f"{len(requests)} requests",
        tuple(requests),
    )


def first_user(seed: int, duration_s: float, sessions_per_s: float) -> PeerWorkload:
    config = LayoutConfig(
        layout="first-user",
        conversations=max(1, round(duration_s * sessions_per_s)),
        turns=4,
        opening_chars=2000 * CHARS_PER_TOKEN,
        doc_share=0.3,
        documents=8,
        starts_per_s=sessions_per_s,
        think_s=1.5,
        seed=seed,
        max_tokens=24,
    )
    requests = streamed(generate_layout(config))
    return PeerWorkload(
        "first-user",
        f"a shared 2,000-token opening at the start of the first user message, "
        f"{config.conversations} conversations x 4 turns ({sessions_per_s:g}/s), 30 % with one "
        f"of 8 shared documents, no session ids: {len(requests)} requests",
        tuple(requests),
    )


def _tools(synth: TextSynth, tokens: int) -> list[dict[str, Any]]:
    text = synth.text("agentic:tools", tokens * CHARS_PER_TOKEN)
    size = 2000
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": text[i : i + size],
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
            },
        }
        for i in range(0, len(text), size)
    ]


def _request(arrival: float, body: dict[str, Any], kind: str, session: str) -> ReplayRequest:
    chars = len(str(body.get("tools", ""))) + sum(len(m["content"]) for m in body["messages"])
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    return ReplayRequest(
        arrival_s=arrival,
        api="openai-chat",
        path=API_PATHS["openai-chat"],
        body=body,
        session_id=session,
        send_session_header=False,
        kind=kind,
        input_tokens=chars // CHARS_PER_TOKEN,
        stream=True,
        max_tokens=int(body["max_tokens"]),
    )


def agentic(seed: int, duration_s: float, agents_per_s: float, chats_per_s: float) -> PeerWorkload:
    """Agents (tool catalogue + growing tool results, long) beside short interactive chats."""
    rng = random.Random(f"agentic:{seed}")
    synth = TextSynth(seed)
    tools = _tools(synth, 8000)
    out: list[ReplayRequest] = []
    t = rng.expovariate(agents_per_s)
    n = 0
    while t < duration_s:
        session = f"agent-{n}"
        messages = [
            {"role": "system", "content": "You are an autonomous agent; use the tools."},
            {"role": "user", "content": f"[{session}] " + synth.text(f"{session}:task", 1200)},
        ]
        arrival = t
        for step in range(rng.randint(4, 7)):
            body = {"model": "sim", "messages": messages, "tools": tools, "max_tokens": 24}
            out.append(_request(arrival, body, "agent", session))
            result = synth.text(f"{session}:result:{step}", rng.randint(1500, 3000) * 4)
            call = synth.text(f"{session}:call:{step}", 96)
            messages = [
                *messages,
                {"role": "assistant", "content": call},
                {"role": "user", "content": "Tool result: " + result},
            ]
            arrival += rng.uniform(1.0, 2.5)
        n += 1
        t += rng.expovariate(agents_per_s)
    chats = _short_chats(rng, synth, duration_s, chats_per_s)
    requests = sorted([*out, *chats], key=lambda r: r.arrival_s)
    return PeerWorkload(
        "agentic",
        f"{n} agent sessions ({agents_per_s:g}/s, 4-7 steps, a shared 8,000-token tool "
        f"catalogue, 1,500-3,000-token tool results) beside {len(chats)} short chat turns "
        f"({chats_per_s:g} sessions/s), no session ids: {len(requests)} requests",
        tuple(requests),
    )


def _short_chats(
    rng: random.Random, synth: TextSynth, duration_s: float, per_s: float
) -> list[ReplayRequest]:
    system = "You are a helpful assistant. " + synth.text("chat:system", 1200)
    out: list[ReplayRequest] = []
    t = rng.expovariate(per_s)
    n = 0
    while t < duration_s:
        session = f"chat-{n}"
        messages = [{"role": "system", "content": system}]
        arrival = t
        for turn in range(rng.randint(2, 4)):
            question = synth.text(f"{session}:q:{turn}", rng.randint(200, 1200))
            content = f"[{session}] {question}" if turn == 0 else question
            messages = [*messages, {"role": "user", "content": content}]
            body = {"model": "sim", "messages": messages, "max_tokens": 24}
            out.append(_request(arrival, body, "chat", session))
            answer = synth.text(f"{session}:a:{turn}", 96)
            messages = [*messages, {"role": "assistant", "content": answer}]
            arrival += rng.uniform(1.0, 2.0)
        n += 1
        t += rng.expovariate(per_s)
    return out


def trace(seed: int, requests: int, concurrency: int) -> PeerWorkload:
    lines = read_trace(TRACE).requests[:requests]
    replay = trace_to_requests(lines, session_header_share=0.0, seed=seed)
    closed = [dataclasses.replace(r, arrival_s=0.0) for r in replay]
    return PeerWorkload(
        "trace",
        f"the Mooncake trace's first {len(closed)} requests (third_party/mooncake), no session "
        f"ids, closed loop at {concurrency} in flight",
        tuple(closed),
        closed_loop=concurrency,
    )


def ramp(seed: int, rates: Sequence[float], step_s: float) -> PeerWorkload:
    """Chat sessions whose arrival rate steps up every ``step_s`` seconds; ``rates`` are
    requests per second (about four turns per session)."""
    out: list[ReplayRequest] = []
    starts: list[float] = []
    for k, rate in enumerate(rates):
        start = k * step_s
        starts.append(start)
        part = chat(seed * 100 + k, step_s, rate / 4.0).requests
        for r in part:
            session = f"step{k}-{r.session_id}"
            out.append(dataclasses.replace(r, arrival_s=r.arrival_s + start, session_id=session))
    requests = sorted(out, key=lambda r: r.arrival_s)
    return PeerWorkload(
        "ramp",
        "chat sessions as `chat`, arriving at "
        + ", ".join(f"{r:g}" for r in rates)
        + f" requests/s in steps of {step_s:g} s: {len(requests)} requests",
        tuple(requests),
        steps=tuple(starts),
    )
