"""The layouts as workloads of `extproc replay` and `extproc bench routing`."""

from __future__ import annotations

import argparse

from extproc.bench import routing
from extproc.harness import replay_cmd


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
