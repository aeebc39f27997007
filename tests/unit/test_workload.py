"""The synthetic workload: deterministic, prefix-extending sessions, capped agents, bursts."""

from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict

import pytest

from extproc.harness.prompts import canonical_prompt, count_tokens
from extproc.harness.workload import BurstSpec, ReplayRequest, WorkloadConfig, generate_workload

SMALL = WorkloadConfig(
    seed=7,
    duration_s=40.0,
    chat_sessions_per_s=2.0,
    chat_think_s=2.0,
    rag_per_s=1.0,
    rag_document_tokens=3000,
    agent_sessions_per_s=0.2,
    agent_step_s=1.0,
    agent_step_tokens=2000,
    agent_max_context_tokens=20_000,
    bursts=(BurstSpec(10.0, 5.0, 20.0, 8000),),
)


def sessions(requests: list[ReplayRequest], kind: str) -> dict[str, list[ReplayRequest]]:
    out: dict[str, list[ReplayRequest]] = defaultdict(list)
    for r in requests:
        if r.kind == kind and r.session_id is not None:
            out[r.session_id].append(r)
    return out


def prompt(r: ReplayRequest) -> str:
    return canonical_prompt(r.api, r.materialize())


def first_user(r: ReplayRequest) -> str:
    messages = r.materialize()["messages"]
    return str(next(m["content"] for m in messages if m["role"] == "user"))


@pytest.fixture(scope="module")
def requests() -> list[ReplayRequest]:
    return generate_workload(SMALL)


def test_same_config_same_requests(requests: list[ReplayRequest]) -> None:
    again = generate_workload(SMALL)
    assert again == requests
    other = generate_workload(dataclasses.replace(SMALL, seed=8))
    assert [r.arrival_s for r in other] != [r.arrival_s for r in requests]


def test_requests_are_sorted_within_the_duration_and_all_kinds_appear(
    requests: list[ReplayRequest],
) -> None:
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals)
    assert arrivals[0] >= 0 and arrivals[-1] < SMALL.duration_s
    assert {r.kind for r in requests} == {"chat", "rag", "agent", "burst"}
    assert all(r.path == "/v1/chat/completions" and r.api == "openai-chat" for r in requests)


def test_each_chat_turn_extends_the_previous_turns_prompt(requests: list[ReplayRequest]) -> None:
    chats = sessions(requests, "chat")
    assert any(len(turns) >= 3 for turns in chats.values())
    for turns in chats.values():
        for earlier, later in itertools.pairwise(turns):
            before = earlier.materialize()["messages"]
            after = later.materialize()["messages"]
            assert after[: len(before)] == before
            assert prompt(later).startswith(prompt(earlier))
            assert later.arrival_s > earlier.arrival_s


def test_chat_sessions_share_a_few_system_prompts(requests: list[ReplayRequest]) -> None:
    systems = {
        turns[0].materialize()["messages"][0]["content"]
        for turns in sessions(requests, "chat").values()
    }
    assert 1 < len(systems) <= SMALL.system_prompts


def test_first_user_messages_differ_within_their_first_200_chars(
    requests: list[ReplayRequest],
) -> None:
    heads = [
        first_user(turns[0])[:200]
        for kind in ("chat", "agent")
        for turns in sessions(requests, kind).values()
    ]
    assert len(heads) > 20
    assert len(set(heads)) == len(heads)


def test_rag_requests_share_document_prefixes_and_send_no_session_header(
    requests: list[ReplayRequest],
) -> None:
    rag = [r for r in requests if r.kind == "rag"]
    heads = {first_user(r)[:1024] for r in rag}
    assert len(heads) <= SMALL.rag_documents < len(rag)
    assert not any(r.send_session_header for r in rag)


def test_agent_context_grows_up_to_the_configured_max(requests: list[ReplayRequest]) -> None:
    agents = sessions(requests, "agent")
    assert agents
    for steps in agents.values():
        sizes = [r.input_tokens for r in steps]
        assert sizes == sorted(sizes)
        assert max(sizes) <= SMALL.agent_max_context_tokens
    assert any(len(steps) >= 5 for steps in agents.values())


def test_burst_requests_arrive_inside_their_window_at_about_the_rate(
    requests: list[ReplayRequest],
) -> None:
    burst = [r for r in requests if r.kind == "burst"]
    assert all(10.0 <= r.arrival_s < 15.0 for r in burst)
    assert 60 <= len(burst) <= 140  # Poisson, mean 100
    assert all(abs(r.input_tokens - 8000) < 10 for r in burst)
    assert SMALL.burst_windows == ((10.0, 15.0),)


def test_input_token_estimate_matches_the_canonical_prompt(requests: list[ReplayRequest]) -> None:
    for r in requests[:: max(1, len(requests) // 50)]:
        assert abs(r.input_tokens - count_tokens(prompt(r))) <= 2


def test_session_header_is_a_per_session_choice_at_about_the_share() -> None:
    config = WorkloadConfig(seed=1, duration_s=200.0, chat_sessions_per_s=2.0, rag_per_s=0.0)
    chats = sessions(generate_workload(config), "chat")
    choices = [{r.send_session_header for r in turns} for turns in chats.values()]
    assert all(len(c) == 1 for c in choices)
    share = sum(True in c for c in choices) / len(choices)
    assert 0.4 < share < 0.6


def test_stream_flag_and_max_tokens_are_in_the_body(requests: list[ReplayRequest]) -> None:
    for r in requests[:20]:
        body = r.materialize()
        assert body["stream"] is r.stream is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["max_tokens"] == r.max_tokens
        low, high = SMALL.output_tokens
        assert low <= r.max_tokens <= high


def test_burst_spec_parsing_and_validation() -> None:
    assert BurstSpec.parse("20,10,2,150000") == BurstSpec(20.0, 10.0, 2.0, 150000)
    with pytest.raises(ValueError):
        BurstSpec.parse("1,2,3")
    with pytest.raises(ValueError):
        BurstSpec(0.0, 0.0, 1.0, 10)
    with pytest.raises(ValueError):
        WorkloadConfig(session_header_share=1.5)
