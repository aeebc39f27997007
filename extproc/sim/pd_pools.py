"""`extproc bench pd-pools`: sizing prefill:decode ratios at fleet scale, without sockets.

64 clusters in 8 islands of 8; each island splits its 8 clusters into prefill and decode
clusters at the ratio under test (1:7 ... 5:3), against a colocated baseline (64 clusters doing
both). A Poisson stream of multi-turn sessions (80 % short turns, colocated on their decode
cluster; 20 % long-context turns, disaggregated) is played through one event loop:

- decode placement: rendezvous over the decode clusters (the processor's placer), prefill
  choice: ``core.pd.choose_prefill`` with the prefills in flight (the processor's rule);
- each cluster is ``harness.kvmodel.ClusterModel`` (prefix cache, FIFO prefill queue, decode
  slots); a long turn prefills on its prefiller, then its KV travels (uncached tokens x KV
  bytes / the pair's link bandwidth) and it decodes on the decode cluster without touching
  that cluster's prefill queue (``admit_remote``).

Reported per layout: TTFT p50/p99 per class, the share of turns within an SLO (short 0.5 s,
long 5 s) and output tokens per second. Simulated seconds throughout; seeded, deterministic.
"""

from __future__ import annotations

import argparse
import heapq
import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from extproc.core.pd import PrefillEndpoint, PrefillParams, Topology, choose_prefill
from extproc.core.placement import Rendezvous, mix64
from extproc.harness.kvmodel import ClusterModel, ClusterParams, ModelRequest
from extproc.harness.replay import percentile

TOPOLOGY = Topology(("nvlink", "island"), (900e9, 50e9), 12.5e9)
KV_BYTES = 327_680
ISLANDS = 8
PER_ISLAND = 8
SLO_S = {"short": 0.5, "long": 5.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rate", type=float, default=120.0, help="turns per simulated second")
    parser.add_argument("--seconds", type=float, default=120.0, help="simulated duration")
    parser.add_argument("--long-share", type=float, default=0.2)
    parser.add_argument("--long-tokens", type=int, default=24_000)
    parser.add_argument("--short-tokens", type=int, default=1_000)
    parser.add_argument("--output-tokens", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)


@dataclass
class Layout:
    name: str
    prefill_per_island: int  # 0: colocated (every cluster does both)


@dataclass
class Result:
    ttft: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    output_tokens: int = 0
    last_done: float = 0.0


def _labels(i: int) -> tuple[str | None, ...]:
    return (f"nvl-{i}", f"ib-{i // PER_ISLAND}")


def simulate(layout: Layout, args: argparse.Namespace) -> Result:
    rng = random.Random(args.seed)
    params = ClusterParams()
    models = [ClusterModel(params) for _ in range(ISLANDS * PER_ISLAND)]
    names = [f"c{i}" for i in range(len(models))]
    prefill_ids = [
        i
        for i in range(len(models))
        if layout.prefill_per_island and i % PER_ISLAND < layout.prefill_per_island
    ]
    decode_ids = [i for i in range(len(models)) if i not in prefill_ids]
    placer = Rendezvous.of([(names[i], 1.0) for i in decode_ids])
    pool = tuple(PrefillEndpoint(names[i], names[i], _labels(i)) for i in prefill_ids)
    index = {n: i for i, n in enumerate(names)}
    pd_params = PrefillParams(pool_tier=1)
    inflight: dict[str, int] = defaultdict(int)
    # Events: (time, seq, kind, payload).
    events: list[tuple[float, int, str, tuple[Any, ...]]] = []
    seq = 0
    t = 0.0
    turns: dict[int, int] = defaultdict(int)
    while t < args.seconds:
        t += rng.expovariate(args.rate)
        long = rng.random() < args.long_share
        session = rng.randrange(400 if long else 4000) + (10**6 if long else 0)
        seq += 1
        heapq.heappush(events, (t, seq, "arrive", (session, long)))
    result = Result()
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            session, long = payload
            assert isinstance(session, int) and isinstance(long, bool)
            turns[session] += 1
            base = args.long_tokens if long else args.short_tokens
            tokens = base + 200 * turns[session]
            point = mix64(session)
            hashes = tuple(mix64(point + b) for b in range(tokens // params.block_tokens))
            request = ModelRequest(hashes, tokens, args.output_tokens)
            decode = index[placer.top2(point).primary]
            choice = (
                choose_prefill(_labels(decode), pool, point, inflight, None, TOPOLOGY, pd_params)
                if long and pool
                else None
            )
            if choice is None or choice.endpoint is None:
                plan = models[decode].admit(request, now)
                _done(result, "long" if long else "short", plan.first_token_at - now, plan.done_at)
                result.output_tokens += args.output_tokens
                continue
            prefiller = choice.endpoint
            inflight[prefiller.address] += 1
            pre = models[index[prefiller.cluster]].admit(ModelRequest(hashes, tokens, 1), now)
            seq += 1
            heapq.heappush(
                events,
                (
                    pre.first_token_at,
                    seq,
                    "prefilled",
                    (now, decode, request, prefiller, choice.tier),
                ),
            )
        else:
            arrival, decode, request, prefiller, tier = payload
            assert isinstance(arrival, float) and isinstance(decode, int)
            assert isinstance(request, ModelRequest) and isinstance(prefiller, PrefillEndpoint)
            assert isinstance(tier, int)
            inflight[prefiller.address] -= 1
            per_token = KV_BYTES / TOPOLOGY.bandwidth(tier)
            plan = models[decode].admit_remote(request, now, per_token)
            _done(result, "long", plan.first_token_at - arrival, plan.done_at)
            result.output_tokens += args.output_tokens
    return result


def _done(result: Result, cls: str, ttft: float, done_at: float) -> None:
    result.ttft[cls].append(ttft)
    result.last_done = max(result.last_done, done_at)


def _fmt(values: list[float], q: float) -> str:
    p = percentile(values, q)
    return "-" if p is None else f"{p:.2f}"


def table(rows: list[tuple[Layout, Result]]) -> str:
    lines = [
        "| layout (64 clusters) | short TTFT p50 / p99 s | long TTFT p50 / p99 s | "
        "short within 0.5 s | long within 5 s | output tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for layout, r in rows:
        share = {
            c: sum(1 for v in r.ttft[c] if v <= SLO_S[c]) / max(1, len(r.ttft[c])) for c in SLO_S
        }
        lines.append(
            f"| {layout.name} | {_fmt(r.ttft['short'], 50)} / {_fmt(r.ttft['short'], 99)} | "
            f"{_fmt(r.ttft['long'], 50)} / {_fmt(r.ttft['long'], 99)} | "
            f"{share['short']:.1%} | {share['long']:.1%} | "
            f"{r.output_tokens / max(r.last_done, 1e-9):,.0f} |"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    layouts = [Layout("colocated (64 both)", 0)] + [
        Layout(f"P/D {p * ISLANDS}:{(PER_ISLAND - p) * ISLANDS} (prefill:decode)", p)
        for p in range(1, 6)
    ]
    print(table([(layout, simulate(layout, args)) for layout in layouts]))
    return 0
