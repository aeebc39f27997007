"""A config reload neither un-budgets nor double-budgets running requests (issue 14, the chaos
table's reload row): the admission gate and its ledgers outlive runtimes, so what requests hold
stays held across a swap, and a changed budget applies to the same count of running requests.
Through the service's own reload, on its in-memory ledger."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from extproc.config import load_runtime
from extproc.pipeline.explain import request_headers
from extproc.pipeline.outcomes import Rejected, Routed
from extproc.serve import service as service_module
from extproc.serve.service import ServeOptions, Service
from tests.support.flow import NO_PLACEMENT, refused_at_once

CHAT = "/v1/chat/completions"
BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


def fleet(clusters: list[str], budget: int) -> dict[str, Any]:
    return {
        "version": 1,
        # Nothing listens there: no probing, so a dead endpoint does not move placement.
        "processor": {"probe_clusters": False},
        "clusters": [
            {"name": c, "endpoints": [f"127.0.0.1:{9 + i}"]} for i, c in enumerate(clusters)
        ],
        "classes": refused_at_once([{"name": "short", "budget": {"max_concurrent": budget}}]),
        "flow": NO_PLACEMENT,
        # Sessions are picked by their hash primary: the tests are about budgets across a
        # reload, not balance (bounded placement of new sessions would spill some of them).
        "affinity": {"balance_factor": 0},
    }


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[Service]:
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(fleet(["c1", "c2"], 2)))
    svc = Service(ServeOptions(str(path)), load_runtime(path), path.read_bytes())
    try:
        yield svc
    finally:
        await svc.gate.close()
        await svc.pipeline.aclose()


async def primary(svc: Service, session: str) -> object:
    return (await svc.explain(CHAT, {"x-session-id": session}, BODY))["primary"]


async def decide(svc: Service, session: str) -> Routed | Rejected:
    headers = request_headers(CHAT, {"x-session-id": session})
    outcome = await svc.pipeline.decide(headers, BODY, svc.clock())
    assert isinstance(outcome, (Routed, Rejected)), outcome
    return outcome


def write(svc: Service, clusters: list[str], budget: int) -> None:
    Path(svc.opts.config_path).write_text(yaml.safe_dump(fleet(clusters, budget)))


async def reload(svc: Service, clusters: list[str], budget: int) -> None:
    write(svc, clusters, budget)
    assert await svc.reload()


async def test_a_reload_keeps_running_requests_budgeted(service: Service) -> None:
    # Sessions on c1 before and after c3 is added (rendezvous hashing moves only the sessions
    # the new cluster wins), found on the new config, then served on the old one.
    await reload(service, ["c1", "c2", "c3"], 2)
    stay = [s for s in (f"s{i}" for i in range(80)) if await primary(service, s) == "c1"]
    await reload(service, ["c1", "c2"], 2)
    stay = [s for s in stay if await primary(service, s) == "c1"]
    assert len(stay) >= 4, stay
    running = [await decide(service, s) for s in stay[:2]]
    assert all(isinstance(r, Routed) and r.hold.ticket is not None for r in running)
    assert isinstance(await decide(service, stay[2]), Rejected)  # c1's budget is full

    # A reload that adds a cluster: c1's two running requests still hold its budget.
    await reload(service, ["c1", "c2", "c3"], 2)
    assert service.gate.held == 2
    assert isinstance(await decide(service, stay[2]), Rejected)

    # One ends: exactly one more is admitted.
    first = running.pop(0)
    assert isinstance(first, Routed)
    await service.pipeline.release(first.hold)
    again = await decide(service, stay[2])
    assert isinstance(again, Routed)
    running.append(again)
    assert isinstance(await decide(service, stay[3]), Rejected)

    # A reload that raises the budget to 3 and removes a cluster: the running two count
    # against the new budget, so one more is admitted, not three.
    await reload(service, ["c1", "c3"], 3)
    assert await primary(service, stay[3]) == "c1"
    extra = await decide(service, stay[3])
    assert isinstance(extra, Routed)
    running.append(extra)
    assert isinstance(await decide(service, stay[4] if len(stay) > 4 else stay[0]), Rejected)
    for r in running:
        assert isinstance(r, Routed)
        await service.pipeline.release(r.hold)
    assert service.gate.held == 0


async def test_the_reload_compiles_off_the_event_loop(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compile runs in a worker thread, so decisions keep flowing while it runs (the chaos
    reload row failed requests open when the loop was blocked on a starved machine)."""
    threads: list[int] = []
    compile_runtime = service_module.runtime_from_bytes

    def spy(*args: Any) -> Any:
        threads.append(threading.get_ident())
        return compile_runtime(*args)

    monkeypatch.setattr(service_module, "runtime_from_bytes", spy)
    await reload(service, ["c1", "c2", "c3"], 2)
    assert threads and threading.get_ident() not in threads
    assert isinstance(await decide(service, "after-reload"), Routed)


# How long a step may take before the test calls it hung: generous, for a starved machine.
HANG_S = 60.0


async def test_decisions_are_answered_while_each_step_of_a_reload_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each piece of a reload's own work (the compile, the CDS union, the final CDS) is held
    until a decision made meanwhile has been answered: a step that ran on the event loop would
    hold the loop too, and the decision would wait for it (Envoy fails such requests open after
    its message timeout). Order only: nothing here depends on how fast the machine is."""
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(fleet(["c1", "c2"], 2)))
    opts = ServeOptions(str(path), envoy_cds_path=str(tmp_path / "cds.yaml"), cds_settle_s=0.0)
    svc = Service(opts, load_runtime(path), path.read_bytes())
    steps = ("runtime_from_bytes", "write_cds_union", "write_cds")
    entered = {step: threading.Event() for step in steps}
    go_on = {step: threading.Event() for step in steps}

    def held(step: str) -> Any:
        real = getattr(service_module, step)

        def run(*args: Any) -> Any:
            entered[step].set()
            assert go_on[step].wait(HANG_S), f"{step} never let go"
            return real(*args)

        return run

    for step in steps:
        monkeypatch.setattr(service_module, step, held(step))
    try:
        write(svc, ["c1", "c2", "c3"], 2)
        reloading = asyncio.create_task(svc.reload())
        for step in steps:
            assert await asyncio.to_thread(entered[step].wait, HANG_S), f"{step} never ran"
            answered = await asyncio.wait_for(decide(svc, f"during-{step}"), HANG_S)
            assert not reloading.done()  # the step is still held: answered meanwhile
            assert isinstance(answered, Routed), answered
            await svc.pipeline.release(answered.hold)
            go_on[step].set()
        assert await asyncio.wait_for(reloading, HANG_S)
        assert svc.holder.current.cluster_names == ("c1", "c2", "c3")
        assert svc.gate.held == 0
    finally:
        for event in go_on.values():
            event.set()
        await svc.gate.close()
        await svc.pipeline.aclose()
