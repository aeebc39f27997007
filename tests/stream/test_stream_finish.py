"""A routed exchange that holds nothing and reads no response ends its stream at its answer.

ext_proc lets the processor close the stream when it needs no more messages; Envoy then marks
the exchange's processing complete and sends nothing further. A fleet without budgets,
affinity, usage or P/D (Runtime.response_phases false) needs nothing after the routing answer,
so the servicer returns OK right after it instead of waiting for Envoy's half-close (one read
and one exchange fewer per request). With anything held or read later, the stream lasts as
long as the exchange, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2

from extproc.protocol import responses
from tests.stream import test_servicer
from tests.stream.test_servicer import (
    CHAT,
    STEP_TIMEOUT,
    Processor,
    body_msg,
    chat,
    headers_msg,
    routed,
)

start = test_servicer.start
PM = processing_mode_pb2.ProcessingMode


def placement_only(**processor: Any) -> dict[str, Any]:
    """Sessions placed over two clusters, no budgets, nothing read from responses."""
    return {
        "version": 1,
        "processor": processor,
        "clusters": [{"name": f"c{i}", "endpoints": [f"127.0.0.1:80{i:02d}"]} for i in (1, 2)],
    }


async def _ends_with_ok_unprompted(call: Any) -> None:
    """The server ends the call by itself: the client never half-closed."""
    assert await asyncio.wait_for(call.read(), STEP_TIMEOUT) is grpc.aio.EOF
    assert await asyncio.wait_for(call.code(), STEP_TIMEOUT) == grpc.StatusCode.OK


async def test_the_header_path_ends_the_stream_after_its_routing_answer(
    start: Callable[..., Awaitable[Processor]],
) -> None:
    proc = await start(doc=placement_only())
    assert not proc.runtime.response_phases and proc.runtime.decide_at_headers
    body = chat("hello")
    extra = {"x-session-id": "agent-1", "content-length": str(len(body))}
    call = proc.stub.Process()
    await asyncio.wait_for(call.write(headers_msg(CHAT, extra=extra)), STEP_TIMEOUT)
    answer = await asyncio.wait_for(call.read(), STEP_TIMEOUT)
    assert answer.request_headers.response.clear_route_cache
    assert answer.mode_override.request_body_mode == PM.NONE
    await _ends_with_ok_unprompted(call)
    assert proc.sample("fleet_header_decisions_total") == 1
    assert proc.sample("fleet_extproc_streams_cancelled_total") == 0


async def test_the_body_path_keeps_the_stream_to_envoys_half_close(
    start: Callable[..., Awaitable[Processor]],
) -> None:
    """Changed in session 5 (the body path ended its stream at its answer too): ended before the
    peer's half-close, the request message holding the body stayed in grpc.aio's reference
    cycles until the cyclic GC ran, hundreds of MB for multi-MiB bodies (BENCHMARKS.md, "Large
    bodies and the allocator"). The body path waits for the half-close, as before."""
    proc = await start(doc=placement_only(read_body="always"))
    call = proc.stub.Process()
    await asyncio.wait_for(call.write(headers_msg(CHAT)), STEP_TIMEOUT)
    first = await asyncio.wait_for(call.read(), STEP_TIMEOUT)
    assert first.WhichOneof("response") == "request_headers"  # waits for the body
    await asyncio.wait_for(call.write(body_msg(chat("hello"))), STEP_TIMEOUT)
    routed(await asyncio.wait_for(call.read(), STEP_TIMEOUT))
    # Still open: a further message is answered.
    await asyncio.wait_for(call.write(body_msg(b"{}")), STEP_TIMEOUT)
    assert await asyncio.wait_for(call.read(), STEP_TIMEOUT) == responses.CONTINUE_BODY
    await asyncio.wait_for(call.done_writing(), STEP_TIMEOUT)
    await _ends_with_ok_unprompted(call)


async def test_a_refusal_or_a_held_budget_keeps_the_stream_open(
    start: Callable[..., Awaitable[Processor]],
) -> None:
    """Not finished: a refusal decided at the headers answers the body message that follows,
    and a budgeted exchange (the canonical fleet) is released only at the stream's end."""
    proc = await start(doc=placement_only())
    too_big = {"x-session-id": "a", "content-length": str(proc.max_body_bytes + 1)}
    call = proc.stub.Process()
    await asyncio.wait_for(call.write(headers_msg(CHAT, extra=too_big)), STEP_TIMEOUT)
    await asyncio.wait_for(call.read(), STEP_TIMEOUT)
    await asyncio.wait_for(call.write(body_msg(b"{}")), STEP_TIMEOUT)
    refused = await asyncio.wait_for(call.read(), STEP_TIMEOUT)
    assert refused.immediate_response.status.code == 413
    await asyncio.wait_for(call.done_writing(), STEP_TIMEOUT)
    await _ends_with_ok_unprompted(call)

    budgeted = await start()
    assert budgeted.runtime.response_phases
    body = chat("hello")
    extra = {"x-session-id": "agent-2", "content-length": str(len(body))}
    call = budgeted.stub.Process()
    await asyncio.wait_for(call.write(headers_msg(CHAT, extra=extra)), STEP_TIMEOUT)
    answer = await asyncio.wait_for(call.read(), STEP_TIMEOUT)
    assert answer.mode_override.request_body_mode == PM.NONE
    # Still open: a further message is answered (a body sent anyway passes).
    await asyncio.wait_for(call.write(body_msg(body)), STEP_TIMEOUT)
    assert await asyncio.wait_for(call.read(), STEP_TIMEOUT) == responses.CONTINUE_BODY
    await asyncio.wait_for(call.done_writing(), STEP_TIMEOUT)
    await _ends_with_ok_unprompted(call)


async def test_without_the_graceful_close_the_stream_waits_for_envoy(
    start: Callable[..., Awaitable[Processor]],
) -> None:
    """An Envoy that resets at the exchange's end: a status sent as the reset arrives is the
    grpc.aio leak the servicer avoids (ENVOY_RESET_LINGER_S), so the stream stays open."""
    proc = await start(doc=placement_only(envoy_graceful_close=False))
    body = chat("hello")
    extra = {"x-session-id": "agent-3", "content-length": str(len(body))}
    call = proc.stub.Process()
    await asyncio.wait_for(call.write(headers_msg(CHAT, extra=extra)), STEP_TIMEOUT)
    await asyncio.wait_for(call.read(), STEP_TIMEOUT)
    await asyncio.wait_for(call.write(body_msg(body)), STEP_TIMEOUT)
    assert await asyncio.wait_for(call.read(), STEP_TIMEOUT) == responses.CONTINUE_BODY
    await asyncio.wait_for(call.done_writing(), STEP_TIMEOUT)
    await _ends_with_ok_unprompted(call)
