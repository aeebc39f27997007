"""`extproc bench pd`: disaggregated prefill/decode, two comparisons, each side by side in one run.

1. **Topology-aware vs topology-blind prefill choice** on a long-context, multi-turn workload:
   four islands, each one decode cluster and two prefill clusters (one in the decode
   cluster's NVLink domain, one in another domain of the island). Aware = the default (the
   island's prefillers pooled), and the NVLink domain tried first (``group_level: nvlink``);
   blind = the same prefix affinity and load rule over the whole prefill pool
   (``disaggregation.topology_aware: false``). Reported: TTFT p50/p99 and, apart, the KV
   transfer p50/p99, plus where the prefills ran relative to their decode target.
2. **P/D vs colocated on the same eight clusters**: short-class TTFT while a burst of
   long-context requests arrives. P/D = four decode clusters (short requests prefill there,
   colocated) + four prefill clusters for the long class; colocated = eight clusters doing
   both.

Every decision is the processor's own (``Pipeline.decide``, in process, memory ledger); the
requests go over HTTP to simulated clusters that speak llm-d's sidecar protocol
(extproc.harness.sim_pd). Times are the simulator's simulated milliseconds (response headers
``x-sim-ttft-ms``, ``x-sim-transfer-ms``), so the figures do not depend on this machine's
speed; only the arrival schedule runs on the wall clock (``--time-scale``).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from prometheus_client import CollectorRegistry

from extproc.config import compile_runtime, parse_config
from extproc.config.runtime import Runtime
from extproc.core.pd import Topology
from extproc.harness.kvmodel import ClusterParams
from extproc.harness.replay import percentile
from extproc.harness.sim_cluster import (
    SIM_TTFT_HEADER,
    RunningSimCluster,
    SimClusterConfig,
    start_sim_cluster,
)
from extproc.harness.sim_pd import (
    SIM_PREFILL_HEADER,
    SIM_RELATION_HEADER,
    SIM_TRANSFER_HEADER,
    PdSimCluster,
    PdSimConfig,
)
from extproc.ledger.gate import build_gate
from extproc.names import PREFILLER_HEADER
from extproc.pipeline.metrics import Metrics
from extproc.pipeline.outcomes import Routed
from extproc.pipeline.pipeline import Pipeline, RuntimeHolder

CHAT = "/v1/chat/completions"
TOPOLOGY = {
    "levels": [{"name": "nvlink", "gbytes_per_s": 900}, {"name": "island", "gbytes_per_s": 50}],
    "cross_gbytes_per_s": 12.5,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sessions", type=int, default=32, help="comparison 1: conversations")
    parser.add_argument("--turns", type=int, default=3, help="comparison 1: turns each")
    parser.add_argument(
        "--context-tokens", type=int, default=16_000, help="comparison 1: document per session"
    )
    parser.add_argument("--concurrency", type=int, default=8, help="comparison 1")
    parser.add_argument("--short-rps", type=float, default=20.0, help="comparison 2, simulated")
    parser.add_argument("--burst", type=int, default=24, help="comparison 2: long requests")
    parser.add_argument("--burst-tokens", type=int, default=32_000, help="comparison 2")
    parser.add_argument("--seconds", type=float, default=8.0, help="comparison 2, simulated")
    parser.add_argument(
        "--time-scale", type=float, default=0.1, help="wall seconds per simulated second"
    )
    parser.add_argument("--seed", type=int, default=1)


# -- one fleet: sims + the processor's pipeline ---------------------------------------------


@dataclass
class Fleet:
    runtime: Runtime
    pipeline: Pipeline
    sims: dict[str, RunningSimCluster]


async def start_fleet(
    layout: dict[str, tuple[str, str, str]], classes: list[dict[str, Any]], args: Any, **pd: Any
) -> Fleet:
    """``layout``: cluster -> (role, nvlink, island)."""
    params = ClusterParams(time_scale=args.time_scale)
    sims: dict[str, RunningSimCluster] = {}
    clusters: list[dict[str, Any]] = []
    for name, (role, nvl, island) in layout.items():
        config = SimClusterConfig(name=name, params=params, max_output=4)
        sims[name] = await start_sim_cluster(config, cluster=PdSimCluster(config, _NO_PD))
        clusters.append(
            {
                "name": name,
                "endpoints": [f"{sims[name].host}:{sims[name].port}"],
                "role": role,
                "topology": {"nvlink": nvl, "island": island},
            }
        )
    data = {
        "version": 1,
        "clusters": clusters,
        "classes": classes,
        "topology": TOPOLOGY,
        "disaggregation": pd,
        "prefix": {"key": "opening"},
    }
    runtime = compile_runtime(parse_config(data, "bench-pd"))
    # The sims learn the topology now that their addresses are known (as --fleet would).
    plan = runtime.pd
    if plan is not None:
        topo = plan.topology
        peers = {c["endpoints"][0]: topo.labels(c["topology"]) for c in clusters}
        for c in clusters:
            cluster = sims[c["name"]].cluster
            assert isinstance(cluster, PdSimCluster)
            cluster.pd = PdSimConfig(
                c["role"], topo.labels(c["topology"]), peers, topo, plan.kv_bytes_per_token
            )
    registry = CollectorRegistry()
    gate = build_gate(runtime, registry, time.monotonic, random.Random(args.seed))
    pipeline = Pipeline(RuntimeHolder(runtime), Metrics(registry), gate)
    return Fleet(runtime, pipeline, sims)


# Until the fleet's addresses (and so the peers' labels) are known.
_NO_PD = PdSimConfig("both", (), {}, Topology())


async def stop_fleet(fleet: Fleet) -> None:
    for sim in fleet.sims.values():
        await sim.close()
        if isinstance(sim.cluster, PdSimCluster):
            await sim.cluster.close_client()


@dataclass(frozen=True)
class Sample:
    kind: str
    ttft_ms: float
    transfer_ms: float | None
    relation: str
    # The prefill leg on the prefiller (its queue + compute), simulated ms; None: colocated.
    prefill_ms: float | None = None


async def send(
    fleet: Fleet, http: aiohttp.ClientSession, text: str, session: str, kind: str
) -> Sample | None:
    body = orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    )
    headers = {":method": "POST", ":path": CHAT, "content-type": "application/json"}
    headers["x-session-id"] = session
    outcome = await fleet.pipeline.decide(headers, body, time.monotonic())
    if not isinstance(outcome, Routed):
        return None
    try:
        decode = fleet.runtime.endpoints[outcome.route.placement.primary][0]
        out = {"content-type": "application/json"}
        prefiller = outcome.prefill.address if outcome.prefill is not None else None
        if prefiller is not None:
            out[PREFILLER_HEADER] = prefiller
        async with http.post(f"http://{decode}{CHAT}", data=body, headers=out) as resp:
            await resp.read()
            if resp.status != 200:
                return None
            transfer = resp.headers.get(SIM_TRANSFER_HEADER)
            prefill = resp.headers.get(SIM_PREFILL_HEADER)
            return Sample(
                kind,
                float(resp.headers[SIM_TTFT_HEADER]),
                float(transfer) if transfer is not None else None,
                resp.headers.get(SIM_RELATION_HEADER, "colocated"),
                float(prefill) if prefill is not None else None,
            )
    finally:
        await fleet.pipeline.release(outcome.hold)


def words(n_tokens: int, seed: str) -> str:
    # The simulator counts four characters a token.
    return (f"{seed} " + "lorem ipsum dolor ") * (n_tokens // 5)


# -- comparison 1 ---------------------------------------------------------------------------

ISLANDS = 4


def topology_layout() -> dict[str, tuple[str, str, str]]:
    layout: dict[str, tuple[str, str, str]] = {}
    for i in range(ISLANDS):
        ib = f"ib-{i}"
        layout[f"d{i}"] = ("decode", f"nvl-{i}a", ib)
        layout[f"p{i}a"] = ("prefill", f"nvl-{i}a", ib)
        layout[f"p{i}b"] = ("prefill", f"nvl-{i}b", ib)
    return layout


async def topology_run(args: Any, **pd: Any) -> list[Sample]:
    classes = [{"name": "short", "max_input_tokens": 2048}, {"name": "long", "disaggregated": True}]
    fleet = await start_fleet(topology_layout(), classes, args, **pd)
    samples: list[Sample] = []
    queue: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
    for turn in range(args.turns):
        for s in range(args.sessions):
            queue.put_nowait((f"conv-{s}", turn))
    try:
        async with aiohttp.ClientSession() as http:

            async def worker() -> None:
                while not queue.empty():
                    session, turn = queue.get_nowait()
                    text = words(args.context_tokens, session) + " next question" * (40 * turn)
                    # A first turn has no prefix cached anywhere: every policy computes the
                    # same prefill, so its TTFT differs by queueing and transfer only.
                    kind = "first" if turn == 0 else "later"
                    sample = await send(fleet, http, text, session, kind)
                    if sample is not None:
                        samples.append(sample)

            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    finally:
        await stop_fleet(fleet)
    return samples


# -- comparison 2 ---------------------------------------------------------------------------


def burst_layout(pd: bool) -> dict[str, tuple[str, str, str]]:
    if not pd:
        return {f"c{i}": ("both", f"nvl-{i}", "ib-0") for i in range(8)}
    layout = {f"d{i}": ("decode", f"nvl-{i}", "ib-0") for i in range(4)}
    layout.update({f"p{i}": ("prefill", f"nvl-{i}", "ib-0") for i in range(4)})
    return layout


async def burst_run(args: Any, pd: bool) -> list[Sample]:
    long_class: dict[str, Any] = {"name": "long", "disaggregated": pd}
    classes = [{"name": "short", "max_input_tokens": 2048}, long_class]
    fleet = await start_fleet(burst_layout(pd), classes, args)
    rng = random.Random(args.seed)
    samples: list[Sample] = []
    scale = args.time_scale
    tasks: list[asyncio.Task[Sample | None]] = []
    try:
        async with aiohttp.ClientSession() as http:
            start = time.monotonic()
            burst_at = args.seconds / 4
            schedule: list[tuple[float, str, str, str]] = []
            t = 0.0
            i = 0
            while t < args.seconds:
                t += rng.expovariate(args.short_rps)
                kind = "short_before" if t < burst_at else "short_burst"
                schedule.append((t, f"q{i} " + "short question " * 20, f"user-{i}", kind))
                i += 1
            for j in range(args.burst):
                at = burst_at + j * 0.05
                schedule.append((at, words(args.burst_tokens, f"doc-{j}"), f"doc-{j}", "long"))
            schedule.sort()
            for at, text, session, kind in schedule:
                delay = start + at * scale - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(send(fleet, http, text, session, kind)))
            for done in await asyncio.gather(*tasks):
                if done is not None:
                    samples.append(done)
    finally:
        await stop_fleet(fleet)
    return samples


# -- report ---------------------------------------------------------------------------------


def _ms(values: Sequence[float], q: float) -> str:
    p = percentile(values, q)
    return "-" if p is None else f"{p:,.0f}"


def topology_table(results: dict[str, list[Sample]]) -> str:
    lines = [
        "| prefill choice | requests | TTFT p50 ms | TTFT p99 ms | first-turn TTFT p50 / p99 ms | "
        "prefill leg p50 / p99 ms | "
        "transfer p50 ms | transfer p99 ms | transfer mean ms | "
        "prefill relation (nvlink / island / cross) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, samples in results.items():
        ttft = [s.ttft_ms for s in samples]
        first = [s.ttft_ms for s in samples if s.kind == "first"]
        transfer = [s.transfer_ms for s in samples if s.transfer_ms is not None]
        prefill = [s.prefill_ms for s in samples if s.prefill_ms is not None]
        rel = Counter(s.relation for s in samples)
        mean = f"{sum(transfer) / len(transfer):,.1f}" if transfer else "-"
        lines.append(
            f"| {name} | {len(samples)} | {_ms(ttft, 50)} | {_ms(ttft, 99)} | "
            f"{_ms(first, 50)} / {_ms(first, 99)} | {_ms(prefill, 50)} / {_ms(prefill, 99)} | "
            f"{_ms(transfer, 50)} | {_ms(transfer, 99)} | {mean} | "
            f"{rel['nvlink']} / {rel['island']} / {rel['cross']} |"
        )
    return "\n".join(lines)


def burst_table(results: dict[str, list[Sample]]) -> str:
    lines = [
        "| serving | short TTFT p50 ms (before the burst) | short p99 (before) | "
        "short p50 (from the burst on) | short p99 (from the burst on) | long TTFT p50 ms | "
        "requests |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, samples in results.items():
        out = [s.ttft_ms for s in samples if s.kind == "short_before"]
        inb = [s.ttft_ms for s in samples if s.kind == "short_burst"]
        long = [s.ttft_ms for s in samples if s.kind == "long"]
        lines.append(
            f"| {name} | {_ms(out, 50)} | {_ms(out, 99)} | {_ms(inb, 50)} | {_ms(inb, 99)} | "
            f"{_ms(long, 50)} | {len(samples)} |"
        )
    return "\n".join(lines)


async def _main(args: Any) -> str:
    topo = {
        "topology-aware (island pooled, the default)": await topology_run(args),
        "topology-aware, NVLink domain first": await topology_run(args, group_level="nvlink"),
        "topology-blind (whole pool)": await topology_run(args, topology_aware=False),
    }
    burst = {
        "colocated (8 both)": await burst_run(args, False),
        "P/D (4 decode + 4 prefill)": await burst_run(args, True),
    }
    return (
        "Topology-aware vs topology-blind prefill (long-context, multi-turn):\n\n"
        + topology_table(topo)
        + "\n\nShort-class TTFT under a long-context burst, same eight clusters:\n\n"
        + burst_table(burst)
    )


def run(args: argparse.Namespace) -> int:
    print(asyncio.run(_main(args)))
    return 0
