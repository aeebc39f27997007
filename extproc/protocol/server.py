"""The ext_proc servicer: the stream loop and the translation between protobuf and outcomes.

Every decision is the pipeline's, asked through the one exchange it opens per stream
(extproc/pipeline/exchange.py); this module reads Envoy's messages into plain headers and
bytes, and turns each outcome into the one answer extproc/protocol/responses.py builds for it.

Envoy keeps the ext_proc stream open for the whole HTTP exchange (normal end, SSE end, client
abort, upstream abort): the stream ends either as a normal close or as a cancellation, so
everything held for the request is released in ``finally``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from extproc import tracing
from extproc.pipeline.exchange import (
    BadRequest,
    Exchanges,
    ModelList,
    Modes,
    Outcome,
    Passthrough,
    Rejected,
    Routed,
    Unavailable,
    Waiting,
)
from extproc.protocol import responses
from extproc.protocol.attributes import served_address, served_cluster
from extproc.protocol.state import StreamState
from extproc.protocol.traced import record_outcome as traced_outcome
from extproc.protocol.traced import served as traced_served
from extproc.protocol.traced import with_headers
from extproc.tracing import DecisionTrace, Tracer, metadata_of

log = logging.getLogger("extproc.server")

# Body modes in which Envoy may send a request body in more than one message.
_PARTIAL_BODY_MODES = frozenset(
    {
        processing_mode_pb2.ProcessingMode.STREAMED,
        processing_mode_pb2.ProcessingMode.BUFFERED_PARTIAL,
        processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED,
        processing_mode_pb2.ProcessingMode.GRPC,
    }
)

Handler = Callable[[StreamState, Any], Awaitable[ep.ProcessingResponse | Waiting]]


def _header_map(headers: Any) -> dict[str, str]:
    # Envoy sends raw_value (bytes); older versions used value (an empty raw_value decodes to
    # "", which falls back to it). Runs for every request, over every header.
    return {h.key: h.raw_value.decode("utf-8", "replace") or h.value for h in headers.headers}


# How an ext_proc stream ends (ARCHITECTURE.md, "End of a stream"). Envoy's filter closes the
# side stream when the HTTP exchange ends (Filter::onDestroy -> closeStreamMaybeGraceful):
# - with envoy.reloadable_features.ext_proc_graceful_grpc_close (off by default in Envoy
#   1.34-1.40; the renderers turn it on with processor.envoy_graceful_close) it half-closes and
#   waits for the server's status, resetting only after its remote-close timeout (1 s default).
#   The handler returns at the half-close and the call ends with OK: no reset, no cancellation.
# - without it, closeStream() is followed at once by resetStream(). A handler that returns at
#   the half-close then makes grpc.aio send a status on a call the reset has just cancelled;
#   that batch fails, and grpc.aio leaks its grpc_op array (grpc/grpc#43360, unfixed in grpcio
#   1.85.3): ~50 B of RSS per stream with a grpc.aio client that half-closes then cancels, and
#   steady RSS growth under a long soak through Envoy. Waiting this long after the half-close
#   lets the reset end the call instead, through grpc.aio's cancellation path; through Envoy
#   1.40 that still leaves ~42 B per stream (RELIABILITY.md), which is why the graceful close
#   is the default. A peer that half-closes and waits for the status gets it this much later.
#   The reset normally arrives within a millisecond and ends the wait at once; the bound is
#   Envoy's own remote-close timeout, so a starved loop that reads the reset late still takes
#   the cancellation path rather than the leaking one.
ENVOY_RESET_LINGER_S = 1.0


async def _wait_or_leave(
    answer: Waiting, requests: AsyncIterator[ep.ProcessingRequest]
) -> tuple[Outcome | None, asyncio.Future[ep.ProcessingRequest] | None]:
    """The wait's outcome, or None when the peer half-closes first. A graceful Envoy ends an
    aborted request's stream with a half-close (ARCHITECTURE.md, "End of a stream"); a waiter
    that did not read the stream would learn of it only from the reset that follows Envoy's
    remote-close timeout (1 s), keeping its queue place meanwhile. With the outcome comes the
    read started here, still pending, for the stream loop: Envoy sends nothing while a message
    awaits its answer, but a message that arrives anyway is not lost."""
    wait: asyncio.Future[Outcome] = asyncio.ensure_future(answer.resume())
    read: asyncio.Future[ep.ProcessingRequest] = asyncio.ensure_future(anext(requests))
    try:
        await asyncio.wait((wait, read), return_when=asyncio.FIRST_COMPLETED)
        if wait.done() or read.exception() is None:
            return await wait, read
    except BaseException:
        wait.cancel()
        read.cancel()
        raise
    ended = read.exception()  # the read ended first: a half-close, or a broken stream
    wait.cancel()
    await asyncio.wait((wait,))  # not `await wait`: that would take our own cancellation too
    late = None if wait.cancelled() else wait.result()
    if late is not None:
        # Admitted just as the peer left: the loop answers it, so that the hold it carries is
        # the stream's and the stream's end releases it.
        return late, None
    if isinstance(ended, StopAsyncIteration):
        return None, None
    assert ended is not None
    raise ended


class FleetProcessor(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(
        self,
        pipeline: Exchanges,
        clock: Callable[[], float] = time.perf_counter,
        wall_clock: Callable[[], float] = time.time,
        reset_linger_s: float = 0.0,
        tracer: Tracer | None = None,
    ) -> None:
        self._exchanges = pipeline
        # Tracing on (tracing.enabled): a decision record per stream, exported by the tracer.
        self._tracer = tracer
        # See ENVOY_RESET_LINGER_S: serve passes it, used only while the runtime says Envoy
        # does not close gracefully; in-process callers that half-close and wait for the status
        # (tests, the fuzz harness) keep 0.
        self._reset_linger_s = reset_linger_s
        # Unix time, for the RFC 3339 resets of Anthropic's rate-limit headers.
        self._wall_clock = wall_clock
        self._metrics = pipeline.metrics
        self._active = 0
        self._metrics.count_streams_of(lambda: self._active)
        self._answers = responses.RouteAnswers()
        # Per runtime (built again after a reload, when the pipeline's modes change): the
        # answer to an inference request's headers while its body is awaited, and the header
        # path's mode override. Both follow the response phases the runtime reads.
        self._phases_for: Modes | None = None
        self._await_body = responses.CONTINUE_HEADERS
        self._await_chunked = responses.CONTINUE_HEADERS
        self._skip = responses.SKIP_REQUEST_BODY[False, False]
        self._clock = clock
        # The whole phase contract, in one table. Phases we never ask Envoy for (see the
        # processing_mode we render) still get a pass-through answer so a mis-configured
        # filter degrades to "no decision" rather than a broken stream.
        self._handlers: dict[str, Handler] = {
            "request_headers": self._on_request_headers,
            "request_body": self._on_request_body,
            # Asked for (SEND): Envoy sends it only for requests that have trailers.
            "request_trailers": self._on_request_trailers,
            # Asked for only when affinity is on: the clusters' load reports ride on them.
            "response_headers": self._on_response_headers,
            # Asked for only when usage inspection is on (cost metrics).
            "response_body": self._on_response_body,
            "response_trailers": self._pass(responses.CONTINUE_RESPONSE_TRAILERS),
        }

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: Any
    ) -> AsyncIterator[ep.ProcessingResponse]:
        state = StreamState(self._exchanges.exchange())
        self._active += 1
        requests = aiter(request_iterator)
        if self._tracer is not None:
            state.trace = DecisionTrace()
            state.trace.metadata = metadata_of(context)
            traced = tracing.begin(state.trace)
        # A read a wait for budget started (_wait_or_leave), still to be taken by the loop.
        pending: asyncio.Future[ep.ProcessingRequest] | None = None
        try:
            while True:
                try:
                    request = await (pending if pending is not None else anext(requests))
                except StopAsyncIteration:
                    break
                pending = None
                phase = request.WhichOneof("request")
                handler = self._handlers.get(phase or "")
                if handler is None:
                    self._metrics.stream_errors.labels("unknown_phase").inc()
                    continue
                answer = await handler(state, request)
                if isinstance(answer, Waiting):
                    # Queued for budget: keep Envoy's message timer from ending the wait,
                    # then answer the body message when the wait ends.
                    queued_ns = time.time_ns()
                    try:
                        yield responses.extend_message_timeout(answer.max_wait_s)
                        outcome, pending = await _wait_or_leave(answer, requests)
                    finally:
                        answer.cancel()  # the stream ended first: leave the queue
                        if state.trace is not None:
                            self._waited(state.trace, queued_ns)
                    if outcome is None:
                        break  # the peer half-closed while the request waited: the client left
                    if state.waits_at_headers:
                        yield self._traced(state, self._header_answer(state, outcome))
                    else:
                        yield self._traced(
                            state, self._answer(state, outcome, responses.CONTINUE_BODY)
                        )
                else:
                    yield answer if state.trace is None else self._traced(state, answer)
                if state.finished:
                    # Nothing more to read or to release: end the call with OK now (the
                    # protocol's "close the stream: no more messages are needed"). Envoy
                    # marks the exchange's processing complete and sends nothing further;
                    # the stream costs no half-close exchange and no read of it.
                    return
            # The peer half-closed. A graceful Envoy waits for our status: return now (OK).
            # Otherwise Envoy resets right behind its half-close: wait for that reset to cancel
            # us instead of answering with a status (ENVOY_RESET_LINGER_S).
            if self._reset_linger_s > 0 and not state.exchange.modes.graceful_close:
                await asyncio.sleep(self._reset_linger_s)
        except asyncio.CancelledError:
            # Envoy resets the stream when the client or upstream aborts, and at every end when
            # it does not close gracefully: an ordinary end, counted (a graceful Envoy's count
            # near the request count means its runtime flag is missing).
            self._metrics.streams_cancelled.inc()
            raise
        except Exception:
            self._metrics.stream_errors.labels("handler_exception").inc()
            log.exception("ext_proc stream failed", extra={"request_id": state.request_id})
            raise
        finally:
            if pending is not None:
                pending.cancel()
            self._active -= 1
            if state.trace is not None and self._tracer is not None:
                self._tracer.close(state.trace)
                tracing.end(traced)
            # Most exchanges hold nothing (no budget, no affinity): no coroutine for them.
            if state.exchange.holds:
                await state.exchange.release()

    @property
    def active(self) -> int:
        """ext_proc streams open right now."""
        return self._active

    def _traced(self, state: StreamState, answer: ep.ProcessingResponse) -> ep.ProcessingResponse:
        """Tracing on: the first answer that carries a decision opens its span, and a routing
        answer carries the span's context to the upstream (extproc.protocol.traced)."""
        trace, outcome = state.trace, state.outcome
        if trace is None or outcome is None or trace.decided_ns is not None:
            return answer
        trace.decided()
        if self._tracer is None or not traced_outcome(trace, outcome):
            return answer
        carry = self._tracer.open(trace, state.headers, trace.metadata)
        return with_headers(answer, carry) if isinstance(outcome, Routed) else answer

    @staticmethod
    def _waited(trace: DecisionTrace, queued_ns: int) -> None:
        now = time.time_ns()
        trace.add_phase("flow_wait", queued_ns, now)
        trace.attributes["fleet.wait_ms"] = round((now - queued_ns) / 1e6, 3)

    @staticmethod
    def _pass(answer: ep.ProcessingResponse) -> Handler:
        async def handler(_state: StreamState, _request: Any) -> ep.ProcessingResponse:
            return answer

        return handler

    async def _on_request_headers(
        self, state: StreamState, request: Any
    ) -> ep.ProcessingResponse | Waiting:
        msg = request.request_headers
        state.headers = _header_map(msg.headers)
        state.request_id = state.headers.get("x-request-id", "")
        if request.HasField("protocol_config"):
            # Sent with the stream's first message (Envoy 1.40). Without it (older Envoys),
            # BUFFERED is assumed: it is what the rendered filter asks for.
            mode = request.protocol_config.request_body_mode
            state.partial_bodies = mode in _PARTIAL_BODY_MODES
        started = self._clock()
        exchange = state.exchange
        outcome = await exchange.at_headers(
            state.headers, started, body_follows=not msg.end_of_stream
        )
        if exchange.api is None:
            # Not an inference request, or one without a body: decided on the headers alone.
            state.decided = True
            assert outcome is not None and not isinstance(outcome, Waiting)
            return self._answer(state, outcome, responses.CONTINUE_HEADERS)
        # The header path: when the body adds nothing to the decision, it is decided now and
        # Envoy is told not to send it (one exchange instead of two, no body copy). Otherwise
        # (None) it waits for the body. If the filter does not allow the override, Envoy sends
        # the body anyway; it then passes, the request already decided.
        if outcome is None:
            return self._awaiting_body(state)
        state.decided = True
        if isinstance(outcome, Waiting):
            state.waits_at_headers = True
            return outcome
        if isinstance(outcome, (Routed, Rejected)):
            self._metrics.decision_seconds.observe(self._clock() - started)
        return self._header_answer(state, outcome)

    def _awaiting_body(self, state: StreamState) -> ep.ProcessingResponse:
        """The answer to an inference request's headers while its body is awaited."""
        self._phase_answers(state.exchange.modes)
        # A body without a content-length: an HTTP/1.1 chunked upload (Envoy removes the
        # transfer-encoding header before its filters), or an HTTP/2 stream without one.
        if "content-length" not in state.headers:
            state.phases_skipped = self._await_chunked is responses.OBSERVE_CHUNKED_UPLOAD
            return self._await_chunked
        return self._await_body

    def _phase_answers(self, modes: Modes) -> None:
        if modes is self._phases_for:
            return
        phases, usage = modes.response_phases, modes.inspect_usage
        # The override asks for the response phases the processor reads (the rendered filter
        # skips them), as continue_inference_headers does on the body path.
        self._await_body = responses.continue_inference_headers(phases, usage)
        self._await_chunked = responses.continue_inference_headers(phases, usage, chunked=True)
        self._skip = responses.SKIP_REQUEST_BODY[phases, usage]
        self._phases_for = modes

    def _header_answer(self, state: StreamState, outcome: Outcome) -> ep.ProcessingResponse:
        """The answer to the headers message for an outcome decided there."""
        if not isinstance(outcome, Routed):
            # A refusal (429, 413, 400) waits for the body: answered while a large body is
            # still uploading, Envoy replies and closes the connection under the client's
            # writes, which then sees a reset instead of the answer and its retry hints.
            # Envoy buffers the body as on the body path (no override) and the refusal
            # answers its body message (or its trailers, for a body-less request).
            state.deferred = self._answer(state, outcome, responses.CONTINUE_HEADERS)
            return responses.CONTINUE_HEADERS
        self._phase_answers(state.exchange.modes)
        return self._answer(state, outcome, responses.CONTINUE_HEADERS, self._skip)

    async def _on_request_body(
        self, state: StreamState, request: Any
    ) -> ep.ProcessingResponse | Waiting:
        exchange = state.exchange
        if exchange.api is None or state.decided:
            deferred, state.deferred = state.deferred, None
            return deferred or responses.CONTINUE_BODY
        msg = request.request_body
        started = self._clock()
        state.decided = True
        body: bytes = msg.body
        self._metrics.body_bytes.observe(len(body))
        if not msg.end_of_stream and state.partial_bodies:
            # A STREAMED / BUFFERED_PARTIAL filter sends the body in pieces: deciding on the
            # first one would hash truncated JSON.
            refused = await exchange.at_body(body, started, whole=False)
            assert isinstance(refused, BadRequest)
            return responses.bad_request_response(refused)
        # BUFFERED: Envoy sends the body once it is whole, in one message: at the end of the
        # stream, or, when the request has trailers, as they arrive, with end_of_stream=false
        # (the trailers message follows this answer). Either way this is the whole body, and
        # the answer's header mutation and clear_route_cache still route the request.
        outcome = await exchange.at_body(body, started)
        if isinstance(outcome, Waiting):
            return outcome
        answer = self._answer(state, outcome, responses.CONTINUE_BODY)
        if isinstance(outcome, (Routed, Rejected)):
            self._metrics.decision_seconds.observe(self._clock() - started)
        return answer

    async def _on_request_trailers(self, state: StreamState, request: Any) -> ep.ProcessingResponse:
        if state.exchange.api is None or state.decided:
            deferred, state.deferred = state.deferred, None
            return deferred or responses.CONTINUE_TRAILERS
        # Headers, then trailers, and no data: Envoy sends no body message at all, so this is
        # the only chance to answer (the body is empty). An ImmediateResponse here is honoured.
        state.decided = True
        outcome = await state.exchange.at_body(None, self._clock())
        assert not isinstance(outcome, Waiting)  # nothing to admit without a body
        return self._answer(state, outcome, responses.CONTINUE_TRAILERS)

    def _answer(
        self,
        state: StreamState,
        outcome: Outcome,
        proceed: ep.ProcessingResponse,
        skip_body: processing_mode_pb2.ProcessingMode | None = None,
    ) -> ep.ProcessingResponse:
        """The Envoy answer for an outcome; ``proceed`` is this phase's "continue";
        ``skip_body``: a routing answer to the headers message (the header path)."""
        if state.trace is not None:
            state.outcome = outcome
        if isinstance(outcome, Routed):
            exchange = state.exchange
            modes = exchange.modes
            self._phase_answers(modes)
            # Not on the body path: a stream ended before Envoy's half-close left its request
            # message, the whole body in it, to grpc.aio's reference cycles, freed only when
            # the cyclic GC ran (4 / 16 MiB bodies: RSS 120 -> 330 MB, 217 -> 405-905 MB, and
            # the allocator's page faults back; BENCHMARKS.md).
            state.finished = modes.end_when_routed and skip_body is not None and not exchange.holds
            if state.phases_skipped:
                self._metrics.response_phases_skipped.labels("chunked_upload").inc()
            # SGLang's P/D protocol: the bootstrap fields (a mirror) instead of llm-d's header.
            prefiller, mirror = exchange.prefill_signal(outcome)
            if outcome.endpoints is None:
                return self._answers.route(
                    outcome.route,
                    outcome.facts,
                    modes.load_reports,
                    prefiller,
                    outcome.engine_key,
                    skip_body,
                    mirror,
                    outcome.engines,
                )
            if not outcome.endpoints:
                return responses.error_response(
                    outcome.facts.api.error_style,
                    503,
                    "no inference endpoint is ready",
                    "no_ready_endpoint",
                )
            return responses.endpoint_response(
                outcome.route,
                outcome.facts,
                outcome.endpoints,
                prefiller,
                skip_body,
                outcome.pool,
                mirror,
            )
        if isinstance(outcome, Rejected):
            return responses.reject_response(
                outcome.reject, outcome.facts.api.error_style, self._wall_clock()
            )
        if isinstance(outcome, BadRequest):
            return responses.bad_request_response(outcome)
        if isinstance(outcome, ModelList):
            return responses.immediate(200, outcome.body, details="fleet_models")
        if isinstance(outcome, Unavailable):
            return responses.model_unavailable_response(outcome.miss, outcome.facts.api.error_style)
        assert isinstance(outcome, Passthrough)
        return proceed

    async def _on_response_headers(self, state: StreamState, request: Any) -> ep.ProcessingResponse:
        exchange = state.exchange
        wanted = exchange.response_headers
        if not wanted:
            return responses.CONTINUE_RESPONSE_HEADERS
        found: dict[str, str] = {}
        for h in request.response_headers.headers.headers:
            if h.key in wanted:
                found[h.key] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        # Envoy names the host that served (response attributes, see attributes.py).
        attributes = request.attributes
        stream, served = await exchange.observe_response(
            found,
            self._clock(),
            functools.partial(served_cluster, attributes),
            served_address(attributes),
        )
        if state.trace is not None:
            traced_served(state.trace, served)
        if stream:
            return responses.STREAM_RESPONSE_HEADERS
        return responses.CONTINUE_RESPONSE_HEADERS

    async def _on_response_body(self, state: StreamState, request: Any) -> ep.ProcessingResponse:
        msg = request.response_body
        await state.exchange.observe_response_body(msg.body, msg.end_of_stream, self._clock())
        return responses.CONTINUE_RESPONSE_BODY
