"""cProfile inside a running processor, switched on and off by signal: its Python per request.

``python -m extproc.bench.pyprofile OUT MODULE [ARGS...]`` runs ``python -m MODULE ARGS...``
(``extproc serve ...`` or the bare processor) with a profiler that the first SIGUSR2 starts and
the second stops, writing its stats to OUT. `extproc bench profile --python` brackets one wrk
run with the two signals, so the stats hold exactly the Python that run cost, grpc.aio's
included (Cython code and C calls do not show, as in any cProfile). ``perf`` (the default of
`bench profile`) sees C frames only on Python 3.11; this sees Python frames only.

Under cProfile small calls cost several times their real time: compare set-ups with each other
and read the call counts, not the absolute microseconds.
"""

from __future__ import annotations

import cProfile
import pstats
import re
import runpy
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

SIGNAL = signal.SIGUSR2
# Paths as far as the package: grpc/aio/..., asyncio/tasks.py, pipeline/pipeline.py.
_SHORTEN = re.compile(r"^.*?(site-packages/|/lib/python3\.\d+/|/extproc/)")


class _Toggle:
    def __init__(self, out: str) -> None:
        self._out = out
        self._profiler = cProfile.Profile()
        self._on = False

    def __call__(self, _signum: int, _frame: FrameType | None) -> None:
        if not self._on:
            self._profiler.enable()
            self._on = True
            return
        self._profiler.disable()
        self._on = False
        self._profiler.dump_stats(self._out)


def wrapped(argv: list[str], out: Path) -> list[str]:
    """``[python, -m, MODULE, ...]`` run under this profiler, its stats written to ``out``."""
    if len(argv) < 3 or argv[1] != "-m":
        raise ValueError(f"not a `python -m MODULE` command line: {argv}")
    return [argv[0], "-m", __name__, str(out), *argv[2:]]


@dataclass(frozen=True)
class Row:
    function: str
    calls_per_req: float
    self_us_per_req: float
    total_us_per_req: float


def per_request(stats_path: Path, requests: int) -> tuple[float, list[Row]]:
    """The profile's Python self time per request (µs) and its functions, most self time first."""
    stats = pstats.Stats(str(stats_path))
    n = max(1, requests)
    rows = []
    raw: dict[tuple[str, int, str], tuple[int, int, float, float, object]]
    raw = stats.stats  # type: ignore[attr-defined]
    for (path, line, name), (_prim, calls, own, cumulative, _callers) in raw.items():
        short = _SHORTEN.sub("", path)
        rows.append(Row(f"{short}:{line}({name})", calls / n, own / n * 1e6, cumulative / n * 1e6))
    rows.sort(key=lambda r: r.self_us_per_req, reverse=True)
    total = float(stats.total_tt) / n * 1e6  # type: ignore[attr-defined]
    return total, rows


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print("usage: python -m extproc.bench.pyprofile OUT MODULE [ARGS...]", file=sys.stderr)
        return 2
    out, module, rest = args[0], args[1], args[2:]
    signal.signal(SIGNAL, _Toggle(out))
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
