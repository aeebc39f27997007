"""The shell's side of load-aware affinity: what the pure policy (extproc.core.affinity) is fed.

Kept out of core/ because it is state over time and I/O:

- :class:`LoadTable` — per cluster: this processor's own requests in flight (acquired when a
  request is routed, released when its ext_proc stream ends), the last load report the cluster
  returned (with the instant it arrived), and "failing until" after Envoy was seen failing over
  from it, and (bounded-load placement on) a decayed count of the requests it placed there.
  ``snapshot(now)`` turns it into the core's immutable :class:`FleetSnapshot`.
- :class:`SessionMemory` — per session key (a 16-byte digest, never the raw id): when it was
  last seen (new vs existing session) and its override (spilled / migrated placement) with an
  expiry. LRU-bounded by ``affinity.max_sessions``; expired entries are dropped as they reach
  the old end.
- :class:`RedisSessions` — the same two facts in Redis, shared by every replica, when
  ``redis.url`` is configured: ``P:aff:<store key>:seen`` (PX = new_session_ttl) and
  ``P:aff:<store key>:ov`` (cluster name, PX = override_ttl), where the store key is the
  session's keyed hash (``SessionKey.store_key``, never the unkeyed digest: Redis readers must
  not be able to test guesses of a session id). Replicas share these only when they share the
  label secret (``FLEET_SESSION_SECRET`` / ``session.label_secret_file``); without one each
  replica keys its own entries, and ``serve`` warns. One pipelined round trip per request
  (GET + PTTL of the override, SET ... GET of the seen mark) and one SET when an override is
  written. Calls are bounded by ``redis.timeout_ms``; on failure the replica's own memory
  answers (fail-open: a lost override costs at most one cache miss, never a request) and Redis
  is left alone for the probe interval of the Redis health tracker it shares with the ledger
  (extproc/ledger/redis_health.py). Memory is always written too, so it is warm then.
- :class:`LinkMemory` and ``P:resp:<link name>`` (PX = ``session.response_link_ttl_s``): Responses
  API response id -> session links (extproc.core.response_links), learnt from responses and
  followed by turns that name a ``previous_response_id``; same fail-open as the sessions.
- :class:`FleetState` — the facade the servicer calls, plus the hot-key estimator.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Any

from extproc.config.runtime import Runtime
from extproc.core.affinity import AffinityParams, Decision, Override, RecentShare, SessionView
from extproc.core.facts import RequestFacts
from extproc.core.hotkeys import HotKeys
from extproc.core.keys import KeySource, SessionKey
from extproc.core.load import ClusterLoad, FleetSnapshot, LoadReport
from extproc.core.placement import RecentCounts, Rendezvous
from extproc.core.response_links import Link, link_name, make_link, read_link
from extproc.ledger.redis_client import UNAVAILABLE, AnyRedis, any_client
from extproc.ledger.redis_health import PROBE_INTERVAL_S, RedisHealth
from extproc.pipeline.metrics import Metrics
from extproc.pipeline.relief import ReliefTable

log = logging.getLogger("extproc.affinity")

__all__ = [
    "PROBE_INTERVAL_S",
    "FleetState",
    "LinkMemory",
    "LoadTable",
    "RedisSessions",
    "SessionMemory",
]


# Updates an incremental total of recent placements takes before it is summed again exactly:
# its rounding stays far inside extproc.core.affinity.SHARE_SLACK.
RESYNC_UPDATES = 4096
# Candidate lists with a kept total (a placer's, or a LoRA adapter's loaded tier); past this
# the oldest is dropped (a reload builds new lists).
MAX_TOTALS = 64


class _Total:
    """The decayed count of recent placements summed over one candidate list, kept up to date
    as requests are placed: with one half-life for every count, the sum of decayed counts is
    itself one decayed counter, so the mean the share bound needs is O(1), not O(clusters)."""

    __slots__ = ("at", "counts", "half_life_s", "lanes", "names", "ready", "updates", "value")

    def __init__(self, names: tuple[str, ...], half_life_s: float) -> None:
        self.names = names  # held: the dict is keyed by its id
        self.lanes = {n: i for i, n in enumerate(names)}
        # The members' own counts as arrays (built at the first spill search), kept equal to
        # LoadTable._recent.
        self.counts: RecentCounts | None = None
        self.half_life_s = half_life_s
        self.value: float | None = None  # None: to be summed exactly at the next read
        self.at = 0.0
        self.updates = 0
        self.ready: Collection[str] | None = None  # the ready set every member was found in


class LoadTable:
    def __init__(self) -> None:
        self._inflight: dict[str, int] = {}
        self._reports: dict[str, tuple[LoadReport, float]] = {}
        self._failing_until: dict[str, float] = {}
        # cluster -> (why its GPUs take no new sessions, until when the verdict holds, since
        # when its GPUs have been hot without a break: the scraper's first hot verdict)
        self._gpu: dict[str, tuple[str, float, float]] = {}
        # Relief for KV pressure (affinity off, engine_metrics on: extproc.core.relief): the
        # KV use at which a cluster is hot and how long a report is trusted; None: off.
        self.kv_relief: tuple[float, float] | None = None
        # cluster -> since when its reports have said KV use at kv_relief's threshold.
        self._kv_high: dict[str, float] = {}
        # cluster -> (decayed count of placed requests, instant it was last brought up to date)
        self._recent: dict[str, tuple[float, float]] = {}
        # id(candidate names) -> their kept total (see share); the latest instant placed saw.
        self._totals: dict[int, _Total] = {}
        # cluster -> the kept totals it is a member of: a placement touches only those.
        self._member_of: dict[str, list[_Total]] = {}
        self._latest = float("-inf")

    def placed(self, cluster: str, now: float, half_life_s: float) -> None:
        """Count one request placed on ``cluster`` (bounded-load placement's input): every
        request, a later turn as much as a new session's first, so the bound compares the
        requests each cluster received recently. O(1) in the fleet's size: only the kept
        totals ``cluster`` is a member of are brought up to date (usually one)."""
        count = self.recent(cluster, now, half_life_s) + 1.0
        self._recent[cluster] = (count, now)
        self._latest = max(self._latest, now)
        for total in self._member_of.get(cluster, ()):
            if total.counts is not None:
                total.counts.set(total.lanes[cluster], count, now)
            value = total.value
            if (
                value is None
                or total.half_life_s != half_life_s
                or now < total.at
                or total.updates >= RESYNC_UPDATES
            ):
                # Summed exactly at the next read: the decay identity needs one half-life and
                # instants in order.
                total.value = None
                continue
            total.value = value * 2.0 ** (-(now - total.at) / half_life_s) + 1.0
            total.at = now
            total.updates += 1

    def _keep(self, total: _Total) -> None:
        if len(self._totals) >= MAX_TOTALS:
            self._drop(self._totals[next(iter(self._totals))])
        self._totals[id(total.names)] = total
        for name in total.lanes:
            self._member_of.setdefault(name, []).append(total)

    def _drop(self, total: _Total) -> None:
        del self._totals[id(total.names)]
        for name in total.lanes:
            held = self._member_of[name]
            held.remove(total)
            if not held:
                del self._member_of[name]

    def share(
        self,
        names: tuple[str, ...],
        cluster: str,
        now: float,
        ready: Collection[str] | None,
        half_life_s: float,
    ) -> RecentShare | None:
        """``cluster``'s recent count against the total over ``names`` (a candidate list
        passed as the same tuple object each time), as extproc.core.affinity's share bound
        reads them, or None when a member is unhealthy (the exact path then takes the mean
        over the healthy ones) or placements arrived out of order."""
        if now < self._latest:
            return None
        total = self._totals.get(id(names))
        if total is None or total.names is not names or total.half_life_s != half_life_s:
            if total is not None:
                self._drop(total)
            total = _Total(names, half_life_s)
            self._keep(total)
        failing = self._failing_until
        if failing and any(now < until and c in total.lanes for c, until in failing.items()):
            return None
        if ready is not None and total.ready is not ready:
            if not frozenset(total.lanes).issubset(ready):
                return None
            total.ready = ready
        value = total.value
        if value is None:
            value = sum(self.recent(n, now, half_life_s) for n in names)
            total.value, total.at, total.updates = value, now, 0
        else:
            value *= 2.0 ** (-(now - total.at) / half_life_s)
        return RecentShare(self.recent(cluster, now, half_life_s), value, len(names))

    def first_within(
        self,
        placer: Rendezvous,
        point: int,
        now: float,
        half_life_s: float,
        low: float,
        high: float,
    ) -> tuple[str | None, bool]:
        """extproc.core.affinity.Shortcut.first_within over ``placer.names`` (after ``share``
        on the same names at ``now`` answered: every member healthy, ``now`` not before the
        latest placement)."""
        total = self._totals[id(placer.names)]
        counts = total.counts
        if counts is None:
            counts = total.counts = RecentCounts(len(placer.names))
            for name, lane in total.lanes.items():
                found = self._recent.get(name)
                if found is not None:
                    counts.set(lane, *found)
        within, maybe = counts.lanes(now, half_life_s, low, high)
        first = placer.first_of(point, maybe)
        if first is None:
            return None, True
        return first, bool(within[total.lanes[first]])

    def recent(self, cluster: str, now: float, half_life_s: float) -> float:
        found = self._recent.get(cluster)
        if found is None:
            return 0.0
        value, at = found
        decay: float = 2.0 ** (-max(0.0, now - at) / half_life_s)
        return value * decay

    def acquire(self, cluster: str) -> int:
        count = self._inflight.get(cluster, 0) + 1
        self._inflight[cluster] = count
        return count

    def release(self, cluster: str) -> int:
        count = max(0, self._inflight.get(cluster, 0) - 1)
        self._inflight[cluster] = count
        return count

    def inflight(self, cluster: str) -> int:
        return self._inflight.get(cluster, 0)

    def record(self, cluster: str, report: LoadReport, now: float) -> None:
        relief = self.kv_relief
        if relief is not None:
            if report.kv is not None and report.kv >= relief[0]:
                if not self.kv_hot(cluster, now):
                    self._kv_high[cluster] = now  # a new hot spell: from this report on
            else:
                self._kv_high.pop(cluster, None)
        self._reports[cluster] = (report, now)

    def forget_scraped(self, cluster: str) -> None:
        """Drop the cluster's report if it came from a scrape (a header report stays)."""
        found = self._reports.get(cluster)
        if found is not None and found[0].source == "scrape":
            del self._reports[cluster]
            self._kv_high.pop(cluster, None)

    def record_gpu(self, cluster: str, reason: str | None, at: float, until: float) -> None:
        """The GPU verdict of a cluster's engines (extproc.pipeline.gpu_scraper) observed at
        ``at``, trusted until ``until``; None: its GPUs are fine (or no longer watched)."""
        if reason is None:
            self._gpu.pop(cluster, None)
            return
        found = self._gpu.get(cluster)
        # Hot without a break (the last verdict still held): the spell goes on.
        since = found[2] if found is not None and at < found[1] else at
        self._gpu[cluster] = (reason, until, since)

    def gpu_reason(self, cluster: str, now: float) -> str | None:
        found = self._gpu.get(cluster)
        return found[0] if found is not None and now < found[1] else None

    def gpu_hot(self, now: float) -> frozenset[str]:
        """The clusters with a fresh GPU verdict at ``now`` (usually none)."""
        if not self._gpu:
            return frozenset()
        return frozenset(c for c, (_reason, until, _since) in self._gpu.items() if now < until)

    def kv_hot(self, cluster: str, now: float) -> bool:
        """Whether the cluster's fresh report says KV use at kv_relief's threshold."""
        relief = self.kv_relief
        if relief is None or cluster not in self._kv_high:
            return False
        found = self._reports.get(cluster)
        return found is not None and now - found[1] <= relief[1]

    def hot_reason(self, cluster: str, now: float) -> str | None:
        """Why the cluster takes no new sessions and is relieved (extproc.core.relief): its
        GPU verdict, else ``kv_cache`` (KV relief); None when it is neither."""
        return self.gpu_reason(cluster, now) or ("kv_cache" if self.kv_hot(cluster, now) else None)

    def hot_since(self, cluster: str, now: float) -> float | None:
        """Since when the cluster has been hot without a break, by the scrapers' clocks (the
        first verdict or report that found it so); None when it is not hot now."""
        times = []
        found = self._gpu.get(cluster)
        if found is not None and now < found[1]:
            times.append(found[2])
        if self.kv_hot(cluster, now):
            times.append(self._kv_high[cluster])
        return min(times) if times else None

    def hot(self, now: float) -> frozenset[str]:
        """The clusters that take no new sessions at ``now``: GPU-hot or KV-hot (usually
        none)."""
        if not self._kv_high:
            return self.gpu_hot(now)
        return self.gpu_hot(now) | {c for c in self._kv_high if self.kv_hot(c, now)}

    def mark_failing(self, cluster: str, until: float) -> None:
        self._failing_until[cluster] = max(until, self._failing_until.get(cluster, until))

    def cluster(
        self,
        name: str,
        now: float,
        ready: Collection[str] | None = None,
        half_life_s: float | None = None,
    ) -> ClusterLoad:
        failing = self._failing_until.get(name)
        healthy = (failing is None or now >= failing) and (ready is None or name in ready)
        recent = 0.0 if half_life_s is None else self.recent(name, now, half_life_s)
        gpu = self.gpu_reason(name, now) if self._gpu else None
        found = self._reports.get(name)
        if found is None:
            return ClusterLoad(
                inflight=self._inflight.get(name, 0), healthy=healthy, recent=recent, gpu=gpu
            )
        report, at = found
        return ClusterLoad(
            inflight=self._inflight.get(name, 0),
            kv=report.kv,
            queue=report.queue,
            reported_inflight=report.inflight,
            reported_at=at,
            healthy=healthy,
            recent=recent,
            gpu=gpu,
        )

    def snapshot(
        self,
        names: Sequence[str],
        now: float,
        ready: Collection[str] | None = None,
        half_life_s: float | None = None,
    ) -> FleetSnapshot:
        """The clusters ``names`` as the policy sees them at ``now``. ``ready``: clusters with
        a ready endpoint (endpoint-picker mode probes them), None when not known;
        ``half_life_s``: decay of the recent-request counts (None: not read, all 0)."""
        return FleetSnapshot.of({n: self.cluster(n, now, ready, half_life_s) for n in names})


