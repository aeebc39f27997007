"""Load- and pressure-aware affinity: where a request goes when pure hashing is not enough.

``place(source, ranked, snapshot, session, now, params, within) -> Decision`` is a pure
function. The shell feeds it the session's candidates in hash order (``Rendezvous.ranked``), a
snapshot of the fleet's load, what it remembers about the session (seen recently? an
override?) and ``now``; it writes back the override the decision asks for. Nothing here reads
a clock or a store.

Cluster states, judged from the snapshot at ``now``:

- *unhealthy*: the shell has evidence it fails (Envoy failed over from it, or no endpoint of it
  is ready);
- *pressured*: its fresh load report says KV use >= ``kv_pressure_threshold`` (0.85): admitting a
  new conversation there would evict the caches of the ones it already holds; or one of its
  engines' GPUs is over a ``gpu_health`` threshold (memory, temperature, a slowdown:
  extproc.core.gpu_health), where a new conversation would risk an out-of-memory or run slow;
- *critical*: KV use >= ``kv_migrate_threshold`` (0.97): the engine is evicting or preempting
  anyway, so the caches a session would stay for are already going;
- *saturated*: more requests in flight than ``saturation_factor`` x the mean over the session's
  candidates (and at least ``min_inflight``, so one request on an idle fleet is not "load");
- *over its share* (only with ``balance_factor`` > 0): one more request would take the cluster's
  recent requests (a decayed count of what this processor placed there, half-life
  ``balance_half_life_s``) above ``balance_factor`` x the mean over the session's candidates
  (consistent hashing with bounded loads, Mirrokni et al.). Each replica bounds what it places
  itself, so the fleet's sum is bounded too;
- *has room*: healthy, not pressured, not saturated, not over its share.

A report older than ``signal_max_age_s`` counts as no report: a cluster that went quiet is
judged by in-flight counts alone, so a pressure reading cannot exile it forever.

The rules, first match wins:

1. **Hot key** (prefix keys only): a key with more than ``hot_key_share`` of its hash primary's
   load is spread over its top ``hot_key_spread`` candidates, to the least loaded one that is
   healthy and not pressured (ties broken by a per-request salt). Nothing is remembered. The
   trade-off: each of the k clusters prefills the shared opening once and holds it (k x its
   KV), and a follow-up request of one user may land beside, not on, its own earlier turn. In
   return no cluster carries a viral prompt alone. Explicit session ids (header, body field)
   are never spread: such a key is one conversation whose every turn extends the last one's
   prefix, so spreading it would cost a re-prefill on almost every turn.
2. **Override**: the session was placed off its hash primary before; it follows that choice
   (its cache is there) unless that cluster is now unhealthy or critical, or relief picked it
   (below), in which case it migrates (rule 3's target search). An override in use is
   refreshed (sliding TTL, see ``_refreshed``), so an active session keeps its cache and an
   idle one drifts back to the hash once its override expires.
3. **Existing session** (seen within ``new_session_ttl_s``): stays on its hash primary while the
   primary is merely busy (saturated or pressured; the class budget answers with 429 and retry
   hints), and migrates only when the primary is unhealthy or critical, or relief picked it
   (below): to the first candidate
   in hash order that is usable and not saturated, whatever its share (else the first healthy
   one that is not pressured). That costs one
   re-prefill, which the shell counts; the target is remembered so later turns follow.
4. **New session**: the hash primary when it has room; otherwise the first candidate in hash
   order with room ("spilled", remembered). Why bounded loads only here: hashing conversations
   (and co-locating those that share a document) leaves some clusters with more sessions than
   others by chance, and an existing session's cache is worth more than evenness, so only
   where a new session starts is chosen for balance. With no room anywhere (every candidate
   over its share or busy), the primary unless it is saturated, else the first candidate that
   is usable and not saturated; then the primary if it is usable (healthy, not pressured),
   else the first usable candidate; a fleet that is full everywhere leaves the budget to say
   no.

A LoRA adapter's request (``within``: its first candidates have it loaded) is decided by the same
rules among its loaded clusters while one of them is healthy: a spill, a hot key's spread or a
migration there never lands on a cluster that would load the adapter first. Only when none of
them is healthy (failover) do the rules run over every candidate of its base model.

**Relief** (``SessionView.leave``; GPU health, and KV pressure with affinity off, below): a
cluster whose GPUs stay over a ``gpu_health`` threshold is relieved in rounds, least active
sessions first
(extproc.core.relief: once it has stayed hot for ``move_after_ms``, ``move_fraction`` of the
sessions it holds, the ones with the fewest recent requests, and again each further
``move_after_ms``; at least one always stays). The shell marks a picked session's view with
the GPU verdict, and rules 2 and 3 migrate it while its cluster is still hot, with that verdict
as the migration's reason (``gpu_memory``, ``gpu_temperature``, ``gpu_slowdown``). The most
active sessions keep their cache: a quiet session's cache is the first an engine evicts anyway.

Without load-aware affinity (``enabled: false``, the product default) the shell asks
:func:`place_bounded` instead: rule 2 with relief's migrations only, then rule 4 judged on the
share bound and the hot set. No load report, in-flight count or hot-key rate is read there
(they ride on the response phase, which affinity alone asks Envoy for), so the only states are
*healthy* (probed clusters), *hot* (the GPU scraper's verdicts, which come from the DCGM
exporters, and, when the engines' /metrics are scraped, KV use at ``kv_migrate_threshold``:
neither comes from responses) and *over its share*; the placement counts are the processor's
own. A hot cluster is treated as an unhealthy one for new sessions and as a failover target:
no new session starts there, no secondary is one while a cooler candidate is healthy, and the
sessions it holds stay unless relief picks them (KV pressure below ``kv_migrate_threshold``
moves nothing there: the cluster is busy, not losing its caches). Relief's reason for a KV
verdict is ``kv_cache``.

The secondary (Envoy's failover target) is always the first other candidate in hash order that
is healthy and not pressured, or simply the next one when none is: with a quiet fleet that is
exactly pure hashing's secondary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from extproc.core.keys import KeySource
from extproc.core.load import ClusterLoad, FleetSnapshot
from extproc.core.placement import Placement

# "placed": a new session moved off its full primary by admission (extproc/core/flow.py).
Kind = Literal["primary", "spilled", "migrated", "hot_spread", "override", "placed"]
KINDS: tuple[Kind, ...] = ("primary", "spilled", "migrated", "hot_spread", "override", "placed")
# Why a session left the cluster holding its cache: the cluster failed, its KV use is critical
# (affinity on: every session leaves), or relief (extproc.core.relief) picked it among the least
# active of a cluster whose GPUs stay over a gpu_health threshold (the GPU verdict's own name)
# or, with affinity off, whose scraped KV use stays at ``kv_migrate_threshold`` ("kv_cache").
MigrationReason = Literal[
    "unhealthy", "memory_pressure", "gpu_memory", "gpu_temperature", "gpu_slowdown", "kv_cache"
]


@dataclass(frozen=True, slots=True)
class AffinityParams:
    """Compiled from fleet.yaml's ``affinity:`` section (validated there)."""

    enabled: bool = False
    saturation_factor: float = 1.25
    min_inflight: int = 4
    kv_pressure_threshold: float = 0.85
    kv_migrate_threshold: float = 0.97
    new_session_ttl_s: float = 600.0
    override_ttl_s: float = 1800.0
    signal_max_age_s: float = 10.0
    hot_key_share: float = 0.5
    hot_key_spread: int = 3
    hot_key_min_requests: float = 20.0
    hot_key_half_life_s: float = 10.0
    # 0: off. Otherwise a new session's cluster stays within this factor of the mean recent
    # requests over its candidates (see "over its share").
    balance_factor: float = 0.0
    balance_half_life_s: float = 60.0


