"""Container health check: ask the processor's gRPC health service, exit 0 only if SERVING.

Run as ``python -m extproc.serve.healthcheck --port 50051`` (the Dockerfile's HEALTHCHECK). A plain
TCP probe would pass while the server is draining; the health service reports NOT_SERVING from
the moment shutdown starts, so Docker stops counting a draining replica as healthy.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m extproc.serve.healthcheck", description=__doc__
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--service", default="", help="health service name ('' = whole server)")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds")
    return parser.parse_args(argv)


def check(host: str, port: int, service: str = "", timeout: float = 2.0) -> tuple[bool, str]:
    """(healthy, one-line reason)."""
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return False, f"{host}:{port}: {exc.code().name}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{host}:{port}: {status}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    healthy, reason = check(args.host, args.port, args.service, args.timeout)
    # Docker keeps the last lines of a health check's output in `docker inspect`.
    print(reason, file=sys.stdout if healthy else sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
