"""`extproc gateway`: print Kubernetes / Gateway API manifests rendered from fleet.yaml."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import yaml

from extproc.config import ConfigError, compile_runtime, load_config
from extproc.render import write_output
from extproc.render.disagg import DisaggRenderError, has_roles, render_disaggregated_sets
from extproc.render.gateway import (
    DEFAULT_IMAGE,
    MODES,
    GatewayOptions,
    GatewayRenderError,
    parse_selector,
    render_manifests,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="path to fleet.yaml")
    parser.add_argument("--namespace", default="fleet", help="namespace of every object")
    parser.add_argument("--image", default=DEFAULT_IMAGE, help="processor container image")
    parser.add_argument(
        "--mode",
        choices=MODES,
        default="envoy-gateway",
        help="envoy-gateway (ext_proc + HTTPRoutes), inference-pool (processor as Endpoint "
        "Picker), or all",
    )
    parser.add_argument("--gateway", default="fleet", help="name of the Gateway routes attach to")
    parser.add_argument(
        "--gateway-namespace", default=None, help="namespace of the Gateway (default --namespace)"
    )
    parser.add_argument(
        "--pool-selector",
        default="app=vllm",
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="InferencePool pod selector (inference-pool mode)",
    )
    parser.add_argument(
        "--pool-port",
        type=int,
        action="append",
        default=None,
        metavar="PORT",
        help="model server port of the pool's pods; repeatable (default 8000)",
    )
    parser.add_argument(
        "--pool-hostname",
        default=None,
        help="hostname of the pool route (required with --mode all)",
    )
    parser.add_argument("-o", "--output", default="-", help="output file (default stdout)")


class ManifestDumper(yaml.SafeDumper):
    """Multi-line strings (the fleet.yaml inside the ConfigMap) as literal blocks."""


def _represent_str(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


ManifestDumper.add_representer(str, _represent_str)


def dump_manifests(objs: list[dict[str, Any]]) -> str:
    return yaml.dump_all(
        objs, Dumper=ManifestDumper, sort_keys=False, width=120, explicit_start=True
    )


def render_text(config_path: str, opts: GatewayOptions) -> str:
    cfg, raw = load_config(config_path)
    runtime = compile_runtime(cfg, raw)
    objs = render_manifests(runtime, raw.decode("utf-8"), opts)
    if has_roles(runtime):
        # P/D: an example DisaggregatedSet per island, placed by topology (render/disagg.py).
        objs += render_disaggregated_sets(runtime, opts.namespace)
    header = (
        f"# Rendered by `extproc gateway --mode {opts.mode}` from {config_path} "
        f"(config version {runtime.version}).\n"
    )
    return header + dump_manifests(objs)


def options_from_args(args: argparse.Namespace) -> GatewayOptions:
    return GatewayOptions(
        namespace=args.namespace,
        image=args.image,
        mode=args.mode,
        gateway=args.gateway,
        gateway_namespace=args.gateway_namespace,
        pool_selector=parse_selector(args.pool_selector),
        pool_ports=tuple(args.pool_port or (8000,)),
        pool_hostname=args.pool_hostname,
    )


def run(args: argparse.Namespace) -> int:
    try:
        text = render_text(args.config, options_from_args(args))
    except (
        ConfigError,
        GatewayRenderError,
        DisaggRenderError,
        OSError,
        UnicodeDecodeError,
    ) as exc:
        print(f"extproc gateway: {exc}", file=sys.stderr)
        return 2
    write_output(args.output, text)
    return 0
