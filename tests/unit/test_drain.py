"""Draining on SIGTERM: the times derived from fleet.yaml, the rendered pieces that must match
them, and the drain sequence itself against a stand-in for the gRPC server."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from extproc.config.drain import (
    SHUTDOWN_MARGIN_S,
    UNBOUNDED_TERMINATION_GRACE_S,
    DrainTimes,
    drain_times,
    longest_request_s,
    termination_grace_s,
)
from extproc.config.load import runtime_from_bytes
from extproc.config.schema import FleetConfig
from extproc.render.envoy import render_bootstrap
from extproc.render.gateway import GatewayOptions, render_deployment
from extproc.serve.drain import FOREVER_S, drain


def _config(**sections: Any) -> FleetConfig:
    return FleetConfig.model_validate(
        {"version": 1, "clusters": [{"name": "c1", "endpoints": ["h:1"]}], **sections}
    )


def test_longest_request_is_receive_then_both_request_phases_then_the_route_timeout() -> None:
    cfg = _config(
        listener={"route_timeout_s": 600, "request_receive_timeout_s": 60},
        processor={"message_timeout_ms": 3000},
    )
    assert longest_request_s(cfg) == 666.0
    assert drain_times(cfg) == DrainTimes(delay_s=5.0, limit_s=666.0)
    assert drain_times(cfg).total_s == 671.0


def test_an_unbounded_upload_means_no_drain_limit() -> None:
    cfg = _config(listener={"route_timeout_s": 600, "request_receive_timeout_s": 0})
    assert longest_request_s(cfg) is None


def test_no_route_timeout_means_no_drain_limit() -> None:
    cfg = _config()  # the defaults: no timer ends a generation
    assert cfg.listener.route_timeout_s == 0
    assert longest_request_s(cfg) is None
    assert drain_times(cfg).limit_s is None
    assert drain_times(cfg).total_s is None
    assert termination_grace_s(cfg) == UNBOUNDED_TERMINATION_GRACE_S


def test_configured_drain_timeout_wins_and_flags_win_over_it() -> None:
    cfg = _config(
        listener={"route_timeout_s": 0},
        processor={"drain_timeout_s": 900, "drain_delay_s": 3},
    )
    assert drain_times(cfg) == DrainTimes(3.0, 900.0)
    assert drain_times(cfg, limit_s=20, delay_s=0) == DrainTimes(0.0, 20.0)
    assert termination_grace_s(cfg) == 3 + 900 + SHUTDOWN_MARGIN_S


def test_rendered_deployment_waits_for_the_whole_drain() -> None:
    raw = b"""
version: 1
listener: {route_timeout_s: 1800, request_receive_timeout_s: 120}
processor: {message_timeout_ms: 2000, drain_delay_s: 5}
clusters: [{name: c1, endpoints: ["c1:8000"]}]
"""
    runtime = runtime_from_bytes(raw, "fleet.yaml")
    pod = render_deployment(runtime, GatewayOptions())["spec"]["template"]["spec"]
    # 5 s taking new streams + 1924 s for the longest request + 5 s to shut down.
    assert pod["terminationGracePeriodSeconds"] == 1934
    assert "lifecycle" not in pod["containers"][0]


def test_rendered_ext_proc_asks_for_request_trailers() -> None:
    runtime = runtime_from_bytes(b"version: 1\nclusters: [{name: c1, endpoints: [h:1]}]\n", "f")
    listener = render_bootstrap(runtime)["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    mode = ext_proc["typed_config"]["processing_mode"]
    assert mode["request_body_mode"] == "BUFFERED"
    assert mode["request_trailer_mode"] == "SEND"


class FakeServer:
    """Stands in for grpc.aio.Server.stop: records when and how it was asked to stop."""

    def __init__(self, streams: list[int]) -> None:
        self.streams = streams
        self.graces: list[float | None] = []
        self.stopped_with_streams: list[int] = []

    async def stop(self, grace: float | None) -> None:
        self.graces.append(grace)
        self.stopped_with_streams.append(self.streams[0])


async def test_streams_are_served_to_their_end_after_the_delay() -> None:
    streams = [3]
    server = FakeServer(streams)

    async def requests_end() -> None:
        await asyncio.sleep(0.05)
        streams[0] = 4  # a new stream taken during the delay
        await asyncio.sleep(0.1)
        streams[0] = 1
        await asyncio.sleep(0.1)
        streams[0] = 0

    ending = asyncio.create_task(requests_end())
    report = await drain(
        server, lambda: streams[0], DrainTimes(0.1, 60.0), time.monotonic, poll_s=0.005
    )
    await ending
    # New streams were refused only after the delay, and none was cut.
    assert server.stopped_with_streams == [4]
    assert server.graces == [60.0]
    assert (report.streams_at_signal, report.streams_at_refuse, report.cut) == (3, 4, 0)
    assert streams == [0]


async def test_streams_still_open_at_the_limit_are_counted_as_cut() -> None:
    streams = [2]
    server = FakeServer(streams)

    async def stop_cancels(grace: float | None) -> None:
        server.graces.append(grace)
        # grpc cancels what is left at its grace; the drain counts what is open at its limit
        # (the same instant): the stand-in cancels a little later so the count is not a race.
        await asyncio.sleep((grace or 0) + 0.5)
        streams[0] = 0

    server.stop = stop_cancels  # type: ignore[method-assign]
    report = await drain(server, lambda: streams[0], DrainTimes(0.0, 0.05), time.monotonic, 0.005)
    assert report.cut == 2
    assert server.graces == [0.05]


@pytest.mark.parametrize("limit", [None, 0.0])
async def test_unbounded_drain_never_passes_none_to_grpc(limit: float | None) -> None:
    # grpc.aio's stop(None) cancels every call at once: "no limit" must be a huge grace.
    server = FakeServer([0])
    report = await drain(server, lambda: 0, DrainTimes(0.0, limit), time.monotonic, 0.005)
    assert server.graces == [FOREVER_S if limit is None else 0.0]
    assert report.cut == 0


def test_envoy_sees_a_draining_replica_before_it_refuses_new_streams() -> None:
    runtime = runtime_from_bytes(b"version: 1\nclusters: [{name: c1, endpoints: [h:1]}]\n", "f")
    clusters = render_bootstrap(runtime)["static_resources"]["clusters"]
    extproc = next(c for c in clusters if c["name"] == "extproc")
    (check,) = extproc["health_checks"]
    assert "grpc_health_check" in check
    assert "close_connections_on_host_health_failure" not in extproc
    interval, timeout = (float(check[k].rstrip("s")) for k in ("interval", "timeout"))
    # The last check before SIGTERM passed; the next unhealthy_threshold ones see NOT_SERVING.
    seconds = check["unhealthy_threshold"] * interval + timeout
    assert seconds < drain_times(runtime.config).delay_s
