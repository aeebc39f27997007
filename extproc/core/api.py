"""The inference APIs the processor understands, and the typed client-error outcome."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


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


# Inference paths; anything else (e.g. /v1/models) is passed through on Envoy's fallback route.
INFERENCE_PATHS: dict[str, Api] = {
    "/v1/chat/completions": Api.OPENAI_CHAT,
    "/v1/completions": Api.OPENAI_COMPLETIONS,
    "/v1/responses": Api.OPENAI_RESPONSES,
    "/v1/messages": Api.ANTHROPIC_MESSAGES,
}


def api_for_path(path: str) -> Api | None:
    """The API a request path speaks, ignoring the query string and one trailing slash."""
    bare = path.split("?", 1)[0]
    if len(bare) > 1 and bare.endswith("/"):
        bare = bare[:-1]
    return INFERENCE_PATHS.get(bare)


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
