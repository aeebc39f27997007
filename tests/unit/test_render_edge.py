"""The edge settings of the rendered bootstrap (issue 12): timers that fit LLM traffic, path
normalisation, retries that never run a generation twice, outlier detection that treats an
engine's 429/503 as backpressure, edge limits and the trusted tier header. Each is also shown
through a real Envoy in tests/e2e (RELIABILITY.md names the tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from extproc.config import compile_runtime, load_runtime, parse_config
from extproc.config.runtime import Runtime
from extproc.names import BUFFER_HEADROOM, FLEET_HEADERS, PD_HEADERS
from extproc.render.envoy import (
    FALLBACK_CLUSTER,
    EnvoyOptions,
    render_bootstrap,
)
from extproc.render.envoy_parts import render_part
from tests.unit.test_render_envoy import _clusters, _hcm, _routes, validate

ROOT = Path(__file__).resolve().parents[2]
CANONICAL = ROOT / "compose" / "fleet.yaml"
ROUTE_TIMER_KEYS = {"timeout", "idle_timeout", "max_stream_duration"}


def runtime_with(**listener: Any) -> Runtime:
    return compile_runtime(
        parse_config(
            {
                "version": 1,
                "listener": listener,
                "session": {"tier_header": "x-tier"},
                "clusters": [
                    {"name": "a", "endpoints": ["127.0.0.1:18201"]},
                    {"name": "b", "endpoints": ["127.0.0.1:18202"]},
                ],
            }
        )
    )


@pytest.fixture(scope="module")
def defaults() -> dict[str, Any]:
    return render_bootstrap(runtime_with(), EnvoyOptions(mode="extproc"))


def test_no_default_timer_ends_a_generation(defaults: dict[str, Any]) -> None:
    hcm = _hcm(defaults)
    # Explicit zeros: an unset route timeout is Envoy's 15 s, an unset stream idle timeout 5 min.
    assert hcm["stream_idle_timeout"] == "0s"
    for route in _routes(defaults):
        timers = {k: v for k, v in route["route"].items() if k in ROUTE_TIMER_KEYS}
        assert timers == {"timeout": "0s"}, route
        assert "per_try_timeout" not in route["route"]["retry_policy"]
    assert "max_stream_duration" not in hcm.get("common_http_protocol_options", {})
    # Only receiving the request is bounded (Envoy disarms it once the request went upstream).
    assert hcm["request_timeout"] == "120s"
    assert hcm["request_headers_timeout"] == "10s"
    # The processor's answer per message is bounded; it is not a timer on the generation.
    ext_proc = hcm["http_filters"][0]["typed_config"]
    assert ext_proc["message_timeout"] == "2s"


def test_every_operator_timeout_is_honoured(tmp_path: Path) -> None:
    runtime = runtime_with(
        route_timeout_s=600,
        per_try_timeout_s=45.5,
        stream_idle_timeout_s=90,
        request_receive_timeout_s=30,
        request_headers_timeout_s=2,
    )
    config = render_bootstrap(runtime, EnvoyOptions(mode="extproc"))
    hcm = _hcm(config)
    assert (hcm["request_timeout"], hcm["request_headers_timeout"]) == ("30s", "2s")
    assert hcm["stream_idle_timeout"] == "90s"
    for route in _routes(config):
        assert route["route"]["timeout"] == "600s"
        assert route["route"]["retry_policy"]["per_try_timeout"] == "45.5s"
    validate(config, tmp_path)


def test_paths_are_normalised_before_any_filter(defaults: dict[str, Any]) -> None:
    hcm = _hcm(defaults)
    assert hcm["normalize_path"] is True
    assert hcm["merge_slashes"] is True
    assert hcm["path_with_escaped_slashes_action"] == "UNESCAPE_AND_FORWARD"
    # All three are ignored when a header validator is configured.
    assert "typed_header_validation_config" not in hcm


def test_the_tier_header_is_only_trusted_from_a_trusted_hop(defaults: dict[str, Any]) -> None:
    hcm = _hcm(defaults)
    # Issue 18 added llm-d's prefiller header (a client must not pick the sidecar's target).
    internal = hcm["route_config"]["internal_only_headers"]
    assert internal == [*FLEET_HEADERS, *PD_HEADERS, "x-tier"]
    # The client is the TCP peer; no address is internal (an empty cidr_ranges list would make
    # loopback and private peers internal again, and keep their headers).
    assert hcm["use_remote_address"] is True
    # A client's x-request-id is replaced at the edge; Envoy's own is returned to the client.
    assert hcm["always_set_request_id_in_response"] is True
    assert "preserve_external_request_id" not in hcm
    assert "internal_address_config" not in hcm


def test_retries_only_where_no_generation_can_have_started(defaults: dict[str, Any]) -> None:
    for route in _routes(defaults):
        policy = route["route"]["retry_policy"]
        retry_on = set(policy["retry_on"].split(","))
        assert retry_on == {
            "connect-failure",
            "refused-stream",
            "reset-before-request",
            "retriable-status-codes",
        }
        assert not retry_on & {"reset", "gateway-error", "5xx", "retriable-4xx"}
        # An engine's refusal moves the request once (to the secondary on the header route).
        assert policy["retriable_status_codes"] == [429, 503]
        assert policy["num_retries"] == 1


def test_backpressure_does_not_eject(defaults: dict[str, Any]) -> None:
    for name, cluster in _clusters(defaults).items():
        if name not in ("a", "b", FALLBACK_CLUSTER):
            continue
        outlier = cluster["outlier_detection"]
        assert outlier["split_external_local_origin_errors"] is True
        assert outlier["consecutive_local_origin_failure"] == 3
        assert outlier["enforcing_consecutive_local_origin_failure"] == 100
        # Every detector that counts the engine's own HTTP statuses is off.
        assert outlier["enforcing_consecutive_5xx"] == 0
        assert outlier["enforcing_consecutive_gateway_failure"] == 0
        assert outlier["enforcing_success_rate"] == 0
        assert outlier["enforcing_failure_percentage"] == 0
        # A host that accepts and resets: the local-origin failure percentage, on every host.
        assert outlier["enforcing_failure_percentage_local_origin"] == 100
        assert outlier["failure_percentage_threshold"] == 50
        assert outlier["failure_percentage_minimum_hosts"] == 1


def test_edge_limits(defaults: dict[str, Any]) -> None:
    (monitor,) = defaults["overload_manager"]["resource_monitors"]
    assert monitor["name"] == "envoy.resource_monitors.global_downstream_max_connections"
    assert monitor["typed_config"]["max_active_downstream_connections"] == 10_000
    assert defaults["admin"]["ignore_global_conn_limit"] is True
    (listener,) = defaults["static_resources"]["listeners"]
    assert _hcm(defaults)["http2_protocol_options"] == {
        "max_concurrent_streams": 100,
        # Envoy takes the stream window as the HTTP/2 stream's buffer limit: it must hold the
        # largest allowed body (a 1 MiB window answered a 1.2 MB body with Envoy's own 413).
        "initial_stream_window_size": (32 << 20) + BUFFER_HEADROOM,
        "initial_connection_window_size": (32 << 20) + BUFFER_HEADROOM,
    }
    # Still admits the largest body the processor accepts.
    assert listener["per_connection_buffer_limit_bytes"] == (32 << 20) + BUFFER_HEADROOM


def test_connection_limit_is_the_operators(tmp_path: Path) -> None:
    runtime = runtime_with(max_connections=64, max_streams_per_connection=1000)
    config = render_bootstrap(runtime, EnvoyOptions(mode="extproc"))
    (monitor,) = config["overload_manager"]["resource_monitors"]
    assert monitor["typed_config"]["max_active_downstream_connections"] == 64
    assert _hcm(config)["http2_protocol_options"]["max_concurrent_streams"] == 1000
    validate(config, tmp_path)


def test_the_compose_bootstrap_carries_the_edge_settings() -> None:
    config = render_bootstrap(load_runtime(CANONICAL), EnvoyOptions(mode="extproc"))
    assert {r["route"]["timeout"] for r in _routes(config)} == {"0s"}
    assert "x-tenant-tier" in _hcm(config)["route_config"]["internal_only_headers"]


def test_the_tenant_header_is_only_trusted_from_a_trusted_hop() -> None:
    """A client naming a tenant would take that tenant's fair share and limits: the tenant
    header is stripped at the edge like the tier header, in the bootstrap and the drop-in
    routes alike."""
    runtime = compile_runtime(
        parse_config(
            {
                "version": 1,
                "session": {"tier_header": "x-tier"},
                "flow": {"tenant_header": "x-tenant"},
                "clusters": [{"name": "a", "endpoints": ["127.0.0.1:18201"]}],
            }
        )
    )
    bootstrap = render_bootstrap(runtime, EnvoyOptions(mode="extproc"))
    internal = _hcm(bootstrap)["route_config"]["internal_only_headers"]
    assert internal[-2:] == ["x-tier", "x-tenant"]
    routes = render_part(runtime, "routes")
    assert routes["internal_only_headers"] == internal
    # The same header for both: named once.
    same = compile_runtime(
        parse_config(
            {
                "version": 1,
                "session": {"tier_header": "x-who"},
                "flow": {"tenant_header": "x-who"},
                "clusters": [{"name": "a", "endpoints": ["127.0.0.1:18201"]}],
            }
        )
    )
    internal = _hcm(render_bootstrap(same, EnvoyOptions(mode="extproc")))["route_config"]
    assert internal["internal_only_headers"].count("x-who") == 1
