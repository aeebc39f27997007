"""The canonical prompt walk: where each API shape keeps its prompt, in prefill order.

Both prefix keys read the prompt through this module, so they agree on what the prompt is:

- the chain key (``extproc.core.chains``) hashes all of it, as segments
  (:func:`prompt_segments`);
- the opening key (``extproc.core.keys``, ``prefix.key: opening``) reads only the system text
  and the first non-system message (:func:`prompt_parts`).

Order: the system text (Anthropic ``system``, Responses ``instructions``), the ``tools``
catalogue, then every message / Responses input item; for ``/v1/completions``, the prompt
(the first one of a batch). That is the order an engine's chat template prefills them in, so a
later turn's walk starts with the earlier turn's.

Pure, and bounded: every text is read through a :class:`CharBudget`, and non-text parts (images,
files, audio) through a bounded :func:`fingerprint`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import Literal

import orjson

from extproc.core.api import Api

# "developer" is the newer OpenAI name of the system role: one opening, one key.
SYSTEM_ROLES = frozenset({"system", "developer"})

PartKind = Literal["system", "tools", "message", "prompt"]

# Non-text parts carry their identity in strings that can be megabytes of base64 whose first
# kilobytes are often the same for every file (PNG/JPEG headers, colour profiles, EXIF).
# Without them every "describe this image" conversation would share one key and one cluster.
# A bounded fingerprint (each string's length, tail and head, for a bounded number of nodes)
# separates them without reading them whole.
_FP_HEAD = 32
_FP_TAIL = 96
_FP_NODES = 16


def fingerprint(part: object) -> str:
    """Bounded identity of a non-text part."""
    out: list[str] = []
    stack: list[object] = [part]
    visited = 0
    while stack and visited < _FP_NODES:
        node = stack.pop()
        visited += 1
        if isinstance(node, str):
            if len(node) <= _FP_HEAD + _FP_TAIL:
                out.append(node)
            else:
                out.append(f"{len(node)}:{node[-_FP_TAIL:]}:{node[:_FP_HEAD]}")
        elif isinstance(node, Mapping):
            # Sorted so that clients that order JSON keys differently still agree.
            items = sorted(
                ((str(k), v) for k, v in itertools.islice(node.items(), _FP_NODES)),
                key=lambda kv: kv[0],
                reverse=True,
            )
            for name, value in items:
                stack.append(value)
                stack.append(name)
        elif isinstance(node, list):
            stack.extend(reversed(node[:_FP_NODES]))
        elif node is not None:
            out.append(str(node))
    return "\x1c" + "\x1c".join(out)


class CharBudget:
    """Characters left to read; every text of the walk is taken through one."""

    def __init__(self, chars: int) -> None:
        self.left = chars

    def take(self, text: str) -> str:
        if self.left <= 0:
            return ""
        piece = text[: self.left]
        self.left -= len(piece)
        return piece


def content_text(content: object, budget: CharBudget) -> str:
    """A message's content (a string, a part, or a list of typed parts) as text."""
    if isinstance(content, str):
        return budget.take(content)
    if isinstance(content, Mapping):
        content = [content]
    if not isinstance(content, list):
        return ""
    out: list[str] = []
    for part in content:
        if budget.left <= 0:
            break
        if isinstance(part, str):
            out.append(budget.take(part))
        elif isinstance(part, Mapping):
            text = part.get("text")
            if isinstance(text, str):
                out.append(budget.take(text))
            elif isinstance(part.get("content"), (str, list)):  # tool_result: nested content
                out.append(budget.take("\x1c") + content_text(part.get("content"), budget))
            else:
                out.append(budget.take(fingerprint(part)))
    return "\x1d".join(out)


def message_role(msg: object) -> str | None:
    """The message's role ("developer" read as "system"); None for a Responses item without
    one (function_call, function_call_output, ...); a bare string is a user message."""
    if isinstance(msg, str):
        return "user"
    if not isinstance(msg, Mapping):
        return None
    role = msg.get("role")
    if not isinstance(role, str):
        return None
    return "system" if role in SYSTEM_ROLES else role


def message_content(msg: object) -> object:
    return msg if isinstance(msg, str) else msg.get("content") if isinstance(msg, Mapping) else None


def prompt_parts(api: Api, doc: Mapping[str, object]) -> Iterator[tuple[PartKind, object]]:
    """The prompt's parts in prefill order, unread: ("system", content), ("tools", list),
    ("message", message or Responses item), or for completions one ("prompt", str | ids)."""
    if api is Api.OPENAI_COMPLETIONS:
        prompt = doc.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch: key on its first prompt
        if isinstance(prompt, (str, list)):
            yield "prompt", prompt
        return
    if api is Api.ANTHROPIC_MESSAGES:
        yield "system", doc.get("system")
    elif api is Api.OPENAI_RESPONSES:
        yield "system", doc.get("instructions")
    tools = doc.get("tools")
    if isinstance(tools, list) and tools:
        yield "tools", tools
    items = doc.get("messages") if api is not Api.OPENAI_RESPONSES else doc.get("input")
    if isinstance(items, str):
        yield "message", items
    elif isinstance(items, list):
        for msg in items:
            yield "message", msg


def _tools(tools: object, budget: CharBudget) -> str:
    # Sorted keys: two clients that serialise the same catalogue differently still agree.
    # The catalogue is bounded by the body limit; slicing keeps the hashed part bounded.
    text = orjson.dumps(tools, option=orjson.OPT_SORT_KEYS).decode("utf-8", "replace")
    return budget.take(text)


def _message(msg: object, budget: CharBudget) -> str:
    role = message_role(msg)
    if role is not None:
        text = budget.take(role + "\x1f") + content_text(message_content(msg), budget)
        calls = msg.get("tool_calls") if isinstance(msg, Mapping) else None
        # OpenAI assistant tool calls: prompt tokens too.
        return text + (budget.take(fingerprint(calls)) if calls is not None else "")
    if not isinstance(msg, Mapping):
        return ""
    # Responses input items without a role: their fields are what the model sees; ids and
    # status are bookkeeping.
    item = {k: v for k, v in msg.items() if k not in ("id", "status")}
    return budget.take("item\x1f" + fingerprint(item))


def prompt_segments(api: Api, doc: Mapping[str, object], scan_chars: int) -> list[str]:
    """The whole canonical prompt as tagged segments (one per part), at most ``scan_chars``
    characters in all."""
    budget = CharBudget(scan_chars)
    out: list[str] = []
    for kind, value in prompt_parts(api, doc):
        if budget.left <= 0:
            break
        if kind == "prompt":
            if isinstance(value, list):
                ids = itertools.islice(value, max(0, scan_chars // 4))
                text, tag = budget.take(",".join(str(t) for t in ids)), "ids"
            else:
                text, tag = budget.take(str(value)), "prompt"
        elif kind == "system":
            text, tag = content_text(value, budget), "system"
        elif kind == "tools":
            text, tag = _tools(value, budget), "tools"
        else:
            text, tag = _message(value, budget), "msg"
        if text:
            out.append(tag + "\x1e" + text)
    return out
