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
    render_processor_config,
)
from extproc.render.grove import GroveOptions, GroveRenderError, render_grove


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
    pd = parser.add_argument_group("disaggregated prefill/decode (a fleet with P/D roles)")
    pd.add_argument(
        "--disagg",
        choices=("lws", "grove"),
        default="lws",
        help="lws: a DisaggregatedSet per island (default); grove: a Grove PodCliqueSet per "
        "island and a ClusterTopologyBinding, for a topology-aware scheduler",
    )
    pd.add_argument(
        "--scheduler",
        choices=("default", "kai"),
        default="default",
        help="grove: kai schedules the sets' pods with KAI (schedulerName kai-scheduler)",
    )
    pd.add_argument("--kai-queue", default="default-queue", help="grove + kai: the KAI queue")
    pd.add_argument(
        "--kai-topology",
        default=None,
        metavar="NAME",
        help="grove + kai: an existing KAI Topology to bind the ClusterTopologyBinding to "
        "(default: Grove creates it from the binding's levels)",
    )
    pd.add_argument(
        "--grove-router",
        action="store_true",
        help="grove: Envoy and the processor as a router clique of every set, in place of the "
        "Gateway objects of --mode",
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


def render_text(config_path: str, opts: GatewayOptions, grove: GroveOptions | None = None) -> str:
    cfg, raw = load_config(config_path)
    runtime = compile_runtime(cfg, raw)
    if grove is not None and not has_roles(runtime):
        raise GroveRenderError("--disagg grove: no cluster has a prefill or decode role")
    if grove is not None and grove.router:
        # Envoy and the processor run in the sets: fleet.yaml (and the Redis URL) only.
        objs = render_processor_config(runtime, opts, raw.decode("utf-8"))
    else:
        objs = render_manifests(runtime, raw.decode("utf-8"), opts)
    if grove is not None:
        # P/D on Grove: a binding and a PodCliqueSet per island (render/grove.py).
        objs += render_grove(runtime, grove)
    elif has_roles(runtime):
        # P/D: an example DisaggregatedSet per island, placed by topology (render/disagg.py).
        objs += render_disaggregated_sets(runtime, opts.namespace)
    what = f"--mode {opts.mode}" if grove is None or not grove.router else "--grove-router"
    header = (
        f"# Rendered by `extproc gateway {what}` from {config_path} "
        f"(config version {runtime.version}).\n"
    )
    return header + dump_manifests(objs)


def grove_options(args: argparse.Namespace) -> GroveOptions | None:
    """None for the lws rendering; Grove-only flags without --disagg grove are refused."""
    if args.disagg != "grove":
        if args.scheduler != "default" or args.grove_router or args.kai_topology:
            raise GroveRenderError(
                "--scheduler, --kai-topology, --grove-router need --disagg grove"
            )
        return None
    if args.kai_topology and args.scheduler != "kai":
        raise GroveRenderError("--kai-topology binds KAI's topology: give --scheduler kai")
    return GroveOptions(
        namespace=args.namespace,
        image=args.image,
        scheduler=args.scheduler,
        kai_queue=args.kai_queue,
        kai_topology=args.kai_topology,
        router=args.grove_router,
    )


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
        text = render_text(args.config, options_from_args(args), grove_options(args))
    except (
        ConfigError,
        GatewayRenderError,
        DisaggRenderError,
        GroveRenderError,
        OSError,
        UnicodeDecodeError,
    ) as exc:
        print(f"extproc gateway: {exc}", file=sys.stderr)
        return 2
    write_output(args.output, text)
    return 0
