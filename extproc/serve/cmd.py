"""`extproc serve`: run the ext_proc gRPC service (optionally as several worker processes)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from types import FrameType

from extproc.serve import allocator

# grpcio's EventEngine paths cost more per exchange than the legacy poller on this workload
# (ARCHITECTURE.md, "Decisions"). The switch is read when grpc initialises, so it must be set
# before anything imports grpc; an operator's own GRPC_EXPERIMENTS wins (set it to "" to compare).
GRPC_EXPERIMENTS = (
    "-event_engine_listener,-event_engine_for_all_other_endpoints,-event_engine_callback_cq"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="path to fleet.yaml")
    parser.add_argument("--port", type=int, default=None, help="override processor.port (0 = any)")
    parser.add_argument("--address", default=None, help="override processor.address")
    parser.add_argument(
        "--metrics-port", type=int, default=None, help="override processor.metrics_port"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="worker processes sharing the gRPC port via SO_REUSEPORT (default processor.workers);"
        " budgets then need redis.url (shared ledger); without it a budget is a config error",
    )
    parser.add_argument("--worker-index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--redis-url", default=None, help="override redis.url (env FLEET_REDIS_URL)"
    )
    parser.add_argument(
        "--envoy-cds", default=None, help="keep this Envoy CDS file in step with fleet.yaml"
    )
    parser.add_argument(
        "--xds-cds",
        action="store_true",
        help="serve Envoy its clusters over gRPC CDS on the processor's port (bootstrap:"
        " `extproc envoy --xds`), no shared CDS file needed",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=None,
        help="after SIGTERM, serve in-flight streams at most this long once new ones are refused"
        " (default processor.drain_timeout_s: the longest request the config allows)",
    )
    parser.add_argument(
        "--drain-delay",
        type=float,
        default=None,
        help="after SIGTERM, keep taking new streams this long while Envoy moves them to other"
        " replicas (default processor.drain_delay_s)",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed for retry-after jitter")
    parser.add_argument("--log-level", default="info")
    parser.add_argument(
        "--no-uvloop", action="store_true", help="use the stock asyncio loop (for comparisons)"
    )
    parser.add_argument(
        "--malloc",
        choices=allocator.CHOICES,
        default=None,
        help="tuned: keep freed memory for the next large body instead of faulting it in again"
        " (default); glibc: glibc's own settings (env FLEET_MALLOC)",
    )


def _workers(args: argparse.Namespace) -> int:
    if args.workers is not None:
        return int(args.workers)
    from extproc.config import ConfigError, load_config

    try:
        cfg, _raw = load_config(args.config)
    except (ConfigError, OSError):
        return 1  # the worker itself reports the error with its paths
    return cfg.processor.workers


def _supervise(args: argparse.Namespace, workers: int) -> int:
    """Run N copies of this command as workers on one port; forward signals; exit when all do."""
    port = args.port
    if not port:
        from extproc.config import ConfigError, load_config

        try:
            cfg, _raw = load_config(args.config)
            port = cfg.processor.port
        except (ConfigError, OSError) as exc:
            print(str(exc), file=sys.stderr)
            return 2
    if not port:
        # Every worker must bind the same port: pick it here, once.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    argv = (
        [sys.executable, "-m", "extproc", "serve", *sys.argv[2:]]
        if sys.argv[1:2] == ["serve"]
        else None
    )
    base = argv or [sys.executable, "-m", "extproc", "serve", "--config", args.config]
    children = [
        subprocess.Popen(
            [
                *_strip(base),
                "--port",
                str(port),
                "--workers",
                str(workers),
                "--worker-index",
                str(i),
            ]
        )
        for i in range(workers)
    ]

    def forward(signum: int, _frame: FrameType | None) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    codes = []
    for child in children:
        while True:
            try:
                codes.append(child.wait())
                break
            except InterruptedError:
                time.sleep(0.01)
    return max(codes) if codes else 0


def _strip(argv: list[str]) -> list[str]:
    """Drop --port/--workers/--worker-index from a copied command line (set per worker)."""
    out: list[str] = []
    skip = False
    for item in argv:
        if skip:
            skip = False
            continue
        if item in ("--port", "--workers", "--worker-index"):
            skip = True
            continue
        if item.startswith(("--port=", "--workers=", "--worker-index=")):
            continue
        out.append(item)
    return out


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)
    workers = _workers(args)
    if workers > 1 and args.worker_index == 0 and "--worker-index" not in sys.argv:
        return _supervise(args, workers)
    # Before the first request: every large body's buffers then reuse the heap's memory.
    allocator.tune(args.malloc or allocator.choice_from_env())
    from extproc.config.runtime import Overrides
    from extproc.serve.service import ServeOptions, serve_forever

    return serve_forever(
        ServeOptions(
            config_path=args.config,
            address=args.address,
            port=args.port,
            metrics_port=args.metrics_port,
            log_level=args.log_level,
            uvloop=not args.no_uvloop,
            grace_s=args.grace,
            drain_delay_s=args.drain_delay,
            workers=workers,
            worker_index=args.worker_index,
            overrides=Overrides(
                redis_url=args.redis_url or os.environ.get("FLEET_REDIS_URL") or None
            ),
            envoy_cds_path=args.envoy_cds,
            xds_cds=args.xds_cds,
            seed=args.seed,
        )
    )
