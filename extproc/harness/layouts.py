"""Workload layouts: many conversations behind one shared opening, placed in each position.

Every layout has ``conversations`` multi-turn conversations that all share one long opening
(instructions, a tool catalogue, a completions preamble...), placed where a given client puts
it; ``doc_share`` of them also carry one of ``documents`` long shared documents after the
opening (RAG). Turn k+1 repeats turn k and appends the reply and a new question, as every
client of these APIs does.

Layouts (``LAYOUTS``):

- ``system``: OpenAI chat, opening in the system message;
- ``first-user``: OpenAI chat, no system role, opening at the start of the first user message;
- ``tools``: OpenAI chat, opening as a ``tools`` catalogue;
- ``completions-8k`` / ``completions-32k``: ``/v1/completions``, an 8 KB / 32 KB preamble,
  turns framed with newline-terminated role markers (ChatML-like);
- ``anthropic``: Anthropic messages, opening split between ``system`` blocks and the first user
  message's first content block; the document and question are further content blocks;
- ``responses``: OpenAI Responses ``input`` items, opening as a developer item.

What each request should do is known from the generator: ``session_id`` names its conversation
and ``doc`` (in ``kind``: ``doc:<j>`` or ``chat``) its document. Deterministic per seed.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from extproc.harness.prompts import API_PATHS, CHARS_PER_TOKEN, ApiKind, TextSynth
from extproc.harness.workload import ReplayRequest

LAYOUTS: tuple[str, ...] = (
    "system",
    "first-user",
    "tools",
    "completions-8k",
    "completions-32k",
    "anthropic",
    "responses",
)


@dataclass(frozen=True, slots=True)
class LayoutConfig:
    layout: str = "system"
    conversations: int = 400
    turns: int = 3
    opening_chars: int = 6000  # the completions layouts use 8 KB / 32 KB
    doc_share: float = 0.3
    documents: int = 40
    doc_chars: int = 6000
    question_chars: tuple[int, int] = (200, 800)
    answer_chars: tuple[int, int] = (200, 600)
    # Arrivals: conversations start at this rate; turns follow after a think time.
    starts_per_s: float = 20.0
    think_s: float = 2.0
    seed: int = 0
    max_tokens: int = 8
    model: str = "sim"

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.conversations < 1 or self.turns < 1 or self.documents < 1:
            raise ValueError("conversations, turns and documents must be >= 1")
        if not 0.0 <= self.doc_share <= 1.0:
            raise ValueError("doc_share must be within [0, 1]")
        if self.starts_per_s <= 0 or self.think_s < 0:
            raise ValueError("starts_per_s must be > 0 and think_s >= 0")

    @property
    def effective_opening_chars(self) -> int:
        if self.layout == "completions-8k":
            return 8 * 1024
        if self.layout == "completions-32k":
            return 32 * 1024
        return self.opening_chars


@dataclass(frozen=True, slots=True)
class _Turn:
    question: str
    answer: str


def _chat_messages(opening: str, doc: str, turns: list[_Turn], in_system: bool) -> list[Any]:
    head = f"{doc}\n\n" if doc else ""
    msgs: list[dict[str, Any]] = []
    if in_system:
        msgs.append({"role": "system", "content": opening})
        first = head + turns[0].question
    else:
        first = f"{opening}\n\n{head}{turns[0].question}"
    for i, turn in enumerate(turns):
        msgs.append({"role": "user", "content": first if i == 0 else turn.question})
        if i < len(turns) - 1:
            msgs.append({"role": "assistant", "content": turn.answer})
    return msgs


def _tools(opening: str) -> list[dict[str, Any]]:
    """A tool catalogue whose descriptions carry the opening (about 1 KB per tool)."""
    size = 1000
    pieces = [opening[i : i + size] for i in range(0, len(opening), size)]
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": piece,
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
            },
        }
        for i, piece in enumerate(pieces)
    ]


def _completions_prompt(opening: str, doc: str, turns: list[_Turn]) -> str:
    parts = [opening, "\n"]
    if doc:
        parts += ["<|document|>\n", doc, "\n"]
    for i, turn in enumerate(turns):
        parts += ["<|user|>\n", turn.question, "\n<|assistant|>\n"]
        if i < len(turns) - 1:
            parts += [turn.answer, "\n"]
    return "".join(parts)


def _anthropic(opening: str, doc: str, turns: list[_Turn]) -> dict[str, Any]:
    half = len(opening) // 2
    system = [{"type": "text", "text": opening[:half]}]
    msgs: list[dict[str, Any]] = []
    for i, turn in enumerate(turns):
        if i == 0:
            blocks = [{"type": "text", "text": opening[half:]}]
            if doc:
                blocks.append({"type": "text", "text": doc})
            blocks.append({"type": "text", "text": turn.question})
            msgs.append({"role": "user", "content": blocks})
        else:
            msgs.append({"role": "user", "content": [{"type": "text", "text": turn.question}]})
        if i < len(turns) - 1:
            msgs.append({"role": "assistant", "content": [{"type": "text", "text": turn.answer}]})
    return {"system": system, "messages": msgs}


def _responses_input(opening: str, doc: str, turns: list[_Turn]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = [{"role": "developer", "content": opening}]
    for i, turn in enumerate(turns):
        text = f"{doc}\n\n{turn.question}" if (doc and i == 0) else turn.question
        items.append({"role": "user", "content": [{"type": "input_text", "text": text}]})
        if i < len(turns) - 1:
            items.append(
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": turn.answer}],
                }
            )
    return items


LayoutBody = Callable[[str, str, list[_Turn]], tuple[str, dict[str, Any]]]


def _body_builder(layout: str) -> LayoutBody:
    """(opening, doc, turns so far) -> (api path, body without model / max_tokens)."""

    def chat_system(o: str, d: str, t: list[_Turn]) -> tuple[str, dict[str, Any]]:
        return API_PATHS["openai-chat"], {"messages": _chat_messages(o, d, t, True)}

    def chat_user(o: str, d: str, t: list[_Turn]) -> tuple[str, dict[str, Any]]:
        return API_PATHS["openai-chat"], {"messages": _chat_messages(o, d, t, False)}

    def chat_tools(o: str, d: str, t: list[_Turn]) -> tuple[str, dict[str, Any]]:
        msgs = [{"role": "system", "content": "You are an agent; use the tools."}]
        msgs += _chat_messages("", d, t, False)
        # _chat_messages put an empty opening at the start of the first message: strip it.
        first = msgs[1]
        first["content"] = str(first["content"]).lstrip("\n")
        return API_PATHS["openai-chat"], {"messages": msgs, "tools": _tools(o)}

    def completions(o: str, d: str, t: list[_Turn]) -> tuple[str, dict[str, Any]]:
        return API_PATHS["openai-completions"], {"prompt": _completions_prompt(o, d, t)}

    def anthropic(o: str, d: str, t: list[_Turn]) -> tuple[str, dict[str, Any]]:
        return API_PATHS["anthropic-messages"], _anthropic(o, d, t)

    def responses(o: str, d: str, t: list[_Turn]) -> tuple[str, dict[str, Any]]:
        return API_PATHS["openai-responses"], {"input": _responses_input(o, d, t)}

    return {
        "system": chat_system,
        "first-user": chat_user,
        "tools": chat_tools,
        "completions-8k": completions,
        "completions-32k": completions,
        "anthropic": anthropic,
        "responses": responses,
    }[layout]


_API_OF_PATH: Mapping[str, ApiKind] = {path: api for api, path in API_PATHS.items()}


def generate_layout(config: LayoutConfig) -> list[ReplayRequest]:
    """Every request of the layout, sorted by arrival time."""
    rng = random.Random(f"layout:{config.layout}:{config.seed}")
    synth = TextSynth(config.seed)
    opening = synth.text("layout:opening", config.effective_opening_chars)
    docs = [synth.text(f"layout:doc:{j}", config.doc_chars) for j in range(config.documents)]
    build = _body_builder(config.layout)
    out: list[ReplayRequest] = []
    start = 0.0
    for c in range(config.conversations):
        start += rng.expovariate(config.starts_per_s)
        has_doc = rng.random() < config.doc_share
        j = rng.randrange(config.documents) if has_doc else -1
        doc = docs[j] if has_doc else ""
        turns: list[_Turn] = []
        arrival = start
        for t in range(config.turns):
            q = synth.text(f"layout:{c}:q:{t}", rng.randint(*config.question_chars))
            a = synth.text(f"layout:{c}:a:{t}", rng.randint(*config.answer_chars))
            turns.append(_Turn(f"Question {c}.{t}: {q}", a))
            path, body = build(opening, doc, list(turns))
            # The Responses API names its output limit max_output_tokens.
            limit = "max_output_tokens" if path == API_PATHS["openai-responses"] else "max_tokens"
            body = {"model": config.model, limit: config.max_tokens, **body}
            api = _API_OF_PATH[path]
            chars = sum(len(str(v)) for v in body.values())
            out.append(
                ReplayRequest(
                    arrival_s=arrival,
                    api=api,
                    path=path,
                    body=body,
                    session_id=f"conv-{c}",
                    send_session_header=False,
                    kind=f"doc:{j}" if has_doc else "chat",
                    input_tokens=max(1, chars // CHARS_PER_TOKEN),
                    stream=False,
                    max_tokens=config.max_tokens,
                )
            )
            arrival += rng.expovariate(1.0 / config.think_s) if config.think_s > 0 else 0.0
    return sorted(out, key=lambda r: r.arrival_s)


def add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    """``--layout-conversations`` / ``--layout-turns``, for commands that take ``--layout``."""
    group = parser.add_argument_group("layout workload (--layout NAME)")
    group.add_argument("--layout-conversations", type=int, default=400)
    group.add_argument("--layout-turns", type=int, default=3)


def layout_from_args(args: argparse.Namespace) -> list[ReplayRequest]:
    return generate_layout(
        LayoutConfig(
            layout=args.layout,
            conversations=args.layout_conversations,
            turns=args.layout_turns,
            seed=args.seed,
            model=args.model if isinstance(getattr(args, "model", None), str) else "sim",
        )
    )


def api_kind(path: str) -> ApiKind | None:
    return _API_OF_PATH.get(path)
