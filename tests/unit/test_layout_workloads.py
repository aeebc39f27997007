"""The layouts as workloads of `extproc replay` and `extproc bench routing`."""

from __future__ import annotations

import argparse

from extproc.bench import routing
from extproc.bench.routing import _split_cause, key_split
from extproc.config import compile_runtime, parse_config
from extproc.core.chains import Chain
from extproc.harness import replay_cmd
from extproc.harness.replay import ClassBounds
from extproc.harness.workload import ReplayRequest


def _parse(add: object, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add(parser)  # type: ignore[operator]
    return parser.parse_args(argv)


def test_replay_takes_a_layout() -> None:
    args = _parse(
        replay_cmd.add_arguments,
        ["--layout", "anthropic", "--layout-conversations", "5", "--layout-turns", "2"],
    )
    requests, windows = replay_cmd._requests(args)
    assert len(requests) == 10 and windows == ()
    assert {r.path for r in requests} == {"/v1/messages"}
    assert not any(r.send_session_header for r in requests)  # keyed by the prompt alone


def test_bench_routing_takes_a_layout_with_the_chain_key_by_default() -> None:
    args = _parse(
        routing.add_arguments,
        ["--layout", "responses", "--layout-conversations", "4", "--layout-turns", "3"],
    )
    assert args.prefix_key == "chain"
    workload = routing.layout_workload(args)
    assert workload.name == "layout" and len(workload.requests) == 12
    assert len(workload.prompt_blocks) == 12 and 0.0 < workload.ideal_hit_ratio < 1.0
    assert routing.DEFAULT_SPEEDUP[workload.name] > 0


def _request(sid: str, text: str, at: float, header: bool = False) -> ReplayRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    return ReplayRequest(
        arrival_s=at,
        api="openai-chat",
        path="/v1/chat/completions",
        body=body,
        session_id=sid,
        send_session_header=header,
        kind="chat",
        input_tokens=len(text) // 4,
        stream=False,
        max_tokens=4,
    )


def test_key_split_counts_sessions_whose_requests_get_more_than_one_key() -> None:
    # Session "doc": six requests reading one long document, each with its own question (a
    # Mooncake session). Session "hdr": the same shape, but it names itself in x-session-id.
    # Session "chat": one conversation's two turns (the second repeats the first and appends).
    doc = "".join(f"line {i} of a long shared document\n" for i in range(200))
    requests = [_request("doc", f"{doc}question {i}: why {i}?\n" * 3, i) for i in range(6)]
    requests += [_request("hdr", f"{doc}other question {i}?", 10 + i, True) for i in range(6)]
    first = "hello there, " * 100 + "\n"  # past the old key's 1,024 characters
    requests.append(_request("chat", first, 20))
    requests.append(_request("chat", first + "and a follow-up turn", 21))
    # The old key reads the first 1,024 characters: one key per session.
    assert key_split(requests, "opening", 4).startswith(
        "opening key (common_after 4): 0 of 3 sessions"
    )
    # The chain key: "doc" is all the traffic the sketch counts (a header session is not
    # counted), so after four conversations the document is a common opening and the later
    # requests of "doc" key deeper; the header session and the turns keep theirs.
    assert key_split(requests, "chain", 4) == (
        "chain key (common_after 4): 1 of 3 sessions with >= 2 requests get more than one key "
        "(1 of the 2 without a session header)"
    )
    assert key_split(requests, "chain", 4, causes=True).splitlines()[1:] == [
        "  chains promoted (made common): 1",
        "  extends no earlier request of its session (a new reader of a prefix made common): 1",
    ]
    assert key_split(requests, "chain", 16).startswith("chain key (common_after 16): 0 of 3")


def test_key_split_tells_a_lost_leaf_from_a_new_reader() -> None:
    earlier = [Chain((1, 2, 3), 3)]
    assert _split_cause(earlier, Chain((1, 2, 3, 4), 4)).startswith("extends an earlier request")
    assert _split_cause(earlier, Chain((1, 2, 5), 3)).startswith("extends no earlier request")
    assert _split_cause(earlier, Chain((1, 2), 2)).startswith("extends no earlier request")


def test_bench_routing_no_wait_gives_the_429_contract_before_flow_control() -> None:
    """`--no-wait`: every operator class refuses at once and no new session is placed; the
    default keeps flow control's waits (large classes 30 s) and placement."""
    assert _parse(routing.add_arguments, ["--no-wait"]).no_wait
    assert not _parse(routing.add_arguments, []).no_wait
    profile = routing.SimProfile(8, 2_000_000, 20_000.0, 50.0, 64, 0.25, 64)
    classes = routing.operator_classes(profile, ClassBounds(), 2, 2)
    clusters = [{"name": f"c{i}", "endpoints": [f"127.0.0.1:{8000 + i}"]} for i in range(1, 9)]
    base = {"version": 1, "clusters": clusters}
    waiting = compile_runtime(parse_config({**base, "classes": classes}))
    assert {c.name: c.wait.max_wait_s for c in waiting.policy.classes} == {
        "short": 0.5,
        "medium": 30.0,
        "long": 30.0,
    }
    assert waiting.flow.place_new_sessions
    refused = compile_runtime(parse_config({**base, **routing.refused_at_once(classes)}))
    assert {c.wait.max_wait_s for c in refused.policy.classes} == {0.0}
    assert not refused.flow.place_new_sessions
    # Nothing else about the classes changes: the same pools and budgets.
    assert [c.budget for c in refused.policy.classes] == [c.budget for c in waiting.policy.classes]
