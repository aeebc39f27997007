"""Requests in flight per request class, as an upstream sees them.

The processor names each admitted request's class in ``x-fleet-class`` (Envoy strips a
client-sent value). Counting at the upstream, for the whole time its handler runs (a streamed
response included), is what proves a budget from the outside: if the gateway released a budget
while its request was still running, the upstream would see more requests of that class at once
than the budget allows. Requests that reach the upstream without the header did not pass through
the processor's admission (the fail-open fallback route); they are counted under ``""``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

# The processor's class header (extproc.protocol.names.CLASS_HEADER); repeated here so the
# simulated engine depends on nothing of the gateway's.
CLASS_HEADER = "x-fleet-class"
# The most recent requests kept with their times (for `extproc chaos`'s diagnosis of a peak):
# bounded, so a long soak's engine does not grow.
KEPT_REQUESTS = 50_000


@dataclass(slots=True)
class ClassConcurrency:
    inflight: dict[str, int] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)
    total: dict[str, int] = field(default_factory=dict)
    # (request id, class, start, end) of finished requests, wall-clock seconds (the processor's
    # log lines carry the same clock), newest last.
    finished: deque[tuple[str, str, float, float]] = field(
        default_factory=lambda: deque(maxlen=KEPT_REQUESTS)
    )

    @contextmanager
    def track(self, request_class: str, request_id: str = "") -> Iterator[None]:
        started = time.time()
        now = self.inflight.get(request_class, 0) + 1
        self.inflight[request_class] = now
        self.total[request_class] = self.total.get(request_class, 0) + 1
        if now > self.peak.get(request_class, 0):
            self.peak[request_class] = now
        try:
            yield
        finally:
            self.inflight[request_class] -= 1
            self.finished.append((request_id, request_class, started, time.time()))

    def requests_since(self, since: float) -> list[tuple[str, str, float, float]]:
        """The kept requests that ended at or after ``since`` (wall-clock seconds)."""
        return [r for r in self.finished if r[3] >= since]

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {"inflight": dict(self.inflight), "peak": dict(self.peak), "total": dict(self.total)}

    def reset_peaks(self) -> None:
        """Start a new measurement: peaks restart from what is in flight now."""
        self.peak = {k: v for k, v in self.inflight.items() if v}
        self.total = {}
