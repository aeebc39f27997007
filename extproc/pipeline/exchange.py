"""The seam between the protocol shell and the pipeline: one HTTP exchange.

The stream loop (extproc/protocol/server.py) opens an :class:`Exchange` when a stream starts
and talks to the pipeline through it alone: what to ask Envoy for (:class:`Modes`), the
decision (at the request headers, at the request body), the response observations, and the
release when the stream ends. The exchange keeps what the request holds (its
:class:`~extproc.pipeline.outcomes.Hold`), so the shell never handles it. The decision union
(:mod:`extproc.pipeline.outcomes`) is re-exported here: the protocol imports nothing else of
the pipeline.

    exchange = pipeline.exchange()
    outcome = await exchange.at_headers(headers, now, body_follows=True)  # None: await the body
    outcome = await exchange.at_body(body, now)     # Routed | Rejected | ... | Waiting
    ...                                              # response phases:
    stream, served = await exchange.observe_response(found, now, served_by, address)
    await exchange.observe_response_body(chunk, end_of_stream, now)
    if exchange.holds:
        await exchange.release()                     # when the stream ends, always
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from extproc.core.api import Api, BadRequest, api_for_path
from extproc.pipeline.metrics import Metrics
from extproc.pipeline.outcomes import (
    Hold,
    ModelList,
    Outcome,
    Passthrough,
    Rejected,
    Routed,
    Unavailable,
    Waiting,
)

if TYPE_CHECKING:
    from extproc.pipeline.pipeline import Pipeline

__all__ = [
    "BadRequest",
    "Exchange",
    "Exchanges",
    "Metrics",
    "ModelList",
    "Modes",
    "Outcome",
    "Passthrough",
    "Rejected",
    "Routed",
    "ServedBy",
    "Unavailable",
    "Waiting",
]

# The serving cluster as Envoy's response attributes name it, given the configured cluster
# names and the endpoints' owners (address -> cluster): the shell reads the attributes, the
# pipeline knows the fleet.
ServedBy = Callable[[Container[str], Mapping[str, str]], str | None]


def inference_api(headers: Mapping[str, str]) -> Api | None:
    """The API of an inference request (a POST to one of the API paths), else None."""
    if headers.get(":method") != "POST":
        return None
    return api_for_path(headers.get(":path", ""))


@dataclass(frozen=True, slots=True)
class Modes:
    """What a stream asks Envoy for under the runtime being served: one value per runtime,
    the same object until a reload swaps the runtime (the shell may cache by it)."""

    # The response phases the processor reads (Runtime.response_phases): asked for in the
    # answer to an inference request's headers.
    response_phases: bool
    # Usage inspection: the response body is asked for too.
    inspect_usage: bool
    # Upstream requests ask for ORCA load reports (affinity reads them from the headers).
    load_reports: bool
    # Envoy half-closes and waits for the status (processor.envoy_graceful_close).
    graceful_close: bool

    @property
    def end_when_routed(self) -> bool:
        """A routed exchange that reads no response and holds nothing needs its stream no
        longer than its answer. Only with Envoy's graceful close: without it Envoy resets the
        stream at the exchange's end, and a status sent as that reset arrives leaks in
        grpc.aio (extproc.protocol.server.ENVOY_RESET_LINGER_S)."""
        return not self.response_phases and self.graceful_close


class Exchanges(Protocol):
    """What the stream loop is given: the processor's metrics and an exchange per stream
    (the :class:`~extproc.pipeline.pipeline.Pipeline`)."""

    @property
    def metrics(self) -> Metrics: ...

    def exchange(self) -> Exchange: ...


class Exchange:
    """One HTTP exchange as the pipeline sees it, from its request headers to its end."""

    __slots__ = ("_body", "_headers", "_hold", "_pipeline", "api")

    def __init__(self, pipeline: Pipeline) -> None:
        self._pipeline = pipeline
        self._headers: Mapping[str, str] = {}
        # Set at the headers of an inference request (a POST to an API path) whose body
        # follows: the request is decided at its headers (the header path) or its body.
        self.api: Api | None = None
        # What a routed exchange holds (budget, in-flight counts, usage scanner) until it ends.
        self._hold: Hold | None = None
        # SGLang's P/D protocol only: the request body, kept until the routing answer
        # rewrites it (prefill_signal), then dropped.
        self._body: bytes | None = None

    @property
    def modes(self) -> Modes:
        """What to ask Envoy for, under the runtime served now."""
        return self._pipeline.modes

    # -- the decision -----------------------------------------------------------------------
    async def at_headers(
        self, headers: Mapping[str, str], now: float, *, body_follows: bool
    ) -> Outcome | Waiting | None:
        """The decision at the request headers (lower-case names, Envoy's pseudo-headers).

        Anything but an inference request whose body follows is decided here, on the headers
        alone (``api`` stays None): a Passthrough, the fleet's model list, a 400 for an
        inference request without a body. An inference request whose body follows is decided
        here when its body adds nothing (the header path, ARCHITECTURE.md), else None: the
        decision waits for :meth:`at_body`.
        """
        self._headers = headers
        pipeline = self._pipeline
        api = inference_api(headers)
        if api is None or not body_follows:
            return self._keep(await pipeline.decide(headers, None, now))
        self.api = api
        outcome = await pipeline.decide_headers(headers, now, wait=False)
        return None if outcome is None else self._took(outcome)

    async def at_body(
        self, body: bytes | None, now: float, *, whole: bool = True
    ) -> Outcome | Waiting:
        """The decision at the request body: the whole body, or None when the request ended
        without one (headers, then trailers). ``whole=False``: the body arrived in pieces
        (the filter is not in BUFFERED mode), refused with a 413 rather than hashed truncated.
        A request queued for budget comes back as :class:`Waiting`: the shell extends Envoy's
        message timer, then awaits ``resume()`` (and calls ``cancel()`` if the stream ends
        first)."""
        pipeline = self._pipeline
        if not whole:
            assert self.api is not None
            return pipeline.refuse_partial_body(self.api)
        if body is not None and pipeline.wants_request_body():
            self._body = body
        outcome = self._took(await pipeline.decide(self._headers, body, now, wait=False))
        if not isinstance(outcome, (Routed, Waiting)):
            self._body = None
        return outcome

    def prefill_signal(self, outcome: Routed) -> tuple[str | None, tuple[str, bytes] | None]:
        """How a routed request names its prefiller: the address for llm-d's header, or, in
        SGLang's P/D protocol, the Envoy cluster to mirror the request to with the body both
        halves get (Pipeline.bootstrap_body). The kept body is dropped here."""
        body, self._body = self._body, None
        if body is None:
            return (outcome.prefill.address if outcome.prefill is not None else None), None
        return None, self._pipeline.bootstrap_body(outcome, body)

    def _took(self, outcome: Outcome | Waiting) -> Outcome | Waiting:
        if isinstance(outcome, Waiting):
            resume = outcome.resume

            async def resumed() -> Outcome:
                return self._keep(await resume())

            outcome.resume = resumed
            return outcome
        return self._keep(outcome)

    def _keep(self, outcome: Outcome) -> Outcome:
        if isinstance(outcome, Routed):
            self._hold = outcome.hold
        return outcome

    # -- the response -----------------------------------------------------------------------
    @property
    def response_headers(self) -> tuple[str, ...]:
        """The response headers :meth:`observe_response` reads (none: answer the phase at
        once). Only these are decoded: a response may carry dozens."""
        return self._pipeline.response_headers_wanted(self._hold)

    async def observe_response(
        self, found: Mapping[str, str], now: float, served_by: ServedBy, address: str | None
    ) -> tuple[bool, str | None]:
        """The response headers arrived (``found``: the wanted ones; ``served_by``: Envoy's
        word on the serving cluster; ``address``: the serving host's). Feeds the load report
        and any failover to the fleet state, moves the budget charge to the serving cluster.
        Returns whether the response body should stream through usage inspection (an SSE
        response), and the serving cluster as known now."""
        hold = self._hold
        if hold is None:
            return False, None
        pipeline = self._pipeline
        served = served_by(pipeline.runtime.cluster_names, pipeline.endpoint_owners())
        stream = pipeline.observe_response(hold, found, now, served, address)
        await pipeline.charge_served(hold)
        return stream, hold.served_by or served

    async def observe_response_body(self, chunk: bytes, end_of_stream: bool, now: float) -> None:
        """A piece of the response body (the whole body unless it streams as SSE)."""
        hold = self._hold
        if hold is not None:
            await self._pipeline.observe_response_body(hold, chunk, end_of_stream, now)

    # -- the end ----------------------------------------------------------------------------
    @property
    def holds(self) -> bool:
        """Whether the exchange holds anything :meth:`release` gives back."""
        hold = self._hold
        return hold is not None and hold.held

    async def release(self) -> None:
        """Give back what the exchange holds, once; call when the stream ends, however."""
        hold, self._hold = self._hold, None
        if hold is not None and hold.held:
            await self._pipeline.release(hold)