@dataclass(frozen=True, slots=True)
class Override:
    """A remembered placement: the session runs on ``cluster`` until ``expires_at``."""

    cluster: str
    expires_at: float


@dataclass(frozen=True, slots=True)
class SessionView:
    """What the shell remembers about the request's session, looked up before deciding."""

    seen: bool  # a request of this session was seen within new_session_ttl_s
    override: Override | None = None
    # The key's share of its hash primary's load (extproc.core.hotkeys), 0 when not measured.
    key_share: float = 0.0
    # Any per-request number (e.g. a hash of the request id): breaks ties among hot-key targets
    # so that sequential requests of a hot key spread too.
    salt: int = 0
    # Set when relief (extproc.core.relief) picked this session to leave the cluster it is on,
    # whose GPUs stay over a threshold: the GPU verdict, the migration's reason.
    leave: MigrationReason | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    placement: Placement
    kind: Kind
    # The shell stores this (session -> cluster until expiry) when not None.
    override_to_write: Override | None = None
    # Set when kind == "migrated": why the session left the cluster that held its cache.
    migrated_from: str | None = None
    migration_reason: MigrationReason | None = None


@dataclass(frozen=True, slots=True)
class _Judge:
    """Cluster states at one instant for one candidate list."""

    snapshot: FleetSnapshot
    now: float
    params: AffinityParams
    mean_load: float
    # Recent requests over the session's healthy candidates: their sum and how many there are.
    recent_total: float = 0.0
    candidates: int = 1

    def load(self, name: str) -> int:
        return self.snapshot.get(name).load(self.now, self.params.signal_max_age_s)

    def healthy(self, name: str) -> bool:
        return self.snapshot.get(name).healthy

    def _kv(self, name: str) -> float | None:
        return self.snapshot.get(name).kv_pressure(self.now, self.params.signal_max_age_s)

    def pressured(self, name: str) -> bool:
        """KV use at the pressure threshold, or a GPU over a gpu_health threshold."""
        if self.snapshot.get(name).gpu is not None:
            return True
        kv = self._kv(name)
        return kv is not None and kv >= self.params.kv_pressure_threshold

    def gpu_hot(self, name: str) -> bool:
        """One of its engines' GPUs is over a gpu_health threshold."""
        return self.snapshot.get(name).gpu is not None

    def critical(self, name: str) -> bool:
        kv = self._kv(name)
        return kv is not None and kv >= self.params.kv_migrate_threshold

    def saturated(self, name: str) -> bool:
        load = self.load(name)
        p = self.params
        return load >= p.min_inflight and load > p.saturation_factor * self.mean_load

    def over_share(self, name: str) -> bool:
        factor = self.params.balance_factor
        if factor <= 0:
            return False
        limit = factor * (self.recent_total + 1.0) / self.candidates
        return self.snapshot.get(name).recent + 1.0 > limit

    def usable(self, name: str) -> bool:
        return self.healthy(name) and not self.pressured(name)

    def can_take(self, name: str) -> bool:
        """Room for a session that is moving (a migration): its cache is lost or already
        moved, so evenness (the share bound) is not a reason to skip a cluster."""
        return self.usable(name) and not self.saturated(name)

    def has_room(self, name: str) -> bool:
        return self.can_take(name) and not self.over_share(name)

    def must_leave(self, name: str, session: SessionView) -> MigrationReason | None:
        if not self.healthy(name):
            return "unhealthy"
        if self.critical(name):
            return "memory_pressure"
        if session.leave is not None and self.gpu_hot(name):
            return session.leave
        return None


