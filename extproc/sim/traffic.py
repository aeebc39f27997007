"""The simulator's traffic: a base trace, multiplied into many sessions, plus long-context bursts.

A *base* is one Mooncake-format trace (or the synthetic workload, turned into the same shape):
per request an arrival time, a session, token counts and the prompt's KV blocks as *prefix
keys* — dense ids where one id names one whole prefix (a trie node over the trace's block ids,
or a vLLM-style chained block hash), so a cache lookup may stop at the first miss.

To reach a million sessions the base is copied k times. Copy c gets its own keys (the base's
ids shifted by ``c * n_keys``: copies never share a cached block, as distinct users would not)
and its own sessions, and each of its sessions is moved in time by the copy's offset
``o_c ~ U[0, period)`` *modulo the period*: a session keeps its inner gaps, and the arrival rate
of k overlaid copies stays flat instead of piling up at the start. Copy 0 is the trace as is.

Burst requests (one per long-context one-shot session, unique blocks) are added on top.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import orjson

from extproc.core.api import BadRequest
from extproc.core.chains import ChainParams, ChainSketch
from extproc.core.facts import ParseLimits, parse_request
from extproc.core.fleet import RequestClass, classify
from extproc.core.keys import KeyRules, KeySource, hash_key
from extproc.harness.prompts import BLOCK_TOKENS, block_hashes, canonical_prompt, count_tokens
from extproc.harness.trace import Trace
from extproc.harness.workload import ReplayRequest

_JSON = {"content-type": "application/json"}
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class BaseTraffic:
    """One trace, requests in arrival order, with prefix keys and the ideal cached tokens."""

    times: tuple[float, ...]  # seconds from the start
    sessions: tuple[int, ...]  # dense session index per request
    input_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]
    keys: tuple[tuple[int, ...], ...]  # prefix keys in 1..n_keys, one per block
    ideal_cached: tuple[int, ...]  # what one infinite cache serving the trace in order hits
    session_labels: tuple[str, ...]
    n_keys: int
    # True when no prefix key is shared by two sessions (the Mooncake trace: a session *is* its
    # first block). Then shifting sessions against each other in time cannot change what an
    # ideal cache hits, and the ideal of every copy equals the base's.
    sessions_disjoint: bool
    block_tokens: int
    source: str
    # Sum over prefix keys of min(conversations whose prompts hold it, clusters): the blocks a
    # fleet of that many clusters must hold, and prefill at least once each, when it spreads
    # conversations evenly (a block shared by s conversations lives on min(s, N) clusters).
    # Counted over the generator's own conversations, whatever the key groups; None: unknown
    # (a trace), taken as n_keys.
    spread_keys: int | None = None
    # Per request: the tenant the edge names in the trusted tenant header (flow.tenant_header);
    # None: no tenants (every waiter is one shared tenant, as without the header).
    tenants: tuple[str, ...] | None = None

    @property
    def period(self) -> float:
        """Length of the cyclic time axis that copies are shifted on."""
        return (self.times[-1] if self.times else 0.0) + 1.0

    @property
    def n_sessions(self) -> int:
        return len(self.session_labels)

    def __len__(self) -> int:
        return len(self.times)


def _ideal(
    keys: Sequence[tuple[int, ...]], inputs: Sequence[int], order: Sequence[int], block: int
) -> list[int]:
    """Cached tokens per request for one infinite cache visiting requests in ``order``.

    The same rule as ``extproc.harness.trace.ideal_hit_ratio``: the leading run of keys seen
    before, ``block`` tokens each, capped at the prompt.
    """
    seen: set[int] = set()
    out = [0] * len(keys)
    for i in order:
        ks = keys[i]
        lead = 0
        for k in ks:
            if k not in seen:
                break
            lead += 1
        seen.update(ks)
        out[i] = min(lead * block, inputs[i])
    return out


def _disjoint(keys: Sequence[tuple[int, ...]], sessions: Sequence[int]) -> bool:
    owner: dict[int, int] = {}
    for ks, s in zip(keys, sessions, strict=True):
        for k in ks:
            if owner.setdefault(k, s) != s:
                return False
    return True


def base_from_trace(trace: Trace) -> BaseTraffic:
    """Requests whose first block id is equal form a session (``TraceRequest.session``)."""
    trie: dict[tuple[int, int], int] = {}
    session_ix: dict[int, int] = {}
    keys: list[tuple[int, ...]] = []
    sessions: list[int] = []
    for request in trace.requests:
        node = 0
        path: list[int] = []
        for block_id in request.hash_ids:
            child = trie.get((node, block_id))
            if child is None:
                child = trie[(node, block_id)] = len(trie) + 1
            path.append(child)
            node = child
        keys.append(tuple(path))
        sessions.append(session_ix.setdefault(request.session, len(session_ix)))
    inputs = tuple(r.input_length for r in trace.requests)
    labels = tuple(f"trace-{first}" for first in session_ix)
    return BaseTraffic(
        times=tuple(r.arrival_s for r in trace.requests),
        sessions=tuple(sessions),
        input_tokens=inputs,
        output_tokens=tuple(r.output_length for r in trace.requests),
        keys=tuple(keys),
        ideal_cached=tuple(_ideal(keys, inputs, range(len(keys)), BLOCK_TOKENS)),
        session_labels=labels,
        n_keys=len(trie),
        # Prefixes are shared only through a common first block, i.e. within one session.
        sessions_disjoint=True,
        block_tokens=BLOCK_TOKENS,
        source=trace.source or "trace",
    )


def processor_sessions(requests: Sequence[ReplayRequest], key: str, clusters: int) -> list[str]:
    """Each request's session as the processor would key it from its prompt alone (no session
    header): ``key`` is ``opening`` or ``chain`` (prefix.key), run over the requests in arrival
    order with one chain sketch, as one processor would see them. Labels ``key:<digest hex>``
    carry the processor's own placement point (see ``_points``)."""
    rules = KeyRules(
        header=None,
        body_fields=(),
        prefix_key="chain" if key == "chain" else "opening",
        sketch=ChainSketch(ChainParams(clusters=clusters)) if key == "chain" else None,
    )
    out = []
    for request in requests:
        body = orjson.dumps(request.materialize())
        facts = parse_request(request.path, _JSON, body, rules, ParseLimits(1 << 30))
        if isinstance(facts, BadRequest):
            raise ValueError(f"request {request.session_id}: {facts.message}")
        out.append("key:" + facts.session.digest.hex())
    return out


