"""A bare ext_proc server on the same gRPC stack as the real one, answering constants.

It is the floor the stack allows: what any Python processor on grpc.aio (+ uvloop, EventEngine
off) costs before doing any work. `bench overhead` compares the real processor against it.
Run: ``python -m extproc.bench.bare --port N --route c1__c2``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

from extproc.serve import allocator
from extproc.serve.cmd import GRPC_EXPERIMENTS


def bare_process(
    route: str, header_path: bool = False
) -> Callable[[AsyncIterator[Any], Any], AsyncIterator[Any]]:
    """The bare handler: constant answers, a routing header on the body's (no gRPC import:
    ``bench handler`` drives it in process). ``header_path``: the floor of the real header
    path instead: the routing header on the headers' answer, the body turned off (mode
    override), and the stream ended right after it, as the real processor ends a routed
    exchange that holds nothing (one exchange per request)."""
    from envoy.config.core.v3 import base_pb2
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    common = ep.CommonResponse(clear_route_cache=True)
    common.header_mutation.set_headers.append(
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key="x-fleet-route", raw_value=route.encode()),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        )
    )
    if header_path:
        mode = processing_mode_pb2.ProcessingMode
        routed = ep.ProcessingResponse(
            request_headers=ep.HeadersResponse(response=common),
            mode_override=mode(request_body_mode=mode.NONE),
        )

        async def at_headers(requests: AsyncIterator[Any], _context: Any) -> AsyncIterator[Any]:
            async for _request in requests:
                yield routed
                return

        return at_headers
    headers_answer = ep.ProcessingResponse(request_headers=ep.HeadersResponse())
    body_answer = ep.ProcessingResponse(request_body=ep.BodyResponse(response=common))

    async def process(requests: AsyncIterator[Any], _context: Any) -> AsyncIterator[Any]:
        async for request in requests:
            if request.HasField("request_headers"):
                yield headers_answer
            else:
                yield body_answer

    return process


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--route", required=True, help="value of x-fleet-route to answer")
    parser.add_argument("--max-body-bytes", type=int, default=32 << 20)
    parser.add_argument(
        "--header-path", action="store_true", help="one exchange: route at the headers, no body"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)
    # The same allocator settings as `extproc serve` (FLEET_MALLOC): a fair floor at large bodies.
    allocator.tune(allocator.choice_from_env())

    import grpc
    import uvloop
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

    from extproc.serve.service import grpc_options

    process = bare_process(args.route, args.header_path)

    class Bare(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
        # grpc.aio serves a stream-stream method as an async generator function only.
        Process = staticmethod(process)

    async def serve() -> None:
        server = grpc.aio.server(options=grpc_options(args.max_body_bytes))
        ep_grpc.add_ExternalProcessorServicer_to_server(Bare(), server)
        port = server.add_insecure_port(f"127.0.0.1:{args.port}")
        await server.start()
        print(f"READY grpc={port} metrics=0", flush=True)
        await server.wait_for_termination()

    uvloop.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