def _first(
    ranked: Sequence[str], ok: Callable[[str], bool], exclude: str | None = None
) -> str | None:
    for name in ranked:
        if name != exclude and ok(name):
            return name
    return None


def _placement(ranked: Sequence[str], chosen: str, judge: _Judge) -> Placement:
    secondary = _first(ranked, judge.usable, chosen) or _first(ranked, lambda _n: True, chosen)
    return Placement(chosen, secondary)


@dataclass(frozen=True, slots=True)
class RecentShare:
    """One cluster's recent-placement count, and the sum and number of the counts of the
    candidates the mean is taken over (all of them healthy), each possibly summed in another
    order or kept incrementally: equal to :func:`_judge`'s up to rounding."""

    recent: float
    total: float
    candidates: int


# Relative slack for the rounding between two ways of summing the same decayed counts: a sum of
# n non-negative terms in another order differs by at most ~n x 2^-53 of the sum, and an
# incrementally decayed total by a few ulps per update since its last exact resync; 1e-9
# covers millions of candidates or updates. A verdict inside the slack is left to the exact
# path.
SHARE_SLACK = 1e-9


def share_verdict(share: RecentShare, factor: float) -> bool | None:
    """:meth:`_Judge.over_share`'s verdict (True: over its share) where the rounding of
    ``share.total`` cannot move it across the limit, None where it might."""
    if factor <= 0:
        return False
    limit = factor * (share.total + 1.0) / share.candidates
    if share.recent + 1.0 < limit * (1.0 - SHARE_SLACK):
        return False
    if share.recent + 1.0 > limit * (1.0 + SHARE_SLACK):
        return True
    return None


