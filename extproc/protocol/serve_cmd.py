"""`extproc serve`: run the ext_proc gRPC service."""

from __future__ import annotations

import argparse
import os

# grpcio's EventEngine paths cost ~70 µs per exchange more than the legacy poller on this
# workload (DESIGN.md, measured). The switch is read when grpc initialises, so it must be set
# before anything imports grpc; an operator's own GRPC_EXPERIMENTS wins.
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
    parser.add_argument("--log-level", default="info")
    parser.add_argument(
        "--no-uvloop", action="store_true", help="use the stock asyncio loop (for comparisons)"
    )


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)
    from extproc.protocol.service import ServeOptions, serve_forever

    return serve_forever(
        ServeOptions(
            config_path=args.config,
            address=args.address,
            port=args.port,
            metrics_port=args.metrics_port,
            log_level=args.log_level,
            uvloop=not args.no_uvloop,
        )
    )
