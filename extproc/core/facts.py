"""Request facts: what the decision core knows about one inference request.

Built from (path, trusted headers, body bytes) by :func:`parse_request`. The parser never raises
on client input: bad input becomes a :class:`BadRequest` value that the protocol shell turns into
a JSON error in the API's own format.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import orjson

from extproc.core import json_body
from extproc.core.api import Api, BadRequest, ErrorStyle, api_for_path
from extproc.core.keys import (
    KeyRules,
    KeySource,
    SessionKey,
    derive_session_key,
    header_session_key,
)
from extproc.core.response_links import valid_response_id


@dataclass(frozen=True, slots=True)
class ParseLimits:
    max_body_bytes: int = 32 << 20
    # Cheap token estimate: JSON bytes / 4. English text averages ~4 characters per token for
    # BPE tokenizers; counting the JSON envelope too errs on the side of a larger estimate,
    # which is the safe side for budgets.
    bytes_per_token: float = 4.0


@dataclass(frozen=True, slots=True)
class RequestFacts:
    api: Api
    model: str
    session: SessionKey
    input_tokens: int
    max_output_tokens: int | None
    tier: str | None
    stream: bool
    body_bytes: int
    # Responses API: the response this turn continues (extproc.core.response_links).
    previous_response_id: str | None = None
    # False: decided at the request headers (header_facts), the body never read: model,
    # max_output_tokens and stream are then unknown ("", None, False) and body_bytes is the
    # declared content-length.
    body_read: bool = True


def _content_type_ok(value: str | None) -> bool:
    if not value:
        return False
    media = value.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def _max_output_tokens(body: Mapping[str, object]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def _too_large(length: int, limits: ParseLimits, style: ErrorStyle) -> BadRequest | None:
    if length <= limits.max_body_bytes:
        return None
    return BadRequest(
        413,
        f"request body is {length} bytes; this gateway accepts at most "
        f"{limits.max_body_bytes} bytes",
        "request_too_large",
        style,
    )


def _not_json(headers: Mapping[str, str], style: ErrorStyle) -> BadRequest | None:
    if _content_type_ok(headers.get("content-type")):
        return None
    return BadRequest(400, "Content-Type must be application/json", "invalid_request_error", style)


def content_length(headers: Mapping[str, str]) -> int | None:
    """The declared body size, or None (absent: a chunked upload; or not plain ASCII digits)."""
    value = headers.get("content-length")
    if value is None or not value.isascii() or not value.isdigit():
        return None
    return int(value)


def header_facts(
    path: str,
    headers: Mapping[str, str],
    rules: KeyRules,
    limits: ParseLimits,
) -> RequestFacts | BadRequest | None:
    """The facts of a request whose decision needs nothing from its body, or None.

    That is a request that carries the trusted session header (the key) and a content-length
    (the size, hence the token estimate and the class): the same facts the body would give for
    every field the decision reads (placement: the key; class: size and tier; admission: the
    estimate). Nothing in the body is checked: bad JSON goes upstream, which answers its own
    400 (``processor.read_body: always`` keeps the processor validating). None: the body is
    needed (no session header, or no content-length — a chunked upload, whose size is known
    only once it has arrived).
    """
    session = header_session_key(headers, rules)
    if session is None:
        return None
    length = content_length(headers)
    api = api_for_path(path)
    if length is None or length == 0 or api is None:
        return None
    style = api.error_style
    bad = _too_large(length, limits, style) or _not_json(headers, style)
    if bad is not None:
        return bad
    tier = headers.get(rules.tier_header) if rules.tier_header else None
    return RequestFacts(
        api=api,
        model="",
        session=session,
        input_tokens=max(1, int(length / limits.bytes_per_token)),
        max_output_tokens=None,
        tier=tier or None,
        stream=False,
        body_bytes=length,
        body_read=False,
    )


def parse_request(
    path: str,
    headers: Mapping[str, str],
    body: bytes,
    rules: KeyRules,
    limits: ParseLimits,
) -> RequestFacts | BadRequest:
    """Read an inference request. ``headers`` are lower-cased names; only trusted ones are used.

    With ``rules.sketch`` set (the processor's), parsing a request also counts it toward the
    chain key's common chains (extproc.core.chains)."""
    api = api_for_path(path)
    style = api.error_style if api is not None else ErrorStyle.OPENAI
    if api is None:
        return BadRequest(
            404, f"no inference API at {path.split('?', 1)[0]}", "not_found_error", style
        )
    bad = _too_large(len(body), limits, style) or _not_json(headers, style)
    if bad is not None:
        return bad
    if not body:
        return BadRequest(
            400, "request body is empty; expected a JSON object", "invalid_request_error", style
        )
    try:
        # orjson's answers at msgspec's speed (extproc/core/json_body.py).
        doc = json_body.loads(body)
    except orjson.JSONDecodeError as exc:
        reason = (
            "request body is not valid UTF-8"
            if "UTF-8" in str(exc)
            else "request body is not valid JSON"
        )
        return BadRequest(400, f"{reason}: {exc}", "invalid_request_error", style)
    if not isinstance(doc, dict):
        return BadRequest(400, "request body must be a JSON object", "invalid_request_error", style)
    model = doc.get("model")
    if not isinstance(model, str):
        model = ""
    session = derive_session_key(api, headers, doc, rules)
    if isinstance(session, BadRequest):
        return session
    tier = headers.get(rules.tier_header) if rules.tier_header else None
    return RequestFacts(
        api=api,
        model=model,
        session=session,
        input_tokens=max(1, int(len(body) / limits.bytes_per_token)),
        max_output_tokens=_max_output_tokens(doc),
        tier=tier or None,
        stream=doc.get("stream") is True,
        body_bytes=len(body),
        previous_response_id=(
            valid_response_id(doc.get("previous_response_id"))
            if api is Api.OPENAI_RESPONSES
            else None
        ),
    )


__all__ = [
    "Api",
    "BadRequest",
    "ErrorStyle",
    "KeySource",
    "ParseLimits",
    "RequestFacts",
    "api_for_path",
    "content_length",
    "header_facts",
    "parse_request",
]