@dataclass(frozen=True, slots=True)
class Shortcut:
    """Cheaper views of place_bounded's inputs, for a new session's judgement.

    ``share(name)``: the cluster's :class:`RecentShare`, or None when it is not known (an
    unhealthy candidate: the mean is then over the healthy ones only); ``head(k)``: exactly
    the first ``k`` of ``ranked()``; ``cluster(name)``: the cluster as ``loads()`` has it."""

    share: Callable[[str], RecentShare | None]
    head: Callable[[int], Sequence[str]]
    cluster: Callable[[str], ClusterLoad]
    size: int  # how many candidates ``ranked()`` lists
    # The cluster's recent count alone (``share(name).recent``, at the same instant).
    recent: Callable[[str], float]
    # For limits (low, high) around the mean's: the first candidate in hash order (of those
    # the mean is over) whose count + 1 is at most ``high``, and whether it is below ``low``;
    # (None, True) when there is none. None: not kept (the head is searched one by one).
    first_within: Callable[[float, float], tuple[str | None, bool]] | None = None


def _in_order(head: Callable[[int], Sequence[str]], size: int) -> Iterator[str]:
    """The first ``size`` of the ranking, asking ``head`` for a few more each time."""
    k, done = 4, 0
    while done < size:
        names = head(min(k, size))
        if len(names) <= done:
            return
        yield from names[done:]
        done, k = len(names), k * 8


def _bounded_by_shortcut(
    hashed: Placement, shortcut: Shortcut, now: float, params: AffinityParams, within: int | None
) -> Decision | None:
    """place_bounded's judgement of a new session from ``shortcut``, or None where it cannot
    settle it (an unhealthy candidate, a verdict too close to the limit)."""
    factor = params.balance_factor
    known = shortcut.share(hashed.primary)
    if known is None:
        return None
    over = share_verdict(known, factor)
    if over is not True:
        return None if over is None else Decision(hashed, "primary")
    # Every candidate is healthy (``share`` knew the primary's): the limit is the same for all.
    limit = factor * (known.total + 1.0) / known.candidates
    low, high = limit * (1.0 - SHARE_SLACK), limit * (1.0 + SHARE_SLACK)
    if high < 1.0:
        # Warm-up (fewer recent placements than candidates): no count is below 0, so every
        # candidate is over its share and the hash placement stands.
        return Decision(hashed, "primary")
    target = None
    if shortcut.first_within is not None:
        target, sure = shortcut.first_within(low, high)
        if not sure:
            return None  # too close to the limit to tell
    else:
        recent = shortcut.recent
        for name in _in_order(shortcut.head, within or shortcut.size):
            count = recent(name) + 1.0
            if count < low:
                target = name
                break
            if count <= high:
                return None  # too close to the limit to tell
    if target is None or target == hashed.primary:
        return Decision(hashed, "primary")
    # _placement's rule: the first usable other candidate in hash order, else the first other.
    secondary = first_other = None
    for name in _in_order(shortcut.head, shortcut.size):
        if name == target:
            continue
        first_other = first_other or name
        snapshot = FleetSnapshot({name: shortcut.cluster(name)})
        if _Judge(snapshot, now, params, 0.0).usable(name):
            secondary = name
            break
    return Decision(
        Placement(target, secondary or first_other),
        "spilled",
        Override(target, now + params.override_ttl_s),
    )


