"""Envoy's clusters over gRPC xDS: the Cluster and Endpoint Discovery Services, state of the world.

An alternative to the CDS file (extproc/render/envoy_dynamic.py): Envoy's bootstrap points its
``cds_config`` at the processor's own gRPC port (the static ``extproc`` cluster, HTTP/2
already), so a plain Envoy needs no shared volume and a fleet change reaches it as soon as the
processor reloads. The clusters are the same rendered dicts as in the file (inference clusters,
their (primary, secondary) aggregates, the fallback cluster), converted to protos here.

The protocol (SotW, one type per stream): Envoy opens StreamClusters and sends a
DiscoveryRequest; the server answers with every cluster, a version and a nonce; Envoy answers
each response with a request carrying that nonce: the version when it applied it (ACK), the
previous version and an ``error_detail`` when it refused it (NACK). Each :meth:`publish` sends
the new set to every open stream; a stream that missed versions gets only the newest.

EDS, the same protocol on its own stream: the pool data path's one cluster takes its endpoints
from here (``type: EDS``, see extproc/render/envoy_dynamic.py), so a fleet change sends a new
endpoint list and leaves the pool cluster, its hosts' health-check sessions and connection
pools in place, where a CDS update would re-create the cluster with every host.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

# Imported for their descriptors: json_format resolves the typed_config "@type" of the
# rendered clusters (aggregate cluster, HTTP/2 protocol options, load-balancing policies)
# through the default pool.
import grpc
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.extensions.clusters.aggregate.v3 import cluster_pb2 as _aggregate  # noqa: F401
from envoy.extensions.load_balancing_policies.override_host.v3 import (  # noqa: F401
    override_host_pb2 as _override_host,
)
from envoy.extensions.load_balancing_policies.round_robin.v3 import (  # noqa: F401
    round_robin_pb2 as _round_robin,
)
from envoy.extensions.upstreams.http.v3 import (  # noqa: F401
    http_protocol_options_pb2 as _http_options,
)
from envoy.service.cluster.v3 import cds_pb2_grpc
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc
from google.protobuf import any_pb2, json_format
from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger("extproc.xds")

CLUSTER_TYPE_URL = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINTS_TYPE_URL = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


def _packed(docs: Sequence[dict[str, Any]], message: Any) -> list[any_pb2.Any]:
    packed = []
    for doc in docs:
        body = {k: v for k, v in doc.items() if k != "@type"}
        resource = any_pb2.Any()
        resource.Pack(json_format.ParseDict(body, message()))
        packed.append(resource)
    return packed


def cluster_resources(clusters: Sequence[dict[str, Any]]) -> list[any_pb2.Any]:
    """The rendered cluster dicts as packed Cluster protos (raises ParseError on a bad one)."""
    return _packed(clusters, cluster_pb2.Cluster)


def endpoint_resources(assignments: Sequence[dict[str, Any]]) -> list[any_pb2.Any]:
    """The pool's rendered ClusterLoadAssignment dicts as packed protos."""
    return _packed(assignments, endpoint_pb2.ClusterLoadAssignment)


class _StateOfTheWorld:
    """One resource type served state-of-the-world to every open stream (see the module note)."""

    def __init__(self, type_url: str, kind: str, metric: str, registry: CollectorRegistry) -> None:
        self._type_url = type_url
        self._kind = kind
        self._serial = 0  # the nonce: one per published set
        self._response = discovery_pb2.DiscoveryResponse(type_url=type_url)
        self._streams: set[asyncio.Event] = set()
        self._closed = False
        self.acks = Counter(
            f"{metric}_responses",
            f"{kind} responses Envoy answered, by result (ack: applied, nack: refused).",
            ["result"],
            registry=registry,
        )
        self.streams = Gauge(
            f"{metric}_streams", f"Envoy {kind} streams open to this replica.", registry=registry
        )

    def close(self) -> None:
        """End every open stream (with OK); new ones end at once (a draining replica)."""
        self._closed = True
        for wake in self._streams:
            wake.set()

    @property
    def version(self) -> str:
        return str(self._response.version_info)

    def _publish(self, version: str, resources: list[any_pb2.Any]) -> None:
        self._serial += 1
        self._response = discovery_pb2.DiscoveryResponse(
            version_info=version,
            resources=resources,
            type_url=self._type_url,
            nonce=str(self._serial),
        )
        for wake in self._streams:
            wake.set()

    async def _read(
        self, requests: AsyncIterator[discovery_pb2.DiscoveryRequest], wake: asyncio.Event
    ) -> None:
        try:
            async for request in requests:
                self._answered(request)
                wake.set()  # the first request asks for the current set
        except grpc.aio.AioRpcError as exc:
            # The stream broke (Envoy gone, connection reset): the writer ends with it.
            log.info(f"envoy {self._kind} stream ended", extra={"error": exc.code().name})

    def _answered(self, request: discovery_pb2.DiscoveryRequest) -> None:
        if not request.response_nonce:
            return  # a first request, or a new stream: not an answer to a response
        if request.HasField("error_detail"):
            self.acks.labels("nack").inc()
            log.error(
                f"envoy refused our {self._kind} resources",
                extra={
                    "nonce": request.response_nonce,
                    "version": request.version_info,
                    "error": request.error_detail.message,
                },
            )
        else:
            self.acks.labels("ack").inc()

    async def _serve(
        self, request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest], context: Any
    ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        """The streaming handler (Stream<Type>): an async generator, as grpc.aio runs one."""
        wake = asyncio.Event()
        reader = asyncio.ensure_future(self._read(request_iterator, wake))
        reader.add_done_callback(lambda _task: wake.set())
        self._streams.add(wake)
        self.streams.inc()
        sent = 0
        try:
            while True:
                await wake.wait()
                wake.clear()
                if reader.done() or self._closed:
                    return  # Envoy closed the stream (or it broke), or this replica drains
                if self._serial != sent and self._serial > 0:
                    sent = self._serial
                    yield self._response
        finally:
            self._streams.discard(wake)
            self.streams.dec()
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def _fetch(
        self, request: discovery_pb2.DiscoveryRequest, context: Any
    ) -> discovery_pb2.DiscoveryResponse:
        return self._response


class ClusterDiscovery(_StateOfTheWorld, cds_pb2_grpc.ClusterDiscoveryServiceServicer):  # type: ignore[misc]
    StreamClusters = _StateOfTheWorld._serve
    FetchClusters = _StateOfTheWorld._fetch

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(CLUSTER_TYPE_URL, "cds", "fleet_xds", registry)

    def publish(self, version: str, clusters: Sequence[dict[str, Any]]) -> None:
        """Serve ``clusters`` (rendered dicts) as ``version`` from now on, to every stream."""
        self._publish(version, cluster_resources(clusters))


class EndpointDiscovery(_StateOfTheWorld, eds_pb2_grpc.EndpointDiscoveryServiceServicer):  # type: ignore[misc]
    """The pool's endpoints. Every stream gets every assignment (the pool's, when the fleet
    uses the pool): Envoy takes the ones its clusters asked for."""

    StreamEndpoints = _StateOfTheWorld._serve
    FetchEndpoints = _StateOfTheWorld._fetch

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(ENDPOINTS_TYPE_URL, "eds", "fleet_eds", registry)

    def publish(self, version: str, assignments: Sequence[dict[str, Any]]) -> None:
        self._publish(version, endpoint_resources(assignments))
