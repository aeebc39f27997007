"""Disaggregated prefill/decode: which prefill endpoint serves a request whose decode target is
already chosen, and what moving its KV cache between the two costs.

The decode target is the session's primary (then its secondary) exactly as without P/D: the KV
cache lives where decode runs, so decode keeps the session's affinity. Prefill is stateless
across requests apart from its prefix cache, so the prefill endpoint is chosen per request:

1. **Topology first.** The prompt's KV cache (1.5-2 GB for a 70B GQA model at 4k tokens) must
   reach the decode target inside the TTFT budget, which only holds on a fast link. Candidates
   are grouped by the narrowest topology level they share with the decode target (the levels
   are configured narrowest first, e.g. ``nvlink`` then ``island``); the group sharing the
   narrowest level is tried first, then the next, and endpoints sharing no level at all come
   last (``cross``) unless cross-island prefill is switched off.
2. **Prefix affinity within a group.** Prefill endpoints keep prefix caches too: rendezvous
   hashing of the request's key point over the group's endpoints sends the same prefix to the
   same prefiller while the group is unchanged.
3. **Load within a group.** A hashed choice that is saturated (more prefills in flight than
   ``saturation_factor`` x the group's mean, and at least ``min_inflight``) yields to the least
   loaded endpoint of the group: a hot prefix must not queue behind itself.
4. **Fallback.** Endpoints the shell knows are not ready are skipped. With no candidate left the
   choice is ``None``: the decode target prefills the request itself (colocated), which is what
   the decode-side sidecar does when no prefiller is named.

Pure: no I/O, no clock. The shell passes readiness and in-flight counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from extproc.core.fleet import RequestClass
from extproc.core.placement import cluster_seed, mix64

# The relation of a pair that shares no configured topology level.
CROSS = "cross"
# No prefiller: the decode target prefills the request itself.
COLOCATED = "colocated"


@dataclass(frozen=True, slots=True)
class Topology:
    """Topology levels, narrowest first, and the KV transfer bandwidth of a link at each level.

    ``bytes_per_s[i]`` is the bandwidth between two hosts whose narrowest shared label is
    ``levels[i]``; ``cross_bytes_per_s`` between hosts sharing none.
    """

    levels: tuple[str, ...] = ()
    bytes_per_s: tuple[float, ...] = ()
    cross_bytes_per_s: float = 12.5e9

    def __post_init__(self) -> None:
        if len(self.levels) != len(self.bytes_per_s):
            raise ValueError("one bandwidth per topology level")

    def labels(self, mapping: Mapping[str, str]) -> tuple[str | None, ...]:
        """A host's labels in level order (None where it has no label at that level)."""
        return tuple(mapping.get(level) for level in self.levels)

    def relation(self, a: Sequence[str | None], b: Sequence[str | None]) -> int:
        """Index of the narrowest level whose label ``a`` and ``b`` share; len(levels) if none."""
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x is not None and x == y:
                return i
        return len(self.levels)

    def relation_name(self, tier: int) -> str:
        return self.levels[tier] if tier < len(self.levels) else CROSS

    def bandwidth(self, tier: int) -> float:
        return self.bytes_per_s[tier] if tier < len(self.levels) else self.cross_bytes_per_s

    def transfer_s(self, kv_bytes: float, tier: int) -> float:
        """Seconds to move ``kv_bytes`` of KV cache over a link at ``tier``."""
        return kv_bytes / self.bandwidth(tier)


@dataclass(frozen=True, slots=True)
class PrefillEndpoint:
    address: str  # host:port, as the decode-side sidecar dials it
    cluster: str
    labels: tuple[str | None, ...]
    seed: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "seed", cluster_seed(self.address))


@dataclass(frozen=True, slots=True)
class PrefillParams:
    saturation_factor: float = 1.25
    min_inflight: int = 4
    # Off: a request whose decode target's islands have no ready prefiller prefills colocated
    # rather than moving its KV over the slowest link.
    cross_island: bool = True


@dataclass(frozen=True, slots=True)
class PrefillChoice:
    """The prefill endpoint (None: colocated prefill on the decode target), how it relates to
    the decode target, and why."""

    endpoint: PrefillEndpoint | None
    relation: str
    reason: str  # "affinity" | "load" | "fallback" (a wider group than the narrowest) | "none"
    tier: int = -1

    @property
    def address(self) -> str | None:
        return None if self.endpoint is None else self.endpoint.address


def choose_prefill(
    decode_labels: Sequence[str | None],
    pool: Sequence[PrefillEndpoint],
    point: int,
    inflight: Mapping[str, int],
    ready: frozenset[str] | None,
    topology: Topology,
    params: PrefillParams,
    down: frozenset[str] = frozenset(),
) -> PrefillChoice:
    """The prefill endpoint for a request decoded on a host with ``decode_labels``.

    ``point``: the request's key point (its prefix/session hash); ``inflight``: prefills in
    flight per endpoint address; ``ready``: addresses known ready (None: no readiness known,
    all are candidates); ``down``: addresses recently seen failing, skipped too.
    """
    groups: dict[int, list[PrefillEndpoint]] = {}
    for ep in pool:
        if (ready is not None and ep.address not in ready) or ep.address in down:
            continue
        tier = topology.relation(decode_labels, ep.labels)
        if tier == len(topology.levels) and not params.cross_island:
            continue
        groups.setdefault(tier, []).append(ep)
    if not groups:
        return PrefillChoice(None, COLOCATED, "none")
    first = min(groups)
    group = groups[first]
    hashed = max(group, key=lambda ep: mix64(point ^ ep.seed))
    reason = "affinity"
    load = inflight.get(hashed.address, 0)
    if len(group) > 1 and load >= params.min_inflight:
        mean = sum(inflight.get(ep.address, 0) for ep in group) / len(group)
        if load > params.saturation_factor * mean:
            # Least loaded; ties go to the hash order so equal loads still follow the prefix.
            hashed = min(
                group, key=lambda ep: (inflight.get(ep.address, 0), -mix64(point ^ ep.seed))
            )
            reason = "load"
    if first > min(topology.relation(decode_labels, ep.labels) for ep in pool):
        reason = "fallback"
    return PrefillChoice(hashed, topology.relation_name(first), reason, first)


@dataclass(frozen=True, slots=True)
class PdPlan:
    """The compiled P/D settings (extproc.config.runtime); None in the runtime when no class
    is disaggregated."""

    topology: Topology
    params: PrefillParams
    # Every cluster's labels in level order (decode targets are looked up here).
    cluster_labels: Mapping[str, tuple[str | None, ...]]
    # Per disaggregated class: its prefill pool ...
    pools: Mapping[str, tuple[PrefillEndpoint, ...]]
    # ... and the class its prefill-pool budget is kept under (named "<class>/prefill", a name
    # no configured class can take: "/" is not allowed in class names).
    prefill_classes: Mapping[str, RequestClass]
    kv_bytes_per_token: int = 327_680

    def choose(
        self,
        class_name: str,
        decode_cluster: str,
        point: int,
        inflight: Mapping[str, int],
        ready: frozenset[str] | None,
        down: frozenset[str] = frozenset(),
    ) -> PrefillChoice | None:
        """The prefill choice for a request of ``class_name`` decoded on ``decode_cluster``;
        None when the class is not disaggregated."""
        pool = self.pools.get(class_name)
        if pool is None:
            return None
        labels = self.cluster_labels.get(decode_cluster, (None,) * len(self.topology.levels))
        return choose_prefill(
            labels, pool, point, inflight, ready, self.topology, self.params, down
        )


def prefill_class_name(class_name: str) -> str:
    return f"{class_name}/prefill"
