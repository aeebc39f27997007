"""Scripted fleet events: a cluster fails, recovers, is added, is removed.

Text form (CLI ``--event``), times in seconds or as a fraction of the trace period with ``T``:

    fail:c3@0.4T      recover:c3@0.7T      add:c17@500      remove:c5@0.6T

A failure keeps the cluster in the hash (the gateway does not know it is down; Envoy's health
checks fail over to the session's secondary) and loses its KV cache. A removal takes it out of
the hash (a config change): its sessions' new primary is their old secondary. An addition puts
a spare into the hash with an empty cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class Kind(StrEnum):
    FAIL = "fail"
    RECOVER = "recover"
    ADD = "add"
    REMOVE = "remove"


@dataclass(frozen=True, slots=True)
class Event:
    time_s: float
    kind: Kind
    cluster: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.cluster}@{self.time_s:g}"


def parse_event(text: str, period: float) -> Event:
    head, sep, when = text.partition("@")
    kind_text, sep2, cluster = head.partition(":")
    if not sep or not sep2 or not cluster or not when:
        raise ValueError(f"event must be KIND:CLUSTER@TIME, got {text!r}")
    try:
        kind = Kind(kind_text)
    except ValueError:
        choices = ", ".join(k.value for k in Kind)
        raise ValueError(f"event kind must be one of {choices}, got {kind_text!r}") from None
    try:
        time_s = float(when[:-1]) * period if when.endswith("T") else float(when)
    except ValueError:
        raise ValueError(f"event time must be seconds or a fraction with T, got {when!r}") from None
    if time_s < 0:
        raise ValueError(f"event time must be >= 0, got {when!r}")
    return Event(time_s, kind, cluster)


def default_events(clusters: int, period: float) -> tuple[Event, ...]:
    """One of each, never overlapping (so each one's effect is measured alone): c1 fails at
    0.25T and recovers at 0.5T; a spare joins at 0.6T; the last base cluster leaves at 0.7T.
    0.8T-0.95T stays free for a burst. Needs one spare (``FleetShape.spares``)."""
    return (
        Event(0.25 * period, Kind.FAIL, "c1"),
        Event(0.5 * period, Kind.RECOVER, "c1"),
        Event(0.6 * period, Kind.ADD, f"c{clusters + 1}"),
        Event(0.7 * period, Kind.REMOVE, f"c{clusters}"),
    )


def validate(events: Sequence[Event], base: Sequence[str], spares: Sequence[str]) -> None:
    """Replay the script on names only, so a bad script fails before the run, not inside it."""
    members = set(base)
    known = set(base) | set(spares)
    down: set[str] = set()
    for event in sorted(events, key=lambda e: e.time_s):
        name = event.cluster
        if name not in known:
            raise ValueError(f"{event}: unknown cluster {name!r} (base or spare clusters only)")
        if event.kind is Kind.ADD:
            if name in members:
                raise ValueError(f"{event}: {name} is already in the fleet")
            members.add(name)
        elif name not in members:
            raise ValueError(f"{event}: {name} is not in the fleet at that time")
        elif event.kind is Kind.REMOVE:
            if len(members) == 1:
                raise ValueError(f"{event}: cannot remove the last cluster")
            members.discard(name)
            down.discard(name)
        elif event.kind is Kind.FAIL:
            if name in down:
                raise ValueError(f"{event}: {name} is already down")
            down.add(name)
        else:
            if name not in down:
                raise ValueError(f"{event}: {name} is not down")
            down.discard(name)