def base_from_requests(
    requests: Sequence[ReplayRequest], source: str, key: str = "session", clusters: int = 8
) -> BaseTraffic:
    """The synthetic workload (or any replay requests): keys are the prompts' chained hashes.

    Only full blocks are hashed (as vLLM caches only full blocks), so a prompt's last partial
    block is never a hit. Sessions are the generator's session ids (``key="session"``, as if
    every client sent a session header), or what the processor's own key function makes of
    the prompts (``key="opening"`` / ``"chain"``: :func:`processor_sessions`).
    """
    dense: dict[int, int] = {}
    session_ix: dict[str, int] = {}
    keys: list[tuple[int, ...]] = []
    sessions: list[int] = []
    inputs: list[int] = []
    # prefix key -> the generator's conversations holding it (spread_keys)
    holders: dict[int, set[str]] = {}
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    keyed = processor_sessions(ordered, key, clusters) if key != "session" else None
    for n, request in enumerate(ordered):
        prompt = canonical_prompt(request.api, request.materialize())
        keys.append(tuple(dense.setdefault(h, len(dense) + 1) for h in block_hashes(prompt)))
        inputs.append(max(1, count_tokens(prompt)))
        conversation = request.session_id or f"anon-{n}"
        for k in keys[-1]:
            holders.setdefault(k, set()).add(conversation)
        label = keyed[n] if keyed else (request.session_id or f"anon-{len(session_ix)}")
        sessions.append(session_ix.setdefault(label, len(session_ix)))
    return BaseTraffic(
        times=tuple(r.arrival_s for r in ordered),
        sessions=tuple(sessions),
        input_tokens=tuple(inputs),
        output_tokens=tuple(r.max_tokens for r in ordered),
        keys=tuple(keys),
        ideal_cached=tuple(_ideal(keys, inputs, range(len(keys)), BLOCK_TOKENS)),
        session_labels=tuple(session_ix),
        n_keys=len(dense),
        sessions_disjoint=_disjoint(keys, sessions),
        block_tokens=BLOCK_TOKENS,
        source=source,
        spread_keys=sum(min(len(h), clusters) for h in holders.values()),
    )


@dataclass(frozen=True, slots=True)
class BurstSpec:
    """Long-context one-shot requests, Poisson at ``rate_per_s`` over [start, start + duration)."""

    start_s: float
    duration_s: float
    rate_per_s: float
    input_tokens: int
    output_tokens: int = 200

    def __post_init__(self) -> None:
        if self.start_s < 0 or self.duration_s <= 0 or self.rate_per_s <= 0:
            raise ValueError(f"burst needs start >= 0, duration > 0, rate > 0: {self}")
        if self.input_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"burst token counts must be >= 1: {self}")

    @property
    def window(self) -> tuple[float, float]:
        return (self.start_s, self.start_s + self.duration_s)


