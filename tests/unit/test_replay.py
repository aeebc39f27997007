"""The open-loop replayer against an in-process sim cluster (no Envoy): every request accounted."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from extproc.harness.kvmodel import ClusterParams
from extproc.harness.replay import (
    ClassBounds,
    ReplayOptions,
    ReplayResult,
    format_table,
    percentile,
    plot_comparison,
    plot_report,
    read_json,
    run_replay,
    write_json,
)
from extproc.harness.sim_cluster import (
    Fault,
    RunningSimCluster,
    SimClusterConfig,
    start_sim_cluster,
)
from extproc.harness.trace import parse_trace, trace_to_requests
from extproc.harness.workload import BurstSpec, ReplayRequest, WorkloadConfig, generate_workload

pytestmark = pytest.mark.timeout(10)

PARAMS = ClusterParams(prefill_tps=20_000.0, decode_tps=200.0, time_scale=0.001)

# Two sessions (first ids 1 and 50) that grow turn by turn, plus one unrelated long request.
TINY_TRACE = [
    {"timestamp": 0, "input_length": 1200, "output_length": 5, "hash_ids": [1, 2, 3]},
    {"timestamp": 10, "input_length": 900, "output_length": 5, "hash_ids": [50, 51]},
    {"timestamp": 20, "input_length": 2000, "output_length": 5, "hash_ids": [1, 2, 3, 4]},
    {"timestamp": 30, "input_length": 1400, "output_length": 5, "hash_ids": [50, 51, 52]},
    {"timestamp": 40, "input_length": 2500, "output_length": 5, "hash_ids": [1, 2, 3, 4, 5]},
    {"timestamp": 50, "input_length": 3000, "output_length": 5, "hash_ids": list(range(90, 96))},
]


def tiny_requests(**kwargs: object) -> list[ReplayRequest]:
    trace = parse_trace(json.dumps(line) for line in TINY_TRACE)
    return trace_to_requests(trace, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
async def sim() -> AsyncIterator[RunningSimCluster]:
    running = await start_sim_cluster(SimClusterConfig(name="c1", params=PARAMS))
    try:
        yield running
    finally:
        await running.close()


def assert_every_request_has_one_outcome(result: ReplayResult, sent: int) -> None:
    assert len(result.outcomes) == sent
    assert sorted(o.index for o in result.outcomes) == list(range(sent))


async def test_trace_replay_records_every_request_with_usage_and_cluster(
    sim: RunningSimCluster,
) -> None:
    options = ReplayOptions(speedup=10.0, class_bounds=ClassBounds(1000, 2800))
    result = await run_replay(tiny_requests(), sim.url, options)
    assert_every_request_has_one_outcome(result, 6)
    assert [o.outcome for o in result.outcomes] == ["2xx"] * 6
    assert result.clusters == {"c1": 6}
    assert [o.klass for o in result.outcomes] == [
        "medium", "short", "medium", "medium", "medium", "long",
    ]  # fmt: skip
    by_index = {o.index: o for o in result.outcomes}
    # Repeat turns reuse the earlier turn's full blocks: 2 of the 3 (framing shifts the text).
    assert by_index[0].cached_tokens == 0
    assert by_index[2].cached_tokens == 2 * 512
    assert by_index[3].cached_tokens == 512
    assert by_index[4].cached_tokens == 3 * 512
    assert by_index[5].cached_tokens == 0
    assert result.hit_ratio is not None and 0 < result.hit_ratio < 1
    assert all(o.ttft_s is not None and o.latency_s is not None for o in result.outcomes)
    assert all(o.ttft_s <= o.latency_s for o in result.outcomes)  # type: ignore[operator]
    summary = result.summary()
    assert summary["all"]["outcomes"]["2xx"] == 6
    assert summary["classes"]["short"]["count"] == 1
    assert summary["skipped"] == 0


async def test_non_streaming_and_anthropic_replays_read_usage(sim: RunningSimCluster) -> None:
    for api in ("openai-chat", "openai-completions", "anthropic-messages"):
        result = await run_replay(
            tiny_requests(api=api, stream=False), sim.url, ReplayOptions(speedup=20.0)
        )
        assert [o.outcome for o in result.outcomes] == ["2xx"] * 6, api
        assert all(o.prompt_tokens and o.prompt_tokens >= 900 for o in result.outcomes), api
    streamed = await run_replay(
        tiny_requests(api="anthropic-messages"), sim.url, ReplayOptions(speedup=20.0)
    )
    assert [o.outcome for o in streamed.outcomes] == ["2xx"] * 6
    assert sum(o.cached_tokens or 0 for o in streamed.outcomes) > 0


async def test_session_header_is_sent_only_for_sessions_chosen_to_send_it() -> None:
    received: list[tuple[str | None, str | None]] = []

    async def record(request: web.Request) -> web.Response:
        received.append((request.headers.get("x-session-id"), request.headers.get("x-extra")))
        usage = {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 4}}
        return web.json_response({"usage": usage}, headers={"x-served-by": "rec"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", record)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        options = ReplayOptions(speedup=50.0, headers={"x-extra": "1"})
        everyone = await run_replay(
            tiny_requests(session_header_share=1.0, stream=False), url, options
        )
        nobody = await run_replay(
            tiny_requests(session_header_share=0.0, stream=False), url, options
        )
    finally:
        await runner.cleanup()
    assert sorted(h or "" for h, _ in received[:6]) == sorted(
        ["trace-1", "trace-1", "trace-1", "trace-50", "trace-50", "trace-90"]
    )
    assert [h for h, _ in received[6:]] == [None] * 6
    assert all(extra == "1" for _, extra in received)
    assert everyone.hit_ratio == pytest.approx(0.4)
    assert nobody.clusters == {"rec": 6}


async def test_caps_skip_requests_and_concurrency_cap_counts_delays(
    sim: RunningSimCluster,
) -> None:
    capped = await run_replay(tiny_requests(), sim.url, ReplayOptions(max_requests=2))
    assert_every_request_has_one_outcome(capped, 2)
    assert capped.skipped == 4
    timed = await run_replay(tiny_requests(), sim.url, ReplayOptions(duration_s=0.025))
    assert len(timed.outcomes) == 3 and timed.skipped == 3
    # All six at once with room for one in flight: five must wait for a slot.
    simultaneous = [dataclasses.replace(r, arrival_s=0.0) for r in tiny_requests()]
    held = await run_replay(simultaneous, sim.url, ReplayOptions(concurrency=1))
    assert_every_request_has_one_outcome(held, 6)
    assert held.summary()["delayed"] == 5
    assert all(o.outcome == "2xx" for o in held.outcomes)


async def test_error_faults_are_counted_by_status(sim: RunningSimCluster) -> None:
    sim.cluster.set_fault(Fault(mode="error", status=503))
    result = await run_replay(tiny_requests(), sim.url, ReplayOptions(speedup=20.0))
    assert [o.outcome for o in result.outcomes] == ["5xx"] * 6
    assert all(o.status == 503 and o.served_by == "c1" for o in result.outcomes)
    sim.cluster.set_fault(Fault(mode="error", status=413))
    result = await run_replay(tiny_requests()[:2], sim.url, ReplayOptions())
    assert [o.outcome for o in result.outcomes] == ["413", "413"]


async def test_429_is_retried_with_retry_after_only_when_enabled(sim: RunningSimCluster) -> None:
    sim.cluster.set_fault(Fault(mode="error", status=429))
    plain = await run_replay(tiny_requests()[:2], sim.url, ReplayOptions())
    assert [(o.outcome, o.retries) for o in plain.outcomes] == [("429", 0), ("429", 0)]
    retried = await run_replay(
        tiny_requests()[:2],
        sim.url,
        ReplayOptions(retry_429=True, max_retries=2, max_retry_after_s=0.01),
    )
    assert [(o.outcome, o.retries) for o in retried.outcomes] == [("429", 2), ("429", 2)]

    async def clear_soon() -> None:
        await asyncio.sleep(0.05)
        sim.cluster.set_fault(Fault())

    clearing = asyncio.create_task(clear_soon())
    recovered = await run_replay(
        tiny_requests()[:1],
        sim.url,
        ReplayOptions(retry_429=True, max_retries=50, max_retry_after_s=0.02),
    )
    await clearing
    assert recovered.outcomes[0].outcome == "2xx"
    assert recovered.outcomes[0].retries >= 1


async def test_hang_ends_in_timeouts_and_dead_targets_in_transport_errors(
    sim: RunningSimCluster,
) -> None:
    sim.cluster.set_fault(Fault(mode="hang"))
    hung = await run_replay(tiny_requests()[:3], sim.url, ReplayOptions(timeout_s=0.2))
    assert [o.outcome for o in hung.outcomes] == ["timeout"] * 3
    sim.cluster.set_fault(Fault())

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    dead = await run_replay(tiny_requests()[:3], f"http://127.0.0.1:{dead_port}", ReplayOptions())
    assert [o.outcome for o in dead.outcomes] == ["transport"] * 3
    assert all(o.error for o in dead.outcomes)

    sim.cluster.set_fault(Fault(mode="refuse"))
    refused = await run_replay(tiny_requests()[:2], sim.url, ReplayOptions())
    assert [o.outcome for o in refused.outcomes] == ["transport"] * 2


# The module's 10 s bound catches a hung replay; this test also imports matplotlib and draws two
# plots, which took over 10 s on a loaded 2-core CI machine.
@pytest.mark.timeout(120)
async def test_burst_windows_split_short_ttft(sim: RunningSimCluster, tmp_path: Path) -> None:
    config = WorkloadConfig(
        seed=3,
        duration_s=4.0,
        chat_sessions_per_s=4.0,
        chat_think_s=0.5,
        rag_per_s=1.0,
        rag_document_tokens=3000,
        agent_sessions_per_s=0.0,
        output_tokens=(2, 8),
        bursts=(BurstSpec(1.0, 1.0, 5.0, 120_000),),
    )
    requests = generate_workload(config)
    progress: list[str] = []
    result = await run_replay(
        requests,
        sim.url,
        ReplayOptions(
            speedup=4.0,
            burst_windows=config.burst_windows,
            progress=progress.append,
            progress_interval_s=0.1,
        ),
    )
    assert_every_request_has_one_outcome(result, len(requests))
    assert all(o.outcome == "2xx" for o in result.outcomes)
    assert {o.klass for o in result.outcomes} >= {"short", "long"}
    burst = result.summary()["burst"]
    assert burst["short_in_burst"] > 0 and burst["short_outside_burst"] > 0
    assert progress and progress[-1].startswith("replay")

    table = format_table(result)
    assert "short" in table and "clusters (2xx): c1=" in table
    path = tmp_path / "run.json"
    write_json(result, path)
    again = read_json(path)
    assert again.outcomes == result.outcomes
    assert again.summary()["all"] == result.summary()["all"]
    plot_report(result, tmp_path / "report.png")
    plot_comparison({"a": result, "b": again}, tmp_path / "compare.png")
    for name in ("report.png", "compare.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_percentile_interpolates_and_handles_empty() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0


def test_class_bounds() -> None:
    bounds = ClassBounds.parse("2048,100000")
    assert [bounds.classify(n) for n in (2047, 2048, 99_999, 100_000)] == [
        "short", "medium", "medium", "long",
    ]  # fmt: skip
    with pytest.raises(ValueError):
        ClassBounds.parse("5")
    with pytest.raises(ValueError):
        ClassBounds(10, 5)


async def test_bodies_over_a_mebibyte_are_sent_whole(sim: RunningSimCluster) -> None:
    content = "y" * 1_500_000  # ~375k tokens: a long-context request, 1.5 MB of JSON
    big = ReplayRequest(
        arrival_s=0.0,
        api="openai-chat",
        path="/v1/chat/completions",
        body={"messages": [{"role": "user", "content": content}], "max_tokens": 2},
        session_id=None,
        send_session_header=False,
        kind="burst",
        input_tokens=375_000,
        stream=False,
        max_tokens=2,
    )
    result = await run_replay([big], sim.url, ReplayOptions())
    assert result.outcomes[0].outcome == "2xx"
    assert result.outcomes[0].klass == "long"
    assert result.outcomes[0].prompt_tokens == 375_003  # + "<|user|>" and "\n" framing
