"""What `extproc chaos` holds each fault row to: the over-admission bound that applies to it, and
the diagnosis of a row's worst peak from the run's own records.

The bound is built from the mechanisms that may admit past a budget, each bounded in
RELIABILITY.md ("Budgets under faults", "A primary cluster down"); per class, in requests
over ``max_concurrent`` on one cluster:

- **local fallback** (the row had ledger calls that failed or timed out): a replica that cannot
  reach Redis admits on its local share, ``max(1, budget // redis.replicas)``, in which its own
  Redis admissions count; the others' Redis admissions keep running. Until its local
  reservations are adopted into Redis they are invisible there, so the requests held at once
  stay within ``budget + Σ local shares``: over by at most ``S = processors * share``.
- **ledger state lost** (Redis killed or restarted without persistence): its leases are gone
  while their requests run, and Redis admits a whole budget again: ``+ budget``.
- **failover** (a cluster killed or answering 503): requests admitted against the failing
  cluster's compartment (itself within ``budget + S``) are served by its sessions' secondary;
  their charge moves there at the response headers, unconditionally: ``+ budget + S``.

A request that reaches an upstream with no class (Envoy went on without the processor's
answer) bypasses every budget: allowed only while a processor replica is being taken away
(``failure_mode: open``), a FAIL anywhere else.

A config reload and a client abort storm add nothing: a reload keeps every held reservation
where it is (the gate and its ledgers outlive runtimes) and budgets travel with each request's
demand; an abort releases a budget only when Envoy ends the stream, which also resets the
upstream request (the simulated engine stops at once, as vLLM and SGLang do).

The diagnosis reads what the simulated clusters saw (``/admin/requests``: request id, class,
start, end) and the processors' debug lines (``routed``: which ledger admitted it and under which
config version; ``charge moved``; ``released``), and explains the peak of each class that went
over: how many of the requests running at that instant were admitted by Redis or by a local
fallback, on another cluster (failed over), already released by the processor, or unknown to
either processor (fail-open).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from extproc.core.fleet import share_of

# Rows whose fault loses the shared ledger's state (no persistence: a restart starts empty).
STATE_LOST = ("redis killed", "redis restarted")
# Rows whose fault makes Envoy serve a cluster's requests on its sessions' secondary.
FAILOVER = ("cluster killed", "cluster erroring")
# Rows whose fault takes a processor replica away: Envoy's ext_proc filter fails open
# (failure_mode: open) for the streams it had sent there until it stops picking that replica.
# Anywhere else a request reaching an upstream without a class is a bypass of the budgets.
REPLICA_LOST = ("processor sigkill", "processor sigterm", "processor restart")
# Timestamps are rounded to the millisecond in the processor's log lines.
CLOCK_SLACK_S = 0.002


def bound_for(
    fault: str, limits: Mapping[str, int], processors: int, ledger_replicas: int, errors: int
) -> tuple[dict[str, int], list[str]]:
    """The over-admission bound per class for one row, and the mechanisms it is made of."""
    name = fault.lower()
    parts: list[str] = []
    if errors:
        parts.append("local fallback")
    if any(k in name for k in STATE_LOST):
        parts.append("ledger state lost")
    if any(k in name for k in FAILOVER):
        parts.append("failover")
    bound: dict[str, int] = {}
    for klass, budget in limits.items():
        local = processors * share_of(budget, ledger_replicas) if errors else 0
        total = local
        if "ledger state lost" in parts:
            total += budget
        if "failover" in parts:
            total += budget + local
        bound[klass] = total
    return bound, parts


def fail_open_allowed(fault: str) -> bool:
    """Whether requests may reach an upstream unplaced and unbudgeted during this fault."""
    return any(k in fault.lower() for k in REPLICA_LOST)


@dataclass
class Admission:
    """One request as the processors' debug lines tell it."""

    processor: int
    cluster: str
    ledger: str | None
    version: str
    routed_at: float
    released_at: float | None = None
    moved_to: str | None = None


