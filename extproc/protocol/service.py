"""Process wiring for `extproc serve`: gRPC server, health, metrics endpoint, signals."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from dataclasses import dataclass

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, start_http_server

from extproc.config import ConfigError, load_runtime
from extproc.logs import setup_logging
from extproc.metrics import Metrics
from extproc.protocol.server import FleetProcessor, RuntimeHolder

log = logging.getLogger("extproc.serve")

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"


@dataclass(frozen=True, slots=True)
class ServeOptions:
    config_path: str
    address: str | None = None
    port: int | None = None
    metrics_port: int | None = None
    log_level: str = "info"
    uvloop: bool = True
    grace_s: float = 10.0


def grpc_options(max_body_bytes: int) -> list[tuple[str, int]]:
    # The body arrives as one gRPC message: the default 4 MiB receive cap would fail long
    # contexts with a 500. grpcio turns SO_REUSEPORT on by default, which lets a stale processor
    # on the same port silently share traffic: off unless multi-process serving asks for it.
    limit = max_body_bytes + (1 << 20)
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.so_reuseport", 0),
    ]


async def serve(opts: ServeOptions) -> int:
    try:
        runtime = load_runtime(opts.config_path)
    except (ConfigError, OSError) as exc:
        print(str(exc), file=sys.stderr)
        return 2
    cfg = runtime.config
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    metrics.config_info.labels(runtime.version).set(1)
    holder = RuntimeHolder(runtime)
    server = grpc.aio.server(options=grpc_options(cfg.processor.max_body_bytes))
    ep_grpc.add_ExternalProcessorServicer_to_server(FleetProcessor(holder, metrics), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = opts.address or cfg.processor.address
    port = cfg.processor.port if opts.port is None else opts.port
    bound = server.add_insecure_port(f"{address}:{port}")
    metrics_port = cfg.processor.metrics_port if opts.metrics_port is None else opts.metrics_port
    metrics_server, _thread = start_http_server(metrics_port, "127.0.0.1", registry=registry)
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info(
        "serving",
        extra={
            "grpc_port": bound,
            "metrics_port": metrics_server.server_port,
            "config_version": runtime.version,
        },
    )
    # A machine-readable ready line on stdout for supervisors and tests.
    print(f"READY grpc={bound} metrics={metrics_server.server_port}", flush=True)
    await stop.wait()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(opts.grace_s)
    metrics_server.shutdown()
    log.info("stopped")
    return 0


def serve_forever(opts: ServeOptions) -> int:
    setup_logging(opts.log_level)
    if opts.uvloop:
        import uvloop

        return uvloop.run(serve(opts))
    return asyncio.run(serve(opts))
