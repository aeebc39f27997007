"""``extproc sim-cluster``: run one simulated inference cluster until interrupted."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from extproc.harness.engine_formats import SIM_ENGINES
from extproc.harness.kvmodel import ClusterParams
from extproc.harness.sim_cluster import RunningSimCluster, SimClusterConfig, start_sim_cluster
from extproc.harness.sim_pd import PdSimCluster, pd_sim_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", default="sim", help="cluster name, echoed in x-served-by")
    parser.add_argument(
        "--engine-id",
        default="",
        help="this process is one engine of the cluster: echoed in x-served-by-engine",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--kv-capacity-tokens", type=int, default=2_000_000)
    parser.add_argument("--prefill-tps", type=float, default=20_000.0, help="prefill tokens/s")
    parser.add_argument("--decode-tps", type=float, default=50.0, help="decode tokens/s/request")
    parser.add_argument("--max-concurrency", type=int, default=64)
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="wall seconds per simulated second (0.01 runs 100x faster than real)",
    )
    parser.add_argument("--max-output", type=int, default=64, help="cap on output tokens")
    parser.add_argument("--access-log", action="store_true", help="log every request")
    parser.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="NAME=PORT",
        help="one more simulated cluster in this process, same parameters; repeatable (large "
        "fleets on one machine: 64 clusters need not be 64 processes)",
    )
    parser.add_argument(
        "--models",
        default="",
        help="comma-separated models served (others get vLLM's 404); empty: any model",
    )
    parser.add_argument(
        "--engine",
        choices=SIM_ENGINES,
        default="sim",
        help="metrics and load headers to expose: the simulator's own, or a real engine's",
    )
    parser.add_argument(
        "--fleet",
        type=Path,
        default=None,
        help="fleet.yaml: serve this cluster's P/D role (prefill/decode/both) with the fleet's"
        " topology, speaking llm-d's sidecar protocol (extproc.harness.sim_pd)",
    )


def config_from_args(args: argparse.Namespace) -> SimClusterConfig:
    params = ClusterParams(
        kv_capacity_tokens=args.kv_capacity_tokens,
        prefill_tps=args.prefill_tps,
        decode_tps=args.decode_tps,
        max_concurrency=args.max_concurrency,
        time_scale=args.time_scale,
    )
    return SimClusterConfig(
        name=args.name,
        params=params,
        max_output=args.max_output,
        engine=args.engine,
        engine_id=args.engine_id,
        models=tuple(m for m in args.models.split(",") if m),
    )


def extra_clusters(values: list[str]) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for value in values:
        name, sep, port = value.rpartition("=")
        if not sep or not name or not port.isdigit():
            raise ValueError(f"--extra wants NAME=PORT, got {value!r}")
        out.append((name, int(port)))
    return out


async def serve(args: argparse.Namespace) -> None:
    config = config_from_args(args)
    cluster = None
    if args.fleet is not None:
        cluster = PdSimCluster(config, pd_sim_config(args.fleet, args.name))
    extras = [
        (dataclasses.replace(config, name=name), port) for name, port in extra_clusters(args.extra)
    ]
    running: list[RunningSimCluster] = []
    try:
        running.append(
            await start_sim_cluster(
                config, host=args.host, port=args.port, access_log=args.access_log, cluster=cluster
            )
        )
        for extra, port in extras:
            running.append(
                await start_sim_cluster(
                    extra, host=args.host, port=port, access_log=args.access_log
                )
            )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        # One parseable line per cluster: harnesses that start us with --port 0 read it here.
        for one in running:
            print(f"sim-cluster {one.name} listening on {one.url}", flush=True)
        await stop.wait()
    finally:
        for one in running:
            await one.close()
        if cluster is not None:
            await cluster.close_client()


def _run(main: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        config_from_args(args)
        if args.fleet is not None:
            pd_sim_config(args.fleet, args.name)
        extra_clusters(args.extra)
    except ValueError as exc:
        print(f"extproc sim-cluster: {exc}", file=sys.stderr)
        return 2
    try:
        _run(serve(args))
    except OSError as exc:
        print(
            f"extproc sim-cluster: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr
        )
        return 1
    return 0
