"""The drop-in parts for an existing Envoy (envoy/parts/, `extproc envoy --part`): each part,
embedded in a minimal host config of this test's own, is accepted by the real Envoy; the
checked-in files are exactly what the renderer produces; the parts are cut from the complete
bootstrap, so the two cannot disagree."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.config import load_runtime
from extproc.render.envoy import render_bootstrap
from extproc.render.envoy_parts import PARTS, host_requirements, render_part
from tests.unit.test_compose import extproc_envoy, find_tool

REPO = Path(__file__).resolve().parents[2]
PARTS_DIR = REPO / "envoy" / "parts"
FLEET = "compose/fleet.yaml"

# A host's own Envoy: its listener, its own route and cluster; nothing of ours.
HOST: dict[str, Any] = {
    "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 9901}}},
    "static_resources": {
        "listeners": [
            {
                "name": "host_ingress",
                "address": {"socket_address": {"address": "0.0.0.0", "port_value": 10000}},
                "filter_chains": [
                    {
                        "filters": [
                            {
                                "name": "envoy.filters.network.http_connection_manager",
                                "typed_config": {
                                    "@type": "type.googleapis.com/envoy.extensions.filters."
                                    "network.http_connection_manager.v3.HttpConnectionManager",
                                    "stat_prefix": "host",
                                    "route_config": {
                                        "name": "host",
                                        "virtual_hosts": [
                                            {
                                                "name": "host",
                                                "domains": ["*"],
                                                "routes": [
                                                    {
                                                        "match": {"prefix": "/host/"},
                                                        "route": {"cluster": "host_service"},
                                                    }
                                                ],
                                            }
                                        ],
                                    },
                                    "http_filters": [
                                        {
                                            "name": "envoy.filters.http.router",
                                            "typed_config": {
                                                "@type": "type.googleapis.com/envoy.extensions."
                                                "filters.http.router.v3.Router"
                                            },
                                        }
                                    ],
                                },
                            }
                        ]
                    }
                ],
            }
        ],
        "clusters": [
            {
                "name": "host_service",
                "type": "STATIC",
                "load_assignment": {
                    "cluster_name": "host_service",
                    "endpoints": [
                        {
                            "lb_endpoints": [
                                {
                                    "endpoint": {
                                        "address": {
                                            "socket_address": {
                                                "address": "127.0.0.1",
                                                "port_value": 8080,
                                            }
                                        }
                                    }
                                }
                            ]
                        }
                    ],
                },
            }
        ],
    },
}


def embed(
    host: dict[str, Any], filters: Any = None, clusters: Any = None, routes: Any = None
) -> dict[str, Any]:
    """``host`` with the given parts put where envoy/README.md says they go."""
    config = copy.deepcopy(host)
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    typed = hcm["typed_config"]
    if filters is not None:
        typed["http_filters"][:0] = filters  # before the router
    if clusters is not None:
        config["static_resources"]["clusters"].extend(clusters)
    if routes is not None:
        own = typed["route_config"]
        own["internal_only_headers"] = routes["internal_only_headers"]
        (vhost,) = routes["virtual_hosts"]
        own["virtual_hosts"][0]["routes"].extend(vhost["routes"])
    return config


def validate(config: dict[str, Any], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "host.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return subprocess.run(
        [find_tool("envoy"), "--mode", "validate", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def parts() -> dict[str, Any]:
    runtime = load_runtime(REPO / FLEET)
    return {part: render_part(runtime, part) for part in PARTS}


def test_checked_in_parts_are_exactly_the_rendered_ones() -> None:
    for part in PARTS:
        rendered = extproc_envoy("--part", part)
        committed = (PARTS_DIR / f"{part}.yaml").read_text(encoding="utf-8")
        assert committed == rendered, f"envoy/parts/{part}.yaml drifted: run `make envoy-configs`"


def test_the_complete_bootstrap_is_the_compose_one() -> None:
    # One file, not a copy: envoy/envoy.yaml is compose/envoy.yaml (checked by test_compose).
    link = REPO / "envoy" / "envoy.yaml"
    assert link.is_symlink() and link.resolve() == (REPO / "compose" / "envoy.yaml").resolve()


def test_parts_are_cut_from_the_complete_bootstrap() -> None:
    runtime = load_runtime(REPO / FLEET)
    full = render_bootstrap(runtime)
    hcm = full["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    got = parts()
    assert got["filter"] == hcm["typed_config"]["http_filters"][:1]
    assert got["clusters"] == full["static_resources"]["clusters"]
    assert got["routes"] == hcm["typed_config"]["route_config"]
    needs = host_requirements(runtime)
    assert needs["listener"]["per_connection_buffer_limit_bytes"] > 1 << 20
    assert needs["http_connection_manager"]["stream_idle_timeout"] == "0s"


@pytest.mark.parametrize("combo", ["clusters", "filter+clusters", "routes+clusters", "all"])
def test_envoy_accepts_each_part_in_a_host_config(combo: str, tmp_path: Path) -> None:
    got = parts()
    chosen = set(PARTS) if combo == "all" else set(combo.split("+"))
    # The routes name the inference clusters and the filter the processor's cluster: both
    # need the clusters part.
    config = embed(
        HOST,
        filters=got["filter"] if "filter" in chosen else None,
        clusters=got["clusters"],
        routes=got["routes"] if "routes" in chosen else None,
    )
    result = validate(config, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:] + result.stdout[-2000:]


def test_routes_without_their_clusters_are_refused(tmp_path: Path) -> None:
    # The validation above can fail: a static route naming a cluster the host lacks is
    # refused. (Measured on 1.40: a filter naming a missing gRPC cluster is accepted at
    # validation and fails only per request, so the filter is not the negative case.)
    result = validate(embed(HOST, routes=parts()["routes"]), tmp_path)
    assert result.returncode != 0
    assert "all_clusters" in result.stderr + result.stdout


def test_envoy_accepts_the_xds_bootstrap(tmp_path: Path) -> None:
    config = yaml.safe_load(extproc_envoy("--xds"))
    source = config["dynamic_resources"]["cds_config"]["api_config_source"]
    assert source["grpc_services"] == [{"envoy_grpc": {"cluster_name": "extproc"}}]
    assert [c["name"] for c in config["static_resources"]["clusters"]] == ["extproc"]
    result = validate(config, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:] + result.stdout[-2000:]
