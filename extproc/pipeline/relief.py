"""The shell's side of relief (extproc.core.relief): which sessions each cluster holds, how
active each is, and the rounds of a cluster's current pressured spell.

Kept per replica, in memory: a session is counted on the cluster this replica last routed it
to, with its last-seen instant and decayed request count; one not seen within
``affinity.new_session_ttl_s`` is dropped (its next request is a new session, which avoids the
pressured cluster anyway). The total is bounded by ``affinity.max_sessions``. Several replicas
each move the least active of the sessions they see; the override a move writes is shared
through Redis when configured, as any other.

A spell is dated from the scrapers' first verdict that found its cluster pressured (the GPU
scraper's, or the engine scraper's KV report; ``since``), not from the first request that finds
it so: its rounds come ``move_after_s`` after the cluster became hot, whether or not a request
arrived in between. It ends at the first request that finds the cluster fine, or when a scraper
says so: a cluster that cools down and heats up again starts its rounds over.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from extproc.core.affinity import MigrationReason, SessionView
from extproc.core.relief import Pressure, ReliefParams, SessionActivity, rounds_due, to_move

if TYPE_CHECKING:
    from extproc.pipeline.fleet_state import LoadTable


@dataclass(slots=True)
class _Spell:
    since: float
    rounds: int = 0
    movers: set[bytes] = field(default_factory=set)


class ReliefTable:
    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self._where: dict[bytes, str] = {}
        # cluster -> its sessions in last-seen order (the stale ones collect at the front)
        self._held: dict[str, OrderedDict[bytes, SessionActivity]] = {}
        self._spells: dict[str, _Spell] = {}

    def __len__(self) -> int:
        return len(self._where)

    def held(self, cluster: str) -> int:
        return len(self._held.get(cluster, ()))

    def seen(
        self, cluster: str, key: bytes, now: float, ttl_s: float, params: ReliefParams
    ) -> None:
        """A request of session ``key`` was routed to ``cluster`` at ``now``."""
        before = self._where.get(key)
        found = None
        if before is not None:
            sessions = self._held[before]
            found = sessions.pop(key)
            if before != cluster:
                spell = self._spells.get(before)
                if spell is not None:
                    spell.movers.discard(key)
        activity = (
            SessionActivity(key, now, 1.0)
            if found is None or now - found.last_seen > ttl_s
            else found.seen_again(now, params.move_after_s)
        )
        sessions = self._held.setdefault(cluster, OrderedDict())
        sessions[key] = activity
        self._where[key] = cluster
        while sessions:
            oldest_key, oldest = next(iter(sessions.items()))
            if len(self._where) <= self.max_sessions and now - oldest.last_seen <= ttl_s:
                break
            del sessions[oldest_key]
            del self._where[oldest_key]

    def leaves(
        self,
        cluster: str,
        key: bytes,
        level: Pressure,
        now: float,
        ttl_s: float,
        params: ReliefParams,
        *,
        since: float | None = None,
        record: bool = True,
    ) -> bool:
        """Whether session ``key`` leaves ``cluster`` (pressured at ``level`` now, and since
        ``since`` when known, else from now) on this request. Runs the rounds the spell has
        earned since the last ask; ``record=False`` previews the answer without starting a
        spell or marking anyone."""
        spell = self._spells.get(cluster)
        if spell is None:
            spell = _Spell(now if since is None else min(since, now))
            if record:
                self._spells[cluster] = spell
        due = rounds_due(spell.since, now, params)
        if due <= spell.rounds:
            return key in spell.movers
        sessions = self._held.get(cluster, OrderedDict())
        left = (
            a for k, a in sessions.items() if k not in spell.movers and now - a.last_seen <= ttl_s
        )
        marked = to_move(left, level, due - spell.rounds, now, params)
        if record:
            spell.movers |= marked
            spell.rounds = due
            return key in spell.movers
        return key in spell.movers or key in marked

    def cooled(self, cluster: str) -> None:
        """``cluster`` is no longer pressured: its spell ends."""
        self._spells.pop(cluster, None)

    def in_spell(self, cluster: str) -> bool:
        return cluster in self._spells


def relief_view(
    table: ReliefTable,
    load: LoadTable,
    params: ReliefParams,
    key: bytes,
    view: SessionView,
    hash_primary: str,
    now: float,
    ttl_s: float,
    record: bool = True,
) -> SessionView:
    """The session view with ``leave`` set when relief picks session ``key`` off the cluster
    it is on (its override's, else its hash primary), which is hot: its GPUs are over a
    threshold, or its KV use at kv_relief_at (extproc.core.relief); a cluster found cool ends
    its spell. ``record=False`` previews it (no spell started or ended, nobody marked)."""
    override = view.override
    if not (view.seen or override is not None):
        return view
    current = (
        override.cluster if override is not None and override.expires_at > now else hash_primary
    )
    reason = load.hot_reason(current, now)
    if reason is None:
        if record and table.in_spell(current):
            table.cooled(current)
        return view
    since = load.hot_since(current, now)
    if not table.leaves(current, key, "hot", now, ttl_s, params, since=since, record=record):
        return view
    return dataclasses.replace(view, leave=cast(MigrationReason, reason))
