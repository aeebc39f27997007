"""Prefix affinity pays on real llama.cpp engines: a short, bounded run of ``extproc bench
engines`` (multi-turn conversations that share nothing, no session id, no host-RAM prompt
cache). Through the processor each conversation's turns stay on one engine, whose slot still
holds the earlier turns; through Envoy round robin they are sprayed over the engines. Compared
from the engines' own counters: the processor's cached ratio is higher and it evaluates fewer
prompt tokens. The full figures (three shapes, both cache settings, TTFT, the ideal) come from
the command itself (docs/real-engines.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from extproc.bench import engines as bench

pytestmark = pytest.mark.timeout(900)


def test_the_processor_reuses_more_of_the_engines_cache_than_round_robin(
    tmp_path: Path, tiny_model: Path
) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(
        ["--conversations", "4", "--turns", "3", "--shared-words", "200", "--turn-words", "40",
         "--output-tokens", "8", "--workdir", str(tmp_path)]
    )  # fmt: skip
    workload = bench.workload_of(args)
    ours = bench.run_setup("extproc", "none", 0, workload, args, tiny_model)
    theirs = bench.run_setup("round_robin", "none", 0, workload, args, tiny_model)
    requests = workload.conversations * workload.turns
    assert (ours.requests, ours.failed) == (requests, 0)
    assert (theirs.requests, theirs.failed) == (requests, 0)
    assert ours.cached_ratio > theirs.cached_ratio, (ours.summary(), theirs.summary())
    assert ours.evaluated < theirs.evaluated, (ours.summary(), theirs.summary())
