"""The chain key: a session key that survives a shared opening anywhere in the prompt.

The old prefix key (system text + the first 1,024 characters of the first message) sends every
conversation to one cluster when many share an opening outside the system role (instructions in
the first user message, a tool catalogue, a long completions preamble, shared content blocks).
The chain key finds where a conversation stops sharing text with the rest of the traffic.

1. **Canonical prompt** (``extproc.core.prompt.prompt_segments``, the walk the opening key
   shares): the request's prompt in the order an engine prefills it (system / instructions,
   tools, then every message or input item), one segment per message, for every API shape.
   Non-text parts are fingerprinted (bounded).
2. **Chunk chain** (:func:`chunk_chain`): each segment is cut at the first newline after
   ``min_chunk`` bytes (or at ``max_chunk``, or at the segment's end), and chunk ``i`` gets the
   chain hash ``h_i = H(h_{i-1} || chunk_i)``. A later turn repeats the earlier turn's text and
   appends, so its chain starts with the earlier turn's chain. At most ``scan_bytes`` of the
   prompt are read: CPU per request is bounded whatever the body size.
3. **Common chains** (:class:`ChainSketch`): a chain prefix is *common* once enough distinct
   conversations passed through it. The key is the shortest chain of the request that is not
   common: for conversations behind a shared opening, the opening plus the first chunk where the
   conversation becomes its own. It is stable across turns (it lies in the first turn's text)
   and distinct between conversations (they differ in that chunk).

How a chain becomes common. The key node of a request (its first non-common chain prefix) is a
*group*; the group remembers the distinct conversations (leaves) that reached it: a request
whose chain contains a remembered leaf is a later turn of that conversation and replaces it, so
a long conversation counts once. It also remembers how deep all its leaves agree (the longest
common prefix with its first request's chain). When ``common_after`` distinct conversations
share a root group (``nested_common_after`` for a group below an already common chain), every
chain prefix down to that depth becomes common in one step. Its conversations seen so far are
*grandfathered*: a request containing one of their leaves keeps the key it had (its later
turns stay where its first turn went); the others key deeper. Why two thresholds: a shared
opening (at the root) should be found fast; a document shared by a few requests below a common
opening (RAG) should keep them together (one prefill of the document), and only a document
that many conversations share spreads.

Both rules also ask for a *share*: a group becomes common only if it carries more of the new
conversations than ``nested_share`` of one cluster's fair share (``nested_share / clusters``),
judged over the recent past; at the root, beyond chance (its count ``_Z`` Poisson deviations
above what that share would give), so an opening that most conversations share is still found
at its ``common_after``-th conversation. Without it, a document read by a few requests at a
time with nothing before it (the Mooncake trace's sessions: a long shared prefix, then requests
that differ, none extending another) became common at its fourth reader, and every later reader
keyed past it onto another cluster: grandfathering cannot help there, since no later request
contains an earlier one's leaf (72 of the trace's 205 header-less sessions split; 0 now).

Memory is bounded: at most ``max_groups`` groups (least recently used dropped; each keeps at
most ``max_rep_chunks`` chain hashes and ``nested_common_after`` leaves) and ``max_common``
common chains (least recently used dropped).

Pure: no I/O, no clock. The shell owns one instance and may merge promotions learnt by other
replicas (:meth:`ChainSketch.merge`), which is how replicas converge
(extproc.pipeline.chain_sync).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import orjson

_HASH_BYTES = 8
# Deviations above chance a root group's count must reach: with 4 conversations in a window, a
# group at 2.5 % of the traffic gets there about once in 80 tries, an opening at 20 % or more
# at its fourth conversation.
_Z = 3.0


@dataclass(frozen=True, slots=True)
class ChainParams:
    min_chunk: int = 128
    max_chunk: int = 2048
    scan_bytes: int = 128 * 1024
    common_after: int = 4
    # Below a common chain (a document after a shared opening), a group is split only when it
    # carries more than nested_share of one cluster's fair share of new conversations (judged
    # over at least nested_common_after / that share conversations), and at least
    # nested_common_after of them: co-locating it then costs at most that much imbalance.
    nested_common_after: int = 16
    nested_share: float = 0.4
    clusters: int = 8
    max_leaves: int = 64
    max_groups: int = 8192
    max_rep_chunks: int = 512
    max_common: int = 4096


# ----- chunk chain --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Chain:
    """Chain hashes of a prompt's chunks (64-bit ints), and how many are final."""

    hashes: tuple[int, ...]
    # Chunks that a later turn repeats unchanged: all but an unterminated last chunk of a
    # completions prompt (a later turn's text may extend it).
    stable: int
    scanned_bytes: int = 0


