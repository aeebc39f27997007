"""Response inspection through a real Envoy: the upstream's usage becomes cost metrics, and
streams keep streaming while they are read."""

from __future__ import annotations

from collections.abc import Iterator

import orjson
import pytest

from extproc.harness.launch import FleetStack, wait_until
from tests.e2e.conftest import MakeClient, dump_logs

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def inspected(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    stack = FleetStack(
        tmp_path_factory.mktemp("usage"),
        clusters=2,
        fleet_overrides={"processor": {"inspect_usage": True}},
    )
    with stack:
        yield stack


def _sum(stack: FleetStack, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(
        v for (n, got), v in stack.processor_metrics().items() if n == name and want <= set(got)
    )


def test_usage_of_json_and_streamed_responses_is_counted(
    inspected: FleetStack, make_client: MakeClient
) -> None:
    client = make_client(inspected.listener_port)
    doc = "a shared long document. " * 400
    prompt = cached = output = 0
    for turn in range(3):
        for stream in (False, True):
            body = orjson.dumps(
                {
                    "model": "m",
                    "messages": [{"role": "user", "content": doc + f" q{turn} {stream}"}],
                    "max_tokens": 8,
                    "stream": stream,
                }
            )
            status, hdrs, data = client.post_json(CHAT, body, {"x-session-id": "usage"})
            assert status == 200, (data[:200], dump_logs(inspected))
            if stream:
                assert hdrs["content-type"].startswith("text/event-stream")
                lines = [ln for ln in data.split(b"\n") if ln.startswith(b"data: {")]
                assert len(lines) >= 2  # the stream arrived as a stream of events
                usage = orjson.loads(lines[-1][6:])["usage"]
            else:
                usage = orjson.loads(data)["usage"]
            prompt += usage["prompt_tokens"]
            cached += usage["prompt_tokens_details"]["cached_tokens"]
            output += usage["completion_tokens"]
    assert cached > 0  # the same session's shared document was a cache hit

    def counted() -> bool:
        return _sum(inspected, "fleet_upstream_output_tokens_total") == output

    wait_until(counted, 5, "usage of every response to be counted")
    assert _sum(inspected, "fleet_upstream_input_tokens_total", cache="hit") == cached
    assert _sum(inspected, "fleet_upstream_input_tokens_total", cache="miss") == prompt - cached
    saved = _sum(inspected, "fleet_cache_savings_dollars_total")
    assert saved == pytest.approx(cached * (3.00 - 0.30) / 1e6)
    assert _sum(inspected, "fleet_usage_missing_responses_total") == 0


def test_anthropic_stream_usage_is_counted(inspected: FleetStack, make_client: MakeClient) -> None:
    client = make_client(inspected.listener_port)
    before = _sum(inspected, "fleet_upstream_output_tokens_total")
    body = orjson.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 6,
            "stream": True,
        }
    )
    status, _hdrs, data = client.post_json("/v1/messages", body)
    assert status == 200
    assert b"message_stop" in data
    wait_until(
        lambda: _sum(inspected, "fleet_upstream_output_tokens_total") - before == 6,
        5,
        "anthropic output tokens counted",
    )
