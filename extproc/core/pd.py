"""Disaggregated prefill/decode: which prefill endpoint serves a request whose decode target is
already chosen, and what moving its KV cache between the two costs.

The decode target is the session's primary (then its secondary) exactly as without P/D: the KV
cache lives where decode runs, so decode keeps the session's affinity. Prefill is stateless
across requests apart from its prefix cache, so the prefill endpoint is chosen per request:

1. **Topology first.** The prompt's KV cache (1.5-2 GB for a 70B GQA model at 4k tokens) must
   reach the decode target inside the TTFT budget, which only holds on a fast link. Candidates
   are grouped by the narrowest topology level they share with the decode target (levels are
   configured narrowest first, e.g. ``nvlink`` then ``island``), with every level up to the
   pooling level (``group_level``, by default the widest: the island) pooled into one group:
   the decode target's island is tried first, then wider levels, and endpoints sharing no
   level at all come last (``cross``) unless cross-island prefill is switched off.
2. **Prefix affinity within a group.** Prefill endpoints keep prefix caches too: rendezvous
   hashing of the request's key point over the group's endpoints sends the same prefix to the
   same prefiller while the group is unchanged. (Pooling the island instead of the NVLink
   domain: a one-prefiller domain would queue all of its decode target's prefills on it while
   the island's other prefillers idle; ``extproc bench pd`` shows both.)
3. **Load within the island.** Prefill is compute-bound: a prefiller with prefills in flight
   queues the next one behind them, which costs more than moving the KV over the island's
   fabric (a 16k-token prefill is ~0.8 s at 20k tokens/s; its 5 GB of KV cross a 50 GB/s IB
   link in ~0.1 s). So a hashed choice that is saturated (at least ``min_inflight`` prefills
   in flight and more than ``saturation_factor`` x the mean over the candidates that share the
   island with the decode target) yields to the least loaded of those, narrowest level first
   on equal load. It never leaves the island for load: crossing islands is only a fallback.
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
    # SGLang's protocol: the endpoint's bootstrap server port (None: the server's default).
    bootstrap_port: int | None = None
    seed: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "seed", cluster_seed(self.address))


@dataclass(frozen=True, slots=True)
class PrefillParams:
    saturation_factor: float = 1.25
    min_inflight: int = 1
    # Off: a request whose decode target's islands have no ready prefiller prefills colocated
    # rather than moving its KV over the slowest link.
    cross_island: bool = True
    # Off: one group for the whole pool (topology still reported in the choice's relation).
    topology_aware: bool = True
    # Levels below this index are pooled into it (0: every level its own group).
    pool_tier: int = 0


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
        groups.setdefault(_group(tier, topology, params), []).append(ep)
    if not groups:
        return PrefillChoice(None, COLOCATED, "none")
    first = min(groups)
    group = groups[first]
    hashed = max(group, key=lambda ep: mix64(point ^ ep.seed))
    reason = "affinity"
    load = inflight.get(hashed.address, 0)
    if load >= params.min_inflight:
        # The candidates sharing the island (every group but cross), or the group itself when
        # only cross-island candidates are left.
        island = len(topology.levels)
        near = [(t, ep) for t, eps in groups.items() if t < island or t == first for ep in eps]
        mean = sum(inflight.get(ep.address, 0) for _, ep in near) / len(near)
        if len(near) > 1 and load > params.saturation_factor * mean:
            # Least loaded, narrowest level first, then the hash order so that equal loads
            # still follow the prefix.
            first, hashed = min(
                near,
                key=lambda te: (
                    inflight.get(te[1].address, 0),
                    te[0],
                    -mix64(point ^ te[1].seed),
                ),
            )
            reason = "load"
    best = min(_group(topology.relation(decode_labels, e.labels), topology, params) for e in pool)
    if reason == "affinity" and first > best:
        reason = "fallback"
    tier = topology.relation(decode_labels, hashed.labels)
    return PrefillChoice(hashed, topology.relation_name(tier), reason, tier)


def _group(tier: int, topology: Topology, params: PrefillParams) -> int:
    """The candidate group of an endpoint at relation ``tier`` (lower is tried first)."""
    if not params.topology_aware:
        return 0
    if tier < len(topology.levels):
        return max(tier, params.pool_tier)
    return tier


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
    # "llm-d" (x-prefiller-host-port) or "sglang" (bootstrap fields + a request mirror).
    protocol: str = "llm-d"

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


# -- SGLang's bootstrap protocol ---------------------------------------------------------------
# SGLang's PD router (sgl-router, bootstrap_injector.rs) sends the same body to the prefill and
# the decode server at once, with these fields added: the prefill server's host (no port), its
# bootstrap server's port (null: the server's default, 8998) and a random room in [0, 2^63)
# that pairs the two halves. A batch (chat ``n`` > 1, a list of prompts / texts / input_ids)
# gets one value per item in each field.
BOOTSTRAP_HOST = "bootstrap_host"
BOOTSTRAP_PORT = "bootstrap_port"
BOOTSTRAP_ROOM = "bootstrap_room"
ROOM_MASK = (1 << 63) - 1


def bootstrap_batch(body: Mapping[str, object]) -> int | None:
    """How many bootstrap rooms a request needs: None for a single request, else the batch
    size. Raises ValueError on an empty batch (the router refuses it too).

    As SGLang's router counts it, except that a flat list of token ids is one prompt (the
    server reads it so; the router would count its tokens)."""
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        return n
    for name in ("prompt", "text", "input_ids"):
        value = body.get(name)
        if not isinstance(value, list):
            continue
        if not value:
            raise ValueError(f"batch {name} is empty")
        if isinstance(value[0], int) and not isinstance(value[0], bool):
            return None  # one tokenised prompt
        return len(value)
    return None


def bootstrap_fields(
    address: str, port: int | None, rooms: Sequence[int], batch: int | None
) -> dict[str, object]:
    """The fields SGLang's router injects for prefill endpoint ``address`` (host:port, as the
    fleet lists it; the host part is sent). ``rooms``: random draws (masked to 63 bits here),
    one per batch item or one for a single request."""
    host = address.rsplit(":", 1)[0].strip("[]")
    masked = [r & ROOM_MASK for r in rooms]
    if batch is None:
        return {BOOTSTRAP_HOST: host, BOOTSTRAP_PORT: port, BOOTSTRAP_ROOM: masked[0]}
    return {
        BOOTSTRAP_HOST: [host] * batch,
        BOOTSTRAP_PORT: [port] * batch,
        BOOTSTRAP_ROOM: masked[:batch],
    }