@dataclass
class LogCursor:
    """Reads a processor's log from where it stopped last time (a restarted processor appends
    to the same file)."""

    path: Path
    offset: int = 0
    partial: bytes = field(default=b"")

    def new_lines(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self.partial + data
        *complete, self.partial = data.split(b"\n")
        docs = []
        for line in complete:
            if not line.startswith(b"{"):
                continue  # the READY line and anything not JSON
            try:
                doc = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(doc, dict):
                docs.append(doc)
        return docs


def read_admissions(
    lines_by_processor: Mapping[int, Iterable[dict[str, Any]]],
) -> dict[str, Admission]:
    found: dict[str, Admission] = {}
    for index, lines in lines_by_processor.items():
        for doc in lines:
            rid = doc.get("request_id")
            if not rid:
                continue
            msg = doc.get("msg")
            ts = float(doc.get("ts", 0.0))
            if msg == "routed":
                found[rid] = Admission(
                    index,
                    str(doc.get("primary", "")),
                    doc.get("ledger"),
                    str(doc.get("config_version", "")),
                    ts,
                )
            elif rid in found and msg == "released":
                found[rid].released_at = ts
            elif rid in found and msg == "charge moved":
                found[rid].moved_to = str(doc.get("to", ""))
    return found


Interval = tuple[str, str, float, float]  # request id, class, start, end


def peak_of(intervals: Iterable[Interval], klass: str) -> tuple[int, float, list[str]]:
    """(peak concurrency, the instant it was first reached, the request ids running then)."""
    events: list[tuple[float, int, str]] = []
    for rid, k, start, end in intervals:
        if k == klass:
            events.append((start, 1, rid))
            events.append((end, -1, rid))
    # Ends before starts at the same instant: a request that ended is not counted with the
    # one that replaced it.
    events.sort(key=lambda e: (e[0], e[1]))
    running: set[str] = set()
    best, at, ids = 0, 0.0, []
    for ts, step, rid in events:
        if step > 0:
            running.add(rid)
            if len(running) > best:
                best, at, ids = len(running), ts, sorted(running)
        else:
            running.discard(rid)
    return best, at, ids


def diagnose(
    upstreams: Mapping[str, list[Interval]],
    admissions: Mapping[str, Admission],
    limits: Mapping[str, int],
    began_wall: float,
) -> dict[str, Any]:
    """Per class that went over its budget on some cluster: the worst cluster's peak, and what
    the requests running at that instant were."""
    out: dict[str, Any] = {}
    for klass, budget in limits.items():
        worst: tuple[int, float, list[str], str] | None = None
        for cluster, intervals in upstreams.items():
            peak, at, ids = peak_of(intervals, klass)
            if peak > budget and (worst is None or peak > worst[0]):
                worst = (peak, at, ids, cluster)
        if worst is None:
            continue
        peak, at, ids, cluster = worst
        ledgers: Counter[str] = Counter()
        versions: Counter[str] = Counter()
        processors: Counter[str] = Counter()
        elsewhere: Counter[str] = Counter()
        released_early = unknown = 0
        for rid in ids:
            seen = admissions.get(rid)
            if seen is None:
                unknown += 1
                continue
            ledgers[seen.ledger or "none"] += 1
            versions[seen.version] += 1
            processors[str(seen.processor)] += 1
            if seen.cluster != cluster:
                elsewhere[seen.cluster] += 1
            if seen.released_at is not None and seen.released_at < at - CLOCK_SLACK_S:
                released_early += 1
        out[klass] = {
            "cluster": cluster,
            "peak": peak,
            "budget": budget,
            "at_s": round(at - began_wall, 2),
            "admitted_by": dict(ledgers),
            "admitted_on_another_cluster": dict(elsewhere),
            "released_before_the_upstream_ended": released_early,
            "unknown_to_the_processors": unknown,
            "config_versions": dict(versions),
            "processors": dict(processors),
        }
    return out


def fail_open(
    upstreams: Mapping[str, list[Interval]],
    admissions: Mapping[str, Admission],
    began_wall: float,
) -> dict[str, Any]:
    """Requests that reached an upstream with no class (Envoy went on without the processor's
    answer: ``failure_mode: open``): how many, when, and how many a processor did decide, too
    late (its answer came after Envoy's message timeout)."""
    seen = [(c, rid, start) for c, kept in upstreams.items() for rid, k, start, _ in kept if not k]
    if not seen:
        return {}
    starts = [start for _c, _rid, start in seen]
    by_cluster = Counter(c for c, _rid, _start in seen)
    return {
        "count": len(seen),
        "first_s": round(min(starts) - began_wall, 2),
        "last_s": round(max(starts) - began_wall, 2),
        "by_cluster": dict(by_cluster),
        "decided_too_late": sum(1 for _c, rid, _s in seen if rid in admissions),
    }


def explain(diagnosis: Mapping[str, Any]) -> str:
    """One line per class that went over, for the printed table."""
    lines = []
    for klass, d in diagnosis.items():
        if klass == "fail_open":
            lines.append(
                f"fail-open {d['count']} at +{d['first_s']}..{d['last_s']}s "
                f"({d['decided_too_late']} decided too late)"
            )
            continue
        bits = [f"{k} {v}" for k, v in sorted(d["admitted_by"].items())]
        if d["admitted_on_another_cluster"]:
            moved = ", ".join(
                f"{k} {v}" for k, v in sorted(d["admitted_on_another_cluster"].items())
            )
            bits.append(f"admitted on {moved}")
        if d["released_before_the_upstream_ended"]:
            bits.append(f"released early {d['released_before_the_upstream_ended']}")
        if d["unknown_to_the_processors"]:
            bits.append(f"unknown {d['unknown_to_the_processors']}")
        if len(d["config_versions"]) > 1:
            bits.append(f"{len(d['config_versions'])} config versions")
        lines.append(
            f"{klass}: peak {d['peak']} on {d['cluster']} (budget {d['budget']}) at "
            f"+{d['at_s']}s: " + ", ".join(bits)
        )
    return "; ".join(lines)
