"""Token usage reported by the upstream, and what the prefix cache saved (pure).

Read only when response inspection is on (``processor.inspect_usage``): non-streaming responses
arrive whole (one JSON document); SSE streams are scanned chunk by chunk for the events that
carry usage — OpenAI's final chunk (``stream_options.include_usage``), Anthropic's
``message_start`` (input and cache reads) and ``message_delta`` (output).

Cached input tokens: OpenAI's ``usage.prompt_tokens_details.cached_tokens`` (vLLM with
``--enable-prompt-tokens-details``, SGLang, llama.cpp's server); a llama.cpp server that sends
no details still reports them beside the usage, in ``timings.cache_n`` (the prompt tokens it
reused; ``timings.prompt_n`` are the ones it evaluated).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import orjson

from extproc.core.api import Api


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0  # all input tokens, cached or not
    cached_tokens: int = 0  # input tokens served from the prefix cache
    output_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.prompt_tokens + other.prompt_tokens,
            self.cached_tokens + other.cached_tokens,
            self.output_tokens + other.output_tokens,
        )


@dataclass(frozen=True, slots=True)
class Prices:
    """$ per million tokens."""

    cached_input: float = 0.30
    uncached_input: float = 3.00
    output: float = 15.00

    def cost(self, usage: Usage) -> float:
        uncached = usage.prompt_tokens - usage.cached_tokens
        return (
            usage.cached_tokens * self.cached_input
            + uncached * self.uncached_input
            + usage.output_tokens * self.output
        ) / 1e6

    def saved(self, usage: Usage) -> float:
        """What the cache hits saved against paying every input token as a miss."""
        return usage.cached_tokens * (self.uncached_input - self.cached_input) / 1e6


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def usage_of(api: Api, usage: object, timings: object = None) -> Usage:
    """One ``usage`` object in the API's own shape; ``timings``: llama.cpp's object beside it
    (read only when the usage has no ``prompt_tokens_details``)."""
    if not isinstance(usage, Mapping):
        return Usage()
    if api is Api.ANTHROPIC_MESSAGES:
        # Anthropic's input_tokens counts only the uncached part of the prompt.
        cached = _int(usage.get("cache_read_input_tokens"))
        prompt = _int(usage.get("input_tokens")) + cached
        prompt += _int(usage.get("cache_creation_input_tokens"))
        return Usage(prompt, cached, _int(usage.get("output_tokens")))
    if api is Api.OPENAI_RESPONSES:
        details = usage.get("input_tokens_details")
        cached = _int(details.get("cached_tokens")) if isinstance(details, Mapping) else 0
        return Usage(_int(usage.get("input_tokens")), cached, _int(usage.get("output_tokens")))
    details = usage.get("prompt_tokens_details")
    if isinstance(details, Mapping):
        cached = _int(details.get("cached_tokens"))
    else:
        cached = _int(timings.get("cache_n")) if isinstance(timings, Mapping) else 0
    prompt = _int(usage.get("prompt_tokens"))
    return Usage(prompt, min(cached, prompt), _int(usage.get("completion_tokens")))


def _response_id(doc: Mapping[str, object]) -> str | None:
    """The id of a Responses API response object (``"object": "response"``)."""
    rid = doc.get("id")
    return rid if doc.get("object") == "response" and isinstance(rid, str) and rid else None


def _object_mentioning(body: bytes, word: bytes) -> Mapping[str, object] | None:
    """The body as a JSON object, if it mentions ``word`` at all (a byte search first: most
    bodies that lack it are never decoded)."""
    if word not in body:
        return None
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return doc if isinstance(doc, Mapping) else None


def response_id_from_body(body: bytes) -> str | None:
    """The id of a whole (non-streaming) Responses API response; None for anything else (an
    error body, a truncated one)."""
    doc = _object_mentioning(body, b'"response"')
    return _response_id(doc) if doc is not None else None


def usage_from_body(api: Api, body: bytes) -> Usage | None:
    """Usage of a whole (non-streaming) response body; None when it carries none."""
    doc = _object_mentioning(body, b'"usage"')
    if doc is None:
        return None
    inner = doc.get("response")
    if api is Api.OPENAI_RESPONSES and isinstance(inner, Mapping):
        doc = inner
    return usage_of(api, doc.get("usage"), doc.get("timings")) if "usage" in doc else None


class SseUsageScanner:
    """Collects usage from an SSE stream fed in arbitrary chunks.

    Only complete ``data:`` lines that mention ``"usage"`` are parsed, so the cost is a byte
    search per chunk; a line split across chunks is carried over (bounded).
    """

    MAX_CARRY = 1 << 16

    def __init__(self, api: Api) -> None:
        self._api = api
        self._carry = b""
        self.usage: Usage | None = None
        # Responses API: the response's id, from its first event (response.created).
        self.response_id: str | None = None
        self._wants_id = api is Api.OPENAI_RESPONSES

    def feed(self, chunk: bytes) -> None:
        data = self._carry + chunk
        lines = data.split(b"\n")
        self._carry = lines.pop()
        if len(self._carry) > self.MAX_CARRY:
            self._carry = b""  # a giant token delta: it cannot be a usage line we care about
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            if b'"usage"' in line or (self._wants_id and b'"response.created"' in line):
                self._line(line[5:].strip())

    def finish(self) -> Usage | None:
        if self._carry.startswith(b"data:") and b'"usage"' in self._carry:
            self._line(self._carry[5:].strip())
        self._carry = b""
        return self.usage

    def _line(self, payload: bytes) -> None:
        try:
            doc = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return
        if not isinstance(doc, Mapping):
            return
        if self._api is Api.ANTHROPIC_MESSAGES:
            message = doc.get("message")
            usage = message.get("usage") if isinstance(message, Mapping) else doc.get("usage")
            part = usage_of(self._api, usage)
            # message_start carries the input side, message_delta the (cumulative) output.
            prev = self.usage or Usage()
            self.usage = Usage(
                max(prev.prompt_tokens, part.prompt_tokens),
                max(prev.cached_tokens, part.cached_tokens),
                max(prev.output_tokens, part.output_tokens),
            )
            return
        if self._api is Api.OPENAI_RESPONSES and isinstance(doc.get("response"), Mapping):
            doc = doc["response"]
            if self._wants_id:
                self.response_id = _response_id(doc)
                self._wants_id = self.response_id is None
        if doc.get("usage") is not None:
            self.usage = usage_of(self._api, doc.get("usage"), doc.get("timings"))