@dataclass(frozen=True, slots=True)
class Traffic:
    """Every request of a run, sorted by arrival, as plain lists (the engine's hot loop reads
    Python lists: indexing a numpy array from Python costs several times more).

    A request is a *template* (its token counts, keys, class) plus a key offset; templates
    ``0 .. len(base)-1`` are the base trace's requests, the rest are burst requests.
    """

    base: BaseTraffic
    copies: int
    times: list[float]
    templates: list[int]
    offsets: list[int]  # added to every key of the template
    sessions: list[int]  # global session index
    copy_of: list[int]  # which copy (-1 for burst requests)
    ideal_cached: list[int]  # per request
    t_keys: list[tuple[int, ...]]  # per template
    t_input: list[int]
    t_output: list[int]
    t_class: list[int]  # index into ``classes``
    classes: tuple[RequestClass, ...]
    points: npt.NDArray[np.uint64]  # placement point per global session
    n_sessions: int
    n_trace_sessions: int
    bursts: tuple[BurstSpec, ...]
    # Per template: its tenant's name (BaseTraffic.tenants; "" for burst requests), or None.
    t_tenant: list[str] | None = None

    def __len__(self) -> int:
        return len(self.times)

    def is_burst(self, i: int) -> bool:
        return self.templates[i] >= len(self.base)


def _point(label: str) -> int:
    if label.startswith("key:") and "/" not in label:
        # A session keyed by the processor from its prompt: its own placement point.
        return int(label[4:20], 16)
    # The processor's own key function for a session id sent in a trusted header: the same
    # 64-bit point the live gateway would place this session with. (Copies of prompt-keyed
    # sessions are other tenants' prompts: a key of their own.)
    return hash_key(KeySource.HEADER, label.encode()).point


def _points(labels: Sequence[str]) -> npt.NDArray[np.uint64]:
    return np.fromiter((_point(label) for label in labels), dtype=np.uint64, count=len(labels))


def copy_label(label: str, copy: int) -> str:
    return label if copy == 0 else f"{label}/copy{copy}"


def expand(
    base: BaseTraffic,
    copies: int,
    classes: tuple[RequestClass, ...],
    bursts: Sequence[BurstSpec] = (),
    seed: int = 0,
) -> Traffic:
    """``copies`` copies of the base (see the module note) plus the burst requests."""
    if copies < 1:
        raise ValueError("copies must be >= 1")
    if not len(base):
        raise ValueError("the base trace has no requests")
    rng = np.random.default_rng([seed, 0x51F7])
    period = base.period
    n = len(base)
    times = np.asarray(base.times, dtype=np.float64)
    sess = np.asarray(base.sessions, dtype=np.int64)
    start = np.full(base.n_sessions, np.inf)
    np.minimum.at(start, sess, times)
    offsets = rng.uniform(0.0, period, size=copies)
    offsets[0] = 0.0
    rel = times - start[sess]  # position inside its session
    shifted = (start[sess][None, :] + offsets[:, None]) % period + rel[None, :]
    copy_ix = np.repeat(np.arange(copies, dtype=np.int64), n)
    tmpl = np.tile(np.arange(n, dtype=np.int64), copies)
    all_times = shifted.reshape(-1)
    all_sess = (copy_ix * base.n_sessions + np.tile(sess, copies)).astype(np.int64)
    key_off = copy_ix * base.n_keys

    ideal = np.tile(np.asarray(base.ideal_cached, dtype=np.int64), copies)
    if not base.sessions_disjoint and copies > 1:
        # Sessions of one copy now interleave differently, and they share prefixes: the ideal
        # cache of each copy must be replayed in that copy's own order.
        for c in range(1, copies):
            order = np.argsort(shifted[c], kind="stable").tolist()
            ideal[c * n : (c + 1) * n] = _ideal(
                base.keys, base.input_tokens, order, base.block_tokens
            )

    t_keys = list(base.keys)
    t_input = list(base.input_tokens)
    t_output = list(base.output_tokens)
    labels = [copy_label(lab, c) for c in range(copies) for lab in base.session_labels]
    b_times, b_tmpl, b_sess = _add_bursts(
        base, bursts, seed, copies * base.n_keys + 1, (t_keys, t_input, t_output), labels
    )
    n_b = len(b_times)
    all_times = np.concatenate([all_times, np.asarray(b_times, dtype=np.float64)])
    tmpl = np.concatenate([tmpl, np.asarray(b_tmpl, dtype=np.int64)])
    all_sess = np.concatenate([all_sess, np.asarray(b_sess, dtype=np.int64)])
    key_off = np.concatenate([key_off, np.zeros(n_b, dtype=np.int64)])
    copy_ix = np.concatenate([copy_ix, np.full(n_b, -1, dtype=np.int64)])
    ideal = np.concatenate([ideal, np.zeros(n_b, dtype=np.int64)])
    # Stable on the (copy, base order) layout: equal times keep a seeded, reproducible order.
    order = np.argsort(all_times, kind="stable")

    t_class_objs = [classify(classes, tokens, None) for tokens in t_input]
    class_ix = {c.name: i for i, c in enumerate(classes)}
    return Traffic(
        base=base,
        copies=copies,
        times=all_times[order].tolist(),
        templates=tmpl[order].tolist(),
        offsets=key_off[order].tolist(),
        sessions=all_sess[order].tolist(),
        copy_of=copy_ix[order].tolist(),
        ideal_cached=ideal[order].tolist(),
        t_keys=t_keys,
        t_input=t_input,
        t_output=t_output,
        t_class=[class_ix[c.name] for c in t_class_objs],
        classes=classes,
        points=_points(labels),
        n_sessions=len(labels),
        n_trace_sessions=copies * base.n_sessions,
        bursts=tuple(bursts),
        t_tenant=(
            None if base.tenants is None else [*base.tenants, *[""] * (len(t_keys) - len(base))]
        ),
    )


