"""A small Mooncake trace replayed through a real Envoy + processor + simulated clusters.

The trace is written here, so the test knows exactly which requests share which prefix: every
request must end in one outcome (a 2xx), every session must stay on one cluster (half of them
name themselves in x-session-id, half rely on the processor's prefix key), and each follow-up
must find exactly the blocks its session's earlier requests left in that cluster's cache.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from extproc.config import load_runtime
from extproc.harness.launch import FleetStack
from extproc.harness.prompts import BLOCK_TOKENS
from extproc.harness.replay import ReplayOptions, ReplayResult, run_replay
from extproc.harness.trace import ideal_hit_ratio, read_trace, trace_to_requests
from extproc.harness.workload import ReplayRequest
from tests.e2e.conftest import dump_logs
from tests.e2e.predict import PURE_HASH, placement_for

pytestmark = pytest.mark.e2e

# Multi-request sessions, by block ids: each list is one request, in arrival order. Prompts are
# whole blocks, so a request sharing k leading ids with an earlier one shares exactly k cached
# blocks in the simulator (its "<|user|>" framing shifts text by 8 characters, never a block).
SESSIONS: tuple[tuple[tuple[int, ...], ...], ...] = (
    ((0, 1, 2), (0, 1, 2, 3, 4), (0, 1, 2, 3, 4, 5), (0, 1, 2, 3, 4, 5, 6, 7)),
    ((10, 11), (10, 11, 12), (10, 11, 12, 13, 14), (10, 11, 12, 13, 14, 15)),
    ((20, 21, 22, 23), (20, 21, 22, 23, 24), (20, 21, 22, 23, 24, 25)),
    ((30,), (30, 31), (30, 31, 32), (30, 31, 32, 33)),
    # Same opening document, different continuations: a shared prefix, not one conversation.
    ((40, 41, 42, 43), (40, 41, 42, 50, 51), (40, 41, 60)),
    ((70, 71, 72), (70, 71, 72, 73)),
)
SINGLETONS = 10  # one-off requests with ids nobody else uses


def _trace_lines() -> list[dict[str, object]]:
    requests: list[tuple[int, ...]] = []
    # Interleave sessions so that their turns alternate with other traffic, as in a real trace.
    for turn in range(max(len(s) for s in SESSIONS)):
        requests.extend(s[turn] for s in SESSIONS if turn < len(s))
    lines: list[dict[str, object]] = [
        {
            "timestamp": 100 * i,
            "input_length": BLOCK_TOKENS * len(ids),
            "output_length": 8,
            "hash_ids": list(ids),
        }
        for i, ids in enumerate(requests)
    ]
    start = len(lines)
    for n in range(SINGLETONS):
        ids = [1000 + 10 * n, 1001 + 10 * n]
        # A partial last block, as most real prompts have.
        lines.append(
            {
                "timestamp": 100 * (start + n),
                "input_length": BLOCK_TOKENS * 2 - 100,
                "output_length": 4,
                "hash_ids": ids,
            }
        )
    return lines


def _expected_cached_blocks(ids_in_order: list[tuple[int, ...]]) -> list[int]:
    """Leading ids each request shares with any earlier request of its session."""
    out: list[int] = []
    for i, ids in enumerate(ids_in_order):
        best = 0
        for earlier in ids_in_order[:i]:
            k = 0
            while k < min(len(ids), len(earlier)) and ids[k] == earlier[k]:
                k += 1
            best = max(best, k)
        out.append(best)
    return out


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    stack = FleetStack(
        tmp_path_factory.mktemp("replay-smoke"),
        clusters=3,
        mode="extproc",
        sim_args=("--time-scale", "0.01"),
        # Pure hashing predicts first turns (no balance spills): tests the replayer.
        fleet_overrides={"affinity": PURE_HASH},
    )
    with stack:
        yield stack


@pytest.mark.timeout(60)
def test_small_trace_every_request_accounted_for_and_sessions_sticky(
    fleet: FleetStack, tmp_path: Path
) -> None:
    lines = _trace_lines()
    assert len(lines) == 30
    trace_path = tmp_path / "trace.jsonl"
    trace_path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    trace = read_trace(trace_path)
    assert len(trace.requests) == 30 and not trace.issues
    requests = trace_to_requests(trace, session_header_share=0.5, seed=3)
    # Both ways of naming a session are exercised: the header, and the prefix key.
    multi = {f"trace-{session[0][0]}" for session in SESSIONS}
    with_header = {r.send_session_header for r in requests if r.session_id in multi}
    assert with_header == {True, False}, "seed must give both kinds of session"

    result: ReplayResult = asyncio.run(
        run_replay(requests, fleet.url, ReplayOptions(speedup=2.0, timeout_s=20.0))
    )

    # Every request has exactly one outcome, and it is a 2xx.
    assert result.skipped == 0
    assert sorted(o.index for o in result.outcomes) == list(range(30))
    bad = [(o.index, o.outcome, o.status, o.error) for o in result.outcomes if o.outcome != "2xx"]
    assert not bad, (bad, dump_logs(fleet))
    assert sum(result.clusters.values()) == 30
    assert set(result.clusters) <= set(fleet.sim_specs)

    # Each session on one cluster: the one the processor's own core predicts.
    runtime = load_runtime(fleet.fleet_path)
    by_session: dict[str, set[str]] = defaultdict(set)
    for outcome in result.outcomes:
        request: ReplayRequest = requests[outcome.index]
        assert request.session_id is not None and outcome.served_by is not None
        headers = {"x-session-id": request.session_id} if request.send_session_header else {}
        body = orjson.dumps(request.materialize())
        predicted = placement_for(runtime, request.path, body, headers).primary
        assert outcome.served_by == predicted, (outcome, predicted)
        by_session[request.session_id].add(outcome.served_by)
    assert all(len(c) == 1 for c in by_session.values()), dict(by_session)
    assert len({next(iter(c)) for c in by_session.values()}) >= 2, "all sessions on one cluster"

    # Each request found exactly the blocks its session left in that cluster's cache.
    ordered = trace.requests  # arrival order, as the replayer indexes them
    sessions: dict[int, list[int]] = defaultdict(list)
    for index, trace_request in enumerate(ordered):
        sessions[trace_request.session].append(index)
    for indexes in sessions.values():
        expected = _expected_cached_blocks([ordered[i].hash_ids for i in indexes])
        for index, blocks in zip(indexes, expected, strict=True):
            outcome = result.outcomes[index]
            assert outcome.index == index
            assert outcome.cached_tokens == BLOCK_TOKENS * blocks, (ordered[index], outcome)
    assert result.hit_ratio is not None
    assert abs(result.hit_ratio - ideal_hit_ratio(ordered)) < 0.01
