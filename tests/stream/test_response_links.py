"""Responses API turns chained by previous_response_id follow their session: two pipelines
(replicas) sharing a real Redis; one learns the link from the response, the other follows it.
What Redis holds is keyed: neither the response id nor the session digest appears in it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import orjson
import pytest
import redis
from prometheus_client import CollectorRegistry

from extproc.config import compile_runtime, parse_config
from extproc.config.runtime import Runtime
from extproc.core.keys import KeySource
from extproc.pipeline.fleet_state import FleetState, RedisSessions
from extproc.pipeline.metrics import Metrics
from extproc.pipeline.outcomes import Routed
from extproc.pipeline.pipeline import Pipeline, RuntimeHolder
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.timeout(60)

RESPONSES = "/v1/responses"
HEADERS = {":method": "POST", ":path": RESPONSES, "content-type": "application/json"}


def runtime(secret: str, monkeypatch: pytest.MonkeyPatch, **processor: Any) -> Runtime:
    monkeypatch.setenv("FLEET_SESSION_SECRET", secret)
    return compile_runtime(
        parse_config(
            {
                "version": 1,
                "clusters": [
                    {"name": f"c{i}", "endpoints": [f"127.0.0.1:80{i:02d}"]} for i in range(8)
                ],
                "classes": [{"name": "all"}],
                "processor": {"inspect_usage": True, **processor},
            }
        )
    )


def request(text: str, previous: str | None = None) -> bytes:
    body: dict[str, Any] = {"model": "m", "input": text}
    if previous is not None:
        body["previous_response_id"] = previous
    return orjson.dumps(body)


def response_body(response_id: str) -> bytes:
    return orjson.dumps(
        {
            "id": response_id,
            "object": "response",
            "status": "completed",
            "output": [],
            "usage": {"input_tokens": 10, "output_tokens": 2},
        }
    )


def sse_created(response_id: str) -> bytes:
    created = {"type": "response.created", "response": {"id": response_id, "object": "response"}}
    return b"event: response.created\ndata: " + orjson.dumps(created) + b"\n\n"


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


@pytest.fixture
async def pipelines(server: RedisServer) -> AsyncIterator[Callable[[Runtime], Pipeline]]:
    made: list[Pipeline] = []

    def make(rt: Runtime) -> Pipeline:
        metrics = Metrics(CollectorRegistry())
        shared = RedisSessions.from_url(server.url, prefix="t", timeout_s=0.5)
        made.append(Pipeline(RuntimeHolder(rt), metrics, fleet=FleetState(metrics, shared=shared)))
        return made[-1]

    yield make
    for pipeline in made:
        await pipeline.aclose()


async def turn(pipeline: Pipeline, text: str, previous: str | None, response_id: str) -> Routed:
    """One exchange: decide, the response (its id in a JSON body), release."""
    outcome = await pipeline.decide(HEADERS, request(text, previous), 1.0)
    assert isinstance(outcome, Routed)
    found = {"content-type": "application/json"}
    assert not pipeline.observe_response(outcome.hold, found, 1.1)
    await pipeline.observe_response_body(outcome.hold, response_body(response_id), True, 1.2)
    await pipeline.release(outcome.hold)
    return outcome


async def test_chained_turns_follow_the_first_turns_session_on_another_replica(
    server: RedisServer,
    pipelines: Callable[[Runtime], Pipeline],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a = pipelines(runtime("fleet-secret", monkeypatch))
    b = pipelines(runtime("fleet-secret", monkeypatch))
    followed = 0
    for conv in range(40):
        first = await turn(a, f"conversation {conv} opens here", None, f"resp_{conv}_0")
        previous = f"resp_{conv}_0"
        for t in range(1, 4):
            # Only the new input: on its own it keys somewhere else entirely.
            pipeline = (a, b)[t % 2]
            later = await turn(pipeline, f"turn {t}", previous, f"resp_{conv}_{t}")
            assert later.facts.session.digest == first.facts.session.digest
            assert later.route.placement == first.route.placement
            previous = f"resp_{conv}_{t}"
            followed += 1
    registry_b = b.metrics.registry
    assert registry_b.get_sample_value("fleet_response_links_total", {"result": "followed"}) > 0
    # Redis holds keyed names and sealed values only.
    probe = redis.Redis.from_url(server.url)
    try:
        keys = [k.decode() for k in probe.keys("t:resp:*")]
        assert len(keys) == 40 * 4
        values = [probe.get(k) for k in keys]
    finally:
        probe.close()
    assert not any("resp_" in k for k in keys)
    digest = first.facts.session.digest
    assert all(v is not None and digest not in v and len(v) == 17 for v in values)


async def test_unknown_ids_and_other_secrets_fall_back_to_the_prefix_key(
    pipelines: Callable[[Runtime], Pipeline], monkeypatch: pytest.MonkeyPatch
) -> None:
    a = pipelines(runtime("secret-a", monkeypatch))
    other = pipelines(runtime("secret-b", monkeypatch))
    first = await turn(a, "opening of a conversation", None, "resp_x")
    # Another secret names the link differently: not found, the request keeps its own key.
    lost = await turn(other, "next", "resp_x", "resp_y")
    assert lost.facts.session.digest != first.facts.session.digest
    assert lost.facts.session.source is KeySource.PREFIX
    unknown = await turn(a, "next", "resp_never_seen", "resp_z")
    assert unknown.facts.session.digest != first.facts.session.digest
    samples = a.metrics.registry.get_sample_value
    assert samples("fleet_response_links_total", {"result": "unknown"}) == 1
    # A body-field session (conversation) wins over the link.
    body = orjson.dumps({"model": "m", "input": "x", "previous_response_id": "resp_x", "user": "u"})
    keyed = await a.decide(HEADERS, body, 2.0)
    assert isinstance(keyed, Routed) and keyed.facts.session.source is KeySource.BODY
    await a.release(keyed.hold)


async def test_streamed_responses_are_linked_from_their_first_event(
    pipelines: Callable[[Runtime], Pipeline], monkeypatch: pytest.MonkeyPatch
) -> None:
    a = pipelines(runtime("fleet-secret", monkeypatch))
    first = await a.decide(HEADERS, request("a streamed conversation"), 1.0)
    assert isinstance(first, Routed)
    assert a.observe_response(first.hold, {"content-type": "text/event-stream"}, 1.1)
    event = sse_created("resp_streamed")
    await a.observe_response_body(first.hold, event[:20], False, 1.2)
    await a.observe_response_body(first.hold, event[20:], False, 1.3)
    # Linked while the stream is still running: the next turn may come from another client.
    chained = await a.decide(HEADERS, request("next", "resp_streamed"), 1.4)
    assert isinstance(chained, Routed)
    assert chained.facts.session.digest == first.facts.session.digest
    await a.observe_response_body(first.hold, b"data: {}\n\n", True, 1.5)
    await a.release(first.hold)
    await a.release(chained.hold)


async def test_without_response_inspection_nothing_is_followed(
    pipelines: Callable[[Runtime], Pipeline], monkeypatch: pytest.MonkeyPatch
) -> None:
    rt = runtime("fleet-secret", monkeypatch, inspect_usage=False)
    assert rt.response_link_ttl_s is None
    a = pipelines(rt)
    first = await a.decide(HEADERS, request("opening"), 1.0)
    assert isinstance(first, Routed) and first.hold.link_session is None
    await a.release(first.hold)
