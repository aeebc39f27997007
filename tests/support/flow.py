"""The 429 contract as it was before flow control's defaults (extproc/core/flow.py).

Since issue 20 a budgeted class waits for budget by default (0.5 s for small classes, 30 s for
large ones) and a new session on a full primary is placed on its next hash candidate. Tests of
the bulkhead's own answer (the 429, its hints, what it holds) configure that contract
explicitly: ``wait.max_wait_s: 0`` on each class and ``flow.place_new_sessions: false``, so an
over-budget request is refused at once on its primary, as those tests assert.
"""

from __future__ import annotations

from typing import Any

# fleet.yaml's flow section without placement of new sessions.
NO_PLACEMENT: dict[str, Any] = {"place_new_sessions": False}


def refused_at_once(classes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``classes`` with ``wait.max_wait_s: 0`` where a class sets no wait of its own."""
    return [c if "wait" in c else {**c, "wait": {"max_wait_s": 0}} for c in classes]
