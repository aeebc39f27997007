"""What one decision's trace records, with nothing of OpenTelemetry imported.

The stream loop opens a :class:`DecisionTrace` per ext_proc stream when tracing is on
(``tracing.enabled``) and makes it the current one (a context variable: each stream runs in its
own task). The pipeline marks the steps that take time with :func:`phase` and adds what it
learns with :func:`annotate`; with tracing off there is no current trace and both return at
once. ``extproc.tracing.otel`` (the OpenTelemetry SDK, loaded only when tracing is on) turns a
finished record into spans.

Times are wall-clock nanoseconds (OpenTelemetry's span times).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from contextvars import ContextVar, Token
from types import TracebackType
from typing import Any, Protocol

AttributeValue = str | bool | int | float

_CURRENT: ContextVar[DecisionTrace | None] = ContextVar("fleet_decision_trace", default=None)


class DecisionTrace:
    """One decision: its start and end, its timed steps, and its attributes."""

    __slots__ = ("attributes", "decided_ns", "metadata", "phases", "span", "start_ns", "status")

    def __init__(self, start_ns: int | None = None) -> None:
        self.start_ns = time.time_ns() if start_ns is None else start_ns
        self.decided_ns: int | None = None
        self.phases: list[tuple[str, int, int]] = []
        self.attributes: dict[str, AttributeValue] = {}
        # An error description for the span's status (a refusal), or None.
        self.status: str | None = None
        # The trace context of the ext_proc call (its gRPC metadata), read at the stream's start.
        self.metadata: Mapping[str, str] = {}
        # The exporter's open span (extproc.tracing.otel), once the answer is given.
        self.span: object | None = None

    @staticmethod
    def end_ns() -> int:
        return time.time_ns()

    def add_phase(self, name: str, start_ns: int, end_ns: int) -> None:
        self.phases.append((name, start_ns, end_ns))

    def decided(self) -> None:
        """The answer is given: the decision span ends here (later phases add attributes)."""
        if self.decided_ns is None:
            self.decided_ns = time.time_ns()


class _Phase:
    __slots__ = ("name", "start_ns", "trace")

    def __init__(self, trace: DecisionTrace, name: str) -> None:
        self.trace, self.name, self.start_ns = trace, name, 0

    def __enter__(self) -> None:
        self.start_ns = time.time_ns()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.trace.add_phase(self.name, self.start_ns, time.time_ns())


class _Untraced:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None


UNTRACED = _Untraced()


def phase(name: str) -> _Phase | _Untraced:
    """``with phase("session_lookup"):`` times a step of the current decision, if traced."""
    trace = _CURRENT.get()
    return UNTRACED if trace is None else _Phase(trace, name)


def annotate(**attributes: AttributeValue) -> None:
    """Attributes of the current decision, if traced (dots in names are written as "__")."""
    trace = _CURRENT.get()
    if trace is not None:
        for key, value in attributes.items():
            trace.attributes[key.replace("__", ".")] = value


def current() -> DecisionTrace | None:
    return _CURRENT.get()


def begin(trace: DecisionTrace) -> Token[DecisionTrace | None]:
    """Make ``trace`` the current decision of this task (the stream)."""
    return _CURRENT.set(trace)


def end(token: Token[DecisionTrace | None]) -> None:
    try:
        _CURRENT.reset(token)
    except ValueError:  # closed from another context than it began in
        _CURRENT.set(None)


class Tracer(Protocol):
    """What the stream loop needs of an exporter (extproc.tracing.otel.DecisionTracer)."""

    def open(
        self, trace: DecisionTrace, headers: Mapping[str, str], metadata: Mapping[str, str]
    ) -> dict[str, str]: ...

    def close(self, trace: DecisionTrace) -> None: ...


def metadata_of(context: Any) -> dict[str, str]:
    """The W3C trace context Envoy's ext_proc call carries in its gRPC metadata, if any."""
    found: dict[str, str] = {}
    metadata = getattr(context, "invocation_metadata", None)
    for key, value in (metadata() if metadata is not None else None) or ():
        if key in ("traceparent", "tracestate") and isinstance(value, str):
            found[key] = value
    return found
