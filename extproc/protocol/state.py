"""Per-stream protocol state: what one HTTP exchange has told the processor so far.

Kept apart from RequestFacts on purpose: facts describe the request (pure, immutable); this
object tracks the exchange (mutable, lives as long as Envoy keeps the stream open).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from extproc.core.api import Api
from extproc.pipeline.outcomes import Hold


@dataclass(slots=True)
class StreamState:
    request_id: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    api: Api | None = None  # set only for POSTs to an inference path that carry a body
    decided: bool = False
    # The filter sends request bodies in pieces (its protocol_config says STREAMED,
    # BUFFERED_PARTIAL, FULL_DUPLEX_STREAMED or GRPC): a body message without end_of_stream is then
    # not the whole body. In BUFFERED mode it is (trailers follow).
    partial_bodies: bool = False
    # What a routed exchange holds (budget, in-flight count, usage scanner) until it ends.
    hold: Hold | None = None