class SessionMemory:
    """Seen marks and overrides of one replica, LRU-bounded."""

    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self._seen: OrderedDict[bytes, float] = OrderedDict()
        self._overrides: OrderedDict[bytes, Override] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def touch(self, key: bytes, now: float, ttl_s: float) -> bool:
        """Mark the session seen at ``now``; True when it had been seen within ``ttl_s``."""
        last = self._seen.pop(key, None)
        self._seen[key] = now
        # The dict is in last-seen order: expired marks collect at the front.
        while self._seen:
            oldest_key, oldest = next(iter(self._seen.items()))
            if len(self._seen) <= self.max_sessions and now - oldest <= ttl_s:
                break
            del self._seen[oldest_key]
        return last is not None and now - last <= ttl_s

    def seen(self, key: bytes, now: float, ttl_s: float) -> bool:
        """Whether the session was seen within ``ttl_s``, without marking it (a preview)."""
        last = self._seen.get(key)
        return last is not None and now - last <= ttl_s

    def override(self, key: bytes, now: float) -> Override | None:
        found = self._overrides.get(key)
        if found is not None and found.expires_at <= now:
            del self._overrides[key]
            return None
        return found

    def write(self, key: bytes, override: Override, now: float) -> None:
        self._overrides.pop(key, None)
        self._overrides[key] = override
        while self._overrides:
            oldest_key, oldest = next(iter(self._overrides.items()))
            if len(self._overrides) <= self.max_sessions and oldest.expires_at > now:
                break
            del self._overrides[oldest_key]

    @property
    def overrides(self) -> int:
        return len(self._overrides)