def _judge(
    ranked: Sequence[str], snapshot: FleetSnapshot, now: float, params: AffinityParams
) -> _Judge:
    partial = _Judge(snapshot, now, params, 0.0)
    healthy = [n for n in ranked if partial.healthy(n)] or list(ranked)
    mean = sum(partial.load(n) for n in healthy) / len(healthy)
    recent = sum(snapshot.get(n).recent for n in healthy) if params.balance_factor > 0 else 0.0
    return _Judge(snapshot, now, params, mean, recent, len(healthy))


def _loaded(
    ranked: Sequence[str], snapshot: FleetSnapshot, within: int | None
) -> tuple[Sequence[str], bool]:
    """The candidates the rules choose among, and whether they are a LoRA adapter's loaded
    tier: its first ``within`` candidates while one of them is healthy, else all of them (a
    cluster without the adapter loads it on demand, which beats no cluster at all)."""
    if not within or within >= len(ranked):
        return ranked, False
    tier = ranked[:within]
    if any(snapshot.get(n).healthy for n in tier):
        return tier, True
    return ranked, False


def _hot_target(ranked: Sequence[str], session: SessionView, judge: _Judge) -> str | None:
    top = [n for n in ranked[: judge.params.hot_key_spread] if judge.usable(n)]
    if len(top) < 2:
        return None  # nothing to spread over: the ordinary rules decide
    width = len(top)
    rotation = session.salt % width
    return min(
        enumerate(top), key=lambda item: (judge.load(item[1]), (item[0] - rotation) % width)
    )[1]


def _refreshed(override: Override, now: float, params: AffinityParams) -> Override | None:
    """A later expiry for an override in use, or None when it still has long enough to run.

    It must outlive the session's "seen" mark: an override that lapsed while the session
    still counted as existing would send its next turn back to the hash primary, away from its
    cache. So it is rewritten once less than ``new_session_ttl_s`` remains (config guarantees
    ``override_ttl_s >= new_session_ttl_s``), and not before half its TTL has passed: writing
    on every request would cost a store write (a Redis round trip) per request.
    """
    threshold = max(params.new_session_ttl_s, params.override_ttl_s / 2)
    if override.expires_at - now < threshold:
        return Override(override.cluster, now + params.override_ttl_s)
    return None


def _migrate(
    ranked: Sequence[str],
    among: Sequence[str],
    tier: bool,
    current: str,
    reason: MigrationReason,
    judge: _Judge,
    now: float,
) -> Decision | None:
    # Not has_room: the share bound places new sessions only. A session leaving a cluster
    # Envoy failed over from already has its cache on the secondary (the first usable
    # candidate after it); the bound would move it a second time, to a third cache.
    target = _first(among, judge.can_take, current) or _first(among, judge.usable, current)
    if target is None and tier and reason == "unhealthy":
        # An adapter's failed cluster: a healthy loaded one, even pressured, rather than
        # staying there for Envoy's failover to a secondary that may not have it.
        target = _first(among, judge.healthy, current)
    if target is None:
        return None  # nowhere better: stay, and let Envoy's failover and the budget cope
    return Decision(
        _placement(ranked, target, judge),
        "migrated",
        Override(target, now + judge.params.override_ttl_s),
        migrated_from=current,
        migration_reason=reason,
    )