def _add_bursts(
    base: BaseTraffic,
    bursts: Sequence[BurstSpec],
    seed: int,
    next_key: int,
    templates: tuple[list[tuple[int, ...]], list[int], list[int]],
    labels: list[str],
) -> tuple[list[float], list[int], list[int]]:
    """The bursts' one-shot requests, each its own template (appended to ``templates``: keys,
    input and output tokens) and its own session (appended to ``labels``), with fresh block
    ids from ``next_key``: their arrival times, templates and sessions."""
    t_keys, t_input, t_output = templates
    b_times: list[float] = []
    b_tmpl: list[int] = []
    b_sess: list[int] = []
    for b, burst in enumerate(bursts):
        brng = np.random.default_rng([seed, 0xB0, b])
        t = burst.start_s
        blocks = math.ceil(burst.input_tokens / base.block_tokens)
        n_burst = 0
        while True:
            t += float(brng.exponential(1.0 / burst.rate_per_s))
            if t >= burst.start_s + burst.duration_s:
                break
            t_keys.append(tuple(range(next_key, next_key + blocks)))
            next_key += blocks
            t_input.append(burst.input_tokens)
            t_output.append(burst.output_tokens)
            b_times.append(t)
            b_tmpl.append(len(t_keys) - 1)
            b_sess.append(len(labels))
            labels.append(f"burst-{b}-{n_burst}")
            n_burst += 1
    return b_times, b_tmpl, b_sess


def copies_for(base: BaseTraffic, sessions: int) -> int:
    """Copies needed for at least ``sessions`` trace sessions."""
    return max(1, math.ceil(sessions / max(1, base.n_sessions)))


def mooncake_like(
    seed: int,
    sessions: int,
    duration_s: float,
    max_turns: int = 8,
    think_s: float = 30.0,
) -> Trace:
    """A small seeded trace in the Mooncake format, for tests and quick experiments.

    Like the real trace (whose shape it mimics, not its figures): most sessions are a single
    request; the others send up to ``max_turns`` requests, each re-sending the previous
    prompt's blocks plus a few new ones, ``think_s`` apart on average. Contexts run from one
    block to a few hundred (a few up to 150K tokens), so every request class is present.
    """
    from random import Random

    from extproc.harness.trace import parse_trace

    rng = Random(f"mooncake-like:{seed}")
    next_id = 0
    lines: list[str] = []
    for _ in range(sessions):
        start = rng.uniform(0.0, duration_s)
        turns = 1 if rng.random() < 0.7 else rng.randint(2, max_turns)
        roll = rng.random()
        blocks = (
            rng.randint(1, 3)
            if roll < 0.35
            else rng.randint(4, 60)
            if roll < 0.97
            else rng.randint(200, 300)
        )
        ids = list(range(next_id, next_id + blocks))
        next_id += blocks
        t = start
        for _turn in range(turns):
            tail = rng.randint(1, 511)
            length = (len(ids) - 1) * 512 + tail
            output = rng.randint(1, 400)
            lines.append(
                f'{{"timestamp": {int(t * 1000)}, "input_length": {length}, '
                f'"output_length": {output}, "hash_ids": {ids}}}'
            )
            grow = rng.randint(1, 6)
            ids = ids + list(range(next_id, next_id + grow))
            next_id += grow
            t += rng.expovariate(1.0 / think_s)
    return parse_trace(lines, source=f"mooncake-like(seed={seed})")