def chunk_chain(
    segments: Sequence[str], params: ChainParams, last_segment_complete: bool = True
) -> Chain:
    hashes: list[int] = []
    # One running hash over the whole prefix: chunk i's chain hash is the hash of everything
    # up to its end (segment tags included), read off a copy of the running state; each byte
    # is hashed once. SHA-256 rather than BLAKE2b: OpenSSL's SHA-256 runs several times
    # faster than CPython's bundled BLAKE2b on the machines measured.
    running = hashlib.sha256()
    stable = 0
    scanned = 0
    last = len(segments) - 1
    for index, segment in enumerate(segments):
        data = segment.encode("utf-8", "surrogatepass")
        view = memoryview(data)
        scanned += len(data)
        running.update(b"\x00")  # segment boundary
        start = 0
        size = len(data)
        while start < size:
            cut = data.find(b"\n", start + params.min_chunk, start + params.max_chunk)
            if cut >= 0:
                end = cut + 1
                terminated = True
            elif size - start <= params.max_chunk:
                end = size
                terminated = index < last or last_segment_complete
            else:
                end = start + params.max_chunk
                terminated = True
            running.update(view[start:end])
            hashes.append(int.from_bytes(running.copy().digest()[:_HASH_BYTES], "big"))
            if terminated:
                stable = len(hashes)
            start = end
    return Chain(tuple(hashes), stable, scanned)


# ----- common chains ------------------------------------------------------------------------


@dataclass(slots=True)
class _Group:
    rep: tuple[int, ...]  # the first request's chain (capped)
    lcp: int  # chunks every leaf shares with ``rep``
    born: int  # the sketch's conversation count when the group was made
    conversations: int = 0  # distinct conversations counted here
    leaves: dict[int, None] = field(default_factory=dict)  # ordered set of conversation tips


@dataclass(frozen=True, slots=True)
class Promotion:
    """Chain prefixes that became common, and the conversations that keep the old key."""

    chains: tuple[int, ...]
    grandfathered: frozenset[int]


@dataclass(frozen=True, slots=True)
class KeyNode:
    """Where a request's key was taken: the chain hash and its depth (1-based)."""

    chain: int
    depth: int
    grandfathered: bool


