"""The drop-in parts in a hand-written host Envoy config, through a real Envoy: the host's own
route still answers, inference requests are placed by the processor on the predicted cluster,
and a client cannot pick its own cluster (the parts' internal_only_headers)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import orjson
import pytest
import yaml

from extproc.config import load_runtime
from extproc.harness.launch import LOOPBACK, FleetStack
from extproc.render.envoy import EnvoyOptions
from extproc.render.envoy_parts import render_part
from tests.e2e.conftest import MakeClient, dump_logs
from tests.e2e.predict import PURE_HASH, placement_for

CHAT = "/v1/chat/completions"

HCM_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
    "HttpConnectionManager"
)
# An existing Envoy, written by hand: its own listener, its own route (a direct response), no
# clusters of its own. The test adds the three parts where envoy/README.md says.
HOST_CONFIG = """
admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin_port}}}}}
static_resources:
  listeners:
  - name: host_ingress
    address: {{socket_address: {{address: 127.0.0.1, port_value: {listener_port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": {hcm_type}
          stat_prefix: host
          stream_idle_timeout: 0s
          use_remote_address: true
          route_config:
            name: host
            virtual_hosts:
            - name: host
              domains: ["*"]
              routes:
              - match: {{prefix: /host/status}}
                direct_response: {{status: 200, body: {{inline_string: host route}}}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters: []
"""


@dataclass
class HostStack(FleetStack):
    """A fleet whose Envoy runs the hand-written host config with the parts added."""

    def write_configs(self) -> None:
        super().write_configs()
        runtime = load_runtime(self.fleet_path)
        replicas = tuple(f"{LOOPBACK}:{p}" for p in self.grpc_ports)
        opts = EnvoyOptions(extproc_endpoints=replicas)
        host = yaml.safe_load(
            HOST_CONFIG.format(
                admin_port=self.admin_port, listener_port=self.listener_port, hcm_type=HCM_TYPE
            )
        )
        hcm = host["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        typed = hcm["typed_config"]
        typed["http_filters"][:0] = render_part(runtime, "filter", opts)
        host["static_resources"]["clusters"].extend(render_part(runtime, "clusters", opts))
        routes = render_part(runtime, "routes", opts)
        typed["route_config"]["internal_only_headers"] = routes["internal_only_headers"]
        typed["route_config"]["virtual_hosts"][0]["routes"].extend(
            routes["virtual_hosts"][0]["routes"]
        )
        self.envoy_path.write_text(yaml.safe_dump(host, sort_keys=False))


@pytest.fixture(scope="module")
def hosted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    stack = HostStack(
        tmp_path_factory.mktemp("hosted"),
        clusters=3,
        # Pure hashing predicts first turns (no balance spills): tests the drop-in parts.
        fleet_overrides={"affinity": PURE_HASH},
    )
    with stack:
        yield stack


def test_host_config_with_the_parts_routes_through_the_processor(
    hosted: FleetStack, make_client: MakeClient
) -> None:
    client = make_client(hosted.listener_port)
    status, _, data = client.request("GET", "/host/status", b"", {})
    assert (status, data) == (200, b"host route")
    runtime = load_runtime(hosted.fleet_path)
    for i in range(12):
        sid = f"hosted-{i}"
        body = orjson.dumps(
            {"model": "m", "messages": [{"role": "user", "content": sid}], "max_tokens": 2}
        )
        headers = {"x-session-id": sid}
        expected = placement_for(runtime, CHAT, body, headers).primary
        # A spoofed route header is stripped (internal_only_headers from the routes part).
        spoof = {**headers, "x-fleet-route": "c3", "x-fleet-primary": "c3"}
        status, got, data = client.post_json(CHAT, body, spoof)
        assert status == 200, (data[:200], dump_logs(hosted))
        assert got["x-served-by"] == expected
    assert hosted.processor_metrics()[("fleet_route_decisions_total", (("kind", "primary"),))] >= 12
