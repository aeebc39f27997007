"""The picker's endpoint prober: a refused connection takes an endpoint out at once, a failed
probe (timeout, error status) only at the second failure in a row."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import yaml
from aiohttp import web

from extproc.config import load_runtime
from extproc.harness.launch import free_port
from extproc.pipeline.endpoint_health import EndpointHealth
from extproc.serve.service import ServeOptions, Service


async def _health_server(slow: dict[str, bool]) -> tuple[web.AppRunner, str]:
    """A /health endpoint that answers after 1 s while ``slow["on"]``; (runner, address)."""

    async def health(_request: web.Request) -> web.Response:
        if slow["on"]:
            await asyncio.sleep(1.0)
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    # No keep-alive grace on cleanup: the prober holds a pooled connection to the server.
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"127.0.0.1:{port}"


async def test_refused_is_out_at_once_a_slow_probe_only_twice_in_a_row() -> None:
    slow = {"on": False}
    runner, live = await _health_server(slow)
    dead = f"127.0.0.1:{free_port()}"  # nothing listens
    prober = EndpointHealth({"c1": (live, dead)}, {}, interval_s=3600, timeout_s=0.2)
    try:
        await prober.start()
        assert prober.ready == frozenset({live})
        slow["on"] = True
        await prober.probe_all()
        assert prober.ready == frozenset({live})  # one timeout: still ready
        await prober.probe_all()
        assert prober.ready == frozenset()  # the second in a row: out
        slow["on"] = False
        await prober.probe_all()
        assert prober.ready == frozenset({live})  # one success: back
        await runner.cleanup()  # now refused
        await prober.probe_all()
        assert prober.ready == frozenset()  # refused: out at once
    finally:
        await prober.close()
        await runner.cleanup()


async def test_a_flapping_probe_never_takes_a_live_endpoint_out() -> None:
    """Health flapping under load (every other probe times out) moves no traffic: only two
    failures in a row take an answering endpoint out, and one success resets the count."""
    slow = {"on": False}
    runner, live = await _health_server(slow)
    prober = EndpointHealth({"c1": (live,)}, {}, interval_s=3600, timeout_s=0.2)
    try:
        await prober.start()
        seen = []
        for round_no in range(8):
            slow["on"] = round_no % 2 == 0
            await prober.probe_all()
            seen.append(live in prober.ready)
        assert seen == [True] * 8
    finally:
        await prober.close()
        await runner.cleanup()


def _write(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


async def test_a_reload_that_adds_the_first_budget_starts_probing(tmp_path: Path) -> None:
    """processor.probe_clusters is on by default once a class has a budget; a reload that adds
    the first budget starts the prober (it used to wait for a restart), and a reload that turns
    probing off stops it. Seen through the decision: a session hashed to a cluster whose only
    endpoint is dead is placed on the live one only while probing is on."""
    runner, live = await _health_server({"on": False})
    dead = f"127.0.0.1:{free_port()}"  # nothing listens
    doc: dict[str, Any] = {
        "version": 1,
        "clusters": [{"name": "c1", "endpoints": [dead]}, {"name": "c2", "endpoints": [live]}],
        "classes": [{"name": "short"}],
    }
    path = tmp_path / "fleet.yaml"
    _write(path, doc)
    service = Service(ServeOptions(str(path)), load_runtime(path), path.read_bytes())
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})

    async def primary(session: str) -> object:
        headers = {"x-session-id": session, "content-type": "application/json"}
        return (await service.explain("/v1/chat/completions", headers, body))["primary"]

    try:
        assert service.endpoint_health is None  # no budget: no probing
        hashed = [s for s in (f"s{i}" for i in range(64)) if await primary(s) == "c1"]
        assert hashed, "no session hashed to c1"
        session = hashed[0]

        doc["classes"] = [{"name": "short", "budget": {"max_concurrent": 4}}]
        _write(path, doc)
        assert await service.reload()
        assert service.endpoint_health is not None
        assert service.endpoint_health.ready == frozenset({live})  # probed before serving
        assert await primary(session) == "c2"

        doc["processor"] = {"probe_clusters": False}
        _write(path, doc)
        assert await service.reload()
        assert service.endpoint_health is None
        assert await primary(session) == "c1"
    finally:
        if service.endpoint_health is not None:
            await service.endpoint_health.close()
        await service.gate.close()
        await service.pipeline.aclose()
        await runner.cleanup()
