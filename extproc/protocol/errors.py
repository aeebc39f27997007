"""JSON error bodies in each API's own format. Pure: no protobuf here."""

from __future__ import annotations

import orjson

from extproc.core.api import ErrorStyle

# Anthropic's error "type" per HTTP status (its documented error shapes).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def error_body(
    style: ErrorStyle, status: int, message: str, code: str, param: str | None = None
) -> bytes:
    if style is ErrorStyle.ANTHROPIC:
        kind = _ANTHROPIC_TYPES.get(
            status, "api_error" if status >= 500 else "invalid_request_error"
        )
        return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})
    kind = (
        "rate_limit_exceeded"
        if status == 429
        else "server_error"
        if status >= 500
        else "invalid_request_error"
    )
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})
