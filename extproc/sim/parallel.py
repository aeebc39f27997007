"""Policies in forked worker processes: the machine's cores each run one policy at a time.

Fork, not spawn: a child inherits the prepared scenario (millions of requests, the placement
tables) without pickling it, and only its result travels back through a pipe. Progress comes
through a shared counter array the parent polls.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from extproc.sim.engine import PolicyRun, Scenario, SimConfig, run_policy

# How often the parent wakes to redraw progress while waiting for results.
POLL_S = 0.5


def _worker(
    scenario: Scenario,
    config: SimConfig,
    name: str,
    slot: int,
    counters: Any,
    conn: Connection,
) -> None:
    def tick(count: int) -> None:
        counters[slot] = count

    try:
        result: tuple[str, object] = ("ok", run_policy(scenario, config, name, tick))
    except BaseException:  # noqa: BLE001 - re-raised in the parent with the child's traceback
        result = ("error", traceback.format_exc())
    conn.send(result)
    conn.close()


def run_forked(
    scenario: Scenario,
    config: SimConfig,
    policies: Sequence[str],
    jobs: int,
    progress: Callable[[Mapping[str, int]], None] | None,
) -> dict[str, PolicyRun]:
    ctx = mp.get_context("fork")
    counters = ctx.Array("q", len(policies), lock=False)
    pending = list(enumerate(policies))
    running: dict[Connection, tuple[str, Any]] = {}
    results: dict[str, PolicyRun] = {}
    try:
        while pending or running:
            while pending and len(running) < jobs:
                slot, name = pending.pop(0)
                parent, child = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_worker,
                    args=(scenario, config, name, slot, counters, child),
                    name=f"sim-{name}",
                )
                proc.start()
                child.close()
                running[parent] = (name, proc)
            for conn in wait(list(running), timeout=POLL_S):
                assert isinstance(conn, Connection)
                name, proc = running.pop(conn)
                try:
                    kind, payload = conn.recv()
                except EOFError:
                    raise RuntimeError(f"policy {name}: worker died ({proc.exitcode})") from None
                proc.join()
                if kind != "ok":
                    raise RuntimeError(f"policy {name} failed in its worker:\n{payload}")
                assert isinstance(payload, PolicyRun)
                results[name] = payload
            if progress is not None:
                progress({name: int(counters[slot]) for slot, name in enumerate(policies)})
    finally:
        # Only on an error: stop the workers this call started, by their own handles.
        for _conn, (_name, proc) in running.items():
            proc.terminate()
            proc.join()
    return {name: results[name] for name in policies}