def place(
    source: KeySource,
    ranked: Sequence[str],
    snapshot: FleetSnapshot,
    session: SessionView,
    now: float,
    params: AffinityParams,
    within: int | None = None,
) -> Decision:
    """Where this request runs; ``ranked`` is its candidates in hash order (never empty);
    ``source`` is where its session key came from (only prefix keys may be hot-spread).

    ``within``: a LoRA adapter's request, whose first ``within`` candidates have it loaded
    (extproc.core.models.Candidates, as in :func:`place_bounded`). While one of them is
    healthy, every choice the rules make (a spill, a hot key's spread, a migration) is among
    them, judged by their own mean load and share; only when none is healthy do the rules run
    over every candidate. An override elsewhere is still followed (the session's cache is
    there) and the secondary is still the first usable candidate in hash order."""
    primary = ranked[0]
    # Inline for the common case, a request without an adapter: not one call more than before.
    among, tier = _loaded(ranked, snapshot, within) if within else (ranked, False)
    judge = _judge(among, snapshot, now, params)

    if (
        source is KeySource.PREFIX
        and params.hot_key_spread >= 2
        and session.key_share >= params.hot_key_share
    ):
        target = _hot_target(among, session, judge)
        if target is not None:
            return Decision(_placement(ranked, target, judge), "hot_spread")

    override = session.override
    if override is not None and override.expires_at > now and override.cluster in ranked:
        reason = judge.must_leave(override.cluster, session)
        if reason is None:
            return Decision(
                _placement(ranked, override.cluster, judge),
                "override",
                _refreshed(override, now, params),
            )
        moved = _migrate(ranked, among, tier, override.cluster, reason, judge, now)
        if moved is not None:
            return moved
        return Decision(_placement(ranked, override.cluster, judge), "override")

    if session.seen:
        reason = judge.must_leave(primary, session)
        if reason is not None:
            moved = _migrate(ranked, among, tier, primary, reason, judge, now)
            if moved is not None:
                return moved
        return Decision(_placement(ranked, primary, judge), "primary")

    if judge.has_room(primary):
        return Decision(_placement(ranked, primary, judge), "primary")
    target = (
        _first(among, judge.has_room)
        # Over its share is a reason to prefer another cluster, saturation a reason to avoid
        # one: with no room anywhere, an unsaturated cluster before a saturated primary (on
        # two clusters, a few spills put the other over its share at once, and the sessions
        # went back to the backlogged primary).
        or (primary if judge.can_take(primary) else None)
        or _first(among, judge.can_take)
        or (primary if judge.usable(primary) else None)
        or _first(among, judge.usable)
        # An adapter's: a healthy loaded cluster before a failed primary (see _migrate).
        or (_first(among, judge.healthy) if tier else None)
        or primary
    )
    if target == primary:
        return Decision(_placement(ranked, primary, judge), "primary")
    return Decision(
        _placement(ranked, target, judge),
        "spilled",
        Override(target, now + params.override_ttl_s),
    )


def place_bounded(
    hashed: Placement,
    candidates: Collection[str],
    ranked: Callable[[], Sequence[str]],
    loads: Callable[[], FleetSnapshot],
    session: SessionView,
    now: float,
    params: AffinityParams,
    within: int | None = None,
    shortcut: Shortcut | None = None,
    hot: Collection[str] = (),
) -> Decision:
    """Bounded-load placement of new sessions with load-aware affinity off: an override is
    followed (refreshed as in rule 2); a new session whose hash primary is over its share, or
    hot, starts on the first healthy candidate in hash order within its share and not hot
    ("spilled", remembered); anything else keeps pure hashing's placement, ``hashed`` (the top
    two of ``ranked``). With ``balance_factor`` 0 and nothing hot nothing is ever spilled.

    ``hot``: the clusters that take no new sessions now (usually none): one of their engines'
    GPUs is over a gpu_health threshold, or their scraped KV use is at ``kv_migrate_threshold``
    (the shell's verdicts). A hot cluster is treated as an unhealthy one for new sessions and as
    Envoy's failover target: a secondary that is hot is replaced by the first other candidate in
    hash order that is healthy and not hot, when there is one (so with nothing hot, and for
    every request whose secondary is cool, the secondary is pure hashing's).

    An existing session moves only when relief picked it (``session.leave``: among the least
    active of a hot cluster, extproc.core.relief) and that cluster is still hot: to the first
    other candidate that is healthy and not hot ("migrated", remembered), or nowhere when there
    is none.

    ``ranked`` (the candidates in hash order) and ``loads`` (health and the recent-placement
    counts) are asked for only when a new session is judged, a session moves or a secondary is
    hot: ranking every candidate and building the snapshot cost more than the rest of the
    decision, and most requests are later turns. ``candidates``: the same clusters, for the
    override's membership. ``within``: spill among (and take the mean over) the first
    ``within`` candidates only (a LoRA adapter's clusters that have it loaded,
    extproc.core.models.Candidates). ``shortcut``: cheaper views of the same inputs
    (:class:`Shortcut`), used while nothing is hot: a new session is judged from them without
    ranking every candidate or building the snapshot where they settle it, and by ``ranked``
    and ``loads`` otherwise. Only verdicts that float rounding cannot flip are taken from them
    (:func:`share_verdict`), so the decision is the same as without them."""
    decision = _bounded(
        hashed, candidates, ranked, loads, session, now, params, within, shortcut, hot
    )
    secondary = decision.placement.secondary
    if secondary is None or secondary not in hot:
        return decision
    primary = decision.placement.primary
    snapshot = loads()
    cool = _first(ranked(), lambda n: n not in hot and snapshot.get(n).healthy, primary)
    if cool is None:
        return decision
    return dataclasses.replace(decision, placement=Placement(primary, cool))


