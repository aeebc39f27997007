"""One view of whether Redis answers, shared by the budget ledger, the affinity session store
and readiness.

After a failed call (a timeout, a refused connection) Redis is left alone for
``probe_interval_s``: an outage then costs one bounded timeout per interval, not one per
request. The first call after the interval is the probe; its success brings everyone back. With
one tracker the ledger and the session store agree (a store timeout also moves budgets to the
local fallback, as the same Redis is down for both) and readiness reports the one state.

Time is passed in (``now``), on the clock of whoever calls: the service gives the ledger and
the pipeline the same monotonic clock.
"""

from __future__ import annotations

from collections.abc import Callable

# After a failure, how long Redis is not called. The ledger's renewal tick (lease TTL / 3) and
# readiness' watcher ping it on their own schedule too, so recovery is seen within a second or so.
PROBE_INTERVAL_S = 1.0


class RedisHealth:
    def __init__(self, probe_interval_s: float = PROBE_INTERVAL_S) -> None:
        self.probe_interval_s = probe_interval_s
        self._down_until: float | None = None
        self._listeners: list[Callable[[bool], None]] = []

    @property
    def up(self) -> bool:
        """No failure since the last success."""
        return self._down_until is None

    def due(self, now: float) -> bool:
        """Whether Redis may be called now: it is up, or the probe interval has passed."""
        return self._down_until is None or now >= self._down_until

    def failed(self, now: float) -> bool:
        """A call failed at ``now``; True when this took Redis from up to down."""
        was_up = self._down_until is None
        self._down_until = now + self.probe_interval_s
        if was_up:
            self._notify(False)
        return was_up

    def succeeded(self) -> bool:
        """A call succeeded; True when this brought Redis back."""
        if self._down_until is None:
            return False
        self._down_until = None
        self._notify(True)
        return True

    def subscribe(self, listener: Callable[[bool], None]) -> None:
        """``listener(up)`` on every change (e.g. the ledger's mode gauge)."""
        self._listeners.append(listener)

    def _notify(self, up: bool) -> None:
        for listener in self._listeners:
            listener(up)
