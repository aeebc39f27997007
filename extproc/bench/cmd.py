"""`extproc bench <name>`: one table of benchmarks, each a module with add_arguments/run."""

from __future__ import annotations

import argparse
import importlib

BENCHES: dict[str, tuple[str, str]] = {
    "overhead": ("extproc.bench.overhead", "Envoy alone vs + bare processor vs + extproc"),
    "profile": ("extproc.bench.profile", "where the processor's CPU goes through Envoy (perf)"),
    "handler": ("extproc.bench.handler", "the processor's CPU per request in process vs bare"),
    "routing": ("extproc.bench.routing", "round robin vs ring hash vs extproc on one workload"),
    "admission": ("extproc.bench.admission", "admission decision cost, memory vs Redis ledger"),
    "renewal": ("extproc.bench.renewal", "lease renewal at scale: chunked vs one script"),
    "deps": ("extproc.bench.deps", "the dependency choices: protobuf libraries, aioredis"),
    "skew": ("extproc.bench.skew", "hot prefixes + a slow cluster: pure hashing vs load-aware"),
    "pd": ("extproc.bench.pd", "P/D: topology-aware vs blind prefill; P/D vs colocated burst"),
    "pd-pools": (
        "extproc.sim.pd_pools",
        "P/D: prefill:decode ratios at 64 clusters (fleet simulator runs)",
    ),
    "layouts": ("extproc.bench.layouts", "a shared opening in each position: old vs chain key"),
    "fairness": ("extproc.bench.fairness", "one tenant's flood in a class: FIFO vs fair shares"),
    "wake": ("extproc.bench.wake", "waiters woken by releases: memory, Redis pub/sub, polling"),
    "scale": ("extproc.bench.scale", "16-512 clusters: pair aggregates vs one pool"),
    "peers": ("extproc.bench.peers", "against vLLM Router and the SGLang gateway, same engines"),
    "real-affinity": (
        "extproc.bench.real_affinity",
        "prefix affinity on real vLLM engines: the processor vs Envoy round robin",
    ),
    "engines": (
        "extproc.bench.engines",
        "prefix affinity on real llama.cpp engines: extproc vs round robin vs the ideal",
    ),
    "scrape": ("extproc.bench.scrape", "the engine scraper's CPU per endpoint at 8 and 512"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, (module_name, help_text) in BENCHES.items():
        bench_parser = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # not built yet in this tree; `run` reports it
        module.add_arguments(bench_parser)


def run(args: argparse.Namespace) -> int:
    module_name, _ = BENCHES[args.bench]
    module = importlib.import_module(module_name)
    result: int = module.run(args)
    return result
