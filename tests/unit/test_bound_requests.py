"""The share bound of the product default (affinity off, ``balance_factor`` 1.1) counts
requests, not sessions: every turn the pipeline places adds to its cluster's decayed count, so a
cluster busy with long conversations takes fewer new sessions, while the conversations it holds
never move for balance (their cache is there). Driven through the real pipeline."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

import orjson
from prometheus_client import CollectorRegistry

from extproc.config import compile_runtime, parse_config
from extproc.config.runtime import DEFAULT_BALANCE_FACTOR
from extproc.core.keys import KeySource, hash_key
from extproc.pipeline.metrics import Metrics
from extproc.pipeline.outcomes import Routed
from extproc.pipeline.pipeline import Pipeline, RuntimeHolder

CLUSTERS = 4
BODY = orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})


def pipeline(balance_factor: float | None = None) -> Pipeline:
    data: dict[str, Any] = {
        "version": 1,
        "clusters": [
            {"name": f"c{i}", "endpoints": [f"127.0.0.1:{9000 + i}"]} for i in range(CLUSTERS)
        ],
    }
    if balance_factor is not None:
        data["affinity"] = {"balance_factor": balance_factor}
    return Pipeline(
        RuntimeHolder(compile_runtime(parse_config(data, "t.yaml"))), Metrics(CollectorRegistry())
    )


def sessions_on(pipe: Pipeline, cluster: str, tag: str, count: int) -> list[str]:
    """``count`` session ids whose hash primary is ``cluster``."""
    order = pipe.runtime.policy.placers["short"]
    found = []
    for i in range(100_000):
        sid = f"{tag}-{i}"
        if order.ranked(hash_key(KeySource.HEADER, sid.encode()).point)[0] == cluster:
            found.append(sid)
            if len(found) == count:
                return found
    raise AssertionError(f"no {count} sessions hash to {cluster}")


async def place(pipe: Pipeline, sid: str, now: float) -> tuple[str, str]:
    headers = {
        ":method": "POST",
        ":path": "/v1/chat/completions",
        "content-type": "application/json",
        "x-session-id": sid,
    }
    outcome = await pipe.decide(headers, BODY, now)
    assert isinstance(outcome, Routed), outcome
    await pipe.release(outcome.hold)
    return outcome.route.placement.primary, outcome.kind


def test_a_cluster_busy_with_long_conversations_takes_fewer_new_sessions() -> None:
    """c0 holds 4 conversations of 9 turns (13 by the end), every other cluster 8 of one turn:
    by sessions c0 is under its share (a bound counting sessions would start new ones there),
    by requests far over it. New sessions that hash to c0 start elsewhere, and every turn of
    the long conversations stays on c0."""
    pipe = pipeline()
    assert pipe.runtime.affinity.balance_factor == DEFAULT_BALANCE_FACTOR
    held = {f"c{i}": sessions_on(pipe, f"c{i}", f"held{i}", 8) for i in range(1, CLUSTERS)}
    held["c0"] = sessions_on(pipe, "c0", "held0", 4)
    fresh = sessions_on(pipe, "c0", "fresh", 12)

    async def run() -> tuple[Counter[str], Counter[str]]:
        now = 0.0
        served: Counter[str] = Counter()

        async def turn(sid: str, cluster: str) -> None:
            nonlocal now
            now += 0.1
            assert await place(pipe, sid, now) == (cluster, "primary")
            served[cluster] += 1

        # Round by round, as conversations interleave: c0's four start in the first four rounds,
        # then go on talking while the other clusters' conversations start.
        for r in range(8):
            for cluster in ("c1", "c2", "c3"):
                await turn(held[cluster][r], cluster)
            for sid in held["c0"][r : r + 1] if r < 4 else held["c0"]:
                await turn(sid, "c0")
        for _ in range(4):
            for sid in held["c0"]:
                await turn(sid, "c0")
        started: Counter[str] = Counter()
        for i, sid in enumerate(fresh):
            now += 0.1
            where, kind = await place(pipe, sid, now)
            started[where] += 1
            assert kind == ("primary" if where == "c0" else "spilled")
            # The long conversations go on beside the new sessions, on their cluster.
            if i % 3 == 0:
                for held_sid in held["c0"]:
                    await turn(held_sid, "c0")
        return served, started

    served, started = asyncio.run(run())
    assert served["c0"] == 52 and served["c1"] == served["c2"] == served["c3"] == 8
    # c0 holds 36 to 52 of 60 to 88 recent requests: over 1.1 x the mean (at most 25) the whole
    # time, so none of the twelve new sessions that hash to it starts there.
    assert started["c0"] == 0
    assert sum(started.values()) == len(fresh)


def test_with_the_bound_off_the_same_new_sessions_start_on_their_hash_primary() -> None:
    """The control for the test above: the spills come from the bound, not from the hash."""
    pipe = pipeline(balance_factor=0)
    fresh = sessions_on(pipe, "c0", "fresh", 12)

    async def run() -> list[str]:
        return [(await place(pipe, sid, 0.1 * i))[0] for i, sid in enumerate(fresh)]

    assert asyncio.run(run()) == ["c0"] * len(fresh)


def test_no_conversation_ever_leaves_the_cluster_of_its_first_turn() -> None:
    """Conversations of 1-12 turns, arriving and interleaving at random: the bound moves some
    new sessions off their hash primary (else this proves nothing), and every later turn of
    every conversation runs where its first did."""
    rng = random.Random(7)
    pipe = pipeline()
    arrivals: list[tuple[float, str]] = []
    for s in range(300):
        start = rng.uniform(0.0, 60.0)
        arrivals += [
            (start + t * rng.uniform(0.5, 4.0), f"conv-{s}") for t in range(rng.randint(1, 12))
        ]
    arrivals.sort()

    async def run() -> tuple[dict[str, str], Counter[str], Counter[str]]:
        first: dict[str, str] = {}
        kinds: Counter[str] = Counter()
        served: Counter[str] = Counter()
        for now, sid in arrivals:
            where, kind = await place(pipe, sid, now)
            kinds[kind] += 1
            served[where] += 1
            assert first.setdefault(sid, where) == where, (sid, kind)
        return first, kinds, served

    first, kinds, served = asyncio.run(run())
    assert kinds["spilled"] > 0
    assert kinds["spilled"] + kinds["primary"] + kinds["override"] == len(arrivals)
    assert len(first) == 300
    assert len(served) == CLUSTERS
