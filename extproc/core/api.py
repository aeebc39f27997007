"""The inference APIs the processor understands, and the typed client-error outcome."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache
from urllib.parse import unquote


class Api(StrEnum):
    OPENAI_CHAT = "openai.chat"
    OPENAI_COMPLETIONS = "openai.completions"
    OPENAI_RESPONSES = "openai.responses"
    ANTHROPIC_MESSAGES = "anthropic.messages"

    @property
    def error_style(self) -> ErrorStyle:
        return ErrorStyle.ANTHROPIC if self is Api.ANTHROPIC_MESSAGES else ErrorStyle.OPENAI


class ErrorStyle(StrEnum):
    OPENAI = "openai"
    ANTHROPIC = "anthropic"


# Inference paths, canonical form; anything else (e.g. /v1/models) is passed through on Envoy's
# fallback route.
INFERENCE_PATHS: dict[str, Api] = {
    "/v1/chat/completions": Api.OPENAI_CHAT,
    "/v1/completions": Api.OPENAI_COMPLETIONS,
    "/v1/responses": Api.OPENAI_RESPONSES,
    "/v1/messages": Api.ANTHROPIC_MESSAGES,
}
# Percent-decoding rounds: an upstream decodes once; more rounds only widen the match.
_DECODE_ROUNDS = 3


def canonical_path(path: str) -> str:
    """The path as any upstream could read it, reduced to one spelling.

    Matching must cover every spelling an engine would serve as an inference API, or such a
    request would bypass placement and budgets (it would take the fallback route). uvicorn
    percent-decodes the path (``%2F`` included) and Starlette redirects trailing slashes to the
    bare route; Envoy's normalisation (render/envoy.py) also resolves dot segments, merges
    slashes and turns backslashes into slashes. Every one of those, plus letter case, is
    applied here, so the match is a superset of what an upstream serves: a spelling no engine
    serves is routed and budgeted, then answered 404 by the engine, which costs nothing.
    The query string is split off first, on the raw path: a decoded ``%3F`` is part of the path.
    """
    raw = path.split("?", 1)[0].split("#", 1)[0]
    for _ in range(_DECODE_ROUNDS):
        decoded = unquote(raw)
        if decoded == raw:
            break
        raw = decoded
    segments: list[str] = []
    for segment in raw.replace("\\", "/").split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if segments:
                segments.pop()
            continue
        segments.append(segment)
    return ("/" + "/".join(segments)).lower()


@lru_cache(maxsize=4096)
def api_for_path(path: str) -> Api | None:
    """The API a request path speaks, matched canonically (see ``canonical_path``).

    Cached: real traffic uses a handful of spellings, and canonicalising costs several
    microseconds per call; the bound keeps a client sending endless new paths from growing it.
    """
    return INFERENCE_PATHS.get(canonical_path(path))


def error_style_for_path(path: str) -> ErrorStyle:
    api = api_for_path(path)
    return api.error_style if api is not None else ErrorStyle.OPENAI


@dataclass(frozen=True, slots=True)
class BadRequest:
    """A client error found while reading the request; becomes a 4xx JSON error."""

    status: int
    message: str
    error_type: str  # "invalid_request_error" (both APIs use this name) or a size error
    style: ErrorStyle
    param: str | None = None
