"""Failures and backpressure on real llama.cpp servers through Envoy and the processor.

- SIGKILL of the engine a session runs on, under sequential traffic: no request fails; the
  session runs on its secondary cluster (Envoy retries the refused connection there) until
  Envoy's health check takes the dead engine out, then on its cluster's other engine; after
  the restart, back on its own engine.
- A client that drops a stream mid-generation frees its class budget at once and the engine
  stops generating (its own counters and gauges say so).
- An engine at its slot limit queues (requests deferred, in its own /metrics): Envoy does not
  eject it, every request succeeds, nothing is generated twice.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from extproc.harness.launch import wait_until
from extproc.harness.real_engines import llamacpp
from extproc.harness.real_engines.fleet import RealFleet
from tests.engines.conftest import (
    TINY,
    counters,
    llamacpp_fleet,
    metric_value,
    processor_sum,
    served,
    tiny_spec,
)

MakeOpenAI = Callable[[RealFleet], openai.OpenAI]
BUDGET = 8  # requests in flight per cluster for the "short" class


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[RealFleet]:
    with llamacpp_fleet(
        tmp_path_factory.mktemp("failures"),
        tiny_spec(tiny_model),
        fleet_overrides={
            "classes": [
                {"name": "short", "max_input_tokens": 2048, "budget": {"max_concurrent": BUDGET}},
                {"name": "long"},
            ],
            # One engine per session, unbounded: a session's concurrent requests all queue on
            # its engine (the slot-limit test).
            "engines": {"balance_factor": None},
        },
    ) as running:
        yield running


def _chat(client: openai.OpenAI, session: str, turn: int) -> str:
    chat = client.chat.completions.create(
        model=TINY,
        messages=[{"role": "user", "content": f"Turn {turn} of the failover conversation."}],
        max_tokens=2,
        extra_headers={"x-session-id": session},
    )
    return chat.choices[0].message.content or ""


def test_sigkill_under_sequential_traffic_fails_no_request(
    fleet: RealFleet, openai_client: MakeOpenAI
) -> None:
    client = openai_client(fleet)
    assert fleet.stack is not None
    session = "failover-1"
    _text, home = served(fleet, lambda: _chat(client, session, 0))
    cluster = home.rpartition("-e")[0]
    for turn in range(1, 4):
        assert served(fleet, lambda t=turn: _chat(client, session, t))[1] == home  # sticky

    fleet.engine(home).kill()
    during = [served(fleet, lambda t=t: _chat(client, session, t))[1] for t in range(30)]
    # Every request succeeded (served). Until Envoy's health check marks the dead engine
    # down, the connect failure is retried on the session's secondary cluster; after that the
    # cluster's Maglev hands the session to its other engine, and it stays there.
    assert home not in during, during
    assert not during[0].startswith(cluster + "-"), during
    runs = [e for i, e in enumerate(during) if i == 0 or during[i - 1] != e]
    assert len(runs) <= 2, during
    if len(runs) == 2:
        assert runs[1] in fleet.names(cluster), during

    fleet.engine(home).restart(llamacpp.START_TIMEOUT_S)
    fleet.stack.wait_healthy([home], timeout=60)

    def back_home() -> bool:
        return served(fleet, lambda: _chat(client, session, 99))[1] == home

    wait_until(back_home, 60, "the session to return to its own engine", 0.2)


def test_a_dropped_stream_frees_its_budget_and_the_engine_stops_generating(
    fleet: RealFleet, openai_client: MakeOpenAI
) -> None:
    client = openai_client(fleet)
    predicted_before = sum(counters(fleet, "llamacpp:tokens_predicted_total").values())
    stream = client.chat.completions.create(
        model=TINY,
        messages=[{"role": "user", "content": "Tell a very long story."}],
        max_tokens=3000,
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers={"x-session-id": "dropped-stream"},
    )
    received = 0
    for chunk in stream:
        received += 1 if chunk.choices and chunk.choices[0].delta.content else 0
        if received >= 5:
            break
    assert processor_sum(fleet, "fleet_budget_inflight_requests") == 1
    stream.close()  # the client goes away mid-generation

    def released() -> bool:
        return processor_sum(fleet, "fleet_budget_inflight_requests") == 0

    wait_until(released, 30, "the dropped stream's budget to be released", 0.1)

    def engines_idle() -> bool:
        return all(
            metric_value(e.metrics_text(), "llamacpp:requests_processing") == 0
            for e in fleet.engines
        )

    wait_until(engines_idle, 60, "the engine to stop the dropped request", 0.1)
    generated = sum(counters(fleet, "llamacpp:tokens_predicted_total").values()) - predicted_before
    # Cancelled, not finished: a finished request would have generated all 3000 tokens.
    assert received <= generated < 3000


def test_an_engine_at_its_slot_limit_queues_and_is_not_ejected(
    fleet: RealFleet, openai_client: MakeOpenAI
) -> None:
    assert fleet.stack is not None
    client = openai_client(fleet)
    session = "slot-limit"
    _text, engine_name = served(fleet, lambda: _chat(client, session, 0))
    engine = fleet.engine(engine_name)
    slots = engine.spec.slots if isinstance(engine, llamacpp.LlamaCppEngine) else 2
    predicted_before = counters(fleet, "llamacpp:tokens_predicted_total")
    requests, tokens = 3 * slots, 48

    def one(i: int) -> int:
        chat = client.chat.completions.create(
            model=TINY,
            messages=[{"role": "user", "content": f"Request {i} beyond the slots."}],
            max_tokens=tokens,
            extra_body={"ignore_eos": True},
            extra_headers={"x-session-id": session},
        )
        assert chat.usage is not None
        return chat.usage.completion_tokens

    deferred_seen = 0.0
    with concurrent.futures.ThreadPoolExecutor(requests) as pool:
        futures = [pool.submit(one, i) for i in range(requests)]
        while not all(f.done() for f in futures):
            page = engine.metrics_text()
            deferred_seen = max(deferred_seen, metric_value(page, "llamacpp:requests_deferred"))
        completions = [f.result() for f in futures]  # every one succeeded
    assert deferred_seen >= 1  # the engine queued what its slots could not take
    assert completions == [tokens] * requests
    predicted = counters(fleet, "llamacpp:tokens_predicted_total")
    moved = {n: predicted[n] - predicted_before.get(n, 0.0) for n in predicted}
    # All on the session's engine, each request generated once.
    assert moved[engine_name] == tokens * requests
    assert all(v == 0 for n, v in moved.items() if n != engine_name), moved
    cluster = engine_name.rpartition("-e")[0]
    assert (
        fleet.stack.envoy_stat(f"cluster.{cluster}.outlier_detection.ejections_enforced_total") == 0
    )
    assert fleet.stack.host_health()[(cluster, engine.address)] is True
