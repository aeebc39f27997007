"""`extproc envoy`: print the Envoy bootstrap rendered from fleet.yaml."""

from __future__ import annotations

import argparse
import sys

import yaml

from extproc.config import ConfigError, load_runtime
from extproc.render import write_output
from extproc.render.envoy import MODES, EnvoyOptions, render_bootstrap


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
    parser.add_argument("-o", "--output", default="-", help="output file (default stdout)")


def parse_map(items: list[str]) -> tuple[tuple[str, str], ...]:
    pairs = []
    for item in items:
        src, sep, dst = item.partition("=")
        if not sep or ":" not in src or ":" not in dst:
            raise ValueError(f"--map {item!r}: expected HOST:PORT=HOST:PORT")
        pairs.append((src, dst))
    return tuple(pairs)


def render_text(config_path: str, opts: EnvoyOptions) -> str:
    runtime = load_runtime(config_path)
    header = (
        f"# Rendered by `extproc envoy` from {config_path} (config version {runtime.version}).\n"
    )
    return header + yaml.safe_dump(render_bootstrap(runtime, opts), sort_keys=False, width=120)


def run(args: argparse.Namespace) -> int:
    try:
        opts = EnvoyOptions(
            mode=args.mode, access_log_path=args.access_log or None, host_map=parse_map(args.map)
        )
        text = render_text(args.config, opts)
    except (ConfigError, OSError, ValueError) as exc:
        print(str(exc), file=sys.stderr)
        return 2
    write_output(args.output, text)
    return 0
