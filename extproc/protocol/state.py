"""Per-stream protocol state: what one HTTP exchange has told the processor so far.

Kept apart from RequestFacts on purpose: facts describe the request (pure, immutable); this
object tracks the exchange (mutable, lives as long as Envoy keeps the stream open).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from extproc.pipeline.exchange import Exchange, Outcome
from extproc.tracing import DecisionTrace


@dataclass(slots=True)
class StreamState:
    # The pipeline's side of the exchange: its decisions, and what the request holds (budget,
    # in-flight counts, usage scanner) until the stream ends.
    exchange: Exchange
    request_id: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    decided: bool = False
    # The filter sends request bodies in pieces (its protocol_config says STREAMED,
    # BUFFERED_PARTIAL, FULL_DUPLEX_STREAMED or GRPC): a body message without end_of_stream is then
    # not the whole body. In BUFFERED mode it is (trailers follow).
    partial_bodies: bool = False
    # The header path's refusal (an ImmediateResponse), decided at the headers and given as
    # the answer to the body (or trailers) message, once the client has sent its body.
    deferred: ep.ProcessingResponse | None = None
    # Decided at the headers but queued for budget: the wait's outcome answers the headers.
    waits_at_headers: bool = False
    # An HTTP/1.1 chunked upload told to skip the response phases the processor would read
    # (responses.OBSERVE_CHUNKED_UPLOAD): counted once routed.
    phases_skipped: bool = False
    # Answered for good: routed, holding nothing, no response phase asked for. The servicer
    # ends the stream with OK right after the answer instead of waiting for Envoy's close.
    finished: bool = False
    # Tracing on: this exchange's decision record, and the outcome its answer carries.
    trace: DecisionTrace | None = None
    outcome: Outcome | None = None
