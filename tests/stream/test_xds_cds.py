"""The processor's CDS server over real gRPC: the current clusters on the first request, a
new set pushed to an open stream on publish, ACKs and NACKs counted; every rendered cluster
(route and endpoint-picker modes) converts to Envoy's Cluster proto."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.service.cluster.v3 import cds_pb2_grpc
from envoy.service.discovery.v3 import discovery_pb2
from google.rpc import status_pb2
from prometheus_client import CollectorRegistry

from extproc.config import compile_runtime, parse_config
from extproc.config.runtime import Runtime
from extproc.protocol.xds import CLUSTER_TYPE_URL, ClusterDiscovery, cluster_resources
from extproc.render.envoy_xds import dynamic_clusters, union_clusters


def runtime(clusters: int, mode: str = "route") -> Runtime:
    return compile_runtime(
        parse_config(
            {
                "version": 1,
                "clusters": [
                    {"name": f"c{i}", "endpoints": [f"127.0.0.1:{8000 + i}"]}
                    for i in range(1, clusters + 1)
                ],
                "processor": {"mode": mode},
            }
        )
    )


def names(response: discovery_pb2.DiscoveryResponse) -> set[str]:
    out = set()
    for resource in response.resources:
        cluster = cluster_pb2.Cluster()
        assert resource.Unpack(cluster)
        out.add(cluster.name)
    return out


@pytest.mark.parametrize("mode", ["route", "endpoint_picker"])
def test_every_rendered_cluster_converts(mode: str) -> None:
    docs = dynamic_clusters(runtime(3, mode))
    packed = cluster_resources(docs)
    assert [r.type_url for r in packed] == [CLUSTER_TYPE_URL] * len(docs)
    aggregate = next((d for d in docs if "__" in d["name"]), None)
    if mode == "route":
        assert aggregate is not None  # typed_config of the aggregate cluster resolved


def test_union_keeps_the_old_clusters_until_the_second_step() -> None:
    old, new = runtime(3), runtime(2)
    union = {c["name"] for c in union_clusters(old, new)}
    assert {"c3", "c1__c3"} <= union
    assert "c3" not in {c["name"] for c in dynamic_clusters(new)}


class CdsServer:
    """A real gRPC server with the CDS service publishing v1 (two clusters), and the queue a
    client's request stream is fed from (None ends it)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.cds = ClusterDiscovery(self.registry)
        self.cds.publish("v1", dynamic_clusters(runtime(2)))
        self.server = grpc.aio.server()
        cds_pb2_grpc.add_ClusterDiscoveryServiceServicer_to_server(self.cds, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.requests: asyncio.Queue[discovery_pb2.DiscoveryRequest | None] = asyncio.Queue()

    async def outgoing(self) -> AsyncIterator[discovery_pb2.DiscoveryRequest]:
        while (item := await self.requests.get()) is not None:
            yield item


async def test_stream_serves_pushes_and_counts_acks() -> None:
    srv = CdsServer()
    registry, cds, server, port, requests = (
        srv.registry,
        srv.cds,
        srv.server,
        srv.port,
        srv.requests,
    )
    outgoing = srv.outgoing
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = cds_pb2_grpc.ClusterDiscoveryServiceStub(channel)
            call = stub.StreamClusters(outgoing())
            await requests.put(discovery_pb2.DiscoveryRequest(type_url=CLUSTER_TYPE_URL))
            first = await asyncio.wait_for(call.read(), 10)
            assert first.version_info == "v1" and names(first) >= {"c1", "c2", "c1__c2"}
            await requests.put(
                discovery_pb2.DiscoveryRequest(
                    version_info="v1", response_nonce=first.nonce, type_url=CLUSTER_TYPE_URL
                )
            )
            cds.publish("v2", dynamic_clusters(runtime(3)))
            second = await asyncio.wait_for(call.read(), 10)
            assert second.version_info == "v2" and {"c3", "c3__c1"} <= names(second)
            assert second.nonce != first.nonce
            await requests.put(
                discovery_pb2.DiscoveryRequest(
                    version_info="v1",
                    response_nonce=second.nonce,
                    type_url=CLUSTER_TYPE_URL,
                    error_detail=status_pb2.Status(code=3, message="refused"),
                )
            )

            def count(result: str) -> float:
                value = registry.get_sample_value("fleet_xds_responses_total", {"result": result})
                return value or 0.0

            for _ in range(200):
                if count("nack") == 1:
                    break
                await asyncio.sleep(0.01)
            assert (count("ack"), count("nack")) == (1, 1)
            assert registry.get_sample_value("fleet_xds_streams") == 1
            await requests.put(None)
            call.cancel()
        for _ in range(200):
            if registry.get_sample_value("fleet_xds_streams") == 0:
                break
            await asyncio.sleep(0.01)
        assert registry.get_sample_value("fleet_xds_streams") == 0
    finally:
        await server.stop(0)


async def test_close_ends_open_streams_so_a_draining_server_can_stop() -> None:
    srv = CdsServer()
    cds, server, port, requests = srv.cds, srv.server, srv.port, srv.requests
    outgoing = srv.outgoing
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = cds_pb2_grpc.ClusterDiscoveryServiceStub(channel).StreamClusters(outgoing())
        await requests.put(discovery_pb2.DiscoveryRequest(type_url=CLUSTER_TYPE_URL))
        assert (await asyncio.wait_for(call.read(), 10)).version_info == "v1"
        cds.close()  # what the drain does when it stops taking new streams
        assert await asyncio.wait_for(call.read(), 10) is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
        # Nothing holds the server's stop() now: it returns long before its 60 s grace (an
        # open CDS stream would hold it the whole grace, and wait_for would time out).
        await asyncio.wait_for(server.stop(60), 30)
        await requests.put(None)
