"""Chain key vs an approximate radix tree per cluster, offline, on the same layout requests.

The issue's alternative to the chain key is what SGLang's router does (``cache_aware``): keep,
per worker, an approximate radix tree of the prompt text routed there; send a request to the
worker whose tree matches the longest prefix of its text when the match covers more than
``cache_threshold`` of it, else to the worker with the smallest tree; and whenever in-flight
load is imbalanced (max - min > ``balance_abs_threshold`` and max > min x
``balance_rel_threshold``), to the least loaded worker. Defaults as in sgl-router's CLI:
0.3, 64, 1.5, trees of at most 2^26 characters (oldest prefixes evicted first).

Here the tree is approximated by the set of prefix hashes of every ``grain`` characters of the
canonical prompt (the text the simulated clusters prefill), which answers "longest matching
prefix" exactly at that granularity. Both routers see the requests in arrival order, one
replica. Judged from the same block hashes the simulated clusters use, with an unbounded
cache per cluster (routing alone, no eviction):

- hit ratio ÷ ideal (ideal: one cache serving everything);
- max/mean requests per cluster;
- the share of later turns on their conversation's first cluster.

What this leaves out (said next to the figures): the radix router's state is per router
process (two replicas learn different trees and disagree), its CPU and memory grow with the
prompt text it has seen, and it must read the whole prompt of every request; the chain key
reads at most ``prefix.scan_bytes`` and shares only its few common chains.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from extproc.core.chains import ChainParams, ChainSketch
from extproc.core.facts import ParseLimits, RequestFacts, parse_request
from extproc.core.keys import KeyRules
from extproc.core.placement import Rendezvous
from extproc.harness.layouts import LayoutConfig, generate_layout
from extproc.harness.prompts import block_hashes, canonical_prompt
from extproc.harness.workload import ReplayRequest

JSON_HEADERS = {"content-type": "application/json"}


@dataclass(frozen=True, slots=True)
class RadixParams:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_chars: int = 1 << 26
    grain: int = 64
    # In-flight model: a request occupies its worker this long after its arrival.
    service_s: float = 1.0


class _Tree:
    """One worker's approximate radix tree: prefix hashes, LRU-bounded by characters."""

    def __init__(self, params: RadixParams) -> None:
        self.params = params
        self.prefixes: OrderedDict[int, None] = OrderedDict()

    @property
    def chars(self) -> int:
        return len(self.prefixes) * self.params.grain

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading grains of the text the tree holds (prefix-closed: binary search)."""
        lo, hi = 0, len(hashes)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in self.prefixes:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def insert(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self.prefixes[h] = None
            self.prefixes.move_to_end(h)
        limit = max(1, self.params.max_tree_chars // self.params.grain)
        while len(self.prefixes) > limit:
            self.prefixes.popitem(last=False)


def _prefix_hashes(text: str, grain: int) -> list[int]:
    running = hashlib.sha1(usedforsecurity=False)
    data = text.encode("utf-8", "surrogatepass")
    out = []
    for start in range(0, len(data), grain):
        running.update(data[start : start + grain])
        out.append(int.from_bytes(running.copy().digest()[:8], "big"))
    return out


class RadixRouter:
    def __init__(self, clusters: Sequence[str], params: RadixParams | None = None) -> None:
        self.params = params or RadixParams()
        self.clusters = tuple(clusters)
        self.trees = {c: _Tree(self.params) for c in self.clusters}
        self._busy: dict[str, list[float]] = {c: [] for c in self.clusters}

    def _inflight(self, now: float) -> dict[str, int]:
        for ends in self._busy.values():
            ends[:] = [t for t in ends if t > now]
        return {c: len(ends) for c, ends in self._busy.items()}

    def route(self, text: str, now: float) -> str:
        p = self.params
        hashes = _prefix_hashes(text, p.grain)
        load = self._inflight(now)
        lo, hi = min(load.values()), max(load.values())
        if hi - lo > p.balance_abs_threshold and hi > lo * p.balance_rel_threshold:
            chosen = min(self.clusters, key=lambda c: load[c])
        else:
            matches = {c: self.trees[c].match(hashes) for c in self.clusters}
            best = max(self.clusters, key=lambda c: matches[c])
            rate = matches[best] / len(hashes) if hashes else 0.0
            if rate > p.cache_threshold:
                chosen = best
            else:
                chosen = min(self.clusters, key=lambda c: self.trees[c].chars)
        self.trees[chosen].insert(hashes)
        self._busy[chosen].append(now + p.service_s)
        return chosen


@dataclass(frozen=True, slots=True)
class OfflineRow:
    router: str
    hit_vs_ideal: float
    max_mean: float
    later_on_first: float


def _judge(
    router: str, requests: Sequence[ReplayRequest], placed: Sequence[str], clusters: int
) -> OfflineRow:
    seen: dict[str, set[int]] = {}
    everything: set[int] = set()
    hit = ideal_hit = total = 0
    first: dict[str, str] = {}
    later = kept = 0
    for request, cluster in zip(requests, placed, strict=True):
        blocks = block_hashes(canonical_prompt(request.api, request.materialize()))
        cache = seen.setdefault(cluster, set())
        # Blocks are chained (each hashes its predecessors): a hit is a prefix match.
        n = 0
        while n < len(blocks) and blocks[n] in cache:
            n += 1
        m = 0
        while m < len(blocks) and blocks[m] in everything:
            m += 1
        hit += n
        ideal_hit += m
        total += len(blocks)
        cache.update(blocks)
        everything.update(blocks)
        sid = request.session_id or f"request-{len(first)}-{later}"
        if sid in first:
            later += 1
            kept += first[sid] == cluster
        else:
            first[sid] = cluster
    counts = Counter(placed)
    mean = len(placed) / clusters
    return OfflineRow(
        router,
        (hit / ideal_hit) if ideal_hit else 1.0,
        max(counts.values()) / mean,
        kept / later if later else 1.0,
    )


def bounded_placement(
    points: Sequence[int], placer: Rendezvous, clusters: int, bound: float
) -> list[str]:
    """Consistent hashing with bounded loads (Mirrokni et al.) for *new* keys only: a key seen
    for the first time goes to the first cluster in its hash order whose request count stays
    within ``bound`` x the mean so far; every later request of the key follows that choice
    (remembered, as the processor's override store would)."""
    chosen: dict[int, str] = {}
    load: Counter[str] = Counter()
    placed = []
    for i, point in enumerate(points):
        cluster = chosen.get(point)
        if cluster is None:
            limit = bound * (i + 1) / clusters
            ranked = placer.ranked(point)
            cluster = next((c for c in ranked if load[c] + 1 <= limit), ranked[0])
            chosen[point] = cluster
        load[cluster] += 1
        placed.append(cluster)
    return placed


def compare(
    requests: Sequence[ReplayRequest],
    clusters: int,
    nested_share: float = 0.4,
    bound: float = 1.1,
    common_after: int = 4,
) -> list[OfflineRow]:
    """The chain key, the old opening key, per-conversation hashing and the radix router on the
    same requests in arrival order. ``nested_share``: the chain key's prefix.nested_share;
    ``bound``: the chain key's keys placed with bounded loads (:func:`bounded_placement`)."""
    names = [f"c{i}" for i in range(1, clusters + 1)]
    placer = Rendezvous.of([(n, 1.0) for n in names])
    rows = []
    chain = ChainParams(clusters=clusters, nested_share=nested_share, common_after=common_after)
    for key in ("chain", "opening"):
        rules = KeyRules(prefix_key=key, sketch=ChainSketch(chain))
        points = []
        for request in requests:
            body = orjson.dumps(request.materialize())
            facts = parse_request(request.path, JSON_HEADERS, body, rules, ParseLimits())
            assert isinstance(facts, RequestFacts), facts
            points.append(facts.session.point)
        placed = [placer.ranked(point)[0] for point in points]
        rows.append(_judge(f"{key} key", requests, placed, clusters))
        if key == "chain":
            placed = bounded_placement(points, placer, clusters, bound)
            label = f"chain key, new keys bounded at {bound:g}x mean"
            rows.append(_judge(label, requests, placed, clusters))
    rng = random.Random(1)
    per_conv: dict[str, str] = {}
    placed = [per_conv.setdefault(r.session_id or "", rng.choice(names)) for r in requests]
    rows.append(_judge("per-conversation hash", requests, placed, clusters))
    texts = [canonical_prompt(r.api, r.materialize()) for r in requests]
    # sgl-router's defaults, then its balance thresholds tightened for a small fleet.
    for label, params in (
        ("radix tree, sgl-router defaults", RadixParams()),
        ("radix tree, balance abs 4", RadixParams(balance_abs_threshold=4)),
    ):
        radix = RadixRouter(names, params)
        placed = [radix.route(t, r.arrival_s) for t, r in zip(texts, requests, strict=True)]
        rows.append(_judge(label, requests, placed, clusters))
    return rows


def offline_table(
    layouts: Sequence[str],
    config: LayoutConfig,
    clusters: int,
    nested_share: float = 0.4,
    bound: float = 1.1,
    common_after: int = 4,
) -> str:
    lines = [
        "| layout | router | hit ÷ ideal | max/mean | later turns on first cluster |",
        "|---|---|---|---|---|",
    ]
    for layout in layouts:
        requests = generate_layout(dataclasses.replace(config, layout=layout))
        for row in compare(requests, clusters, nested_share, bound, common_after):
            lines.append(
                f"| {layout} | {row.router} | {row.hit_vs_ideal:.3f} | {row.max_mean:.3f} | "
                f"{row.later_on_first:.3f} |"
            )
    return "\n".join(lines)