def _bounded(
    hashed: Placement,
    candidates: Collection[str],
    ranked: Callable[[], Sequence[str]],
    loads: Callable[[], FleetSnapshot],
    session: SessionView,
    now: float,
    params: AffinityParams,
    within: int | None,
    shortcut: Shortcut | None,
    hot: Collection[str],
) -> Decision:
    override = session.override
    followed = override is not None and override.expires_at > now and override.cluster in candidates
    if followed or session.seen:
        current = override.cluster if followed and override is not None else hashed.primary
        if session.leave is not None and current in hot:
            moved = _relieved(current, session.leave, ranked, loads, now, params, within, hot)
            if moved is not None:
                return moved
        if not followed or override is None:
            return Decision(hashed, "primary")
        # Pure hashing's failover rule (the first other candidate in hash order).
        secondary = hashed.secondary if current == hashed.primary else hashed.primary
        return Decision(
            Placement(current, secondary), "override", _refreshed(override, now, params)
        )
    if params.balance_factor <= 0 and hashed.primary not in hot:
        return Decision(hashed, "primary")
    # The shortcut knows nothing of hot clusters: while one is, a spill's target is searched
    # exactly.
    if shortcut is not None and not hot:
        quick = _bounded_by_shortcut(hashed, shortcut, now, params, within)
        if quick is not None:
            return quick
    order = ranked()
    among = order[:within] if within else order
    judge = _judge(among, loads(), now, params)

    def open_to_new(name: str) -> bool:
        return judge.healthy(name) and name not in hot

    primary = hashed.primary
    if primary not in hot and not judge.over_share(primary):
        return Decision(hashed, "primary")
    target = _first(among, lambda n: open_to_new(n) and not judge.over_share(n))
    if target is None and primary in hot:
        # Over its share is a reason to prefer another cluster, a hot one a reason to avoid
        # it: with no cluster within its share, the first that is not hot.
        target = _first(among, open_to_new)
    if target is None or target == primary:
        return Decision(hashed, "primary")
    return Decision(
        _placement(order, target, judge),
        "spilled",
        Override(target, now + params.override_ttl_s),
    )


def _relieved(
    current: str,
    reason: MigrationReason,
    ranked: Callable[[], Sequence[str]],
    loads: Callable[[], FleetSnapshot],
    now: float,
    params: AffinityParams,
    within: int | None,
    hot: Collection[str],
) -> Decision | None:
    """place_bounded's move of a session relief picked off the hot ``current``: to the first
    other candidate (of the adapter's loaded ones, when ``within``) that is healthy and not
    hot, whatever its share (as :func:`_migrate`: the bound places new sessions only)."""
    order = ranked()
    among = order[:within] if within else order
    judge = _judge(among, loads(), now, params)
    target = _first(among, lambda n: judge.healthy(n) and n not in hot, current)
    if target is None:
        return None
    return Decision(
        _placement(order, target, judge),
        "migrated",
        Override(target, now + params.override_ttl_s),
        migrated_from=current,
        migration_reason=reason,
    )
