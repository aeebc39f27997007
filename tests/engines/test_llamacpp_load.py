"""Load signals from real llama.cpp servers: a backlog on one engine (requests deferred for lack
of a slot, read from its own /metrics by the processor's scraper, no load header anywhere)
moves new sessions off its cluster and keeps the sessions already there."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from extproc.config import load_runtime
from extproc.harness.launch import wait_until
from extproc.harness.real_engines.fleet import RealFleet
from tests.e2e.predict import placement_for
from tests.engines.conftest import (
    TINY,
    StreamHog,
    llamacpp_fleet,
    metric_value,
    processor_sum,
    served,
    tiny_spec,
)

MakeOpenAI = Callable[[RealFleet], openai.OpenAI]
CHAT = "/v1/chat/completions"
BACKLOGGED = "c1"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[RealFleet]:
    with llamacpp_fleet(
        tmp_path_factory.mktemp("load"),
        tiny_spec(tiny_model),
        fleet_overrides={
            "affinity": {
                "enabled": True,
                "load_from_response_headers": False,
                "signal_max_age_s": 30,
            },
            "engine_metrics": {"enabled": True, "interval_ms": 100, "max_age_ms": 2000},
        },
    ) as running:
        yield running


def _body(text: str) -> dict[str, object]:
    return {"model": TINY, "messages": [{"role": "user", "content": text}], "max_tokens": 2}


def _sessions_on(fleet: RealFleet, cluster: str, count: int, tag: str) -> list[str]:
    assert fleet.stack is not None
    runtime = load_runtime(fleet.stack.fleet_path)
    found, i = [], 0
    while len(found) < count:
        sid = f"{tag}-{i}"
        i += 1
        headers = {"x-session-id": sid}
        if (
            placement_for(runtime, CHAT, b'{"model":"tiny","messages":[]}', headers).primary
            == cluster
        ):
            found.append(sid)
    return found


def _turn(client: openai.OpenAI, sid: str, turn: int) -> str:
    chat = client.chat.completions.create(
        model=TINY,
        messages=[{"role": "user", "content": f"Turn {turn} of session {sid}."}],
        max_tokens=2,
        extra_headers={"x-session-id": sid},
    )
    return chat.choices[0].message.content or ""


def test_a_backlog_on_one_engine_moves_new_sessions_and_keeps_old_ones(
    fleet: RealFleet, openai_client: MakeOpenAI
) -> None:
    client = openai_client(fleet)
    hogged = fleet.engine(f"{BACKLOGGED}-e1")
    # Sessions already on the backlogged cluster, on its other engine (one on the backlogged
    # engine would wait for a slot behind the backlog).
    old: list[str] = []
    for sid in _sessions_on(fleet, BACKLOGGED, 12, "old"):
        if served(fleet, lambda sid=sid: _turn(client, sid, 0))[1] == f"{BACKLOGGED}-e2":
            old.append(sid)
        if len(old) == 3:
            break
    assert old
    slots = 2
    hog = StreamHog(hogged.port, 3 * slots, max_tokens=3000)
    try:

        def backlog_seen() -> bool:
            page = hogged.metrics_text()
            deferred = metric_value(page, "llamacpp:requests_deferred")
            scraped = processor_sum(fleet, "fleet_cluster_queue_depth", cluster=BACKLOGGED)
            return deferred >= 2 * slots and scraped >= 2 * slots

        wait_until(backlog_seen, 60, "the backlog in the engine's /metrics and in the scrape", 0.1)
        spilled_before = processor_sum(fleet, "fleet_route_decisions_total", kind="spilled")
        new = _sessions_on(fleet, BACKLOGGED, 6, "new")
        moved = [served(fleet, lambda sid=sid: _turn(client, sid, 0))[1] for sid in new]
        kept = [served(fleet, lambda sid=sid: _turn(client, sid, 1))[1] for sid in old]
    finally:
        hog.close()
    assert not [e for e in moved if e.startswith(BACKLOGGED + "-")], moved
    assert kept == [f"{BACKLOGGED}-e2"] * len(old), kept
    spilled = processor_sum(fleet, "fleet_route_decisions_total", kind="spilled") - spilled_before
    assert spilled >= len(new)
    assert processor_sum(fleet, "fleet_load_reports_total", source="orca") == 0
    assert processor_sum(fleet, "fleet_load_reports_total", source="scrape") > 0

    def drained() -> bool:
        return metric_value(hogged.metrics_text(), "llamacpp:requests_processing") == 0

    wait_until(drained, 60, "the engine to cancel the dropped backlog", 0.2)