class LinkMemory:
    """Response links of one replica (extproc.core.response_links): link name -> the session
    and when the link expires; LRU-bounded."""

    def __init__(self, max_links: int) -> None:
        self.max_links = max_links
        self._links: OrderedDict[bytes, tuple[SessionKey, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._links)

    def get(self, name: bytes, now: float) -> SessionKey | None:
        found = self._links.get(name)
        if found is None:
            return None
        if found[1] <= now:
            del self._links[name]
            return None
        return found[0]

    def put(self, name: bytes, session: SessionKey, expires_at: float) -> None:
        self._links.pop(name, None)
        self._links[name] = (session, expires_at)
        while len(self._links) > self.max_links:
            self._links.popitem(last=False)


class RedisSessions:
    """Seen marks and overrides shared by every replica (see the module docstring)."""

    def __init__(self, client: AnyRedis, prefix: str, timeout_s: float) -> None:
        self.client = client
        self.prefix = prefix
        self.timeout_s = timeout_s

    @classmethod
    def from_url(
        cls, url: str, prefix: str = "fleet", timeout_s: float = 0.05, max_connections: int = 16
    ) -> RedisSessions:
        # No client-side retries, as for the ledger: the answer to an unreachable Redis
        # belongs to FleetState.
        # Same URL forms as the ledger (redis+cluster:// for Redis Cluster).
        return cls(any_client(url, timeout_s, max_connections), prefix, timeout_s)

    def _keys(self, key: bytes) -> tuple[str, str]:
        base = f"{self.prefix}:aff:{key.hex()}"
        return f"{base}:seen", f"{base}:ov"

    async def lookup(
        self, key: bytes, now: float, seen_ttl_s: float
    ) -> tuple[bool, Override | None]:
        """(seen within the TTL, override) and mark the session seen — one round trip."""
        seen_key, ov_key = self._keys(key)
        pipe = self.client.pipeline(transaction=False)
        pipe.get(ov_key)
        pipe.pttl(ov_key)
        pipe.set(seen_key, b"1", px=max(1, int(seen_ttl_s * 1000)), get=True)
        async with asyncio.timeout(self.timeout_s):
            cluster, pttl, previous = await pipe.execute()
        override = None
        if cluster is not None and isinstance(pttl, int) and pttl > 0:
            name = cluster.decode() if isinstance(cluster, bytes) else str(cluster)
            # The remaining TTL, on this replica's clock: replicas never compare clocks.
            override = Override(name, now + pttl / 1000.0)
        return previous is not None, override

    async def peek(self, key: bytes, now: float) -> tuple[bool, Override | None]:
        """(seen within its TTL, override), marking nothing: for a preview (``explain``)."""
        seen_key, ov_key = self._keys(key)
        pipe = self.client.pipeline(transaction=False)
        pipe.get(ov_key)
        pipe.pttl(ov_key)
        pipe.exists(seen_key)
        async with asyncio.timeout(self.timeout_s):
            cluster, pttl, seen = await pipe.execute()
        override = None
        if cluster is not None and isinstance(pttl, int) and pttl > 0:
            name = cluster.decode() if isinstance(cluster, bytes) else str(cluster)
            override = Override(name, now + pttl / 1000.0)
        return bool(seen), override

    async def write(self, key: bytes, override: Override, now: float) -> None:
        _seen_key, ov_key = self._keys(key)
        ttl_ms = max(1, int((override.expires_at - now) * 1000))
        async with asyncio.timeout(self.timeout_s):
            await self.client.set(ov_key, override.cluster.encode(), px=ttl_ms)

    def _link_key(self, name: bytes) -> str:
        return f"{self.prefix}:resp:{name.hex()}"

    async def link(self, name: bytes) -> bytes | None:
        async with asyncio.timeout(self.timeout_s):
            value = await self.client.get(self._link_key(name))
        return value if isinstance(value, bytes) else None

    async def write_link(self, link: Link, ttl_s: float) -> None:
        async with asyncio.timeout(self.timeout_s):
            await self.client.set(
                self._link_key(link.name), link.value, px=max(1, int(ttl_s * 1000))
            )

    async def close(self) -> None:
        await self.client.aclose()


def kv_relief(runtime: Runtime) -> tuple[float, float] | None:
    """The load table's KV relief: (the KV use that makes a cluster hot, how long a scraped
    report is trusted), or None when KV use is not watched."""
    at = runtime.kv_relief_at
    return None if at is None else (at, runtime.affinity.signal_max_age_s)


class FleetState:
    """Everything the affinity policy is fed, owned by one servicer."""

    def __init__(
        self,
        metrics: Metrics,
        max_sessions: int = 1_000_000,
        shared: RedisSessions | None = None,
        health: RedisHealth | None = None,
    ) -> None:
        self.metrics = metrics
        self.load = LoadTable()
        self.memory = SessionMemory(max_sessions)
        self.links = LinkMemory(max_sessions)
        # Which sessions each cluster holds, for GPU health's relief (gpu_health only).
        self.relief = ReliefTable(max_sessions)
        self.shared = shared
        # The service passes the ledger's tracker: one view of one Redis.
        self.health = health or RedisHealth()
        self._hot: HotKeys | None = None
        # Metric children cached per cluster: labels() costs more than the update itself.
        self._kv_gauges: dict[str, Any] = {}
        self._queue_gauges: dict[str, Any] = {}
        self._inflight_gauges: dict[str, Any] = {}

    def relieve_kv(self, runtime: Runtime) -> None:
        """Follow the runtime's KV relief (``kv_relief_at``; a reload may change it)."""
        self.load.kv_relief = kv_relief(runtime)

    def hot_keys(self, params: AffinityParams) -> HotKeys:
        # Rebuilt when a reload changes the half-life: old rates decayed differently.
        if self._hot is None or self._hot.half_life_s != params.hot_key_half_life_s:
            self._hot = HotKeys(params.hot_key_half_life_s)
        return self._hot

    # -- sessions ----------------------------------------------------------------------------
    def _shared_usable(self, now: float) -> bool:
        return self.shared is not None and self.health.due(now)

    def _shared_failed(self, op: str, exc: BaseException, now: float) -> None:
        self.metrics.affinity_store_errors.labels(op).inc()
        # Logged once per probe interval at most: while down, Redis is not called at all.
        log.warning(
            "affinity store unavailable; using this replica's memory",
            extra={
                "op": op,
                "error": f"{type(exc).__name__}: {exc}",
                "retry_in_s": self.health.probe_interval_s,
            },
        )
        self.health.failed(now)

    async def view(
        self,
        facts: RequestFacts,
        hash_primary: str,
        now: float,
        params: AffinityParams,
        salt: int = 0,
        *,
        record: bool = True,
        hot: bool = True,
    ) -> SessionView:
        """Look the session up (and mark it seen); count the request toward hot-key rates.

        With ``record=False`` nothing is marked or counted, and the view is the one this request
        would get: how ``explain`` previews a decision on the live state. ``hot=False``: no
        hot-key rate (only load-aware affinity spreads hot keys).
        """
        key = facts.session.digest
        ttl = params.new_session_ttl_s
        seen = self.memory.touch(key, now, ttl) if record else self.memory.seen(key, now, ttl)
        override = self.memory.override(key, now)
        if self.shared is not None and self._shared_usable(now):
            try:
                shared_seen, shared_override = (
                    await self.shared.lookup(facts.session.store_key, now, ttl)
                    if record
                    else await self.shared.peek(facts.session.store_key, now)
                )
            except UNAVAILABLE as exc:
                self._shared_failed("lookup", exc, now)
            else:
                self.health.succeeded()
                # Either store having seen it makes it existing (a restarted Redis forgets).
                seen = seen or shared_seen
                override = shared_override or override
        if not hot:
            return SessionView(seen=seen, override=override, salt=salt)
        hot_keys = self.hot_keys(params)
        share = 0.0
        if record:
            hot_keys.observe(key, hash_primary, now)
            if facts.session.source is KeySource.PREFIX:
                share = hot_keys.share(key, hash_primary, now, params.hot_key_min_requests)
        elif facts.session.source is KeySource.PREFIX:
            share = hot_keys.share_if_observed(key, hash_primary, now, params.hot_key_min_requests)
        return SessionView(seen=seen, override=override, key_share=share, salt=salt)

    async def remember(self, facts: RequestFacts, decision: Decision, now: float) -> None:
        override = decision.override_to_write
        if override is None:
            return
        key = facts.session.digest
        self.memory.write(key, override, now)
        if self.shared is not None and self._shared_usable(now):
            try:
                await self.shared.write(facts.session.store_key, override, now)
            except UNAVAILABLE as exc:
                self._shared_failed("write", exc, now)
            else:
                self.health.succeeded()

    # -- response links (extproc.core.response_links) ---------------------------------------
    async def follow(self, response_id: str, secret: bytes, now: float) -> SessionKey | None:
        """The session that produced ``response_id``, if a link to it is known."""
        name = link_name(secret, response_id)
        found = self.links.get(name, now)
        if found is not None or self.shared is None or not self._shared_usable(now):
            return found
        try:
            value = await self.shared.link(name)
        except UNAVAILABLE as exc:
            self._shared_failed("link_get", exc, now)
            return None
        self.health.succeeded()
        return None if value is None else read_link(secret, response_id, value)

    async def learn(
        self, response_id: str, session: SessionKey, secret: bytes, now: float, ttl_s: float
    ) -> None:
        """Link ``response_id`` to ``session`` (memory always, Redis when configured)."""
        link = make_link(secret, response_id, session)
        self.links.put(link.name, session, now + ttl_s)
        if self.shared is not None and self._shared_usable(now):
            try:
                await self.shared.write_link(link, ttl_s)
            except UNAVAILABLE as exc:
                self._shared_failed("link_set", exc, now)
            else:
                self.health.succeeded()

    # -- load --------------------------------------------------------------------------------
    def _child(self, cache: dict[str, Any], gauge: Any, cluster: str) -> Any:
        child = cache.get(cluster)
        if child is None:
            child = cache[cluster] = gauge.labels(cluster)
        return child

    def routed(self, cluster: str) -> None:
        count = self.load.acquire(cluster)
        self._child(self._inflight_gauges, self.metrics.cluster_inflight, cluster).set(count)

    def finished(self, cluster: str) -> None:
        count = self.load.release(cluster)
        self._child(self._inflight_gauges, self.metrics.cluster_inflight, cluster).set(count)

    def reported(
        self,
        chosen: str,
        served_by: str | None,
        report: LoadReport | None,
        now: float,
        params: AffinityParams,
    ) -> None:
        """A routed request's response headers arrived. ``served_by``: the cluster that says it
        served (a known name) or None when the response does not say."""
        cluster = served_by or chosen
        if served_by is not None and served_by != chosen:
            # Envoy moved the request to the aggregate's next priority: the chosen cluster was
            # unhealthy, ejected, or failed this attempt.
            self.load.mark_failing(chosen, now + params.signal_max_age_s)
            self.metrics.failovers_seen.labels(chosen).inc()
        if report is None:
            self.metrics.load_reports.labels("none").inc()
            return
        self.metrics.load_reports.labels(report.source).inc()
        self.load.record(cluster, report, now)
        if report.kv is not None:
            self._child(self._kv_gauges, self.metrics.cluster_kv, cluster).set(report.kv)
        if report.queue is not None:
            self._child(self._queue_gauges, self.metrics.cluster_queue, cluster).set(report.queue)

    def gpu_checked(self, cluster: str, reason: str | None, at: float, until: float) -> None:
        """The GPU scraper's verdict on a cluster (extproc.pipeline.gpu_scraper), observed at
        ``at`` and trusted until ``until``, on the pipeline's clock."""
        self.load.record_gpu(cluster, reason, at, until)
        self._maybe_cooled(cluster, at)

    def _maybe_cooled(self, cluster: str, at: float) -> None:
        """End the cluster's relief spell once neither its GPUs nor its KV use keep it hot."""
        if self.load.hot_reason(cluster, at) is None:
            self.relief.cooled(cluster)

    def scraped(self, cluster: str, report: LoadReport | None, at: float) -> None:
        """The engine scraper's view of a cluster (extproc.pipeline.engine_scraper); None when
        no endpoint of it has a fresh scrape. ``at`` is on the pipeline's clock."""
        if report is None:
            self.load.forget_scraped(cluster)
            self._maybe_cooled(cluster, at)
            return
        self.metrics.load_reports.labels(report.source).inc()
        self.load.record(cluster, report, at)
        self._maybe_cooled(cluster, at)
        if report.kv is not None:
            self._child(self._kv_gauges, self.metrics.cluster_kv, cluster).set(report.kv)
        if report.queue is not None:
            self._child(self._queue_gauges, self.metrics.cluster_queue, cluster).set(report.queue)

    async def close(self) -> None:
        if self.shared is not None:
            await self.shared.close()
