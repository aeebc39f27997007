"""Responses API conversations chained by previous_response_id, through a real Envoy, two
processor replicas sharing a real Redis, and simulated clusters that keep stored responses per
cluster (another cluster answers vLLM's 404): the OpenAI SDK sends only each turn's new input,
and every turn is served by its first turn's cluster."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from extproc.harness.launch import FleetStack
from tests.e2e.conftest import dump_logs
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.timeout(300)

CONVERSATIONS = 12
TURNS = 4


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    with RedisServer() as redis_server:
        fleet = FleetStack(
            tmp_path_factory.mktemp("links"),
            clusters=4,
            processors=2,
            # Four simulated clusters and two processors start at once: on a loaded machine a
            # simulated cluster took longer than the default 20 s to answer /health.
            fleet_overrides={
                "processor": {"inspect_usage": True},
                "prefix": {"key": "chain"},
                # A link reaches the other replica only through Redis: when a call times out
                # Redis is left alone for a second and links stay in one replica's memory
                # (the documented fail-open). At load average 25 the default 50 ms timed out.
                "redis": {"url": redis_server.url, "timeout_ms": 2000},
            },
        )
        with fleet:
            yield fleet


def _total(stack: FleetStack, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(
        v
        for i in range(stack.processors)
        for (n, got), v in stack.processor_metrics(i).items()
        if n == name and want <= set(got)
    )


def test_chained_turns_stay_on_the_cluster_that_stored_their_response(stack: FleetStack) -> None:
    sdk = openai.OpenAI(
        base_url=f"http://127.0.0.1:{stack.listener_port}/v1", api_key="e2e", max_retries=0
    )
    try:
        moved = 0
        for conv in range(CONVERSATIONS):
            previous: str | None = None
            first_cluster: str | None = None
            for turn in range(TURNS):
                stream = turn % 2 == 1
                extra = {"previous_response_id": previous} if previous else {}
                raw = sdk.responses.with_raw_response.create(
                    model="m",
                    instructions="You are a helpful assistant.",
                    input=f"conversation {conv}, turn {turn}: tell me more",
                    max_output_tokens=8,
                    stream=stream,
                    **extra,  # type: ignore[arg-type]
                )
                cluster = raw.headers["x-served-by"]
                if stream:
                    done = [e for e in raw.parse() if e.type == "response.completed"]
                    assert len(done) == 1
                    response_id = done[0].response.id
                else:
                    response_id = raw.parse().id
                first_cluster = first_cluster or cluster
                moved += cluster != first_cluster
                previous = response_id
        assert moved == 0, dump_logs(stack)
    except openai.NotFoundError as exc:  # a turn reached a cluster without its response
        pytest.fail(f"{exc}\n{dump_logs(stack)}")
    finally:
        sdk.close()
    chained = CONVERSATIONS * (TURNS - 1)
    assert _total(stack, "fleet_response_links_total", result="followed") == chained
    assert _total(stack, "fleet_response_links_total", result="learnt") == CONVERSATIONS * TURNS
    # Both replicas decided requests (Envoy spreads the ext_proc streams over them).
    decided = [
        sum(v for (n, _l), v in stack.processor_metrics(i).items() if n == "fleet_requests_total")
        for i in range(stack.processors)
    ]
    assert all(d > 0 for d in decided), decided


def test_an_unknown_previous_response_is_the_engines_own_404(stack: FleetStack) -> None:
    sdk = openai.OpenAI(
        base_url=f"http://127.0.0.1:{stack.listener_port}/v1", api_key="e2e", max_retries=0
    )
    try:
        with pytest.raises(openai.NotFoundError) as caught:
            sdk.responses.create(model="m", previous_response_id="resp_nowhere", input="hi")
    finally:
        sdk.close()
    assert "Response with id 'resp_nowhere' not found." in str(caught.value)
    assert _total(stack, "fleet_response_links_total", result="unknown") >= 1
