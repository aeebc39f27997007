"""The pure parts of `extproc bench peers`: engine counters, per-run deltas, the sustained rate,
the generated block of the page, the fault windows and the /proc readings of a process tree."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from extproc.bench.peer_procs import (
    EngineCounters,
    counter_deltas,
    cpu_seconds,
    parse_counters,
    process_tree,
    rss_bytes,
)
from extproc.bench.peer_report import fault_row, ramp_row
from extproc.bench.peer_routers import Peer, make_router
from extproc.bench.peer_runs import RunResult, RunSpec, placement_cpus
from extproc.bench.peer_workloads import BOUNDS, PeerWorkload, agentic, chat, first_user
from extproc.bench.peers import DOC_BEGIN, DOC_END, write_doc
from extproc.harness.replay import ReplayResult, RequestOutcome

VLLM_METRICS = """\
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="sim"} 2048.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="sim"} 512.0
# TYPE sim_requests counter
sim_requests_total{api="openai-chat",code="200"} 7.0
sim_requests_total{api="openai-chat",code="404"} 3.0
"""


def test_counters_are_read_from_vllm_families_and_answered_requests() -> None:
    assert parse_counters(VLLM_METRICS) == EngineCounters(2048.0, 512.0, 7.0)


def test_a_run_counts_what_it_added_and_a_restarted_engine_from_zero() -> None:
    before = {"e1": EngineCounters(100, 50, 2), "e2": EngineCounters(100, 50, 2)}
    after = {"e1": EngineCounters(300, 150, 5), "e2": EngineCounters(40, 10, 1)}
    deltas = counter_deltas(after, before)
    assert deltas["e1"] == EngineCounters(200, 100, 3)
    assert deltas["e2"] == EngineCounters(40, 10, 1)


def _outcome(i: int, sent: float, ok: bool, ttft: float, cached: int = 0) -> RequestOutcome:
    return RequestOutcome(
        index=i, kind="chat", klass="short", outcome="2xx" if ok else "transport",
        status=200 if ok else None, scheduled_s=sent, sent_s=sent, ttft_s=ttft,
        latency_s=ttft, prompt_tokens=100, cached_tokens=cached, served_by=None, retries=0,
        delayed=False, in_burst=False, session_id=None, input_tokens=100,
    )  # fmt: skip


def _run(outcomes: list[RequestOutcome], events: dict[str, float] | None = None) -> RunResult:
    workload = PeerWorkload("w", "w", ())
    replay = ReplayResult("t", tuple(outcomes), 0, 1.0)
    return RunResult(RunSpec("direct", workload), replay, {}, None, 0, [], events or {})


def test_the_sustained_rate_is_the_last_step_before_the_first_that_fails() -> None:
    outcomes = [_outcome(0, 0.5, True, 0.1), _outcome(1, 1.5, True, 0.1)]
    outcomes += [_outcome(2, 2.5, True, 2.0), _outcome(3, 3.5, True, 0.1)]
    outcomes += [_outcome(4, 4.5, False, 0.1)]
    row = ramp_row(_run(outcomes), [0.0, 1.0, 2.0, 3.0, 4.0], 1.0, 1.0)
    assert [c["ok"] for c in row["steps"]] == [True, True, False, True, False]
    assert row["sustained_rate"] == 1.0  # step 4 passes, but after step 3 failed


def test_fault_windows_split_failures_and_read_hits_after_each_fault() -> None:
    events = {"engine_killed": 10.0, "engine_back": 20.0, "router_stopped": 30.0}
    events["router_back"] = 31.0
    outcomes = [_outcome(0, 5.0, True, 0.1, cached=50), _outcome(1, 12.0, False, 0.1)]
    outcomes += [_outcome(2, 22.0, True, 0.1, cached=80), _outcome(3, 30.5, False, 0.1)]
    outcomes += [_outcome(4, 33.0, True, 0.1, cached=90), _outcome(5, 45.0, False, 0.1)]
    row = fault_row(_run(outcomes, events))
    assert (row["failed_engine_down"], row["failed_router_restart"], row["failed_other"]) == (
        1,
        1,
        1,
    )
    assert row["hit_before_kill"] == pytest.approx(0.5)
    assert row["hit_after_engine_back"] == pytest.approx(0.85)  # both 2xx within 20 s
    assert row["hit_after_restart"] == pytest.approx(0.9)


def test_the_generated_block_is_replaced_and_the_rest_kept(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text(f"intro\n{DOC_BEGIN}\nold\n{DOC_END}\noutro\n")
    write_doc(page, "new tables")
    assert page.read_text() == f"intro\n{DOC_BEGIN}\nnew tables\n{DOC_END}\noutro\n"
    page.write_text("no markers\n")
    with pytest.raises(ValueError, match="block"):
        write_doc(page, "x")


def test_process_tree_cpu_and_memory_of_this_process() -> None:
    assert os.getpid() in process_tree([os.getpid()])
    assert cpu_seconds([os.getpid()]) > 0
    assert rss_bytes([os.getpid()]) > 0
    assert process_tree([2**22 + 12345]) == []  # no such process: nothing, no error


def test_isolated_placement_gives_the_router_its_own_cpu() -> None:
    client, router = placement_cpus("isolated")
    if (os.cpu_count() or 1) >= 2:
        assert client.isdisjoint(router) and len(router) == 1
    shared = placement_cpus("shared")
    assert shared[0] == shared[1]


def test_peers_are_started_with_their_documented_flags(tmp_path: Path) -> None:
    router = make_router("vllm-router:cache_aware", ["http://a:1", "http://b:2"], {}, tmp_path,
                         tmp_path)  # fmt: skip
    assert isinstance(router, Peer)
    argv = router.argv(9000, 9001)
    assert argv[0] == str(tmp_path / "vllm-router")
    assert argv[argv.index("--policy") + 1] == "cache_aware"
    assert argv[argv.index("--cache-threshold") + 1] == "0.5"
    smg = make_router("smg:round_robin", ["http://a:1"], {}, tmp_path, tmp_path)
    assert isinstance(smg, Peer)
    assert smg.argv(9000, 9001)[:2] == [str(tmp_path / "smg"), "launch"]
    with pytest.raises(ValueError, match="unknown set-up"):
        make_router("nginx", [], {}, tmp_path, tmp_path)


def test_workloads_split_into_short_and_long_classes() -> None:
    mixed = agentic(0, 6.0, 0.5, 2.0)
    classes = {BOUNDS.classify(r.input_tokens) for r in mixed.requests}
    assert classes == {"short", "long"}
    for workload in (chat(0, 4.0, 2.0), first_user(0, 4.0, 2.0)):
        assert workload.requests and all(r.stream for r in workload.requests)
        assert 0 < workload.ideal < 1
