"""The request parser: per-API shapes, bad input, paths.

Every case goes through ``parse_request``, the one entry point the protocol shell uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
import pytest

from extproc.core.api import Api, BadRequest, ErrorStyle, api_for_path, error_style_for_path
from extproc.core.facts import ParseLimits, RequestFacts, parse_request
from extproc.core.keys import KeyRules, KeySource

JSON = {"content-type": "application/json"}
RULES = KeyRules()
LIMITS = ParseLimits()

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"


def parse(
    path: str,
    body: Any,
    headers: Mapping[str, str] = JSON,
    rules: KeyRules = RULES,
    limits: ParseLimits = LIMITS,
) -> RequestFacts | BadRequest:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return parse_request(path, headers, raw, rules, limits)


def facts_of(path: str, body: Any, headers: Mapping[str, str] = JSON) -> RequestFacts:
    result = parse(path, body, headers)
    assert isinstance(result, RequestFacts), result
    return result


def key_of(path: str, body: Any) -> bytes:
    return facts_of(path, body).session.digest


# --- one well-formed request per API shape -------------------------------------------------

SHAPES: list[tuple[str, dict[str, Any], Api]] = [
    (
        CHAT,
        {"model": "m-chat", "messages": [{"role": "user", "content": "hello"}]},
        Api.OPENAI_CHAT,
    ),
    (
        CHAT,
        {
            "model": "m-chat",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hello"}]},
            ],
        },
        Api.OPENAI_CHAT,
    ),
    (
        CHAT,
        {
            "model": "m-chat",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": "hello"},
            ],
        },
        Api.OPENAI_CHAT,
    ),
    (
        COMPLETIONS,
        {"model": "m-cmpl", "prompt": "Once upon a time"},
        Api.OPENAI_COMPLETIONS,
    ),
    (
        COMPLETIONS,
        {"model": "m-cmpl", "prompt": ["Once upon a time", "In a galaxy"]},
        Api.OPENAI_COMPLETIONS,
    ),
    (
        COMPLETIONS,
        {"model": "m-cmpl", "prompt": [101, 2023, 2003, 102]},
        Api.OPENAI_COMPLETIONS,
    ),
    (
        RESPONSES,
        {"model": "m-resp", "instructions": "be brief", "input": "hello"},
        Api.OPENAI_RESPONSES,
    ),
    (
        RESPONSES,
        {
            "model": "m-resp",
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "hi"}],
                }
            ],
        },
        Api.OPENAI_RESPONSES,
    ),
    (
        MESSAGES,
        {
            "model": "m-anth",
            "system": "be brief",
            "messages": [{"role": "user", "content": "hello"}],
        },
        Api.ANTHROPIC_MESSAGES,
    ),
    (
        MESSAGES,
        {
            "model": "m-anth",
            "system": [
                {"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}
            ],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
        },
        Api.ANTHROPIC_MESSAGES,
    ),
]
SHAPE_IDS = [
    "chat-string-content",
    "chat-system-and-typed-parts",
    "chat-developer-role",
    "completions-prompt-string",
    "completions-prompt-list-of-strings",
    "completions-token-ids",
    "responses-instructions-and-input-string",
    "responses-input-message-list",
    "anthropic-system-string",
    "anthropic-system-blocks",
]


@pytest.mark.parametrize(("path", "body", "api"), SHAPES, ids=SHAPE_IDS)
def test_each_api_shape_parses_to_facts(path: str, body: dict[str, Any], api: Api) -> None:
    facts = facts_of(path, body)
    assert facts.api is api
    assert facts.model == body["model"]
    assert facts.session.source is KeySource.PREFIX
    raw = orjson.dumps(body)
    assert facts.body_bytes == len(raw)
    assert facts.input_tokens == max(1, int(len(raw) / LIMITS.bytes_per_token))
    assert facts.stream is False
    assert facts.max_output_tokens is None
    assert facts.tier is None


# Two spellings of one conversation opening must share a key: a client that switches between
# them (SDK upgrade, a proxy rewriting content to typed parts) keeps its cache affinity.
SAME_KEY = [
    (
        CHAT,
        {"messages": [{"role": "user", "content": "hello there"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]},
    ),
    (
        CHAT,
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]},
        {"messages": [{"role": "developer", "content": "S"}, {"role": "user", "content": "q"}]},
    ),
    (
        MESSAGES,
        {"system": "be brief", "messages": [{"role": "user", "content": "q"}]},
        {
            "system": [{"type": "text", "text": "be brief"}],
            "messages": [{"role": "user", "content": "q"}],
        },
    ),
    (
        RESPONSES,
        {"instructions": "S", "input": "hello"},
        {"instructions": "S", "input": [{"role": "user", "content": "hello"}]},
    ),
    (
        COMPLETIONS,
        {"prompt": ["first prompt", "second prompt"]},
        {"prompt": "first prompt"},
    ),
    (
        COMPLETIONS,
        {"prompt": [[1, 2, 3], [4, 5, 6]]},
        {"prompt": [1, 2, 3]},
    ),
]


@pytest.mark.parametrize(
    ("path", "a", "b"),
    SAME_KEY,
    ids=[
        "chat-string-equals-typed-parts",
        "chat-system-equals-developer-role",
        "anthropic-system-string-equals-blocks",
        "responses-input-string-equals-one-user-message",
        "completions-batch-keys-on-first-prompt",
        "completions-token-id-batch-keys-on-first-ids",
    ],
)
def test_equivalent_openings_share_a_key(path: str, a: dict[str, Any], b: dict[str, Any]) -> None:
    assert key_of(path, a) == key_of(path, b)


DIFFERENT_KEY = [
    (
        CHAT,
        {"messages": [{"role": "user", "content": "question one"}]},
        {"messages": [{"role": "user", "content": "question two"}]},
    ),
    (
        CHAT,
        {"messages": [{"role": "system", "content": "S1"}, {"role": "user", "content": "q"}]},
        {"messages": [{"role": "system", "content": "S2"}, {"role": "user", "content": "q"}]},
    ),
    (
        MESSAGES,
        {"system": "S1", "messages": [{"role": "user", "content": "q"}]},
        {
            "system": [{"type": "text", "text": "S2"}],
            "messages": [{"role": "user", "content": "q"}],
        },
    ),
    (
        RESPONSES,
        {"instructions": "S1", "input": "q"},
        {"instructions": "S2", "input": "q"},
    ),
    (
        RESPONSES,
        {"input": "q1"},
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "q2"}]}]},
    ),
    (COMPLETIONS, {"prompt": "alpha"}, {"prompt": "beta"}),
    (COMPLETIONS, {"prompt": [1, 2, 3]}, {"prompt": [1, 2, 4]}),
    # The same characters as text and as token ids are different prompts.
    (COMPLETIONS, {"prompt": "1,2,3"}, {"prompt": [1, 2, 3]}),
]


@pytest.mark.parametrize(
    ("path", "a", "b"),
    DIFFERENT_KEY,
    ids=[
        "chat-different-first-message",
        "chat-different-system-prompt",
        "anthropic-different-system",
        "responses-different-instructions",
        "responses-different-input",
        "completions-different-prompt",
        "completions-different-token-ids",
        "completions-text-is-not-token-ids",
    ],
)
def test_different_openings_get_different_keys(
    path: str, a: dict[str, Any], b: dict[str, Any]
) -> None:
    assert key_of(path, a) != key_of(path, b)


# --- other facts ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"max_tokens": 100}, 100),
        ({"max_completion_tokens": 50, "max_tokens": 100}, 50),
        ({"max_output_tokens": 70}, 70),
        ({"max_tokens": True}, None),
        ({"max_tokens": -1}, None),
        ({"max_tokens": "100"}, None),
        ({}, None),
    ],
    ids=[
        "max-tokens",
        "max-completion-tokens-wins-over-max-tokens",
        "responses-max-output-tokens",
        "boolean-is-not-a-count",
        "negative-is-ignored",
        "string-is-ignored",
        "absent",
    ],
)
def test_max_output_tokens(fields: dict[str, Any], expected: int | None) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}
    assert facts_of(CHAT, body).max_output_tokens == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [(True, True), (False, False), ("true", False), (1, False)],
    ids=["true", "false", "string-true-is-not-stream", "one-is-not-stream"],
)
def test_stream_flag_is_exactly_json_true(value: object, expected: bool) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "stream": value}
    assert facts_of(CHAT, body).stream is expected


def test_model_that_is_not_a_string_reads_as_empty() -> None:
    assert facts_of(CHAT, {"model": 7, "messages": []}).model == ""


def test_input_tokens_grow_with_the_body() -> None:
    small = facts_of(CHAT, {"messages": [{"role": "user", "content": "x" * 400}]})
    large = facts_of(CHAT, {"messages": [{"role": "user", "content": "x" * 40_000}]})
    assert small.input_tokens >= 100
    assert large.input_tokens >= 10_000
    assert large.input_tokens > small.input_tokens


def test_tier_comes_from_the_configured_trusted_header_only() -> None:
    rules = KeyRules(tier_header="x-tenant-tier")
    body = orjson.dumps({"messages": [{"role": "user", "content": "x"}]})
    with_tier = parse_request(CHAT, {**JSON, "x-tenant-tier": "gold"}, body, rules, LIMITS)
    without = parse_request(CHAT, JSON, body, rules, LIMITS)
    untrusted = parse_request(CHAT, {**JSON, "x-tenant-tier": "gold"}, body, RULES, LIMITS)
    assert isinstance(with_tier, RequestFacts)
    assert isinstance(without, RequestFacts)
    assert isinstance(untrusted, RequestFacts)
    assert with_tier.tier == "gold"
    assert without.tier is None
    assert untrusted.tier is None  # no tier header configured: the header means nothing


@pytest.mark.parametrize(
    "content_type",
    [
        "application/json",
        "application/json; charset=utf-8",
        "Application/JSON",
        "application/x+json",
    ],
    ids=["plain", "with-charset", "mixed-case", "structured-suffix"],
)
def test_json_content_types_are_accepted(content_type: str) -> None:
    result = parse(CHAT, {"messages": []}, {"content-type": content_type})
    assert isinstance(result, RequestFacts)


# --- bad input ------------------------------------------------------------------------------

GOOD_CHAT = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})

BAD_BODIES: list[tuple[bytes, Mapping[str, str], int, str]] = [
    (b'{"model": "m", "messages": [', JSON, 400, "not valid JSON"),
    (b'[{"role": "user"}]', JSON, 400, "must be a JSON object"),
    (b'"just a string"', JSON, 400, "must be a JSON object"),
    (b"42", JSON, 400, "must be a JSON object"),
    (b"null", JSON, 400, "must be a JSON object"),
    (GOOD_CHAT, {}, 400, "Content-Type"),
    (GOOD_CHAT, {"content-type": "text/plain"}, 400, "Content-Type"),
    (GOOD_CHAT, {"content-type": ""}, 400, "Content-Type"),
    (b'{"model": "m", "messages": "\xff\xfe"}', JSON, 400, "not valid UTF-8"),
    (b"", JSON, 400, "empty"),
]
BAD_IDS = [
    "malformed-json",
    "body-is-array",
    "body-is-string",
    "body-is-number",
    "body-is-null",
    "missing-content-type",
    "text-plain-content-type",
    "empty-content-type",
    "invalid-utf8",
    "empty-body",
]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, RESPONSES, MESSAGES])
@pytest.mark.parametrize(("body", "headers", "status", "why"), BAD_BODIES, ids=BAD_IDS)
def test_bad_bodies_are_client_errors_in_the_apis_style(
    path: str, body: bytes, headers: Mapping[str, str], status: int, why: str
) -> None:
    result = parse(path, body, headers)
    assert isinstance(result, BadRequest)
    assert result.status == status
    assert result.error_type == "invalid_request_error"
    assert why in result.message
    expected_style = ErrorStyle.ANTHROPIC if path == MESSAGES else ErrorStyle.OPENAI
    assert result.style is expected_style


@pytest.mark.parametrize("path", [CHAT, MESSAGES], ids=["openai", "anthropic"])
def test_over_the_size_limit_is_413(path: str) -> None:
    limits = ParseLimits(max_body_bytes=1000)
    body = orjson.dumps({"messages": [{"role": "user", "content": "x" * 2000}]})
    at_limit = orjson.dumps({"messages": [{"role": "user", "content": "x"}]})
    at_limit = at_limit[:-2] + b" " * (1000 - len(at_limit)) + at_limit[-2:]
    assert len(at_limit) == 1000
    too_big = parse(path, body, limits=limits)
    assert isinstance(too_big, BadRequest)
    assert too_big.status == 413
    assert too_big.error_type == "request_too_large"
    assert str(limits.max_body_bytes) in too_big.message
    assert too_big.style is (ErrorStyle.ANTHROPIC if path == MESSAGES else ErrorStyle.OPENAI)
    # The limit is inclusive: a body of exactly max_body_bytes is read.
    assert isinstance(parse(path, at_limit, limits=limits), RequestFacts)


# Shape errors must not depend on how the session is keyed: a body with a session header or a
# ``user`` field is exactly as invalid as one keyed by prefix.
WRONG_SHAPES = [
    (CHAT, {"messages": "hello"}, "messages"),
    (CHAT, {"messages": {"role": "user", "content": "hi"}}, "messages"),
    (CHAT, {"model": "m"}, "messages"),
    (MESSAGES, {"messages": "hello"}, "messages"),
    (MESSAGES, {"system": "S"}, "messages"),
    (RESPONSES, {"input": 42}, "input"),
    (RESPONSES, {"instructions": "S"}, "input"),
    (COMPLETIONS, {"prompt": {"text": "x"}}, "prompt"),
    (COMPLETIONS, {"model": "m"}, "prompt"),
]
WRONG_SHAPE_IDS = [
    "chat-messages-is-string",
    "chat-messages-is-object",
    "chat-messages-missing",
    "anthropic-messages-is-string",
    "anthropic-messages-missing",
    "responses-input-is-number",
    "responses-input-missing",
    "completions-prompt-is-object",
    "completions-prompt-missing",
]
KEYED_BY = [
    ({}, {}),
    ({"x-session-id": "s-1"}, {}),
    ({}, {"user": "u-1"}),
]


@pytest.mark.parametrize(
    ("extra_headers", "extra_body"), KEYED_BY, ids=["prefix", "session-header", "body-user"]
)
@pytest.mark.parametrize(("path", "body", "param"), WRONG_SHAPES, ids=WRONG_SHAPE_IDS)
def test_wrong_input_field_type_is_400_whatever_the_key_source(
    path: str,
    body: dict[str, Any],
    param: str,
    extra_headers: dict[str, str],
    extra_body: dict[str, str],
) -> None:
    result = parse(path, {**body, **extra_body}, {**JSON, **extra_headers})
    assert isinstance(result, BadRequest)
    assert result.status == 400
    assert result.param == param
    assert f"'{param}'" in result.message
    assert result.style is (ErrorStyle.ANTHROPIC if path == MESSAGES else ErrorStyle.OPENAI)


def test_error_messages_do_not_echo_prompt_text() -> None:
    secret = "SECRET-PROMPT-TEXT"
    broken = b'{"messages": [{"role": "user", "content": "' + secret.encode() + b'"}'
    result = parse(CHAT, broken)
    assert isinstance(result, BadRequest)
    assert secret not in result.message


# --- paths ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "api"),
    [
        ("/v1/chat/completions", Api.OPENAI_CHAT),
        ("/v1/chat/completions/", Api.OPENAI_CHAT),
        ("/v1/chat/completions?api-version=2024-10-21", Api.OPENAI_CHAT),
        ("/v1/chat/completions/?stream=true", Api.OPENAI_CHAT),
        ("/v1/completions", Api.OPENAI_COMPLETIONS),
        ("/v1/responses?x=/v1/messages", Api.OPENAI_RESPONSES),
        ("/v1/messages", Api.ANTHROPIC_MESSAGES),
        ("/v1/messages/?beta=true", Api.ANTHROPIC_MESSAGES),
        ("/v1/models", None),
        ("/v1/messages/count_tokens", None),
        ("/v1/chat", None),
        ("/v1/chat/completionsx", None),
        # Every spelling an upstream could serve as the API (uvicorn percent-decodes, Starlette
        # redirects trailing slashes, Envoy normalises dot segments and slashes) is the API.
        ("/v1/chat/completions//", Api.OPENAI_CHAT),
        ("/", None),
        ("", None),
        ("/health", None),
        ("/V1/CHAT/COMPLETIONS", Api.OPENAI_CHAT),
        ("/?next=/v1/chat/completions", None),
        ("/v1/chat/%63ompletions", Api.OPENAI_CHAT),
        ("/v1/chat/%63%6Fmpletions", Api.OPENAI_CHAT),
        ("/v1/chat%2Fcompletions", Api.OPENAI_CHAT),
        ("/v1/chat%2fcompletions", Api.OPENAI_CHAT),
        ("/v1%5Cchat%5Ccompletions", Api.OPENAI_CHAT),
        ("/v1//chat///completions", Api.OPENAI_CHAT),
        ("//v1/messages", Api.ANTHROPIC_MESSAGES),
        ("/v1/chat/./completions", Api.OPENAI_CHAT),
        ("/v1/x/../chat/completions", Api.OPENAI_CHAT),
        ("/../v1/responses", Api.OPENAI_RESPONSES),
        ("/v1/chat/%2563ompletions", Api.OPENAI_CHAT),
        ("/v1/Messages?beta=true", Api.ANTHROPIC_MESSAGES),
        ("/v1/chat/completions%3Fx=1", None),
        ("/v1/chat/completions#frag", Api.OPENAI_CHAT),
        ("/v1/chat/completions/..", None),
        ("/v1/chat/completions%00", None),
    ],
    ids=[
        "chat",
        "chat-trailing-slash",
        "chat-query-string",
        "chat-trailing-slash-and-query",
        "completions",
        "responses-query-naming-another-path",
        "anthropic-messages",
        "anthropic-trailing-slash-and-query",
        "models-is-not-inference",
        "anthropic-count-tokens-is-not-inference",
        "path-prefix-is-not-inference",
        "longer-name-is-not-inference",
        "two-trailing-slashes",
        "root",
        "empty",
        "health",
        "letter-case",
        "inference-path-only-in-query",
        "percent-encoded-letter",
        "percent-encoded-letters",
        "encoded-slash",
        "encoded-slash-lower-case",
        "encoded-backslashes",
        "duplicate-slashes",
        "leading-double-slash",
        "dot-segment",
        "dot-dot-segment",
        "dot-dot-above-root",
        "double-encoded-letter",
        "anthropic-letter-case-and-query",
        "encoded-question-mark-is-part-of-the-path",
        "fragment",
        "dot-dot-leaves-the-api",
        "encoded-nul-is-not-inference",
    ],
)
def test_api_for_path(path: str, api: Api | None) -> None:
    assert api_for_path(path) is api


def test_non_inference_path_is_a_404_in_openai_style() -> None:
    result = parse("/v1/models?limit=5", GOOD_CHAT)
    assert isinstance(result, BadRequest)
    assert result.status == 404
    assert result.style is ErrorStyle.OPENAI
    assert "/v1/models" in result.message
    assert "limit=5" not in result.message  # the query string may carry secrets


@pytest.mark.parametrize(
    ("path", "style"),
    [
        ("/v1/messages?beta=true", ErrorStyle.ANTHROPIC),
        ("/v1/chat/completions", ErrorStyle.OPENAI),
        ("/v1/models", ErrorStyle.OPENAI),
    ],
    ids=["anthropic-path", "openai-path", "unknown-path-defaults-to-openai"],
)
def test_error_style_for_path(path: str, style: ErrorStyle) -> None:
    assert error_style_for_path(path) is style
