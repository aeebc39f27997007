"""Command line: one verb per module, imported only when its verb runs.

Each verb module exposes ``add_arguments(parser)`` and ``run(args) -> int``. Lazy imports keep
``extproc sim-cluster`` or ``extproc replay`` from paying for grpc/protobuf start-up.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# verb -> (module, one-line help). The whole command surface, in one visible table.
VERBS: dict[str, tuple[str, str]] = {
    "serve": ("extproc.serve.cmd", "run the ext_proc gRPC service"),
    "envoy": ("extproc.render.envoy_cmd", "print the Envoy bootstrap rendered from fleet.yaml"),
    "gateway": ("extproc.render.gateway_cmd", "print Kubernetes / Gateway API manifests"),
    "config": (
        "extproc.config.cmd",
        "fleet.yaml: print its JSON Schema, check a file, render the reference",
    ),
    "explain": ("extproc.explain", "show the decision for a session id or a request body"),
    "demo": ("extproc.harness.demo", "run Envoy + processor + simulated clusters and report"),
    "sim-cluster": ("extproc.harness.sim_cluster_cmd", "run a simulated inference cluster"),
    "replay": ("extproc.harness.replay_cmd", "replay a trace or synthetic workload"),
    "otlp-collector": (
        "extproc.harness.otlp_collector_cmd",
        "receive OTLP/gRPC spans and serve them as JSON over HTTP (compose's trace viewer)",
    ),
    "bench": ("extproc.bench.cmd", "benchmarks: overhead, routing, admission"),
    "engine-fixtures": (
        "extproc.harness.real_engines.record",
        "record a real llama.cpp server's /metrics, /v1/models and responses as test fixtures",
    ),
    "simulate": ("extproc.sim.cmd", "discrete-event fleet simulator"),
    "fuzz": ("extproc.reliability.fuzz_cmd", "fuzz the stream handler or a real Envoy + processor"),
    "chaos": ("extproc.reliability.chaos", "run a fault schedule against a local fleet"),
    "soak": ("extproc.reliability.soak", "steady load for a long time, failing on growth"),
    "abort-storm": (
        "extproc.reliability.abort_storm",
        "client aborts during upload, prefill and mid-stream; budgets held and leaked",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="extproc", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for verb, (_module, help_text) in VERBS.items():
        sub.add_parser(verb, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in VERBS:
        parser = build_parser()
        if args and args[0] not in ("-h", "--help"):
            parser.print_usage(sys.stderr)
            print(f"extproc: unknown verb {args[0]!r}", file=sys.stderr)
            return 2
        parser.print_help()
        return 0 if args else 2
    verb = args[0]
    module_name, help_text = VERBS[verb]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        print(f"extproc {verb}: not available in this build", file=sys.stderr)
        return 2
    verb_parser = argparse.ArgumentParser(prog=f"extproc {verb}", description=help_text)
    module.add_arguments(verb_parser)
    ns = verb_parser.parse_args(args[1:])
    result: int = module.run(ns)
    return result
