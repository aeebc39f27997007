"""The OpenAI API through Envoy and the processor to real llama.cpp servers: chat and
completions, streamed and not, with usage; the processor's cost metrics come from the engines'
real usage and agree with what the engines themselves counted."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from extproc.harness.launch import wait_until
from extproc.harness.real_engines.fleet import RealFleet
from tests.engines.conftest import TINY, engine_counter, llamacpp_fleet, processor_sum, tiny_spec

MakeOpenAI = Callable[[RealFleet], openai.OpenAI]
SHARED = "You are a terse assistant for the fleet tests. " * 40


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[RealFleet]:
    with llamacpp_fleet(
        tmp_path_factory.mktemp("api"),
        tiny_spec(tiny_model),
        fleet_overrides={"processor": {"inspect_usage": True}},
    ) as running:
        yield running


def _counted(fleet: RealFleet) -> tuple[float, float, float]:
    return (
        processor_sum(fleet, "fleet_upstream_input_tokens_total", cache="hit"),
        processor_sum(fleet, "fleet_upstream_input_tokens_total", cache="miss"),
        processor_sum(fleet, "fleet_upstream_output_tokens_total"),
    )


def _engines_counted(fleet: RealFleet) -> tuple[float, float, float]:
    return (
        engine_counter(fleet, "llamacpp:prompt_tokens_cached_total"),
        engine_counter(fleet, "llamacpp:prompt_tokens_total"),  # evaluated: excludes cached
        engine_counter(fleet, "llamacpp:tokens_predicted_total"),
    )


def test_chat_and_completions_streamed_and_not_with_usage_that_matches_the_engines(
    fleet: RealFleet, openai_client: MakeOpenAI
) -> None:
    client = openai_client(fleet)
    ours_before, theirs_before = _counted(fleet), _engines_counted(fleet)
    hit = miss = out = 0
    for turn in range(3):
        question = f"{SHARED} Question {turn}: what is the fleet?"
        chat = client.chat.completions.create(
            model=TINY,
            messages=[{"role": "user", "content": question}],
            max_tokens=4,
            extra_headers={"x-session-id": "api-chat"},
        )
        assert chat.choices[0].message.content
        assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
        cached = chat.usage.prompt_tokens_details.cached_tokens or 0
        hit, miss = hit + cached, miss + chat.usage.prompt_tokens - cached
        out += chat.usage.completion_tokens

        chunks = list(
            client.chat.completions.create(
                model=TINY,
                messages=[{"role": "user", "content": question + " Stream it."}],
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers={"x-session-id": "api-chat"},
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text and len(chunks) >= 3  # it arrived as a stream of events
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens or 0
        hit, miss = hit + cached, miss + usage.prompt_tokens - cached
        out += usage.completion_tokens

        for stream in (False, True):
            prompt = f"{SHARED} Complete {turn} {stream}:"
            if stream:
                events = list(
                    client.completions.create(
                        model=TINY,
                        prompt=prompt,
                        max_tokens=3,
                        stream=True,
                        stream_options={"include_usage": True},
                        extra_headers={"x-session-id": "api-completion"},
                    )
                )
                assert "".join(e.choices[0].text for e in events if e.choices)
                cusage = events[-1].usage
            else:
                completion = client.completions.create(
                    model=TINY,
                    prompt=prompt,
                    max_tokens=3,
                    extra_headers={"x-session-id": "api-completion"},
                )
                assert completion.choices[0].text
                cusage = completion.usage
            assert cusage is not None and cusage.prompt_tokens_details is not None
            cached = cusage.prompt_tokens_details.cached_tokens or 0
            hit, miss = hit + cached, miss + cusage.prompt_tokens - cached
            out += cusage.completion_tokens
    assert hit > 0  # the session's shared opening was reused from the slot's KV cache

    def delta(now: tuple[float, ...], before: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(a - b for a, b in zip(now, before, strict=True))

    wait_until(
        lambda: delta(_counted(fleet), ours_before) == (hit, miss, out),
        10,
        "the processor to count every response's usage",
    )
    # What the engines themselves counted: the same cached, evaluated and generated tokens.
    assert delta(_engines_counted(fleet), theirs_before) == (hit, miss, out)
    assert processor_sum(fleet, "fleet_usage_missing_responses_total") == 0
    saved = processor_sum(fleet, "fleet_cache_savings_dollars_total")
    assert saved == pytest.approx(hit * (3.00 - 0.30) / 1e6)  # the default prices
