"""``extproc otlp-collector``: an OTLP/gRPC trace receiver that keeps the newest spans and
serves them as JSON over HTTP (the compose harness's collector; needs the ``tracing`` extra)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from extproc.harness.otlp import Collector
from extproc.harness.otlp_view import TraceView


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address both servers listen on")
    parser.add_argument("--grpc-port", type=int, default=4317, help="OTLP/gRPC TraceService")
    parser.add_argument("--http-port", type=int, default=4319, help="the spans as JSON")
    parser.add_argument(
        "--max-spans", type=int, default=100_000, help="spans kept; older ones are dropped"
    )


def run(args: argparse.Namespace) -> int:
    collector = Collector(limit=args.max_spans).start(args.host, args.grpc_port)
    view = TraceView(collector, args.host, args.http_port).start()
    print(
        f"otlp-collector: OTLP/gRPC on {args.host}:{collector.port}, "
        f"JSON on http://{args.host}:{view.port}/traces",
        file=sys.stderr,
        flush=True,
    )
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    stopping.wait()
    view.stop()
    collector.stop()
    return 0
