"""Real engines behind a real Envoy and the processor: the real-engine tier's whole stack.

    fleet = RealFleet(workdir, {"c1": [engine, engine], "c2": [...]}, fleet_overrides={...})
    with fleet:
        fleet.stack.url            # Envoy's listener: point an OpenAI client at url + "/v1"
        fleet.engine("c1-e2")      # the EngineProcess serving as cluster c1's second endpoint

The engines start first (in parallel, each waited on until it serves), then the processor and
Envoy (extproc.harness.launch.FleetStack with ``external_engines``). Engine names follow the
stack's: ``<cluster>-e<n>`` in the order given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from extproc.harness.launch import FleetStack
from extproc.harness.real_engines.base import EngineProcess, start_engines, stop_engines


class RealFleet:
    def __init__(
        self,
        workdir: Path,
        clusters: Mapping[str, Sequence[EngineProcess]],
        start_timeout_s: float,
        **stack_options: Any,
    ) -> None:
        self.workdir = workdir
        self.clusters = {name: list(engines) for name, engines in clusters.items()}
        self.start_timeout_s = start_timeout_s
        self._stack_options = stack_options
        self.stack: FleetStack | None = None

    @property
    def engines(self) -> list[EngineProcess]:
        return [e for engines in self.clusters.values() for e in engines]

    def engine(self, name: str) -> EngineProcess:
        """An engine by its stack name, ``<cluster>-e<n>`` (1-based)."""
        cluster, _, index = name.rpartition("-e")
        return self.clusters[cluster][int(index) - 1]

    def names(self, cluster: str) -> list[str]:
        return [f"{cluster}-e{i}" for i in range(1, len(self.clusters[cluster]) + 1)]

    def name_of(self, address: str) -> str | None:
        """The stack name of the engine at ``host:port`` (None: not one of ours)."""
        for cluster, engines in self.clusters.items():
            for i, engine in enumerate(engines, 1):
                if engine.address == address:
                    return f"{cluster}-e{i}"
        return None

    def cluster_of(self, address: str) -> str | None:
        name = self.name_of(address)
        return None if name is None else name.rpartition("-e")[0]

    def start(self) -> RealFleet:
        start_engines(self.engines, self.start_timeout_s)
        ports = {name: [e.port for e in engines] for name, engines in self.clusters.items()}
        self.stack = FleetStack(
            self.workdir / "stack", external_engines=ports, **self._stack_options
        )
        try:
            self.stack.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.stack is not None:
            self.stack.stop()
        stop_engines(self.engines)

    def __enter__(self) -> RealFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
