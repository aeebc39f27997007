"""The seam the protocol shell talks to (extproc/pipeline/exchange.py), driven directly: each
exchange keeps what its request holds and gives it back once; the decision at the headers and
at the body; the modes the stream asks Envoy for follow the runtime served."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import orjson
from prometheus_client import CollectorRegistry

from extproc.config import compile_runtime, parse_config
from extproc.core.api import BadRequest
from extproc.ledger.gate import build_gate
from extproc.pipeline.exchange import Passthrough, Rejected, Routed, Waiting
from extproc.pipeline.metrics import Metrics
from extproc.pipeline.pipeline import Pipeline, RuntimeHolder
from tests.support.flow import NO_PLACEMENT, refused_at_once

CHAT = "/v1/chat/completions"
BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


def doc(classes: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "version": 1,
        "clusters": [{"name": f"c{i}", "endpoints": [f"127.0.0.1:80{i:02d}"]} for i in (1, 2)],
        "classes": classes or refused_at_once([{"name": "one", "budget": {"max_concurrent": 1}}]),
        "flow": NO_PLACEMENT,
        **extra,
    }


def headers(sid: str, *, sized: bool = False) -> dict[str, str]:
    out = {
        ":method": "POST",
        ":path": CHAT,
        "content-type": "application/json",
        "x-session-id": sid,
    }
    if sized:
        out["content-length"] = str(len(BODY))
    return out


def build(config: dict[str, Any]) -> tuple[Pipeline, Any]:
    runtime = compile_runtime(parse_config(config))
    registry = CollectorRegistry()
    gate = build_gate(runtime, registry, time.monotonic, random.Random(1))
    return Pipeline(RuntimeHolder(runtime), Metrics(registry), gate), gate


async def test_an_exchange_gives_back_what_its_request_holds_once() -> None:
    pipeline, gate = build(doc())
    try:
        first = pipeline.exchange()
        # No content-length: the body is needed (a chunked upload), the decision waits for it.
        assert await first.at_headers(headers("a"), 1.0, body_follows=True) is None
        assert first.api is not None and not first.holds
        routed = await first.at_body(BODY, 1.0)
        assert isinstance(routed, Routed)
        assert first.holds and gate.held == 1
        assert first.response_headers  # a budget: the response headers are read
        # The same session: the same primary, whose budget the first one fills.
        second = pipeline.exchange()
        assert await second.at_headers(headers("a"), 1.1, body_follows=True) is None
        refused = await second.at_body(BODY, 1.1)
        assert isinstance(refused, Rejected) and refused.reject.status == 429
        assert not second.holds and second.response_headers == ()
        await first.release()
        assert not first.holds and gate.held == 0
        await first.release()  # once: nothing more is given back
        assert gate.held == 0
        third = pipeline.exchange()
        assert await third.at_headers(headers("a"), 1.2, body_follows=True) is None
        assert isinstance(await third.at_body(BODY, 1.2), Routed)
        assert gate.held == 1
        await third.release()
        assert gate.held == 0
    finally:
        await pipeline.aclose()
        await gate.close()


async def test_what_the_headers_decide_and_what_waits_for_the_body() -> None:
    pipeline, gate = build(doc())
    try:
        other = pipeline.exchange()
        get = {":method": "GET", ":path": "/healthz"}
        assert isinstance(await other.at_headers(get, 0.0, body_follows=False), Passthrough)
        assert other.api is None and not other.holds
        bodiless = pipeline.exchange()
        empty = await bodiless.at_headers(headers("a"), 0.0, body_follows=False)
        assert isinstance(empty, BadRequest) and empty.status == 400
        assert bodiless.api is None  # decided on the headers alone
        # The header path: a session header and a content-length, decided at the headers.
        early = pipeline.exchange()
        decided = await early.at_headers(headers("a", sized=True), 0.0, body_follows=True)
        assert isinstance(decided, Routed) and early.holds and gate.held == 1
        await early.release()
        assert gate.held == 0
        # A body in pieces is refused, not hashed truncated.
        pieces = pipeline.exchange()
        assert await pieces.at_headers(headers("b"), 0.0, body_follows=True) is None
        partial = await pieces.at_body(BODY[:5], 0.0, whole=False)
        assert isinstance(partial, BadRequest) and partial.status == 413
        assert not pieces.holds and gate.held == 0
    finally:
        await pipeline.aclose()
        await gate.close()


async def test_a_queued_request_is_held_by_its_exchange_once_admitted() -> None:
    queued = [{"name": "one", "budget": {"max_concurrent": 1}, "wait": {"max_wait_s": 30}}]
    pipeline, gate = build(doc(queued))
    try:
        first = pipeline.exchange()
        assert await first.at_headers(headers("a"), 0.0, body_follows=True) is None
        assert isinstance(await first.at_body(BODY, 0.0), Routed)
        second = pipeline.exchange()
        assert await second.at_headers(headers("a"), 0.1, body_follows=True) is None
        waiting = await second.at_body(BODY, 0.1)
        assert isinstance(waiting, Waiting) and not second.holds
        resumed = asyncio.ensure_future(waiting.resume())
        await first.release()
        outcome = await asyncio.wait_for(resumed, 30)
        assert isinstance(outcome, Routed) and second.holds and gate.held == 1
        await second.release()
        assert gate.held == 0
    finally:
        await pipeline.aclose()
        await gate.close()


def test_the_modes_follow_the_runtime_served() -> None:
    budgeted = compile_runtime(parse_config(doc()))
    plain = compile_runtime(
        parse_config(doc([{"name": "any"}], processor={"envoy_graceful_close": True}))
    )
    pipeline = Pipeline(RuntimeHolder(budgeted), Metrics(CollectorRegistry()))
    exchange = pipeline.exchange()
    modes = exchange.modes
    assert modes.response_phases and not modes.end_when_routed
    assert exchange.modes is modes  # one value per runtime: the shell caches by it
    pipeline.use(plain)
    assert not exchange.modes.response_phases and exchange.modes.end_when_routed
    assert exchange.modes is not modes
