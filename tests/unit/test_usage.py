"""Upstream usage parsing and the cost arithmetic (response inspection)."""

from __future__ import annotations

import orjson
import pytest

from extproc.core.api import Api
from extproc.core.usage import Prices, SseUsageScanner, Usage, usage_from_body, usage_of


@pytest.mark.parametrize(
    ("api", "usage", "expected"),
    [
        (
            Api.OPENAI_CHAT,
            {
                "prompt_tokens": 1000,
                "completion_tokens": 20,
                "prompt_tokens_details": {"cached_tokens": 768},
            },
            Usage(1000, 768, 20),
        ),
        (Api.OPENAI_COMPLETIONS, {"prompt_tokens": 10, "completion_tokens": 2}, Usage(10, 0, 2)),
        (
            Api.OPENAI_RESPONSES,
            {
                "input_tokens": 500,
                "output_tokens": 9,
                "input_tokens_details": {"cached_tokens": 256},
            },
            Usage(500, 256, 9),
        ),
        (
            Api.ANTHROPIC_MESSAGES,
            {"input_tokens": 232, "cache_read_input_tokens": 768, "output_tokens": 5},
            Usage(1000, 768, 5),
        ),
        (Api.OPENAI_CHAT, {"prompt_tokens": -3, "completion_tokens": "x"}, Usage(0, 0, 0)),
    ],
    ids=[
        "openai-chat",
        "openai-completions",
        "openai-responses",
        "anthropic-uncached-part",
        "garbage",
    ],
)
def test_usage_in_each_api_shape(api: Api, usage: dict[str, object], expected: Usage) -> None:
    assert usage_of(api, usage) == expected


def test_a_whole_body_without_usage_is_none() -> None:
    assert usage_from_body(Api.OPENAI_CHAT, b'{"choices": []}') is None
    assert usage_from_body(Api.OPENAI_CHAT, b'not json but mentions "usage"') is None
    body = orjson.dumps({"usage": {"prompt_tokens": 4, "completion_tokens": 1}})
    assert usage_from_body(Api.OPENAI_CHAT, body) == Usage(4, 0, 1)


def test_sse_usage_found_across_arbitrary_chunk_boundaries() -> None:
    final = {
        "choices": [],
        "usage": {
            "prompt_tokens": 300,
            "completion_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 256},
        },
    }
    stream = (
        b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
        + b"data: "
        + orjson.dumps(final)
        + b"\n\ndata: [DONE]\n\n"
    )
    for cut in range(1, len(stream), 7):
        scanner = SseUsageScanner(Api.OPENAI_CHAT)
        scanner.feed(stream[:cut])
        scanner.feed(stream[cut:])
        assert scanner.finish() == Usage(300, 256, 7), cut


def test_anthropic_stream_combines_message_start_and_delta() -> None:
    start = {
        "type": "message_start",
        "message": {
            "usage": {"input_tokens": 40, "cache_read_input_tokens": 960, "output_tokens": 1}
        },
    }
    delta = {"type": "message_delta", "usage": {"output_tokens": 12}}
    stream = (
        b"event: message_start\ndata: " + orjson.dumps(start) + b"\n\n"
        b"event: message_delta\ndata: " + orjson.dumps(delta) + b"\n\n"
    )
    scanner = SseUsageScanner(Api.ANTHROPIC_MESSAGES)
    scanner.feed(stream)
    assert scanner.finish() == Usage(1000, 960, 12)


def test_cost_and_savings_at_the_default_prices() -> None:
    prices = Prices()
    usage = Usage(prompt_tokens=1_000_000, cached_tokens=900_000, output_tokens=10_000)
    # 0.9M cached at $0.30/M + 0.1M uncached at $3.00/M + 10K output at $15/M
    assert prices.cost(usage) == pytest.approx(0.27 + 0.30 + 0.15)
    assert prices.saved(usage) == pytest.approx(0.9 * (3.00 - 0.30))
