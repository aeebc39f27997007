"""The simulated cluster's /v1/responses, read by the real OpenAI SDK: the response object, the
typed stream events, previous_response_id served from the cluster's own store (a prefix-cache
hit), and vLLM's 404 on a cluster that does not hold the response."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest

from extproc.harness.kvmodel import ClusterParams
from extproc.harness.sim_cluster import RunningSimCluster, SimClusterConfig, start_sim_cluster

pytestmark = pytest.mark.timeout(30)

PARAMS = ClusterParams(prefill_tps=20_000.0, decode_tps=50.0, time_scale=0.001)
LONG = " ".join(f"word{i}" for i in range(2000))  # several KV blocks


@pytest.fixture
async def sims() -> AsyncIterator[list[openai.AsyncOpenAI]]:
    """An SDK client for each of two clusters."""
    running: list[RunningSimCluster] = []
    clients: list[openai.AsyncOpenAI] = []
    try:
        for name in ("r1", "r2"):
            sim = await start_sim_cluster(SimClusterConfig(name=name, params=PARAMS, max_output=16))
            running.append(sim)
            clients.append(
                openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="sim", max_retries=0)
            )
        yield clients
    finally:
        for sdk in clients:
            await sdk.close()
        for sim in running:
            await sim.close()


async def test_a_response_object_then_a_chained_turn_served_from_the_store(
    sims: list[openai.AsyncOpenAI],
) -> None:
    sdk = sims[0]
    first = await sdk.responses.create(
        model="m", instructions="Be brief.", input=LONG, max_output_tokens=8
    )
    assert first.object == "response" and first.id.startswith("resp_")
    assert first.status == "incomplete"  # 8 < the cluster's 16 tokens: cut at the limit
    assert first.incomplete_details is not None
    assert first.incomplete_details.reason == "max_output_tokens"
    assert first.output_text == "the sim kv  ok  and one two via new run "[: len(first.output_text)]
    assert first.usage is not None and first.usage.output_tokens == 8
    assert first.usage.input_tokens_details.cached_tokens == 0
    # Only the new input is sent: the cluster prefills the stored conversation before it,
    # so the earlier prompt's blocks are cache hits.
    second = await sdk.responses.create(model="m", previous_response_id=first.id, input="And then?")
    assert second.status == "completed" and second.previous_response_id == first.id
    assert second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 512


async def test_another_cluster_does_not_hold_the_response_404(
    sims: list[openai.AsyncOpenAI],
) -> None:
    first = await sims[0].responses.create(model="m", input="hello")
    with pytest.raises(openai.NotFoundError) as caught:
        await sims[1].responses.create(model="m", previous_response_id=first.id, input="again")
    assert caught.value.status_code == 404
    assert f"Response with id '{first.id}' not found." in str(caught.value)
    # store=false: not kept, so not found on its own cluster either.
    unstored = await sims[0].responses.create(model="m", input="x", store=False)
    with pytest.raises(openai.NotFoundError):
        await sims[0].responses.create(model="m", previous_response_id=unstored.id, input="y")


async def test_the_stream_is_the_typed_event_sequence(sims: list[openai.AsyncOpenAI]) -> None:
    sdk = sims[0]
    stream = await sdk.responses.create(model="m", input=LONG, stream=True)
    kinds: list[str] = []
    seqs: list[int] = []
    deltas: list[str] = []
    final = None
    async for event in stream:
        kinds.append(event.type)
        seqs.append(event.sequence_number)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type == "response.completed":
            final = event.response
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert seqs == list(range(len(seqs)))
    assert final is not None and final.status == "completed"
    assert final.output_text == "".join(deltas)
    assert final.usage is not None and final.usage.output_tokens == 16
    # The streamed response is stored like any other.
    chained = await sdk.responses.create(model="m", previous_response_id=final.id, input="more")
    assert chained.usage is not None and chained.usage.input_tokens_details.cached_tokens > 0