class ChainSketch:
    def __init__(self, params: ChainParams | None = None) -> None:
        self.params = params or ChainParams()
        # chain -> conversation tips that keep this chain as their key (may be empty)
        self._common: OrderedDict[int, frozenset[int]] = OrderedDict()
        self._groups: OrderedDict[int, _Group] = OrderedDict()
        self._promotions: list[Promotion] = []
        self._conversations = 0  # distinct conversations counted, all groups

    # -- reading --------------------------------------------------------------------------
    def is_common(self, chain: int) -> bool:
        return chain in self._common

    @property
    def common_count(self) -> int:
        return len(self._common)

    @property
    def group_count(self) -> int:
        return len(self._groups)

    def key_node(self, chain: Chain) -> KeyNode | None:
        """The shortest chain prefix that is not common (or a grandfathered one)."""
        hashes = chain.hashes
        if not hashes:
            return None
        path: frozenset[int] | None = None
        for depth, h in enumerate(hashes, 1):
            keep = self._common.get(h)
            if keep is None:
                return KeyNode(h, depth, False)
            self._common.move_to_end(h)
            if keep:
                if path is None:
                    path = frozenset(hashes[: chain.stable])
                if not keep.isdisjoint(path):
                    return KeyNode(h, depth, True)
        return KeyNode(hashes[-1], len(hashes), False)

    # -- learning -------------------------------------------------------------------------
    def observe(self, chain: Chain, node: KeyNode) -> Promotion | None:
        """Count the request toward its group; promote the group when enough conversations
        share it. Returns the promotion (for sharing with other replicas), if any."""
        if node.grandfathered or chain.stable == 0 or node.depth > chain.stable:
            # A grandfathered key stays; a request whose key chunk is still growing (an
            # unterminated completions tail) has no stable identity to count yet.
            return None
        p = self.params
        tip = chain.hashes[chain.stable - 1]
        group = self._groups.get(node.chain)
        known = False
        if group is None:
            group = _Group(
                chain.hashes[: p.max_rep_chunks],
                min(chain.stable, p.max_rep_chunks),
                self._conversations,
            )
            self._groups[node.chain] = group
            if len(self._groups) > p.max_groups:
                self._groups.popitem(last=False)
        else:
            self._groups.move_to_end(node.chain)
            path = set(chain.hashes[: chain.stable])
            for leaf in [leaf for leaf in group.leaves if leaf in path]:
                del group.leaves[leaf]  # a later turn of a known conversation
                known = True
            group.lcp = min(group.lcp, _common_prefix(group.rep, chain.hashes, group.lcp))
        if tip in group.leaves:
            known = True
        group.leaves[tip] = None
        if len(group.leaves) > p.max_leaves:
            del group.leaves[next(iter(group.leaves))]
        if not known:
            group.conversations += 1
            self._conversations += 1
        if not self._ready(group, chain, node):
            return None
        depth = max(group.lcp, node.depth)
        promotion = Promotion(
            tuple(group.rep[node.depth - 1 : depth]) or (node.chain,),
            frozenset(group.leaves),
        )
        del self._groups[node.chain]
        self._apply(promotion)
        self._promotions.append(promotion)
        return promotion

    def _ready(self, group: _Group, chain: Chain, node: KeyNode) -> bool:
        p = self.params
        share = p.nested_share / max(1, p.clusters)
        # The share is judged over the recent past: past twice the nested rule's window, a
        # group's history is scaled down to that window (the ratio kept). An opening that
        # trickled in for long (a canary of a new system prompt) and then takes the traffic
        # is found within a few dozen conversations, not after hundreds.
        half = max(1, int(p.nested_common_after / share))
        window = self._conversations - group.born
        if window > 2 * half:
            group.conversations = group.conversations * half // window
            group.born = self._conversations - half
            window = half
        expected = share * window
        nested = node.depth > 1 and chain.hashes[node.depth - 2] in self._common
        if not nested:
            # A root group is a shared opening only if it carries more of the new
            # conversations than a group at the nested rule's share would, beyond chance (a
            # Poisson count ``_Z`` deviations above its expectation): a document read by a
            # few conversations at a time, with nothing before it (a Mooncake session),
            # stays on one cluster whatever its number of readers. An opening that most
            # conversations share is still found at common_after of them.
            return group.conversations >= max(p.common_after, expected + _Z * math.sqrt(expected))
        if group.conversations < p.nested_common_after:
            return False
        return window >= p.nested_common_after / share and group.conversations >= expected

    def _apply(self, promotion: Promotion) -> None:
        first, *rest = promotion.chains
        keep = self._common.get(first, frozenset()) | promotion.grandfathered
        self._common[first] = keep
        self._common.move_to_end(first)
        for h in rest:
            self._common.setdefault(h, frozenset())
            self._common.move_to_end(h)
        while len(self._common) > self.params.max_common:
            self._common.popitem(last=False)

    def merge(self, promotions: Iterable[Promotion]) -> None:
        """Apply promotions learnt elsewhere (another replica); idempotent."""
        for promotion in promotions:
            self._groups.pop(promotion.chains[0], None)
            self._apply(promotion)

    def requeue(self, promotions: Iterable[Promotion]) -> None:
        """Promotions that could not be published: offer them again next time."""
        self._promotions[:0] = list(promotions)

    def drain_promotions(self) -> list[Promotion]:
        """Promotions learnt here since the last call (the shell publishes them)."""
        out, self._promotions = self._promotions, []
        return out


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def encode_promotion(promotion: Promotion) -> bytes:
    return orjson.dumps(
        {
            "c": [f"{h:016x}" for h in promotion.chains],
            "g": [f"{h:016x}" for h in sorted(promotion.grandfathered)],
        }
    )


def decode_promotion(data: bytes) -> Promotion | None:
    """None for anything that is not a promotion (shared state is not trusted blindly)."""
    try:
        doc = orjson.loads(data)
        chains = tuple(int(h, 16) for h in doc["c"])
        grandfathered = frozenset(int(h, 16) for h in doc["g"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None
    if not chains or any(not 0 <= h < 1 << 64 for h in (*chains, *grandfathered)):
        return None
    return Promotion(chains, grandfathered)
