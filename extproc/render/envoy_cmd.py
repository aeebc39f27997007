"""`extproc envoy`: print the Envoy bootstrap rendered from fleet.yaml, or one drop-in part of
it for an existing Envoy (``--part filter|clusters|routes``, extproc/render/envoy_parts.py)."""

from __future__ import annotations

import argparse
import sys

import yaml

from extproc.config import ConfigError, load_runtime
from extproc.render import write_output
from extproc.render.envoy import MODES, EnvoyOptions, render_bootstrap
from extproc.render.envoy_parts import ALL_PARTS, Part, render_part
from extproc.render.envoy_xds import xds_bootstrap


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="path to fleet.yaml")
    parser.add_argument(
        "--mode",
        choices=MODES,
        default="extproc",
        help="extproc (default), or Envoy-only baselines for benchmarks",
    )
    parser.add_argument("--access-log", default="/dev/stdout", help="access log path ('' = none)")
    parser.add_argument(
        "--map",
        action="append",
        default=[],
        metavar="HOST:PORT=HOST:PORT",
        help="rewrite an address from fleet.yaml (e.g. sim-c1:8000=127.0.0.1:18001)",
    )
    parser.add_argument(
        "--part",
        choices=ALL_PARTS,
        default=None,
        help="print one drop-in part for an existing Envoy instead of the whole bootstrap "
        "(filter: the ext_proc HTTP filter; clusters: every cluster it needs; routes: the "
        "route_config; tracing: Envoy's tracer and the router's upstream filters); see "
        "envoy/README.md",
    )
    parser.add_argument(
        "--xds",
        action="store_true",
        help="clusters from the processor over gRPC CDS (`extproc serve --xds-cds`) instead of"
        " static ones",
    )
    parser.add_argument("-o", "--output", default="-", help="output file (default stdout)")


def parse_map(items: list[str]) -> tuple[tuple[str, str], ...]:
    pairs = []
    for item in items:
        src, sep, dst = item.partition("=")
        if not sep or ":" not in src or ":" not in dst:
            raise ValueError(f"--map {item!r}: expected HOST:PORT=HOST:PORT")
        pairs.append((src, dst))
    return tuple(pairs)


def render_text(
    config_path: str, opts: EnvoyOptions, part: Part | None = None, xds: bool = False
) -> str:
    runtime = load_runtime(config_path)
    what = "`extproc envoy`" if part is None else f"`extproc envoy --part {part}`"
    header = f"# Rendered by {what} from {config_path} (config version {runtime.version}).\n"
    if part is not None:
        doc = render_part(runtime, part, opts)
    elif xds:
        doc = xds_bootstrap(runtime, opts)
    else:
        doc = render_bootstrap(runtime, opts)
    return header + yaml.safe_dump(doc, sort_keys=False, width=120)


def run(args: argparse.Namespace) -> int:
    try:
        opts = EnvoyOptions(
            mode=args.mode, access_log_path=args.access_log or None, host_map=parse_map(args.map)
        )
        if args.xds and (args.part or args.mode != "extproc"):
            raise ValueError("--xds renders the whole extproc bootstrap: no --part, no --mode")
        text = render_text(args.config, opts, args.part, args.xds)
    except (ConfigError, OSError, ValueError) as exc:
        print(str(exc), file=sys.stderr)
        return 2
    write_output(args.output, text)
    return 0
