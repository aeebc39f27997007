"""How a stream ends while its request waits for budget (ARCHITECTURE.md, "End of a stream").

A graceful Envoy ends an aborted request's ext_proc stream with a half-close, and resets it only
when its remote-close timer (1 s) runs out. A request queued by flow control does not read its
stream while it waits; the servicer watches for that half-close meanwhile, so the waiter leaves
the queue at the client's abort, not at Envoy's later reset. Here the peer half-closes and never
resets: without the watch the wait would run to its 60 s maximum.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from extproc.protocol.server import FleetProcessor
from tests.stream.test_flow import BODY, CHAT, doc, make, sample, session_on
from tests.stream.test_servicer import STEP_TIMEOUT, body_msg, headers_msg, routed

WAIT_S = 60.0  # the longest wait: far beyond every step's timeout


@pytest.fixture
async def served() -> AsyncIterator[tuple[Any, Any, Any, str]]:
    pipeline, gate, registry = await make(doc(wait_s=WAIT_S))
    server = grpc.aio.server()
    ep_grpc.add_ExternalProcessorServicer_to_server(FleetProcessor(pipeline), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    sid = session_on(pipeline, "c1", "leaver")
    try:
        yield ep_grpc.ExternalProcessorStub(channel), gate, registry, sid
    finally:
        await channel.close()
        await server.stop(None)
        await gate.close()


async def _holding(stub: Any, sid: str) -> Any:
    """A stream whose request was admitted: it holds the class's one slot until it ends."""
    call = stub.Process()
    extra = {"x-session-id": sid, "x-tenant": "t"}
    await asyncio.wait_for(call.write(headers_msg(CHAT, extra=extra)), STEP_TIMEOUT)
    await asyncio.wait_for(call.read(), STEP_TIMEOUT)
    await asyncio.wait_for(call.write(body_msg(BODY)), STEP_TIMEOUT)
    routed(await asyncio.wait_for(call.read(), STEP_TIMEOUT))
    return call


async def _released(gate: Any) -> bool:
    """Whether every hold is given back within a bounded wait (the release runs as the stream
    ends, after the status the client saw)."""
    for _ in range(200):
        if gate.held == 0:
            return True
        await asyncio.sleep(0.05)
    return False


async def _queued(stub: Any, sid: str) -> Any:
    """A stream whose request waits for budget: headers answered, the body's answer pending
    behind the message-timer extension flow control sends first."""
    call = stub.Process()
    extra = {"x-session-id": sid, "x-tenant": "t"}  # no content-length: the body path
    await asyncio.wait_for(call.write(headers_msg(CHAT, extra=extra)), STEP_TIMEOUT)
    await asyncio.wait_for(call.read(), STEP_TIMEOUT)
    await asyncio.wait_for(call.write(body_msg(BODY)), STEP_TIMEOUT)
    extension = await asyncio.wait_for(call.read(), STEP_TIMEOUT)
    assert extension.HasField("override_message_timeout"), extension
    return call


async def test_a_half_close_while_waiting_for_budget_leaves_the_queue_at_once(
    served: tuple[Any, Any, Any, str],
) -> None:
    stub, gate, registry, sid = served
    holder = await _holding(stub, sid)
    waiter = await _queued(stub, sid)
    assert len(gate.waiters) == 1
    await asyncio.wait_for(waiter.done_writing(), STEP_TIMEOUT)  # the client aborted
    assert await asyncio.wait_for(waiter.code(), STEP_TIMEOUT) == grpc.StatusCode.OK
    assert len(gate.waiters) == 0
    assert sample(registry, "fleet_flow_waits_total", request_class="long", result="cancelled") == 1
    assert gate.held == 1, "only the holder's request is held"
    await asyncio.wait_for(holder.done_writing(), STEP_TIMEOUT)
    assert await asyncio.wait_for(holder.code(), STEP_TIMEOUT) == grpc.StatusCode.OK
    assert await _released(gate)


async def test_a_waiter_admitted_before_any_half_close_is_answered_and_released(
    served: tuple[Any, Any, Any, str],
) -> None:
    """The watch does not disturb an ordinary wait: the release admits the waiter, which gets
    its routing answer, and its own end releases it."""
    stub, gate, registry, sid = served
    holder = await _holding(stub, sid)
    waiter = await _queued(stub, sid)
    await asyncio.wait_for(holder.done_writing(), STEP_TIMEOUT)  # the holder ends: a release
    assert await asyncio.wait_for(holder.code(), STEP_TIMEOUT) == grpc.StatusCode.OK
    routed(await asyncio.wait_for(waiter.read(), STEP_TIMEOUT))
    assert sample(registry, "fleet_flow_waits_total", request_class="long", result="admitted") == 1
    assert gate.held == 1
    await asyncio.wait_for(waiter.done_writing(), STEP_TIMEOUT)
    assert await asyncio.wait_for(waiter.read(), STEP_TIMEOUT) is grpc.aio.EOF
    assert await asyncio.wait_for(waiter.code(), STEP_TIMEOUT) == grpc.StatusCode.OK
    assert await _released(gate)
