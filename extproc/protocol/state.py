"""Per-stream protocol state: what one HTTP exchange has told the processor so far.

Kept apart from RequestFacts on purpose: facts describe the request (pure, immutable); this
object tracks the exchange (mutable, lives as long as Envoy keeps the stream open).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from extproc.core.api import Api


@dataclass(slots=True)
class StreamState:
    path: str = ""
    method: str = ""
    request_id: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    api: Api | None = None  # set only for POSTs to an inference path
    decided: bool = False
    # Budget reservation held for the life of the exchange; released when the stream ends.
    ticket: Any = None
    # Load-aware affinity only: the cluster this exchange was routed to (counted in flight
    # there until the stream ends) and whether its response's load report was read already.
    routed_to: str | None = None
    reported: bool = False
    # Usage inspection only: the cluster the request was sent to (primary, or the serving
    # cluster named by the response) and the SSE scanner when the response is a stream.
    usage_cluster: str | None = None
    usage_stream: Any = None
