"""Which existing sessions leave a pressured cluster, least active first. Pure: the shell
(extproc.pipeline.relief) keeps each cluster's sessions and how active they are, and asks this
module which of them move on their next request.

A cluster whose GPUs stay over a ``gpu_health`` threshold (extproc.core.gpu_health), or, with
load-aware affinity off, whose scraped KV use stays at ``affinity.kv_migrate_threshold``, takes
no new sessions, but the sessions it holds keep it full or hot. Once it has stayed over for
``move_after_s``, a *round* marks ``move_fraction`` of the sessions it still holds, the least
active first; each further ``move_after_s`` it stays over, another round marks the same
fraction of those left. A marked session migrates on its next request (one re-prefill on its
next usable candidate); the unmarked ones keep their cache.

Why the least active: an engine's prefix cache evicts its least recently used blocks first
(vLLM's free-block queue, SGLang's radix tree), so a session that has been quiet has most
likely lost its cache already: moving it costs little, while moving the most active would throw
away the cache it is using. A session's activity is its request count with each request
weighing half as much per ``move_after_s`` since it arrived (a decayed count on the timescale
of the rounds), ties broken by the older last request.

Why bounded: moving every session at once would carry the whole load to the next cluster in one
step (and could make it hot in turn); a round moves a fraction, and the next round waits to see
whether that was enough. A round always keeps at least one session: relief never empties a
cluster, since moving the one session it has left only moves its heat elsewhere.

At ``critical`` every session leaves, the least active first in the order (the rule load-aware
affinity applies at ``kv_migrate_threshold``, extproc.core.affinity's rule 3: it reads every
response's load report, so it sees the pressure as it grows). Without affinity the KV verdict
comes from the scraper alone, and relief moves the least active in rounds as for a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

Pressure = Literal["hot", "critical"]


@dataclass(frozen=True, slots=True)
class ReliefParams:
    """Compiled from fleet.yaml's ``gpu_health`` (``move_after_ms``, ``move_fraction``), which
    pace relief for KV pressure too."""

    move_after_s: float = 30.0
    move_fraction: float = 0.25


@dataclass(frozen=True, slots=True)
class SessionActivity:
    """One session as the shell last saw it on a cluster."""

    key: bytes  # the session's digest (never a raw id)
    last_seen: float
    requests: float  # the decayed request count at ``last_seen``

    def activity(self, now: float, half_life_s: float) -> float:
        decay: float = 2.0 ** (-max(0.0, now - self.last_seen) / half_life_s)
        return self.requests * decay

    def seen_again(self, now: float, half_life_s: float) -> SessionActivity:
        """The same session after one more request at ``now``."""
        return SessionActivity(self.key, now, self.activity(now, half_life_s) + 1.0)


def rounds_due(hot_since: float, now: float, params: ReliefParams) -> int:
    """How many rounds a cluster pressured since ``hot_since`` has earned by ``now``."""
    if params.move_fraction <= 0 or now < hot_since:
        return 0
    return int((now - hot_since) // params.move_after_s)


def least_active_first(
    sessions: Iterable[SessionActivity], now: float, params: ReliefParams
) -> list[SessionActivity]:
    return sorted(
        sessions, key=lambda s: (s.activity(now, params.move_after_s), s.last_seen, s.key)
    )


def to_move(
    sessions: Iterable[SessionActivity],
    level: Pressure | None,
    rounds: int,
    now: float,
    params: ReliefParams,
) -> frozenset[bytes]:
    """The sessions (of those a pressured cluster still holds unmarked) that ``rounds`` more
    rounds mark to leave: the least active ``n - max(1, floor(n x (1 - fraction)^rounds))``
    at ``hot``; all of them at ``critical``; none without pressure or a round."""
    if level is None or rounds <= 0:
        return frozenset()
    present = list(sessions)
    if level == "critical":
        return frozenset(s.key for s in present)
    if params.move_fraction <= 0 or len(present) <= 1:
        return frozenset()
    # The slack keeps 100 x 0.9 ** 2 at 81, not 80.99999999999999's floor.
    keep = max(1, math.floor(len(present) * (1.0 - params.move_fraction) ** rounds + 1e-9))
    ranked = least_active_first(present, now, params)
    return frozenset(s.key for s in ranked[: len(present) - keep])


def cool_first(names: Sequence[str], hot: Collection[str]) -> tuple[str, ...]:
    """``names`` (in order) without the hot ones, or all of them when every one is hot: a hot
    cluster takes no new session while a cooler one can."""
    cool = tuple(n for n in names if n not in hot)
    return cool or tuple(names)


def cool_secondary(ranked: Sequence[str], chosen: str, hot: Collection[str]) -> str | None:
    """Envoy's failover target for a request placed on ``chosen``: the first other candidate in
    hash order that is not hot, else the first other one (pure hashing's own rule, which this
    is whenever the next candidate is cool)."""
    first = None
    for name in ranked:
        if name == chosen:
            continue
        if name not in hot:
            return name
        if first is None:
            first = name
    return first
